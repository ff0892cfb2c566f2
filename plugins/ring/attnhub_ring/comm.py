"""The ring's transport: torch.distributed point-to-point, nothing home-made.

Every hop sends one packed buffer (K and V, or dK and dV, flattened back to back) to the next
rank and receives the previous rank's buffer, through ``batch_isend_irecv`` so the send and the
receive are posted together (NCCL fuses them into one group call; gloo runs them on its
transport threads). The caller posts the hop, computes on the block it already has, then waits:
that is the overlap of communication with computation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attnhub import InputError

ProcessGroup = dist.ProcessGroup


class RingError(InputError):
    """The ring cannot run as configured (no process group, no local backend, bad shards).

    An ``InputError``, so the hub never falls back to a single-device kernel: attention of one
    shard alone would be silently wrong.
    """


def resolve_group(group: ProcessGroup | None) -> ProcessGroup:
    """The given process group, or the default (WORLD) group; raises when none exists."""
    if not dist.is_available() or not dist.is_initialized():
        raise RingError(
            "ring: torch.distributed is not initialized; launch with torchrun and call "
            "torch.distributed.init_process_group() first (see docs/ring-attention.md)")
    return group if group is not None else dist.group.WORLD


class PendingHop:
    """A posted hop: ``wait()`` returns the received buffer."""

    __slots__ = ("recv", "works")

    def __init__(self, works: list[dist.Work], recv: torch.Tensor):
        self.works = works
        self.recv = recv

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.recv


class Ring:
    """Ranks of one process group arranged in a ring: send to ``rank+1``, receive from
    ``rank-1``."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def hop(self, send: torch.Tensor, recv_numel: int, tag: int = 0,
            into: torch.Tensor | None = None) -> PendingHop:
        """Post: send ``send`` to the next rank, receive ``recv_numel`` elements from the
        previous (into the front of ``into`` when given: the ring's second buffer). Empty
        messages are skipped on both sides (both know the sizes); ``tag`` keeps two hops in
        flight at once (K/V and dK/dV in the backward) apart."""
        if self.world == 1:
            return PendingHop([], send)
        recv = (into[:recv_numel] if into is not None
                else torch.empty(recv_numel, dtype=send.dtype, device=send.device))
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, self._next, self.group, tag))
        if recv_numel:
            ops.append(dist.P2POp(dist.irecv, recv, self._prev, self.group, tag))
        return PendingHop(dist.batch_isend_irecv(ops) if ops else [], recv)

    def gather_lengths(self, lens: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's ``lens`` (same count on every rank), in rank order. One tiny
        all-gather, and a host sync: pass ``global_seqlens`` to skip it."""
        mine = torch.tensor(lens, dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        return [t.tolist() for t in every]
