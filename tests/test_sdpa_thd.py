"""torch_sdpa on packed documents (thd) without a Python loop over documents: the padded
path (CPU and GPU), the per-document loop it replaces, and torch's varlen FlashAttention
kernel (GPU) against the fp64 reference by the FlashAttention rule, on random lengths with
empty and one-token documents and Sq != Sk per document."""

from __future__ import annotations

import math

import pytest
import torch

from attnhub.core import builtin
from attnhub.core.builtin import TorchSDPABackend, flash_varlen_window
from attnhub.core.spec import AttentionSpec, AttnParams, MaskSpec
from attnhub.testing import assert_fa_rule, assert_lse, fa_references

MASKS = {
    "none": {},
    "causal": {"causal": True},
    "causal_top_left": {"causal": True, "alignment": "top_left"},
    "window": {"window": (3, 2)},
    "causal_window": {"causal": True, "window": (4, 0)},
    "top_left_window": {"window": (2, 5), "alignment": "top_left"},
    "alibi": {"alibi_slopes": "rand"},
    "prefix_lm": {"causal": True, "prefix_lens": "rand"},
}


def _docs(lens_q: list[int], lens_k: list[int], hq: int, hkv: int, d: int,
          dtype: torch.dtype, device: str = "cpu", grads: bool = False):
    def cu(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                            device=device)

    q = torch.randn(sum(lens_q), hq, d, device=device, dtype=dtype, requires_grad=grads)
    k = torch.randn(sum(lens_k), hkv, d, device=device, dtype=dtype, requires_grad=grads)
    v = torch.randn(sum(lens_k), hkv, d, device=device, dtype=dtype, requires_grad=grads)
    return q, k, v, cu(lens_q), cu(lens_k)


def _params(mask: str, cu_q: torch.Tensor, cu_k: torch.Tensor, hq: int, d: int,
            lens_q: list[int], lens_k: list[int], pad: int = 0) -> AttnParams:
    kw = dict(MASKS[mask])
    b = len(lens_q)
    if kw.get("alibi_slopes") == "rand":
        kw["alibi_slopes"] = torch.rand(b, hq, device=cu_q.device) * 0.3
    if kw.get("prefix_lens") == "rand":
        kw["prefix_lens"] = torch.tensor([torch.randint(0, n + 1, ()).item() for n in lens_k],
                                         device=cu_q.device)
    return AttnParams(scale=1 / math.sqrt(d), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                      max_seqlen_q=max(lens_q) + pad, max_seqlen_k=max(lens_k) + pad,
                      return_lse=True, **kw)


def _spec(p: AttnParams, q: torch.Tensor, k: torch.Tensor, b: int) -> AttentionSpec:
    return AttentionSpec(phase="prefill", dtype={torch.float32: "fp32", torch.bfloat16: "bf16",
                                                  torch.float16: "fp16"}[q.dtype],
                         head_dim=q.shape[-1], num_q_heads=q.shape[1], num_kv_heads=k.shape[1],
                         layout="thd", mask=MaskSpec(causal=p.causal, alignment=p.alignment,
                                                     document=True),
                         max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k, batch=b)


def _check(q, k, v, p: AttnParams, b: int, grads: bool) -> None:
    out, lse = TorchSDPABackend().forward(q, k, v, _spec(p, q, k, b), p)
    ref64, ref_lse, same = fa_references(q, k, v, p, layout="thd")
    assert out.shape == (q.shape[0], q.shape[1], v.shape[-1])
    assert_fa_rule(out, ref64, same, what="output")
    assert_lse(lse, ref_lse, atol=1e-3 if q.dtype == torch.float32 else 2e-2)
    if grads:
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), g)
        want = torch.autograd.grad(ref64, (q, k, v), g.double())
        want_same = torch.autograd.grad(same, (q, k, v), g)
        for name, a, r, s in zip("qkv", got, want, want_same):
            assert_fa_rule(a, r, s, mult=3, what=f"d{name}")


