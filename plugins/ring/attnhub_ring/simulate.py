"""A ring of ``W`` virtual ranks on one device: what one GPU can show of the ring's cost.

:class:`SimulatedRing` stands in for the process group of one rank: a K/V hop copies the
block that the previous rank would send (an on-device copy in place of the link), so the
rank runs exactly the code, kernels, merges and buffers of a real ring. Running every virtual
rank in turn gives the compute side of strong scaling: ``t_one / sum_r t_rank`` is the
efficiency a ring of ``W`` GPUs reaches when its hops hide completely, and the time beyond
the local kernels is the ring's own overhead (merges, copies, host work per step).

Forward outputs, LSE and dQ are exact. dK/dV are not: the accumulators other ranks would add
to are not simulated (a received dK/dV buffer is zeros), so use the simulation for timing
and for out/LSE/dQ, and the distributed tests for dK/dV.
"""

from __future__ import annotations

import torch

from .comm import PendingHop, RingError
from .ring import _DKV_TAG

__all__ = ["SimulatedRing", "pack_kv"]


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V of one rank flattened back to back, as the ring sends them."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


class SimulatedRing:
    """Rank ``rank`` of ``len(blocks)`` virtual ranks; ``blocks[r]`` is rank r's packed K/V
    (:func:`pack_kv`). Pass it as ``transport=`` with ``global_seqlens``."""

    def __init__(self, rank: int, blocks: list[torch.Tensor]):
        self.rank = rank
        self.world = len(blocks)
        self.blocks = blocks
        self._kv_hops = 0

    def hop(self, send: torch.Tensor, recv_numel: int, tag: int = 0,
            into: torch.Tensor | None = None) -> PendingHop:
        recv = (into[:recv_numel] if into is not None
                else torch.empty(recv_numel, dtype=send.dtype, device=send.device))
        if tag == _DKV_TAG:  # other ranks' dK/dV shares: not simulated (timing only)
            recv.zero_()
            return PendingHop([], recv)
        step = self._kv_hops % max(1, self.world - 1)  # forward and backward each W-1 hops
        self._kv_hops += 1
        src = (self.rank - step - 1) % self.world
        recv.copy_(self.blocks[src])
        return PendingHop([], recv)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        raise RingError("ring: a simulated ring has no group to gather lengths from; pass "
                        "global_seqlens")
