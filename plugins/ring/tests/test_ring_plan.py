"""Single-process properties of the ring's pieces: zigzag layout, block plans, LSE merge."""

from __future__ import annotations

import torch
from attnhub_ring import (
    ZigzagLayout,
    merge_partial,
    zigzag_shard,
    zigzag_shard_varlen,
    zigzag_unshard,
    zigzag_unshard_varlen,
)
from attnhub_ring.plan import block_plans
from hypothesis import given, settings
from hypothesis import strategies as st

from attnhub.plugin import AttnParams, reference_attention

worlds = st.integers(1, 5)
doc_lists = st.lists(st.integers(0, 23), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(world=worlds, docs=doc_lists)
def test_shards_partition_every_document(world: int, docs: list[int]) -> None:
    layout = ZigzagLayout(world, tuple(docs))
    idx = torch.cat([layout.global_indices(r) for r in range(world)])
    assert sorted(idx.tolist()) == list(range(sum(docs)))
    for d, n in enumerate(docs):
        sizes = [layout.chunk_len(d, c) for c in range(2 * world)]
        assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    per_rank = [list(layout.local_lens(r)) for r in range(world)]
    assert ZigzagLayout.from_local_lens(per_rank) == layout


@settings(max_examples=25, deadline=None)
@given(world=worlds, docs=doc_lists, causal=st.booleans())
def test_plans_cover_each_visible_pair_exactly_once(world: int, docs: list[int],
                                                    causal: bool) -> None:
    """Over all ranks and steps, the blocks' visible (query, key) pairs, mapped back to global
    positions, are exactly the pairs of the global causal/document mask, each once."""
    layout = ZigzagLayout(world, tuple(docs))
    total = sum(docs)
    seen = torch.zeros(total, total, dtype=torch.int64)
    for rank in range(world):
        g_q = layout.global_indices(rank)
        for plan in block_plans(layout, rank, causal):
            if plan.empty:
                continue
            g_k = layout.global_indices(plan.source)
            q_rows, k_rows = (_as_index(r, g_q.numel() if i == 0 else g_k.numel())
                              for i, r in enumerate((plan.q_rows(torch.device("cpu")),
                                                     plan.k_rows(torch.device("cpu")))))
            ok = plan.allowed(0, q_rows.numel(), torch.device("cpu"))
            if ok is None:
                ok = torch.ones(q_rows.numel(), k_rows.numel(), dtype=torch.bool)
            qi, ki = torch.nonzero(ok, as_tuple=True)
            seen.index_put_((g_q[q_rows[qi]], g_k[k_rows[ki]]),
                            torch.ones_like(qi), accumulate=True)
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    want = doc[:, None] == doc[None, :]
    if causal:
        want &= torch.arange(total)[None, :] <= torch.arange(total)[:, None]
    assert torch.equal(seen, want.long())


def _as_index(rows: slice | torch.Tensor, n: int) -> torch.Tensor:
    return torch.arange(n)[rows] if isinstance(rows, slice) else rows


def test_causal_work_is_balanced_and_a_short_sequence_masks_a_whole_shard() -> None:
    """Zigzag: with S divisible by 2W every rank has the same number of visible causal pairs;
    with S = W+1 some rank's whole shard sees nothing of a later rank's block."""
    world, s = 4, 48
    layout = ZigzagLayout(world, (s,))
    work = [int((layout.global_indices(r) + 1).sum()) for r in range(world)]
    assert len(set(work)) == 1, work
    short = ZigzagLayout(world, (world + 1,))
    plans = block_plans(short, 0, causal=True)
    assert short.local_lens(0) == (1,) and any(p.empty for p in plans)


@settings(max_examples=20, deadline=None)
@given(world=worlds, docs=doc_lists)
def test_shard_then_unshard_is_identity(world: int, docs: list[int]) -> None:
    x = torch.randn(2, sum(docs), 3)
    assert torch.equal(zigzag_unshard([zigzag_shard(x, r, world) for r in range(world)]), x)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    t = torch.randn(sum(docs), 3)
    parts = [zigzag_shard_varlen(t, cu, r, world) for r in range(world)]
    for r, (local, cu_local) in enumerate(parts):
        assert cu_local.dtype == torch.int32 and int(cu_local[-1]) == local.shape[0]
        assert torch.diff(cu_local).tolist() == list(ZigzagLayout(world, tuple(docs))
                                                     .local_lens(r))
    assert torch.equal(zigzag_unshard_varlen([p[0] for p in parts], cu), t)


def test_lengths_that_are_not_a_zigzag_shard_are_rejected() -> None:
    import pytest

    from attnhub import InputError

    with pytest.raises(InputError, match="zigzag_shard"):
        ZigzagLayout.from_local_lens([[5], [1]])


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention restricted to the key set ``keys`` (bool over Sk), in fp64."""
    def only(b, h, qi, ki):  # type: ignore[no-untyped-def]
        return keys[ki] & (ki <= qi)

    out, lse = reference_attention(q, k, v, AttnParams(scale=0.5, mask_mod=only))
    return out, lse.transpose(1, 2)  # token-major, as the ring merges


@settings(max_examples=15, deadline=None)
@given(blocks=st.integers(1, 5), seed=st.integers(0, 2**16), empty_block=st.booleans())
def test_merging_blocks_by_lse_is_attention_over_their_union(blocks: int, seed: int,
                                                             empty_block: bool) -> None:
    """Random disjoint key blocks under a causal mask (early rows see nothing of late
    blocks: LSE -inf), merged in any order, give full causal attention without NaN."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 9, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    owner = torch.randint(0, blocks, (9,), generator=g)
    out = torch.zeros(1, 9, 2, 4)  # fp32 accumulators, as in the ring
    lse = torch.full((1, 9, 2), float("-inf"))
    sets = [owner == b for b in torch.randperm(blocks, generator=g).tolist()]
    if empty_block:
        sets.append(torch.zeros(9, dtype=torch.bool))
    for keys in sets:
        o_b, l_b = _partial(q, k, v, keys)
        out, lse = merge_partial(out, lse, o_b, l_b)
    full_out, full_lse = _partial(q, k, v, torch.ones(9, dtype=torch.bool))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, full_out.float())
    torch.testing.assert_close(lse, full_lse.float())


def test_merging_two_fully_masked_partials_stays_zero_and_minus_inf() -> None:
    inf = torch.full((3, 2), float("-inf"))
    garbage = torch.full((3, 2, 4), float("nan"))  # a kernel's rows that it reports masked
    out, lse = merge_partial(torch.zeros(3, 2, 4), inf, garbage, inf)
    assert torch.equal(out, torch.zeros(3, 2, 4)) and torch.equal(lse, inf)
