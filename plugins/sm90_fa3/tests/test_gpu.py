"""On the H200: fa3, cudnn and fa3_fp8 against the fp64 reference through the hub.

Exact backends follow the FlashAttention rule (error vs fp64 at most 2x the bf16 reference's
for outputs, 3x for gradients, plus a rounding floor) on a mask/shape grid; a case a backend
declines (check() gives reasons) is skipped, never silently passed. FP8 must stay within the
budget it declares.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnhub
from attnhub.plugin import AttnParams, reference_attention
from attnhub.testing import (
    FA_GPU_SHAPES,
    assert_fa_rule,
    assert_grads_fa_rule,
    assert_lse,
    attention_or_skip,
    fa_references,
    gpu_marks,
    grid_id,
)

pytestmark = gpu_marks()

GRID = [(*shape, None) for shape in FA_GPU_SHAPES] + [  # ..., softcap
    (1, 128, 256, 8, 2, 128, True, "bottom_right", 30.0),
]


@pytest.fixture(scope="module")
def hub():
    return attnhub.Hub()


def inputs(b, sq, sk, hq, hkv, d, seed=0, grad=False):
    g = torch.Generator("cuda").manual_seed(seed)
    out = [torch.randn(b, s, h, d, generator=g, device="cuda").to(torch.bfloat16)
           .requires_grad_(grad) for s, h in ((sq, hq), (sk, hkv), (sk, hkv))]
    return out


@pytest.mark.parametrize("name", ["fa3", "cudnn"])
@pytest.mark.parametrize("case", GRID, ids=grid_id)
def test_forward_fa_rule(hub, name, case):
    b, sq, sk, hq, hkv, d, causal, align, softcap = case
    q, k, v = inputs(b, sq, sk, hq, hkv, d)
    p = AttnParams(scale=1 / math.sqrt(d), causal=causal, alignment=align, softcap=softcap)
    out, lse = attention_or_skip(hub, name, q, k, v, causal=causal, causal_alignment=align,
                                 softcap=softcap, return_lse=True)
    ref64, ref_lse, ref_bf16 = fa_references(q, k, v, p)
    assert_fa_rule(out, ref64, ref_bf16, mult=2.0)
    assert_lse(lse, ref_lse, atol=2e-2)


@pytest.mark.parametrize("name", ["fa3", "cudnn"])
def test_backward_fa_rule(hub, name):
    q, k, v = inputs(2, 128, 128, 8, 8, 128, grad=True)
    p = AttnParams(scale=1 / math.sqrt(128), causal=True)
    out = attention_or_skip(hub, name, q, k, v, causal=True)
    ref64, _, ref_bf16 = fa_references(q, k, v, p)
    assert_grads_fa_rule(out, ref64, ref_bf16, (q, k, v))


def test_fa3_paged_matches_contiguous(hub):
    q, k, v = inputs(2, 1, 512, 8, 2, 128)
    page = 64
    perm = torch.randperm(16, device="cuda")  # page i of the contiguous cache lives at perm[i]
    kc = torch.empty(16, page, 2, 128, device="cuda", dtype=k.dtype)
    vc = torch.empty_like(kc)
    kc[perm], vc[perm] = k.reshape(16, page, 2, 128), v.reshape(16, page, 2, 128)
    table = perm.view(2, 8).to(torch.int32)
    seqlens = torch.tensor([512, 300], device="cuda", dtype=torch.int32)
    out = attention_or_skip(hub, "fa3", q, kc, vc, layout="paged", block_table=table,
                            seqlens_k=seqlens, causal=True)
    dense0 = attention_or_skip(hub, "fa3", q[:1], k[:1], v[:1], causal=True)
    dense1 = attention_or_skip(hub, "fa3", q[1:], k[1:, :300], v[1:, :300], causal=True)
    torch.testing.assert_close(out, torch.cat([dense0, dense1]), atol=2e-2, rtol=0)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_fp8_within_declared_budget_and_smoothing_helps(hub):
    backend = hub.registry.get("fa3_fp8")
    budget = backend.capabilities.error_budget
    q, k, v = inputs(2, 1024, 1024, 16, 4, 128, seed=3)
    p = AttnParams(scale=1 / math.sqrt(128), causal=True)
    ref, _ = reference_attention(q, k, v, p, compute_dtype=torch.float32)
    out = attention_or_skip(hub, "fa3_fp8", q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and rel(out, ref) <= budget, rel(out, ref)
    kb = k.clone()
    kb[..., 7] += 20.0  # a key channel with a large common offset
    ref_b, _ = reference_attention(q, kb, v, p, compute_dtype=torch.float32)
    spec = attnhub.AttentionSpec(dtype="bf16", head_dim=128, num_q_heads=16, num_kv_heads=4,
                                 mask=attnhub.MaskSpec(causal=True), max_seqlen_q=1024,
                                 max_seqlen_k=1024, batch=2)
    backend.load()
    errs = {}
    for recipe in backend.recipes:
        pr = AttnParams(scale=p.scale, causal=True, return_lse=True,
                        extra={"fp8_recipe": recipe})
        o, lse = backend.forward(q, kb, v, spec, pr)
        errs[recipe] = rel(o, ref_b)
        assert torch.isfinite(lse).all()
    assert errs["smooth_k"] < errs["plain"], errs
    assert errs["smooth_k"] <= budget, errs


@pytest.mark.parametrize("case", GRID, ids=grid_id)
def test_op_path_is_the_interface_path(hub, case):
    """The forward op called directly (calls without autograd) computes exactly what FA3's
    interface functions compute: the same kernel, bit for bit."""
    from attnhub_sm90_fa3.fa3 import Fa3Backend

    b, sq, sk, hq, hkv, d, causal, align, softcap = case
    q, k, v = inputs(b, sq, sk, hq, hkv, d, seed=5)
    fa3 = hub.registry.get("fa3")
    fa3.load()
    if fa3._run.op is None:
        pytest.skip(f"no direct op: {fa3._run.op_note}")
    p = AttnParams(scale=1 / math.sqrt(d), causal=causal, alignment=align, softcap=softcap,
                   return_lse=True)
    for phase in ("prefill", "decode") if sq == 1 else ("prefill",):
        spec = _spec(q, k, causal, align, softcap, phase)
        if fa3.check(spec, hub.device):
            pytest.skip(f"fa3 declines: {fa3.check(spec, hub.device)}")
        op_out, op_lse = fa3.forward(q, k, v, spec, p)
        iface = Fa3Backend()
        iface.load()
        iface._run.op = None  # the interface functions
        out, lse = iface.forward(q, k, v, spec, p)
        assert torch.equal(op_out, out) and torch.equal(op_lse, lse), phase


def _spec(q, k, causal, align, softcap, phase):
    from attnhub.plugin import AttentionSpec, MaskSpec

    return AttentionSpec(phase=phase, dtype="bf16", kv_dtype="bf16", head_dim=q.shape[-1],
                         num_q_heads=q.shape[2], num_kv_heads=k.shape[2], layout="bshd",
                         mask=MaskSpec(causal=causal, alignment=align, softcap=bool(softcap)),
                         max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1]).bucketed()
