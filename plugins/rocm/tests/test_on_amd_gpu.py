"""On a real AMD GPU only (skipped elsewhere; never run so far: no AMD GPU was available).

Each backend against the reference by the FlashAttention rule on the device it was bound
for: forward, gradients, and paged decode for triton_rocm.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnhub
from attnhub.plugin import AttentionSpec, AttnParams, MaskSpec, reference_attention
from attnhub.testing import assert_fa_rule
from attnhub_rocm.ck_fa import CKFlashBackend
from attnhub_rocm.triton_rocm import TritonRocmBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and getattr(torch.version, "hip", None)),
                       reason="needs a ROCm GPU"),
]


def _device() -> attnhub.DeviceInfo:
    return attnhub.probe()


@pytest.mark.parametrize("name", ["ck_fa", "triton_rocm"])
@pytest.mark.parametrize("sq,sk,causal", [(1023, 1023, True), (113, 203, True),
                                          (203, 113, False)])
def test_forward_and_grads_match_reference(name: str, sq: int, sk: int, causal: bool) -> None:
    backend = CKFlashBackend() if name == "ck_fa" else TritonRocmBackend()
    spec = AttentionSpec(phase="train", dtype="bf16", head_dim=128, num_q_heads=8,
                         num_kv_heads=2, mask=MaskSpec(causal=causal), max_seqlen_q=sq,
                         max_seqlen_k=sk, needs_grad=True)
    reasons = backend.check(spec, _device())
    if reasons:
        pytest.skip(f"{name} cannot serve here: {reasons}")
    backend.load()
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(2, sq, 8, 128, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(2, sk, 2, 128, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(2, sk, 2, 128, device=dev, dtype=dt, requires_grad=True)
    params = AttnParams(scale=1 / math.sqrt(128), causal=causal)
    out = backend.forward(q, k, v, spec, params).out
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def ref(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        qs, ks, vs = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        o, _ = reference_attention(qs, ks, vs, params, compute_dtype=dtype)
        return (o, *torch.autograd.grad(o, (qs, ks, vs), dout.to(dtype)))

    hi, same = ref(torch.float32), ref(dt)
    assert_fa_rule(out, hi[0], same[0])
    for g, g_hi, g_same, what in zip(grads, hi[1:], same[1:], ("dq", "dk", "dv")):
        assert_fa_rule(g, g_hi, g_same, mult=3, what=what)


def test_triton_rocm_paged_decode_matches_contiguous() -> None:
    backend = TritonRocmBackend()
    backend.load()
    b, hkv, d, page, n = 4, 8, 128, 16, 1000
    q = torch.randn(b, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pages = math.ceil(n / page)
    table = torch.randperm(b * pages, device="cuda").view(b, pages).to(torch.int32)
    k_cache = torch.zeros(b * pages, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    for i in range(b):
        for p in range(pages):
            rows = slice(p * page, min((p + 1) * page, n))
            k_cache[table[i, p], : rows.stop - rows.start] = k[i, rows]
            v_cache[table[i, p], : rows.stop - rows.start] = v[i, rows]
    params = AttnParams(scale=d ** -0.5, causal=True, block_table=table,
                        seqlens_k=torch.full((b,), n, dtype=torch.int32, device="cuda"))
    spec = AttentionSpec(phase="decode", dtype="bf16", head_dim=d, num_q_heads=32,
                         num_kv_heads=hkv, layout="paged", mask=MaskSpec(causal=True),
                         max_seqlen_q=1, max_seqlen_k=n, page_size=page)
    out = backend.forward(q, k_cache, v_cache, spec, params).out
    plain = AttnParams(scale=d ** -0.5, causal=True)
    ref32, _ = reference_attention(q, k, v, plain, compute_dtype=torch.float32)
    ref16, _ = reference_attention(q, k, v, plain, compute_dtype=torch.bfloat16)
    assert_fa_rule(out, ref32, ref16)
