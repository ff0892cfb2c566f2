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


def resolve_group(group: object, name: str = "the process group") -> ProcessGroup:
    """The given process group, or the default (WORLD) group; a :class:`RingError` when none
    exists or ``group`` (the argument ``name``) is not a live ProcessGroup. The message holds
    nothing rank-specific: every rank passing the same wrong group raises the same error at
    once, with no group to hang on (torch's raw AttributeError/ValueError did not say which
    argument was wrong)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RingError(
            "ring: torch.distributed is not initialized; launch with torchrun and call "
            "torch.distributed.init_process_group() first (see docs/ring-attention.md)")
    if group is None:
        return dist.group.WORLD
    fix = ("pass the group object (torch.distributed.new_group(...); for a DeviceMesh "
           "dimension, mesh.get_group(dim)), or leave it unset for the default group")
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        return group  # type: ignore[return-value]  # new_group's placeholder: Ring names it
    if not isinstance(group, ProcessGroup):
        # no repr of other objects: it may hold an address, which differs between ranks
        what = (f"the str {group!r:.60}" if isinstance(group, str)
                else f"a {type(group).__name__}")
        raise RingError(f"ring: {name} is {what}, not a torch.distributed ProcessGroup; {fix}")
    try:
        dist.get_rank(group)
    except (ValueError, RuntimeError):  # torch's message holds the group's address
        raise RingError(f"ring: {name} is a ProcessGroup torch.distributed no longer knows "
                        f"(destroyed by torch.distributed.destroy_process_group?); {fix}"
                        ) from None
    return group


#: ``Ring.all_gather``'s default exchange, for its timeout message.
HANDSHAKE = "the handshake every rank makes before the first hop"


class PendingHop:
    """A posted hop: ``wait()`` returns the received buffer."""

    __slots__ = ("recv", "works")

    def __init__(self, works: list[dist.Work], recv: torch.Tensor):
        self.works = works
        self.recv = recv

    def wait(self) -> torch.Tensor:
        try:
            for w in self.works:
                w.wait()
        except RuntimeError as exc:  # gloo/NCCL timeouts and lost peers (DistBackendError)
            raise RingError(
                "ring: a K/V hop to or from a neighbouring rank failed: a rank raised or "
                "stopped mid-call, or the ranks disagree on the call (with global_seqlens the "
                "handshake that checks them is skipped by a rank that repeats an agreed call: a "
                "rank whose inputs changed alone waits in a handshake this rank skipped, and "
                "its own error names what changed); torch.distributed said: "
                f"{exc}") from exc
        return self.recv


class Ring:
    """Ranks of one process group arranged in a ring: send to ``rank+1``, receive from
    ``rank-1``."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.rank < 0:  # torch answers -1 to a process outside the group
            raise RingError(
                f"ring: this process (global rank {dist.get_rank()}) is not a member of the "
                "process group it was given; pass the context-parallel group this rank "
                "belongs to (torch.distributed.new_group returns a placeholder to the others)")
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

    def all_gather(self, t: torch.Tensor, during: str = HANDSHAKE) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape and dtype everywhere), in rank order: the
        handshake's collective (handshake.py) and the reasons of a failed pass (ring.py), a
        host sync. A rank that never joins (it raised before its ring call, or
        skipped it) fails the others here after the process group's timeout, with a
        :class:`RingError` that says so (``during``: in which exchange)."""
        every = [torch.empty_like(t) for _ in range(self.world)]
        try:
            dist.all_gather(every, t, group=self.group)
        except RuntimeError as exc:  # gloo/NCCL timeouts and lost peers (DistBackendError)
            raise RingError(self._no_answer(during, exc)) from exc
        return every

    def count(self, flag: bool, device: torch.device, during: str) -> int:
        """How many ranks pass ``flag`` true: the status check closing each pass (ring.py).
        One all-reduce of a one-element tensor made on ``device`` (the call's tensors': CUDA
        for NCCL, the CPU for gloo) by a fill, not a host-to-device copy, and read once: the
        pass's one host sync."""
        t = torch.full((1,), int(flag), dtype=torch.int32, device=device)
        try:
            dist.all_reduce(t, group=self.group)
            return int(t.item())  # NCCL reports a failed collective here too
        except RuntimeError as exc:  # gloo/NCCL timeouts and lost peers (DistBackendError)
            raise RingError(self._no_answer(during, exc)) from exc

    def _no_answer(self, during: str, exc: BaseException) -> str:
        return (f"ring: rank {self.rank} of {self.world} got no answer from the other ranks "
                f"in {during}: a rank raised before or during its ring call, skipped this "
                "attention call (or its backward) or lost its process (every rank must call "
                "attention the same number of times, with the same arguments but its shard); "
                f"torch.distributed said: {exc}")
