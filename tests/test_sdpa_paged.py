"""torch_sdpa on a paged KV cache through one padded gather (``_sdpa_paged``: no host sync,
no loop over sequences) against the fp64 reference by the FlashAttention rule: random
scattered page tables, lengths 0..capacity (Sq > length included), GQA, every mask kind the
gather path serves, both alignments, and the LSE."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attnhub.core import builtin
from attnhub.core.paged import paged_to_varlen
from attnhub.core.spec import AttnParams
from attnhub.testing import assert_fa_rule, assert_lse, fa_references

MASKS = {
    "none": {},
    "causal": {"causal": True},
    "causal_top_left": {"causal": True, "alignment": "top_left"},
    "causal_window": {"causal": True, "window": (5, 0)},
    "window_top_left": {"window": (3, 4), "alignment": "top_left"},
    "alibi_causal": {"causal": True, "alibi_slopes": "rand"},
    "prefix_lm": {"causal": True, "prefix_lens": "rand"},
}


def _paged(seed: int, b: int, sq: int, hq: int, hkv: int, d: int, page: int):
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = 4
    num_pages = b * pages_per_seq + 3
    cap = pages_per_seq * page
    lens = torch.randint(0, cap + 1, (b,), generator=gen)
    lens[0] = 0  # an empty sequence: its rows see no key
    lens[-1] = cap  # a full one
    table = torch.randperm(num_pages, generator=gen)[: b * pages_per_seq].view(b, -1)
    kc = torch.randn(num_pages, page, hkv, d, generator=gen)
    vc = torch.randn(num_pages, page, hkv, d, generator=gen)
    q = torch.randn(b, sq, hq, d, generator=gen)
    return q, kc, vc, table.to(torch.int32), lens.to(torch.int32), int(lens.max())


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("sq", [1, 3])
def test_paged_gather_matches_reference(mask: str, sq: int) -> None:
    b, hq, hkv, d, page = 4, 4, 2, 16, 4
    q, kc, vc, table, lens, longest = _paged(sq * 31 + len(mask), b, sq, hq, hkv, d, page)
    kw = dict(MASKS[mask])
    if kw.get("alibi_slopes") == "rand":
        kw["alibi_slopes"] = torch.rand(b, hq) * 0.3
    if kw.get("prefix_lens") == "rand":
        kw["prefix_lens"] = (lens.to(torch.long) * 0.5).to(torch.long)
    p = AttnParams(scale=1 / math.sqrt(d), block_table=table, seqlens_k=lens, max_seqlen_q=sq,
                   max_seqlen_k=longest + 2, return_lse=True, **kw)  # an upper bound
    out, lse = builtin._sdpa_paged(q, kc, vc, p)
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, kc, vc, table, lens)
    pt = dataclasses.replace(p, block_table=None, seqlens_k=None, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, max_seqlen_k=longest)
    ref64, ref_lse, same = fa_references(qv, kv, vv, pt, layout="thd")
    assert out.shape == q.shape
    assert_fa_rule(out.reshape(b * sq, hq, d), ref64, same, what=f"{mask} output")
    assert_lse(lse.transpose(0, 1).reshape(hq, b * sq), ref_lse, atol=1e-4)
    assert torch.all(out[0] == 0)  # the empty sequence


def test_paged_gather_is_for_accelerators_with_known_lengths() -> None:
    """The CPU keeps the varlen route; mask_mod and column ranges (per-sequence indices) and
    calls without ``max_seqlen_k`` keep it everywhere."""
    q = torch.empty(1, 1, 2, 8, device="meta")
    p = AttnParams(scale=1.0, max_seqlen_k=8)
    assert builtin._paged_gather_serves(q, p)
    assert not builtin._paged_gather_serves(q.new_empty(1, 1, 2, 8, device="cpu"), p)
    assert not builtin._paged_gather_serves(q, dataclasses.replace(p, max_seqlen_k=None))
    assert not builtin._paged_gather_serves(q, dataclasses.replace(
        p, mask_mod=lambda b, h, i, j: i >= j))


def test_backend_routes_paged_calls_through_the_gather(monkeypatch) -> None:
    """``TorchSDPABackend.forward`` takes the gather path where it serves (forced here on the
    CPU) and agrees with the varlen route it replaces."""
    from attnhub.core.builtin import TorchSDPABackend
    from attnhub.core.spec import AttentionSpec, MaskSpec

    b, sq, hq, hkv, d, page = 3, 2, 4, 2, 16, 4
    q, kc, vc, table, lens, longest = _paged(5, b, sq, hq, hkv, d, page)
    p = AttnParams(scale=0.25, causal=True, block_table=table, seqlens_k=lens,
                   max_seqlen_q=sq, max_seqlen_k=longest)
    spec = AttentionSpec(phase="decode", dtype="fp32", head_dim=d, num_q_heads=hq,
                         num_kv_heads=hkv, layout="paged", mask=MaskSpec(causal=True),
                         max_seqlen_q=sq, max_seqlen_k=longest, batch=b, page_size=page)
    backend = TorchSDPABackend()
    before, _ = backend.forward(q, kc, vc, spec, p)  # the CPU: varlen route
    used = []
    real = builtin._sdpa_paged
    monkeypatch.setattr(builtin, "_paged_gather_serves", lambda q, p: True)
    monkeypatch.setattr(builtin, "_sdpa_paged", lambda *a: used.append(1) or real(*a))
    after, _ = backend.forward(q, kc, vc, spec, p)
    assert used == [1] and torch.allclose(after, before, atol=1e-5)
