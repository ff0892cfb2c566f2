"""Zigzag (and contiguous) sharding: which tokens of a sequence each rank of the ring holds.

Each sequence (a whole ``bshd`` sequence, or each document of a packed ``thd`` batch) is cut
into ``2W`` balanced chunks (sizes differ by at most one token, so lengths need not divide
evenly) and rank ``i`` holds chunks ``i`` and ``2W-1-i``, in that order. Under a causal mask
an early chunk has little work and a late one much, so pairing them gives every rank the same
amount of work (the ring's step time is its slowest rank). Splitting every document, rather
than the packed stream, keeps that balance for varlen batches too.

``sharding="contiguous"`` describes the other common cut, ``torch.tensor_split(x, W)``: each
sequence in ``W`` chunks, rank ``i`` holds chunk ``i``. Causal work is then unbalanced, but
the answer is exact once the ring is told (shards carry no positions, so it cannot guess).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch

from attnhub import InputError

#: How the ranks cut each sequence: ``zigzag`` (chunks i and 2W-1-i of 2W) or ``contiguous``
#: (chunk i of W, ``torch.tensor_split``).
SHARDINGS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class ZigzagLayout:
    """Global sequence (or document) lengths over ``world`` ranks, cut by ``sharding``
    (zigzag by default, or contiguous); all sizes derive from it."""

    world: int
    doc_lens: tuple[int, ...]
    sharding: str = "zigzag"

    def __post_init__(self) -> None:
        if self.world < 1 or any(n < 0 for n in self.doc_lens) \
                or self.sharding not in SHARDINGS:
            raise ValueError(f"ZigzagLayout(world={self.world}, doc_lens={self.doc_lens}, "
                             f"sharding={self.sharding!r}): world must be >= 1, lengths >= 0 "
                             f"and sharding one of {', '.join(SHARDINGS)}")

    # -- chunk sizes --------------------------------------------------------------------
    @property
    def parts(self) -> int:
        """Chunks per sequence: 2W (zigzag) or W (contiguous)."""
        return 2 * self.world if self.sharding == "zigzag" else self.world

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The chunks rank ``rank`` holds, in local order."""
        return (rank, 2 * self.world - 1 - rank) if self.sharding == "zigzag" else (rank,)

    def chunk_len(self, doc: int, chunk: int) -> int:
        """Tokens of chunk ``chunk`` (0..parts-1) of document ``doc``: the first
        ``n % parts`` chunks get one more token than the rest."""
        n, parts = self.doc_lens[doc], self.parts
        return n // parts + (1 if chunk < n % parts else 0)

    def first_lens(self, rank: int) -> tuple[int, ...]:
        """Per document, the length of the rank's early chunk (chunk ``rank``)."""
        return tuple(self.chunk_len(d, rank) for d in range(len(self.doc_lens)))

    def second_lens(self, rank: int) -> tuple[int, ...]:
        """Per document, the length of the rank's late chunk (chunk ``2W-1-rank``; none for
        contiguous shards, whose one chunk precedes every later rank's)."""
        if self.sharding != "zigzag":
            return (0,) * len(self.doc_lens)
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
        local order: for every document, its chunk ``rank`` then (zigzag) its chunk
        ``2W-1-rank``.

        Use them for shard-aware inputs (positions for RoPE are ``idx - doc_start``)."""
        if not 0 <= rank < self.world:
            raise InputError(f"ring: rank {rank} is not a rank of a ring of {self.world}")
        parts: list[torch.Tensor] = []
        for d in range(len(self.doc_lens)):
            start = self.doc_starts[d]
            for c in self.chunks(rank):
                c0 = start + sum(self.chunk_len(d, x) for x in range(c))
                parts.append(torch.arange(c0, c0 + self.chunk_len(d, c)))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    # -- from what the ranks hold -------------------------------------------------------
    @classmethod
    def from_local_lens(cls, per_rank: list[list[int]],
                        sharding: str = "zigzag") -> ZigzagLayout:
        """Rebuild the layout from every rank's per-document local lengths (``W x B``) and
        check that they are a sharding of that kind; raise naming the helper that makes one."""
        world = len(per_rank)
        layout = cls(world, tuple(sum(col) for col in zip(*per_rank)), sharding)
        for r, lens in enumerate(per_rank):
            if tuple(lens) != layout.local_lens(r):
                raise InputError(
                    f"ring: rank {r} holds {list(lens)} tokens per sequence, but a {sharding} "
                    f"shard of global lengths {list(layout.doc_lens)} over {world} ranks holds "
                    f"{list(layout.local_lens(r))}; {shard_hint(sharding)}")
        return layout


def shard_hint(sharding: str) -> str:
    """What makes a shard of this kind (for error messages)."""
    if sharding == "contiguous":
        return ("cut contiguous shards with attnhub_ring.contiguous_shard (torch.tensor_split; "
                "torch.chunk cuts differently) or zigzag_shard_varlen(..., "
                "sharding='contiguous')")
    return ("shard inputs with attnhub_ring.zigzag_shard (bshd) or zigzag_shard_varlen (thd), "
            "or pass sharding='contiguous' for torch.tensor_split shards")


def _cu(lens: tuple[int, ...] | list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=device)


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """The zigzag shard of a full-length tensor that rank ``rank`` passes to the ring
    (``dim`` is the sequence axis: 1 for bshd q/k/v, 0 for positions)."""
    rank, world_size = _check_rank("zigzag_shard", rank, world_size)
    dim = _check_dim("zigzag_shard", x, dim)
    layout = ZigzagLayout(world_size, (x.shape[dim],))
    return x.index_select(dim, layout.global_indices(rank).to(x.device))


def contiguous_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s contiguous shard, ``torch.tensor_split(x, world_size, dim)[rank]``;
    pass it to the ring with ``sharding="contiguous"`` (its inverse is ``torch.cat``)."""
    rank, world_size = _check_rank("contiguous_shard", rank, world_size)
    dim = _check_dim("contiguous_shard", x, dim)
    return torch.tensor_split(x, world_size, dim)[rank]


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard`: the full tensor from every rank's shard, in rank order."""
    dim = _check_shards("zigzag_unshard", shards, dim)
    layout = ZigzagLayout(len(shards), (sum(s.shape[dim] for s in shards),))
    _check_shard_lens("zigzag_unshard", shards, layout, dim)
    return _scatter(shards, layout, dim)


def zigzag_shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int,
                        world_size: int, sharding: str = "zigzag",
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard a packed ``thd`` tensor document by document (``sharding="contiguous"``: each
    document ``tensor_split`` in ``world_size``); returns ``(local, local_cu)`` where
    ``local_cu`` (int32) is the ``cu_seqlens`` the rank passes with its shard."""
    rank, world_size = _check_rank("zigzag_shard_varlen", rank, world_size)
    _check_dim("zigzag_shard_varlen", x, 0)
    layout = ZigzagLayout(world_size, _doc_lens("zigzag_shard_varlen", cu_seqlens,
                                                x.shape[0]), _check_sharding(sharding))
    local = x.index_select(0, layout.global_indices(rank).to(x.device))
    return local, _cu(layout.local_lens(rank), cu_seqlens.device)


def zigzag_unshard_varlen(shards: list[torch.Tensor], cu_seqlens: torch.Tensor,
                          sharding: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`zigzag_shard_varlen` given the global ``cu_seqlens``."""
    _check_shards("zigzag_unshard_varlen", shards, 0)
    total = sum(s.shape[0] for s in shards)
    layout = ZigzagLayout(len(shards), _doc_lens("zigzag_unshard_varlen", cu_seqlens, total),
                          _check_sharding(sharding))
    _check_shard_lens("zigzag_unshard_varlen", shards, layout, 0)
    return _scatter(shards, layout, 0)


def _scatter(shards: list[torch.Tensor], layout: ZigzagLayout, dim: int) -> torch.Tensor:
    idx = torch.cat([layout.global_indices(r) for r in range(layout.world)])
    cat = torch.cat(shards, dim)
    out = torch.empty_like(cat)
    return out.index_copy_(dim, idx.to(cat.device), cat)


# -- argument checks: a wrong shard would be silently wrong attention ----------------------
def _check_rank(fn: str, rank: object, world: object) -> tuple[int, int]:
    """(rank, world) as ints (anything ``operator.index`` takes), or a clear refusal."""
    w = _as_int(world)
    if w is None or w < 1:
        raise InputError(f"{fn}: world_size={world!r}; pass the ring's size, an int >= 1")
    r = _as_int(rank)
    if r is None or not 0 <= r < w:
        raise InputError(f"{fn}: rank={rank!r} is not a rank of a ring of {w} (0..{w - 1}); "
                         "pass torch.distributed.get_rank(group)")
    return r, w


def _check_sharding(sharding: object) -> str:
    if sharding not in SHARDINGS:
        raise InputError(f"sharding={sharding!r}; use one of {', '.join(SHARDINGS)}")
    return str(sharding)


def _as_int(x: object) -> int | None:
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return None


def _check_dim(fn: str, x: object, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{fn}: expected a tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim() or x.dim() == 0:
        raise InputError(f"{fn}: dim={dim} is not an axis of a tensor of shape "
                         f"{tuple(x.shape)}; pass the sequence axis (1 for bshd, 0 for thd)")
    return dim % x.dim()


def _check_shards(fn: str, shards: object, dim: int) -> int:
    if not isinstance(shards, (list, tuple)) or not shards:
        raise InputError(f"{fn}: pass every rank's shard, in rank order (a non-empty list)")
    dim = _check_dim(fn, shards[0], dim)
    first = shards[0]
    for r, s in enumerate(shards):
        _check_dim(fn, s, dim)
        other = [n for i, n in enumerate(s.shape) if i != dim]
        want = [n for i, n in enumerate(first.shape) if i != dim]
        if s.dim() != first.dim() or other != want or s.dtype != first.dtype \
                or s.device != first.device:
            raise InputError(
                f"{fn}: rank {r}'s shard is {tuple(s.shape)} {s.dtype} on {s.device} but rank "
                f"0's is {tuple(first.shape)} {first.dtype} on {first.device}; shards must "
                f"differ only in their length along dim {dim}")
    return dim


def _check_shard_lens(fn: str, shards: list[torch.Tensor] | tuple[torch.Tensor, ...],
                      layout: ZigzagLayout, dim: int) -> None:
    got = [s.shape[dim] for s in shards]
    want = [sum(layout.local_lens(r)) for r in range(layout.world)]
    if got != want:
        raise InputError(
            f"{fn}: shard lengths {got} are not a zigzag sharding of {list(layout.doc_lens)} "
            f"over {layout.world} ranks ({want}); pass every rank's shard in rank order, as "
            "zigzag_shard / zigzag_shard_varlen made them")


def _doc_lens(fn: str, cu: object, total: int) -> tuple[int, ...]:
    """Document lengths of a global ``cu_seqlens`` that must cover ``total`` tokens."""
    if (not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1
            or cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool):
        raise InputError(f"{fn}: cu_seqlens must be a 1-D integer tensor [0, ..., T] (the "
                         f"global document offsets), got {cu!r:.80}")
    offs = cu.tolist()
    if offs[0] != 0 or offs[-1] != total or any(b < a for a, b in zip(offs, offs[1:])):
        raise InputError(f"{fn}: cu_seqlens {offs if len(offs) <= 16 else '...'} must start "
                         f"at 0, not decrease and end at the {total} tokens given")
    return tuple(b - a for a, b in zip(offs, offs[1:]))
