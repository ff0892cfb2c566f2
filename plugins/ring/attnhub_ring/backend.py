"""The ``ring`` backend: context parallelism around any local backend that returns LSE.

The policy binds ``ring`` for a spec and, one level down, a local kernel for the blocks (the
decision's ``inner``); the hub hands that kernel over in ``params.extra["local_backend"]``.
The process group is ``params.extra["process_group"]`` when given, else the default group;
``params.extra["block_backward"]`` forces the blocks' backward kernel (block_kernels.py),
``params.extra["sharding"]`` says how the shards were cut (``zigzag``, the default, or
``contiguous``) and ``params.extra["global_seqlens"]`` gives the unsharded lengths.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from attnhub import probe
from attnhub.plugin import (
    FLOAT_DTYPES,
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    Capabilities,
    DeviceInfo,
)

from .comm import ProcessGroup, RingError, resolve_group
from .ring import run_ring

NO_LOCAL_BACKEND = (
    "ring: no local backend to run the blocks with. Bind ring through a policy rule (the rest "
    "of the policy picks the local kernel; `attnhub explain` shows both levels), or pass one: "
    "RingBackend(local_backend=...) or attnhub_ring.ring_attention(..., local_backend=...)")


class RingBackend(Backend):
    """Shards the sequence over a process group and passes K/V blocks around the ring."""

    name = "ring"
    tier = "distributed"
    description = ("ring attention over torch.distributed (zigzag shards, K/V rotated with "
                   "isend/irecv, partial outputs merged by LSE) around a local backend")
    capabilities = Capabilities(
        dtypes=FLOAT_DTYPES, max_head_dim=1024, different_v_dim=True,
        masks=frozenset({"none", "causal", "softcap", "document"}),
        phases=frozenset({"train", "prefill"}), layouts=frozenset({"bshd", "bhsd", "thd"}),
        backward=True, deterministic_backward=True, gqa=True, returns_lse=True,
        deterministic_forward=True, top_left_causal=True,
    )

    def __init__(self, local_backend: Backend | None = None,
                 process_group: ProcessGroup | None = None):
        super().__init__()
        self.local_backend = local_backend
        self.process_group = process_group

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """Self-attention only; and, on a real device, a process group of >= 2 ranks (the
        spec has no world size, so this asks torch.distributed at bind time; a simulated
        device plans offline and relies on the policy's ``world_size`` condition).

        thd is left to the call: its max_seqlen_q/k may be a caller's upper bound (on one rank
        only, even), so unequal buckets prove nothing, and refusing here raised on that rank
        alone while the others waited in the handshake. The ring's own check
        (cu_seqlens_q == cu_seqlens_k) raises on every rank through the handshake."""
        reasons = []
        if spec.layout != "thd" and spec.max_seqlen_q != spec.max_seqlen_k:
            reasons.append(f"shards self-attention only: query length (<= {spec.max_seqlen_q}) "
                           f"and key length (<= {spec.max_seqlen_k}) differ")
        if not device.simulated:
            reasons += process_group_reasons(self.process_group, "RingBackend.process_group")
        return reasons

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        local, problem = params.extra.get("local_backend"), None
        try:  # a refusal is raised on every rank by the handshake, not here alone
            if local is None:  # not bound by a policy, which has checked the local kernel
                local = check_local(self.local_backend, spec)
            load_local(local)
        except RingError as exc:
            local, problem = None, str(exc)
        given = "process_group" in params.extra
        group = params.extra["process_group"] if given else self.process_group
        if dist.is_available() and dist.is_initialized():  # else run_ring says so
            group = resolve_group(group, "extra['process_group']" if given
                                  else "RingBackend.process_group")
        want = params.extra.get("world_size")
        if problem is None and want is not None and dist.is_initialized() and (
                want != dist.get_world_size(group)):
            # a 2-D mesh whose context-parallel group was not given: the ring would run
            # over another group's ranks and mix their sequences
            problem = (f"ring: the call is bound for world_size={want} (its BindContext), but "
                       f"the process group has {dist.get_world_size(group)} ranks: give the "
                       "context-parallel group (RingBackend.process_group, or "
                       "extra['process_group']) or bind for the group's size")
        out, lse = run_ring(q, k, v, local, spec, params, group,
                            params.extra.get("global_seqlens"),
                            block_backward=params.extra.get("block_backward", "auto"),
                            problem=problem, sharding=params.extra.get("sharding", "zigzag"))
        return AttentionOutput(out, lse if params.return_lse else None)


def check_local(local: Backend | None, spec: AttentionSpec) -> Backend:
    """The local backend given by hand, or a :class:`RingError` saying what does not fit:
    it must be a single-device kernel that returns LSE and serves the blocks of ``spec``.
    A passing check is remembered per (backend, spec): no check work on repeated calls."""
    if local is None:
        raise RingError(NO_LOCAL_BACKEND)
    passed = _CHECKED.setdefault(local, set())
    if spec in passed:
        return local
    if local.tier == "distributed":
        raise RingError(f"ring: local backend {local.name!r} is itself distributed; bind a "
                        "single-device kernel for the blocks")
    reasons = local.check(spec.with_(needs_grad=False, return_lse=True), probe())
    if reasons:
        raise RingError(f"ring: local backend {local.name!r} cannot run the blocks: "
                        + "; ".join(reasons))
    if len(passed) > 1024:
        passed.clear()
    passed.add(spec)
    return local


def load_local(local: Backend) -> None:
    """Load the local kernel; a failure becomes a :class:`RingError` (the ring raises it on
    every rank: one rank failing alone would leave the others waiting)."""
    try:
        local.load()
    except Exception as exc:
        raise RingError(f"ring: local backend {local.name!r} failed to load: "
                        f"{type(exc).__name__}: {exc}") from exc


#: Specs that passed ``check_local``, per backend object (weakly held).
_CHECKED: weakref.WeakKeyDictionary[Backend, set[AttentionSpec]] = weakref.WeakKeyDictionary()


def process_group_reasons(group: ProcessGroup | None = None,
                          name: str = "the process group") -> list[str]:
    """Why the ring cannot run in this process now (empty when it can); ``name`` is where
    ``group`` came from, for the message."""
    if not dist.is_available():
        return ["torch.distributed is not available in this torch build"]
    if not dist.is_initialized():
        return [("torch.distributed is not initialized: launch with torchrun and call "
                 "torch.distributed.init_process_group() before binding (plan offline with "
                 "--hardware to skip this check)")]
    try:
        size = dist.get_world_size(resolve_group(group, name))
    except RingError as exc:
        return [str(exc)]
    if size < 2:
        return [(f"needs a process group of at least 2 ranks; this one has {size} "
                 "(torchrun --nproc-per-node N with N >= 2)")]
    return []
