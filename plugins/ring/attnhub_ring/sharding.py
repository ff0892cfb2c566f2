"""Zigzag sharding: which tokens of a sequence each rank of the ring holds.

Each sequence (a whole ``bshd`` sequence, or each document of a packed ``thd`` batch) is cut
into ``2W`` balanced chunks (sizes differ by at most one token, so lengths need not divide
evenly) and rank ``i`` holds chunks ``i`` and ``2W-1-i``, in that order. Under a causal mask
an early chunk has little work and a late one much, so pairing them gives every rank the same
amount of work (the ring's step time is its slowest rank). Splitting every document, rather
than the packed stream, keeps that balance for varlen batches too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch

from attnhub import InputError


@dataclass(frozen=True)
class ZigzagLayout:
    """Global sequence (or document) lengths over ``world`` ranks; all sizes derive from it."""

    world: int
    doc_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.world < 1 or any(n < 0 for n in self.doc_lens):
            raise ValueError(f"ZigzagLayout(world={self.world}, doc_lens={self.doc_lens}): "
                             "world must be >= 1 and lengths >= 0")

    # -- chunk sizes --------------------------------------------------------------------
    def chunk_len(self, doc: int, chunk: int) -> int:
        """Tokens of chunk ``chunk`` (0..2W-1) of document ``doc``: the first ``n % 2W``
        chunks get one more token than the rest."""
        n, parts = self.doc_lens[doc], 2 * self.world
        return n // parts + (1 if chunk < n % parts else 0)

    def first_lens(self, rank: int) -> tuple[int, ...]:
        """Per document, the length of the rank's early chunk (chunk ``rank``)."""
        return tuple(self.chunk_len(d, rank) for d in range(len(self.doc_lens)))

    def second_lens(self, rank: int) -> tuple[int, ...]:
        """Per document, the length of the rank's late chunk (chunk ``2W-1-rank``)."""
        c = 2 * self.world - 1 - rank
        return tuple(self.chunk_len(d, c) for d in range(len(self.doc_lens)))

    def local_lens(self, rank: int) -> tuple[int, ...]:
        """Per document, the tokens rank ``rank`` holds."""
        return tuple(a + b for a, b in zip(self.first_lens(rank), self.second_lens(rank)))

    def local_offsets(self, rank: int) -> tuple[int, ...]:
        """Start of each document in the rank's local (packed) shard, plus the total."""
        return (0, *accumulate(self.local_lens(rank)))

    @cached_property
    def doc_starts(self) -> tuple[int, ...]:
        return (0, *accumulate(self.doc_lens))

    # -- token indices ------------------------------------------------------------------
    def global_indices(self, rank: int) -> torch.Tensor:
        """Indices into the global (packed) sequence of the tokens rank ``rank`` holds, in
        local order: for every document, its chunk ``rank`` then its chunk ``2W-1-rank``.

        Use them for shard-aware inputs (positions for RoPE are ``idx - doc_start``)."""
        parts: list[torch.Tensor] = []
        late = 2 * self.world - 1 - rank
        for d in range(len(self.doc_lens)):
            start = self.doc_starts[d]
            for c in (rank, late):
                c0 = start + sum(self.chunk_len(d, x) for x in range(c))
                parts.append(torch.arange(c0, c0 + self.chunk_len(d, c)))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    # -- from what the ranks hold -------------------------------------------------------
    @classmethod
    def from_local_lens(cls, per_rank: list[list[int]]) -> ZigzagLayout:
        """Rebuild the layout from every rank's per-document local lengths (``W x B``) and
        check that they are a zigzag sharding; raise naming the helper that makes one."""
        world = len(per_rank)
        layout = cls(world, tuple(sum(col) for col in zip(*per_rank)))
        for r, lens in enumerate(per_rank):
            if tuple(lens) != layout.local_lens(r):
                raise InputError(
                    f"ring: rank {r} holds {list(lens)} tokens per sequence, but a zigzag shard "
                    f"of global lengths {list(layout.doc_lens)} over {world} ranks holds "
                    f"{list(layout.local_lens(r))}; shard inputs with attnhub_ring.zigzag_shard "
                    "(bshd) or zigzag_shard_varlen (thd)")
        return layout


def _cu(lens: tuple[int, ...] | list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=device)


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """The zigzag shard of a full-length tensor that rank ``rank`` passes to the ring
    (``dim`` is the sequence axis: 1 for bshd q/k/v, 0 for positions)."""
    layout = ZigzagLayout(world_size, (x.shape[dim],))
    return x.index_select(dim, layout.global_indices(rank).to(x.device))


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard`: the full tensor from every rank's shard, in rank order."""
    layout = ZigzagLayout(len(shards), (sum(s.shape[dim] for s in shards),))
    return _scatter(shards, layout, dim)


def zigzag_shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int,
                        world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard a packed ``thd`` tensor document by document; returns ``(local, local_cu)``
    where ``local_cu`` (int32) is the ``cu_seqlens`` the rank passes with its shard."""
    layout = ZigzagLayout(world_size, tuple(torch.diff(cu_seqlens).tolist()))
    local = x.index_select(0, layout.global_indices(rank).to(x.device))
    return local, _cu(layout.local_lens(rank), cu_seqlens.device)


def zigzag_unshard_varlen(shards: list[torch.Tensor], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard_varlen` given the global ``cu_seqlens``."""
    layout = ZigzagLayout(len(shards), tuple(torch.diff(cu_seqlens).tolist()))
    return _scatter(shards, layout, 0)


def _scatter(shards: list[torch.Tensor], layout: ZigzagLayout, dim: int) -> torch.Tensor:
    idx = torch.cat([layout.global_indices(r) for r in range(layout.world)])
    cat = torch.cat(shards, dim)
    out = torch.empty_like(cat)
    return out.index_copy_(dim, idx.to(cat.device), cat)