def _random_lens(gen: torch.Generator, b: int, n: int) -> list[int]:
    lens = torch.randint(0, n + 1, (b,), generator=gen).tolist()
    lens[0], lens[-1] = 0, 1  # an empty document and a one-token one, every time
    return lens


@pytest.mark.parametrize("mask", list(MASKS))
def test_padded_path_matches_reference(mask, monkeypatch):
    """Random per-document lengths, Sq != Sk per document (both ways), GQA, LSE, grads (the
    padded path serves accelerators; forced here on the CPU)."""
    calls = []
    monkeypatch.setattr(builtin, "_padded_fits", lambda device, n: True)
    monkeypatch.setattr(builtin, "_sdpa_thd_loop", lambda *a: calls.append(a))
    gen = torch.Generator().manual_seed(hash(mask) % 1000)
    for trial in range(2):
        lens_q, lens_k = _random_lens(gen, 5, 13), _random_lens(gen, 5, 17)
        lens_k[1] = 0  # keys-free document with queries: rows that see nothing
        q, k, v, cu_q, cu_k = _docs(lens_q, lens_k, 6, 2, 16, torch.float32, grads=True)
        p = _params(mask, cu_q, cu_k, 6, 16, lens_q, lens_k, pad=trial * 3)
        _check(q, k, v, p, 5, grads=True)
    assert not calls, "the padded path must not fall back to the per-document loop"


@pytest.mark.parametrize("mask", list(MASKS))
def test_equal_documents_are_a_bshd_view(mask, monkeypatch):
    """Documents all max_seqlen_q x max_seqlen_k (Sq != Sk) run as one bshd call: exact,
    neither the loop nor the padded path."""
    for name in ("_sdpa_thd_loop", "_sdpa_thd_padded"):
        monkeypatch.setattr(builtin, name, lambda *a: pytest.fail("not the uniform path"))
    q, k, v, cu_q, cu_k = _docs([7] * 3, [11] * 3, 6, 2, 16, torch.float32, grads=True)
    _check(q, k, v, _params(mask, cu_q, cu_k, 6, 16, [7] * 3, [11] * 3), 3, grads=True)
    q, k, v, cu_q, cu_k = _docs([9] * 2, [4] * 2, 4, 4, 8, torch.bfloat16)
    _check(q, k, v, _params(mask, cu_q, cu_k, 4, 8, [9] * 2, [4] * 2), 2, grads=False)


@pytest.mark.parametrize("mask", ["causal", "causal_top_left", "alibi"])
def test_padded_path_bf16(mask, monkeypatch):
    monkeypatch.setattr(builtin, "_padded_fits", lambda device, n: True)
    gen = torch.Generator().manual_seed(7)
    lens_q, lens_k = _random_lens(gen, 4, 20), _random_lens(gen, 4, 9)
    q, k, v, cu_q, cu_k = _docs(lens_q, lens_k, 4, 1, 32, torch.bfloat16)
    _check(q, k, v, _params(mask, cu_q, cu_k, 4, 32, lens_q, lens_k), 4, grads=False)


