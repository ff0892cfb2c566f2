"""On a CUDA GPU: fa2, fa2_torch and the FlashInfer backends against the fp64 reference.

The FlashAttention rule (2x the bf16 reference's error for outputs, 3x for gradients, plus a
rounding floor) on a mask/shape grid; paged results against the same keys gathered into a
contiguous cache. FlashInfer cases stay at head dim 128 in bf16 without window or softcap:
every other variant is a separate JIT compile (~90 s each on the H200).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnhub
from attnhub.plugin import AttnParams, paged_to_varlen
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

GRID = [(*shape, None) for shape in FA_GPU_SHAPES] + [  # ..., window
    (1, 128, 256, 8, 2, 128, True, "bottom_right", (32, 0)),
]


@pytest.fixture(scope="module")
def hub():
    return attnhub.Hub()


def rnd(*shape, seed=0, grad=False):
    g = torch.Generator("cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16).requires_grad_(grad)


@pytest.mark.parametrize("name", ["fa2", "fa2_torch"])
@pytest.mark.parametrize("case", GRID, ids=grid_id)
def test_forward_fa_rule(hub, name, case):
    b, sq, sk, hq, hkv, d, causal, align, window = case
    q, k, v = rnd(b, sq, hq, d), rnd(b, sk, hkv, d, seed=1), rnd(b, sk, hkv, d, seed=2)
    p = AttnParams(scale=1 / math.sqrt(d), causal=causal, alignment=align, window=window)
    out, lse = attention_or_skip(hub, name, q, k, v, causal=causal, causal_alignment=align,
                                 window=window, return_lse=True)
    ref64, ref_lse, ref_bf16 = fa_references(q, k, v, p)
    assert_fa_rule(out, ref64, ref_bf16)
    assert_lse(lse, ref_lse, atol=2e-2)


@pytest.mark.parametrize("name", ["fa2", "fa2_torch"])
def test_varlen_and_backward(hub, name):
    cu = torch.tensor([0, 50, 178, 200], device="cuda", dtype=torch.int32)
    q, k, v = (rnd(200, h, 128, seed=i, grad=True) for i, h in enumerate((8, 2, 2)))
    p = AttnParams(scale=1 / math.sqrt(128), causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    out = attention_or_skip(hub, name, q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu,
                            causal=True)
    ref, _, ref_bf = fa_references(q, k, v, p, layout="thd")
    assert_fa_rule(out, ref, ref_bf)
    assert_grads_fa_rule(out, ref, ref_bf, (q, k, v))


def paged_cache(lens, page, hkv, d, hnd=False, seed=0):
    need = [-(-n // page) for n in lens]
    total = sum(need) + 2
    kc, vc = rnd(total, page, hkv, d, seed=seed), rnd(total, page, hkv, d, seed=seed + 1)
    if hnd:  # (pages, H, page, D) storage, passed as its (pages, page, H, D) view
        kc, vc = kc.transpose(1, 2).contiguous().transpose(1, 2), \
            vc.transpose(1, 2).contiguous().transpose(1, 2)
    perm = torch.randperm(total, device="cuda").to(torch.int32)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at:at + n]
        at += n
    return kc, vc, table, torch.tensor(lens, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("name,sq", [("flashinfer_decode", 1), ("flashinfer_prefill", 1),
                                     ("flashinfer_prefill", 17), ("fa2", 1)])
@pytest.mark.parametrize("page,hnd,tc", [(16, False, "0"), (16, True, "1"), (1, False, "0"),
                                         (256, False, "0")])
def test_paged_against_gathered_reference(hub, monkeypatch, name, sq, page, hnd, tc):
    monkeypatch.setenv("ATTNHUB_FLASHINFER_TENSOR_CORES", tc)
    lens = [700, 33, 258]
    kc, vc, table, seqlens = paged_cache(lens, page, 8, 128, hnd=hnd)
    q = rnd(3, sq, 32, 128, seed=5)
    out, lse = attention_or_skip(hub, name, q, kc, vc, layout="paged", block_table=table,
                                 seqlens_k=seqlens, causal=True, return_lse=True)
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, kc, vc, table, seqlens)
    p = AttnParams(scale=1 / math.sqrt(128), causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref, ref_lse, ref_bf = fa_references(qv, kv, vv, p, layout="thd")
    assert_fa_rule(out.reshape(qv.shape), ref, ref_bf)
    assert_lse(lse, ref_lse.view(32, 3, sq).transpose(0, 1), atol=2e-2)
