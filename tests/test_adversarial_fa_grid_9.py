"""FlashAttention's grid, ninth round (CPU): window edges past every key.

A window edge as large as the sequence or larger means "unbounded" (FlashAttention clamps an
edge >= Sk to -1), and large sentinels are how such windows get written: 2**31 - 1, or
``sys.maxsize``. Found: ``sys.maxsize`` wrapped the int64 index grids of ``reference`` and
``torch_sdpa`` (``pos + right`` negative: every row fully masked, 0 out, LSE -inf); an edge
of 2**64 raised OverflowError inside every backend (charged to the backends); and the
FlashAttention translation handed edges >= 2**31 to kernels whose C++ entry takes an int.
Now edges at or past max(Sq, Sk) become -1 (``masking.window_within``), which is exact.

Also found: the fp64 reference built its ALiBi bias in fp32."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

import attnhub
from attnhub.core.flash_conventions import flash_dense_form, flash_kwargs, flash_varlen
from attnhub.core.masking import allowed_mask, window_within
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.testing import (
    assert_fa_rule,
    assert_grads_fa_rule,
    assert_lse,
    fa_references,
    flash_reference,
)
from tests.test_review_flash_clamp import _fa2_varlen as _clamped_varlen

BIG = [2**31 - 1, 2**31, sys.maxsize, 2**64]


def _unbounded(window: tuple[int, int], sq: int, sk: int) -> tuple[int, int]:
    """The window the big edges stand for: each edge past every key is -1."""
    return tuple(-1 if w >= max(sq, sk) else w for w in window)  # type: ignore[return-value]


@pytest.mark.parametrize("backend", ["reference", "torch_sdpa"])
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5), (1, 7)])
@pytest.mark.parametrize("big", BIG)
def test_big_window_edges_mean_unbounded(backend: str, sq: int, sk: int, big: int) -> None:
    """out, LSE and gradients of windows (big, big), (2, big) and causal (big, 0) equal those
    of the windows they stand for, by the FlashAttention rule against the fp64 reference."""
    g = torch.Generator().manual_seed(sq * 31 + sk)
    base = [torch.randn(2, s, h, 16, generator=g) for s, h in ((sq, 4), (sk, 2), (sk, 2))]
    dout = torch.randn(2, sq, 4, 16, generator=g)
    for window, causal in (((big, big), False), ((2, big), False), ((big, 0), True)):
        qkv = [t.clone().requires_grad_() for t in base]
        out, lse = attnhub.attention(*qkv, backend=backend, window=window, causal=causal,
                                     return_lse=True)
        leaves = [t.clone().requires_grad_() for t in base]
        params = AttnParams(scale=0.25, causal=causal, window=_unbounded(window, sq, sk))
        ref64, ref_lse, same = fa_references(*leaves, params)
        assert_fa_rule(out, ref64, same)
        assert_lse(lse, ref_lse, atol=1e-4)
        assert_grads_fa_rule(out, ref64, same, qkv, ref_inputs=leaves, dout=dout)


def test_big_window_edges_on_packed_documents() -> None:
    """thd on both CPU backends: documents with Sq > Sk, Sq < Sk and none, ALiBi per
    document, window (sys.maxsize, 1) beside the -1 it stands for."""
    g = torch.Generator().manual_seed(9)
    lq, lk = [4, 0, 2, 6], [2, 3, 5, 6]
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 8, generator=g)
    k, v = (torch.randn(sum(lk), 2, 8, generator=g) for _ in "kv")
    slopes = torch.rand(4, 4, generator=g) * 0.3
    params = AttnParams(scale=0.3, window=(-1, 1), alibi_slopes=slopes, cu_seqlens_q=cu_q,
                        cu_seqlens_k=cu_k)
    ref, ref_lse = reference_attention(q, k, v, params, layout="thd")
    for backend in ("reference", "torch_sdpa"):
        out, lse = attnhub.attention(q, k, v, backend=backend, layout="thd", window=(
            sys.maxsize, 1), alibi_slopes=slopes, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            scale=0.3, return_lse=True)
        torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
        assert_lse(lse, ref_lse, atol=1e-5)


def _int_window(window_size: tuple[int, int]) -> None:
    """What FlashAttention's C++ entry (pybind11 / a torch op's int) does with an edge
    outside int32: refuses it (never a silent truncation we could miss here)."""
    if any(not -2**31 <= w < 2**31 for w in window_size):
        raise OverflowError(f"window_size {window_size} does not fit a C++ int")


def _fa2_func(q, k, v, *, softmax_scale, causal=False, window_size=(-1, -1),
              **kw):  # type: ignore[no-untyped-def]
    _int_window(window_size)
    return flash_reference(q, k, v, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, **kw)[0]


def _fa2_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1),
                **kw):  # type: ignore[no-untyped-def]
    """flash_attn_varlen_func: int edges, then its clamped per-document maths."""
    _int_window(window_size)
    return _clamped_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size, **kw)


@pytest.mark.parametrize("big", BIG[1:])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_flash_translation_passes_int_windows(big: int, align: str) -> None:
    """FA2/FA3/fa2_torch get window edges that fit their C++ ints and mean the same mask:
    dense (top-left converted too) and packed."""
    g = torch.Generator().manual_seed(big % 97)
    q, k, v = (torch.randn(1, s, 2, 8, generator=g) for s in (4, 7, 7))
    for window, causal in (((big, big), False), ((1, big), False), ((big, 0), True)):
        p = AttnParams(scale=0.3, causal=causal, alignment=align, window=window)
        form, kk, vv = flash_dense_form("fa2", p, q, k, v)
        out = _fa2_func(q, kk, vv, **flash_kwargs(p, form))
        want = AttnParams(scale=0.3, causal=causal, alignment=align,
                          window=_unbounded(window, 4, 7))
        torch.testing.assert_close(out, reference_attention(q, k, v, want)[0].float(),
                                   atol=1e-5, rtol=1e-5)
    lq, lk = [3, 2], [3, 5]
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], dtype=torch.int32)
    qt, kt, vt = (torch.randn(n, 2, 8, generator=g) for n in (sum(lq), sum(lk), sum(lk)))
    p = AttnParams(scale=0.3, window=(big, 2), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                   max_seqlen_q=3, max_seqlen_k=5)
    out = flash_varlen(_fa2_varlen, "fa2", qt, kt, vt, p)
    want = AttnParams(scale=0.3, window=(-1, 2), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(out, reference_attention(qt, kt, vt, want, layout="thd")[0]
                               .float(), atol=1e-5, rtol=1e-5)


def test_window_within_is_exact_at_the_bound() -> None:
    """Edges just below max(Sq, Sk) still mask (kept); at it they mask nothing (-1)."""
    for sq, sk in ((3, 8), (8, 3), (5, 5)):
        n = max(sq, sk)
        for left, right in itertools.product((n - 1, n, n + 1, sys.maxsize), repeat=2):
            want = _grid(sq, sk, left, right)
            clamped = window_within((left, right), n)
            assert clamped == tuple(-1 if w >= n else w for w in (left, right))
            for window in ((left, right), clamped):
                m = allowed_mask(AttnParams(scale=1.0, window=window), 1, 1, sq, sk,
                                 torch.device("cpu"))
                assert torch.equal(m[0, 0], want), (sq, sk, window)


def _grid(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    """The window mask by its definition (-1: unbounded), in Python ints (no overflow)."""
    def seen(i: int, j: int) -> bool:
        p = i + sk - sq
        return (left < 0 or j >= p - left) and (right < 0 or j <= p + right)
    return torch.tensor([[seen(i, j) for j in range(sk)] for i in range(sq)])


def test_fp64_reference_keeps_alibi_in_fp64() -> None:
    """The oracle's ALiBi bias was made in fp32 and then widened: at 4000 keys (slope 0.37)
    its scores were off by up to 6e-5 and its outputs by 6e-8, errors every fp32 kernel
    shares with it (so the rule could not see them). Now it agrees with fp64 maths."""
    g = torch.Generator().manual_seed(11)
    sk = 4000
    q, k, v = (torch.randn(1, s, 2, 8, generator=g) for s in (2, sk, sk))
    slopes = torch.tensor([0.3711, 0.0913])
    params = AttnParams(scale=0.35, alibi_slopes=slopes)
    out, lse = reference_attention(q, k, v, params)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 0.35
    pos = torch.arange(2, dtype=torch.float64).view(2, 1) + sk - 2
    s = s - slopes.double().view(1, 2, 1, 1) * (pos - torch.arange(sk).double()).abs()
    want = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double())
    torch.testing.assert_close(lse.double(), s.logsumexp(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", ["sliding_window", "flex", None])
@pytest.mark.parametrize("big", BIG)
def test_the_hub_normalises_big_edges_for_every_backend(backend: str | None, big: int) -> None:
    """The hub makes an edge past every key -1 before any backend sees it, so a plugin's
    kernel (``sliding_window`` here) never meets a sentinel it would overflow on."""
    g = torch.Generator().manual_seed(big % 1000)
    q, k, v = (torch.randn(1, 9, 2, 16, generator=g) for _ in range(3))
    want = attnhub.attention(q, k, v, backend="reference", window=(3, 8))
    got = attnhub.attention(q, k, v, backend=backend, window=(3, big))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_growing_cache_keeps_its_window_within_one_length_bucket() -> None:
    """Calls of one length bucket share a binding (the hub's growing-cache path), so the
    edges are normalised by the bucket, not the length: a window of 700 keys stays a
    window for every step from 500 to 1100 keys (buckets 512, 1024, 2048)."""
    hub = attnhub.Hub(hardware="cpu")
    g = torch.Generator().manual_seed(0)
    k_all, v_all = (torch.randn(1, 1100, 1, 8, generator=g) for _ in range(2))
    for sk in (500, 600, 1000, 1024, 1025, 1100):
        q = torch.randn(1, 1, 1, 8, generator=g)
        k, v = k_all[:, :sk], v_all[:, :sk]
        got = hub.attention(q, k, v, window=(700, 0), causal=True)
        want = attnhub.attention(q, k, v, backend="reference", window=(700, 0), causal=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _fa2_varlen_gqa_fast_path(q, k, v, cu_q, cu_k, max_q, max_k,
                              **kw):  # type: ignore[no-untyped-def]
    """FlashAttention-2's varlen entry with its one-query GQA fast path: at max_seqlen_q 1
    it reshapes q as one token per document, which throws when a document holds none."""
    if max_q == 1 and q.shape[0] != cu_q.shape[0] - 1:
        raise RuntimeError("shape '[3, 1, 4, 8]' is invalid for input of size 64")
    return _fa2_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def test_one_query_documents_beside_an_empty_one_reach_flash_varlen_exactly() -> None:
    """Packed decode (one query per document, one document with none, GQA): the
    FlashAttention translation passes max_seqlen_q 2, an exact upper bound, so the
    library's one-query fast path never reshapes q by the document count."""
    g = torch.Generator().manual_seed(3)
    lq, lk = [1, 0, 1], [4, 3, 6]
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], dtype=torch.int32)
    qt = torch.randn(sum(lq), 4, 8, generator=g)
    kt, vt = (torch.randn(sum(lk), 2, 8, generator=g) for _ in range(2))
    p = AttnParams(scale=0.3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1,
                   max_seqlen_k=6)
    out = flash_varlen(_fa2_varlen_gqa_fast_path, "fa2", qt, kt, vt, p)
    want = reference_attention(qt, kt, vt, AttnParams(scale=0.3, cu_seqlens_q=cu_q,
                                                      cu_seqlens_k=cu_k), layout="thd")[0]
    torch.testing.assert_close(out, want.float(), atol=1e-5, rtol=1e-5)
    from attnhub.plugin import varlen_max_q

    assert (varlen_max_q(1, 2, 3), varlen_max_q(1, 3, 3), varlen_max_q(5, 2, 3)) == (2, 1, 5)


def test_fa2_torch_passes_the_exact_bound_for_packed_one_query_documents(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``fa2_torch`` (torch's own flash op) takes the same bound on its packed path."""
    from attnhub_sm80_fa2 import fa2_torch

    seen: list[int] = []

    def op(q, k, v, cu_q, cu_k, max_q, max_k, causal, **kw):  # type: ignore[no-untyped-def]
        seen.append(max_q)
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(fa2_torch, "flash_op", op)
    cu_q = torch.tensor([0, 1, 1, 2], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 7, 13], dtype=torch.int32)
    p = AttnParams(scale=0.3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1,
                   max_seqlen_k=6)
    spec = attnhub.AttentionSpec(phase="decode", dtype="fp16", head_dim=8, num_q_heads=4,
                                 num_kv_heads=2, layout="thd", max_seqlen_q=1, max_seqlen_k=6)
    q = torch.randn(2, 4, 8, dtype=torch.float16)
    k, v = (torch.randn(13, 2, 8, dtype=torch.float16) for _ in range(2))
    fa2_torch.TorchFlashBackend().forward(q, k, v, spec, p)
    assert seen == [2]