def test_loop_on_cpu_above_the_budget_and_for_mask_mod(monkeypatch):
    """The per-document loop serves the CPU, calls above PADDED_MASK_BUDGET and mask_mod
    (per-document indices), with the padded path's answer."""
    assert not builtin._padded_fits(torch.device("cpu"), 1)
    assert builtin._padded_fits(torch.device("cuda", 0), builtin.PADDED_MASK_BUDGET)
    assert not builtin._padded_fits(torch.device("cuda", 0), builtin.PADDED_MASK_BUDGET + 1)
    lens_q, lens_k = [3, 0, 9, 1], [5, 2, 9, 11]
    q, k, v, cu_q, cu_k = _docs(lens_q, lens_k, 4, 2, 16, torch.float32)
    p = _params("causal_window", cu_q, cu_k, 4, 16, lens_q, lens_k)
    seen = []
    loop = builtin._sdpa_thd_loop
    monkeypatch.setattr(builtin, "_sdpa_thd_loop", lambda *a: seen.append(1) or loop(*a))
    looped = TorchSDPABackend().forward(q, k, v, _spec(p, q, k, 4), p)
    assert seen
    monkeypatch.setattr(builtin, "_padded_fits", lambda device, n: True)
    seen.clear()
    padded = TorchSDPABackend().forward(q, k, v, _spec(p, q, k, 4), p)
    assert not seen
    torch.testing.assert_close(looped.out, padded.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(looped.lse, padded.lse, atol=1e-5, rtol=1e-5)
    pm = AttnParams(scale=0.25, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=9,
                    max_seqlen_k=11, mask_mod=lambda b, h, i, j: (i + j) % 3 != 0)
    out = TorchSDPABackend().forward(q, k, v, _spec(pm, q, k, 4), pm).out
    ref64, _, same = fa_references(q, k, v, pm, layout="thd")
    assert seen and out.shape == q.shape
    assert_fa_rule(out, ref64, same)


def test_flash_varlen_form_only_where_exact(monkeypatch):
    """torch's varlen FlashAttention takes a call only where its mask is the document's."""
    monkeypatch.setattr(builtin, "_torch_flash_varlen", lambda index: True)
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16

    def form(dtype=bf16, d=128, dv=128, max_q=64, max_k=64, **kw):
        return flash_varlen_window(AttnParams(scale=0.1, **kw), cuda, dtype, d, dv, max_q,
                                   max_k)

    assert form() == (-1, -1)
    assert form(causal=True) == (-1, 0)
    assert form(causal=True, window=(8, 0)) == (8, 0)
    assert form(causal=True, window=(8, 5)) == (8, 0)  # causal already hides the right
    assert form(window=(8, 3)) == (8, 3)
    assert form(causal=True, alignment="top_left") is None  # the shift differs per document
    assert form(alignment="top_left") == (-1, -1)  # no mask: alignment has no meaning
    assert form(window=(2, 100), max_q=300, max_k=64) is None  # clamped right edge
    # an edge past every key is unbounded: the kernel gets -1, not an edge to clamp
    assert form(window=(2, 400), max_q=300, max_k=64) == (2, -1)
    assert form(dtype=torch.float32) is None and form(d=72) is None
    assert form(d=64, dv=128) is None and form(d=512, dv=512) is None
    assert form(alibi_slopes=torch.ones(4)) is None
    assert form(prefix_lens=torch.ones(2), causal=True) is None
    assert flash_varlen_window(AttnParams(scale=0.1), torch.device("cpu"), bf16, 64, 64,
                               8, 8) is None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("mask", ["none", "causal", "window", "causal_window",
                                  "causal_top_left", "alibi"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_thd_matches_reference_without_host_sync(mask, dtype):
    """On the GPU (flash for bf16 bottom-right, padded otherwise): exact, and no host sync
    in the forward (torch's sync debug mode raises on one)."""
    gen = torch.Generator().manual_seed(3)
    for hq, hkv, lens_q, lens_k in ((8, 2, _random_lens(gen, 6, 300), _random_lens(gen, 6, 200)),
                                    (8, 2, [1, 0, 1, 1], [40, 7, 0, 129])):
        q, k, v, cu_q, cu_k = _docs(lens_q, lens_k, hq, hkv, 64, dtype, "cuda", grads=True)
        p = _params(mask, cu_q, cu_k, hq, 64, lens_q, lens_k)
        spec = _spec(p, q, k, len(lens_q))
        TorchSDPABackend().forward(q, k, v, spec, p)  # warm-up (first-call setup)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            TorchSDPABackend().forward(q, k, v, spec, p)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _check(q, k, v, p, len(lens_q), grads=True)
