"""Review: FlashAttention-2 clamps a window edge >= max_seqlen_k to "unbounded" in its
varlen entry point (``mha_varlen_fwd``: ``if (window_size_right >= max_seqlen_k)
window_size_right = -1``), for every document of the batch. Under bottom-right alignment a
document with more queries than keys needs exactly such an edge for its first queries, so
the call must be refused rather than answered with keys the window excludes. The fake below
clamps as the library does; every answer ``flash_varlen`` gives must equal the reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnhub.core.flash_conventions import flash_varlen
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.errors import BackendUnavailableError
from attnhub.testing import flash_reference


def _fa2_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale, causal=False,
                window_size=(-1, -1), **_):  # type: ignore[no-untyped-def]
    """flash_attn_varlen_func's maths: windows clamped against max_seqlen_k, then each
    document bottom-right."""
    window = tuple(-1 if w >= max_k else w for w in window_size)
    outs = []
    for (qs, qe), (ks, ke) in zip(itertools.pairwise(cu_q.tolist()),
                                  itertools.pairwise(cu_k.tolist())):
        o, _ = flash_reference(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
                               softmax_scale=softmax_scale, causal=causal, window_size=window)
        outs.append(o[0])
    return torch.cat(outs)


@pytest.mark.parametrize("window", [(1, 3), (-1, 3), (2, 0), (0, 5), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_window_answers_exactly_or_refuses(window: tuple[int, int],
                                                   causal: bool) -> None:
    torch.manual_seed(0)
    lq, lk = [7, 2, 3], [2, 3, 3]  # a document with more queries than keys
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], dtype=torch.int32)
    q, k, v = torch.randn(sum(lq), 2, 8), torch.randn(sum(lk), 1, 8), torch.randn(sum(lk), 1, 8)
    p = AttnParams(scale=0.3, causal=causal, window=window, cu_seqlens_q=cu_q,
                   cu_seqlens_k=cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    try:
        out = flash_varlen(_fa2_varlen, "fa2", q, k, v, p)
    except BackendUnavailableError as exc:
        assert "window" in str(exc)
        return
    ref, _ = reference_attention(q, k, v, p, layout="thd")
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)


def _fa2_paged(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale,
               causal=False, window_size=(-1, -1), **_):  # type: ignore[no-untyped-def]
    """flash_attn_with_kvcache's maths on a paged cache: window edges clamped against the
    tables' capacity (pages per row x page size), then each sequence bottom-right."""
    capacity = block_table.shape[1] * k_cache.shape[1]
    window = tuple(-1 if w >= capacity else w for w in window_size)
    outs = []
    for b, n in enumerate(cache_seqlens.tolist()):
        k = k_cache[block_table[b].long()].flatten(0, 1)[:n]
        v = v_cache[block_table[b].long()].flatten(0, 1)[:n]
        pb = AttnParams(scale=softmax_scale, causal=causal,
                        window=None if window == (-1, -1) else window)
        outs.append(reference_attention(q[b:b + 1], k[None], v[None], pb)[0].float())
    return torch.cat(outs)


@pytest.mark.parametrize("window", [(1, 3), (-1, 4), (2, 0), (0, 6), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_window_answers_exactly_or_refuses(window: tuple[int, int],
                                                  causal: bool) -> None:
    """The same clamp on a paged cache, against its capacity: 7 queries on a capacity of 4
    keys (one page of 4 per row), sequences of 2 and 4 keys."""
    from attnhub.core.flash_conventions import flash_kwargs, flash_paged_form
    from attnhub.core.paged import paged_to_varlen

    torch.manual_seed(1)
    kc, vc = torch.randn(3, 4, 1, 8), torch.randn(3, 4, 1, 8)
    table = torch.tensor([[2], [0]], dtype=torch.int32)
    lens = torch.tensor([2, 4], dtype=torch.int32)
    q = torch.randn(2, 7, 2, 8)
    p = AttnParams(scale=0.3, causal=causal, window=window, block_table=table, seqlens_k=lens)
    try:
        form = flash_paged_form("fa2", p, q, kc)
    except BackendUnavailableError as exc:
        assert "window" in str(exc)
        return
    out = _fa2_paged(q, kc, vc, cache_seqlens=lens, block_table=table,
                     **flash_kwargs(p, form))
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, kc, vc, table, lens)
    pv = AttnParams(scale=0.3, causal=causal, window=window, cu_seqlens_q=cu_q,
                    cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=4)
    ref, _ = reference_attention(qv, kv, vv, pv, layout="thd")
    torch.testing.assert_close(out.reshape(ref.shape), ref.float(), atol=1e-5, rtol=1e-5)


def test_flash_kwargs_hand_over_fp32_slopes_with_a_unit_stride() -> None:
    """flash_attn refuses ALiBi slopes whose last stride is not 1: a strided view of
    per-batch slopes (a column of a wider tensor) is made contiguous, values unchanged."""
    from attnhub.core.flash_conventions import flash_kwargs
    from attnhub.core.masking import bottom_right_form

    wide = torch.rand(3, 8, dtype=torch.float64)
    slopes = wide[:, ::2]  # (3, 4), last stride 2
    p = AttnParams(scale=0.5, causal=True, alibi_slopes=slopes)
    got = flash_kwargs(p, bottom_right_form(True, "bottom_right", None, 5, 5))["alibi_slopes"]
    assert got.dtype == torch.float32 and got.stride(-1) == 1
    torch.testing.assert_close(got, slopes.float())
