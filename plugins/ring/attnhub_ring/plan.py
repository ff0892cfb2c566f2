"""Block plans: which local queries meet which keys of a KV block, and under which mask.

With zigzag sharding every (query chunk, key chunk) pair of a document is either wholly
visible, the causal diagonal (the same chunk on both sides, so a square causal mask), or wholly
masked; the plan for the block that rank ``i`` receives from rank ``j`` is therefore:

- not causal: every local query against every key of the block;
- causal, ``j == i``: the local shard against itself under a square causal mask (local order
  follows global order, so the early chunk cannot see the late one);
- causal, ``j < i``: every local query against only the block's early chunk;
- causal, ``j > i``: only the local late chunk against the whole block.

Contiguous shards (``sharding="contiguous"``) are the case of an empty late chunk: a block
from an earlier rank is wholly visible, from a later one wholly masked.

Per document this gives one query segment and one key segment; documents with an empty side
are dropped, so fully masked work never reaches the local kernel (its rows keep LSE -inf).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, pairwise

import torch

from .sharding import ZigzagLayout

#: Rows along the sequence axis: a contiguous range (a view) or gathered indices (a copy).
Rows = slice | torch.Tensor


@dataclass(frozen=True)
class Segment:
    """One document's part of a block, in local row coordinates."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int


@dataclass(frozen=True)
class BlockPlan:
    """The work of one ring step for one rank (``source`` is the rank whose KV it uses)."""

    source: int
    causal: bool
    segments: tuple[Segment, ...]

    @property
    def empty(self) -> bool:
        return not self.segments

    @property
    def max_q(self) -> int:
        return max((s.q_len for s in self.segments), default=0)

    @property
    def max_k(self) -> int:
        return max((s.k_len for s in self.segments), default=0)

    def q_rows(self, device: torch.device) -> Rows:
        return _rows([(s.q_start, s.q_len) for s in self.segments], device)

    def k_rows(self, device: torch.device) -> Rows:
        return _rows([(s.k_start, s.k_len) for s in self.segments], device)

    def cu_seqlens(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 cu_seqlens of the gathered queries and keys (for a ``thd`` local call)."""
        cu_q = [0, *accumulate(s.q_len for s in self.segments)]
        cu_k = [0, *accumulate(s.k_len for s in self.segments)]
        return (torch.tensor(cu_q, dtype=torch.int32, device=device),
                torch.tensor(cu_k, dtype=torch.int32, device=device))

    def allowed(self, q_lo: int, q_hi: int, device: torch.device) -> torch.Tensor | None:
        """Boolean (q_hi-q_lo, K) visibility of gathered query rows [q_lo, q_hi) against the
        gathered keys; None when every pair is visible (one segment, no causal mask)."""
        if len(self.segments) == 1 and not self.causal:
            return None
        q_seg, q_pos = _seg_pos([s.q_len for s in self.segments], device)
        k_seg, k_pos = _seg_pos([s.k_len for s in self.segments], device)
        q_seg, q_pos = q_seg[q_lo:q_hi, None], q_pos[q_lo:q_hi, None]
        ok = q_seg == k_seg[None, :]
        if self.causal:  # causal blocks are square per segment: key pos <= query pos
            ok &= k_pos[None, :] <= q_pos
        return ok


def block_plans(layout: ZigzagLayout, rank: int, causal: bool) -> list[BlockPlan]:
    """Plans for ring steps 0..W-1 of ``rank``; step ``s`` uses the KV of rank ``rank - s``."""
    w = layout.world
    return [_plan(layout, rank, (rank - s) % w, causal) for s in range(w)]


def _plan(layout: ZigzagLayout, rank: int, src: int, causal: bool) -> BlockPlan:
    q_off, k_off = layout.local_offsets(rank), layout.local_offsets(src)
    q_first, k_first = layout.first_lens(rank), layout.first_lens(src)
    q_all, k_all = layout.local_lens(rank), layout.local_lens(src)
    segs = []
    for d in range(len(layout.doc_lens)):
        qs, ql, ks, kl = q_off[d], q_all[d], k_off[d], k_all[d]
        if causal and src < rank:
            kl = k_first[d]  # only the source's early chunk precedes our queries
        elif causal and src > rank:
            qs, ql = qs + q_first[d], ql - q_first[d]  # only our late chunk follows its keys
        if ql > 0 and kl > 0:
            segs.append(Segment(qs, ql, ks, kl))
    return BlockPlan(src, causal and src == rank, tuple(segs))


def _rows(ranges: list[tuple[int, int]], device: torch.device) -> Rows:
    """A slice when the ranges are back to back (no copy), else the gathered indices."""
    if all(a + n == b for (a, n), (b, _) in pairwise(ranges)):
        start = ranges[0][0] if ranges else 0
        return slice(start, start + sum(n for _, n in ranges))
    return torch.cat([torch.arange(a, a + n, device=device) for a, n in ranges])


def _seg_pos(lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment id and position within the segment of each gathered row."""
    lens_t = torch.tensor(lens, device=device)
    seg = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t)
    starts = torch.cumsum(lens_t, 0) - lens_t
    return seg, torch.arange(int(lens_t.sum()), device=device) - starts[seg]
