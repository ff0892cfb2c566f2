"""Ring attention: the forward and backward passes over a ring of ranks.

Forward, on rank ``i`` of ``W``: at step ``s`` it holds the K/V block of rank ``i - s``; it
posts the hop that passes this block on (and receives the next one), runs the local kernel on
the part of the block its plan allows, merges the result into fp32 accumulators by LSE, then
waits for the hop. Backward walks the same ring: K/V blocks travel as in the forward, and
each block's dK/dV accumulator travels with it, one hop behind, collecting every rank's
contribution until it arrives back at the rank that owns the block (``W`` hops). A block's
gradients come from a fused backward given the merged output and the global LSE (cuDNN or
torch's FlashAttention), or from the exact fp32 math where those cannot serve
(block_kernels.py says which and why).

A rank whose part of a pass fails (its block kernel or merge raises, its forced block
backward refuses its own loss, an allocation fails) stops computing but keeps draining the
ring: it passes every block (and dK/dV accumulator) on, so no rank is left waiting in a hop.
Each pass then ends with a status exchange (one tiny all-reduce, a host sync): if any rank
failed, every rank raises the same :class:`RingError` naming each failed rank, the step and
block it was at, and why; no rank returns an output or gradients of that call (another
rank's result would be exact, or hold a partial dK/dV, but its job's step is lost either way,
and a rank that went on alone would wait in its next call's collectives for the failed one).
"""

from __future__ import annotations

import operator
import traceback
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

import torch

from attnhub.plugin import AttentionSpec, AttnParams, Backend, MaskSpec, first_order_only

from .block_backward import block_backward
from .comm import PendingHop, ProcessGroup, Ring, RingError, resolve_group
from .handshake import BLOCK_CHOICES, agree, changes, exchange_reasons, fields
from .block_kernels import backward_segments, block_backward_fn, block_backward_kernel
from .merge import merge_into, merge_partial
from .plan import BlockPlan, Rows, block_plans
from .sharding import SHARDINGS, ZigzagLayout, shard_hint

_KV_TAG, _DKV_TAG = 0, 1


class Transport(Protocol):
    """What the ring needs of its ranks: :class:`~attnhub_ring.comm.Ring`, or a simulated
    one (``attnhub_ring.simulate``) that plays every rank on one device."""

    rank: int
    world: int

    def hop(self, send: torch.Tensor, recv_numel: int, tag: int = 0,
            into: torch.Tensor | None = None) -> PendingHop: ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...


@dataclass
class RingCall:
    """Everything one call needs besides the tensors: ring, plans, shapes, the local kernel,
    and each step's block spec/params (built once per call, not per step)."""

    ring: Transport
    local: Backend
    spec: AttentionSpec
    params: AttnParams
    layout: ZigzagLayout
    plans: tuple[BlockPlan, ...]
    thd: bool
    kv_shapes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # per rank: (k, v) shape
    block_backward: str = "auto"  # cudnn, flash, math, or auto (block_kernels.py)
    _blocks: dict[int, tuple[AttentionSpec, AttnParams]] = field(default_factory=dict)

    @property
    def axis(self) -> int:
        """The sequence axis of q/k/v: 0 for thd (T,H,D), 1 for bshd (B,S,H,D)."""
        return 0 if self.thd else 1

    def numel(self, rank: int) -> int:
        ks, vs = self.kv_shapes[rank]
        return _prod(ks) + _prod(vs)

    def unpack(self, buf: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of K and V (or dK and dV) of ``rank``'s block in a packed buffer."""
        ks, vs = self.kv_shapes[rank]
        nk = _prod(ks)
        return buf[:nk].view(ks), buf[nk:nk + _prod(vs)].view(vs)

    def next_source(self, step: int) -> int:
        """The rank whose block arrives for step ``step + 1``."""
        return (self.ring.rank - step - 1) % self.ring.world

    def kv_buffers(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two buffers of the largest packed block: this rank's K/V packed into the first;
        hops receive into the other one, alternating."""
        n = max(self.numel(r) for r in range(self.ring.world))
        first = torch.empty(n, dtype=k.dtype, device=k.device)
        mine = self.numel(self.ring.rank)
        nk = k.numel()
        first[:nk].view(k.shape).copy_(k)
        first[nk:mine].view(v.shape).copy_(v)
        second = torch.empty(n if self.ring.world > 1 else 0, dtype=k.dtype, device=k.device)
        return first, second

    def dkv_buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two fp32 buffers of the largest packed block that the dK/dV hops receive into,
        alternating (the second also serves a rank that failed before its first block, as
        the accumulator it passes on): a rank that drains the backward (after an
        out-of-memory error, say) allocates nothing more."""
        n = max(self.numel(r) for r in range(self.ring.world))
        return (torch.empty(n, dtype=torch.float32, device=device),
                torch.empty(n if self.ring.world > 1 else 0, dtype=torch.float32,
                            device=device))

    def block_call(self, step: int, device: torch.device) -> tuple[AttentionSpec, AttnParams]:
        """The local kernel's spec and params for step ``step``'s block: per call for thd
        (its cu_seqlens are device tensors), across calls for bshd (pure data)."""
        hit = self._blocks.get(step)
        if hit is None:
            p, plan = self.params, self.plans[step]
            if self.thd:
                hit = _block_call(plan, self.spec, p.scale, p.alignment, p.softcap,
                                  p.deterministic, True, plan.cu_seqlens(device))
            else:
                hit = _cached_block_call(plan, self.spec, p.scale, p.alignment, p.softcap,
                                         p.deterministic)
            self._blocks[step] = hit
        return hit


def _block_call(plan: BlockPlan, spec: AttentionSpec, scale: float, alignment: str,
                softcap: float | None, deterministic: bool, thd: bool,
                cu: tuple[torch.Tensor, torch.Tensor] | tuple[None, None] = (None, None),
                ) -> tuple[AttentionSpec, AttnParams]:
    bspec = spec.with_(
        mask=MaskSpec(causal=plan.causal, alignment=spec.mask.alignment,
                      softcap=spec.mask.softcap, document=thd),
        max_seqlen_q=plan.max_q, max_seqlen_k=plan.max_k, needs_grad=False,
        return_lse=True, batch=len(plan.segments) if thd else spec.batch)
    bparams = AttnParams(scale=scale, causal=plan.causal, alignment=alignment,
                         softcap=softcap, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1],
                         max_seqlen_q=plan.max_q, max_seqlen_k=plan.max_k,
                         deterministic=deterministic, return_lse=True)
    return bspec, bparams


@lru_cache(maxsize=1024)
def _cached_block_call(plan: BlockPlan, spec: AttentionSpec, scale: float, alignment: str,
                       softcap: float | None, deterministic: bool
                       ) -> tuple[AttentionSpec, AttnParams]:
    """bshd blocks: the same objects for every call of one geometry (local kernels only
    read them)."""
    return _block_call(plan, spec, scale, alignment, softcap, deterministic, False)


@lru_cache(maxsize=256)
def _geometry(world: int, rank: int, doc_lens: tuple[int, ...], causal: bool, thd: bool,
              k_tail: tuple[int, ...], v_tail: tuple[int, ...], sharding: str
              ) -> tuple[tuple[BlockPlan, ...], tuple[tuple[tuple[int, ...], ...], ...]]:
    """Plans and per-rank K/V block shapes of one call geometry: pure Python work, cached so
    a training step's repeated calls (every layer, every step) pay it once."""
    layout = ZigzagLayout(world, doc_lens, sharding)

    def shape(r: int, tail: tuple[int, ...]) -> tuple[int, ...]:
        n = sum(layout.local_lens(r))
        return (n, *tail) if thd else (tail[0], n, *tail[1:])

    kv_shapes = tuple((shape(r, k_tail), shape(r, v_tail)) for r in range(world))
    return tuple(block_plans(layout, rank, causal)), kv_shapes


def run_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, local: Backend | None,
             spec: AttentionSpec, params: AttnParams, group: ProcessGroup | None = None,
             global_seqlens: list[int] | None = None,
             transport: Transport | None = None,
             block_backward: str = "auto",
             problem: str | None = None,
             sharding: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of this rank's shard (``sharding``: zigzag or contiguous, see
    sharding.py; every rank must say the same, the handshake checks it). Returns ``out``
    (q's dtype) and the LSE in the contract layout ((B,Hq,S) or (Hq,T), fp32); both carry
    autograd. ``transport`` replaces the process group (a simulated ring on one device);
    ``block_backward`` forces the kernel of the blocks' gradients (see block_kernels.py;
    also a handshake field: alike on every rank). ``problem`` is why the caller
    found this rank cannot run the call (``local`` is then None): it is raised on every rank
    through the handshake (handshake.py), never on this rank alone while the others wait."""
    problem = problem or _call_problem(q, k, v, spec, params, sharding, block_backward)
    try:
        ring = transport if transport is not None else Ring(resolve_group(group))
    except RingError:
        if problem:  # no group to tell: the call's own fault first
            raise RingError(problem) from None
        raise
    thd = spec.layout == "thd"
    local_lens = values = None
    if problem is None:
        local_lens = torch.diff(params.cu_seqlens_q).tolist() if thd else [q.shape[1]]
    gs = None
    if global_seqlens is not None:
        gs, problem = _given_layout(global_seqlens, ring, local_lens, problem, sharding)
    if problem is None:
        values = fields(q, k, v, thd, bool(params.causal), params.scale, params.softcap, gs,
                        sharding, block_backward)
    if gs is None:
        layout = ZigzagLayout.from_local_lens(agree(ring, problem, values, local_lens or [],
                                                    q.device), sharding)
    else:
        # the caller gave the layout: the handshake runs only when this call differs from the
        # last one of its geometry the ranks agreed on, so repeated calls skip it
        _agree_once(ring, problem, gs, local_lens, values, q.device)
        layout = ZigzagLayout(ring.world, gs, sharding)
    assert local is not None  # a rank without one had a problem, raised above
    k_tail = tuple(k.shape[1:]) if thd else (k.shape[0], *k.shape[2:])
    v_tail = tuple(v.shape[1:]) if thd else (v.shape[0], *v.shape[2:])
    plans, kv_shapes = _geometry(ring.world, ring.rank, layout.doc_lens, bool(params.causal),
                                 thd, k_tail, v_tail, sharding)
    call = RingCall(ring, local, spec, params, layout, plans, thd, kv_shapes, block_backward)
    out, lse = _RingAttention.apply(q, k, v, call)
    return out, (lse.t() if thd else lse.transpose(1, 2))


#: Per (group name, rank, world, global_seqlens): the shard lengths and header of the last call
#: the ranks agreed on. Only the last: a rank that went back alone to an earlier agreed call
#: (causal, scale, dtype...) while the others repeat the last one would skip the handshake
#: with them and run a silently wrong ring.
_AGREED: dict[tuple[Any, ...], tuple[tuple[int, ...], list[int]]] = {}


def _agree_once(ring: Transport, problem: str | None, gs: tuple[int, ...],
                local_lens: list[int] | None, values: list[int] | None,
                device: torch.device) -> None:
    """The handshake of a ``global_seqlens`` call: when this rank's call differs from the
    last one of its geometry that the ranks agreed on (its first call included). Such a rank
    cannot tell whether the others changed too (legal: they handshake with it) or repeat the
    geometry (they skip it and wait in the first hop): if nobody answers, its error names
    what changed."""
    if not _has_peers(ring):  # a simulated ring has no peers to agree with
        if problem:
            raise RingError(problem)
        return
    # the group's name, not id(): a destroyed group's address may be reused by a new group on
    # one rank only, which would then skip a handshake that the other ranks make (a hang)
    geo = (getattr(ring.group, "group_name", id(ring.group)), ring.rank, ring.world, gs)
    mine = (tuple(local_lens or ()), values or [])
    before = _AGREED.get(geo)
    if problem is None and before == mine:
        return
    try:
        agree(ring, problem, values, local_lens or [], device)
    except RingError as exc:
        if before is None or exc.__cause__ is None:  # no cause: the ranks answered, and differ
            raise
        why = problem or (
            f"this rank's call differs from the last call of global_seqlens={list(gs)} that "
            "the ranks agreed on (" + ("; ".join(changes(before[1], values or []))
                                       or "shard lengths") + ")")
        raise RingError(
            f"{exc}. Likely cause: {why}; ranks that repeat an agreed call skip the "
            "handshake, so with global_seqlens every rank must change its inputs alike (or "
            "omit global_seqlens: every call then handshakes)") from exc
    if len(_AGREED) > 4096:
        _AGREED.clear()
    _AGREED[geo] = mine


def _given_layout(global_seqlens: Any, ring: Transport, local_lens: list[int] | None,
                  problem: str | None, sharding: str,
                  ) -> tuple[tuple[int, ...], str | None]:
    """``global_seqlens`` as a tuple, and the call's problem (it may add one: lengths that
    are not non-negative ints, or a shard that is not this rank's zigzag part of them)."""
    try:
        gs = tuple(operator.index(n) for n in global_seqlens)
        if any(n < 0 for n in gs) or (local_lens is not None and len(gs) != len(local_lens)):
            raise ValueError
    except (TypeError, ValueError):
        return (), problem or (
            f"ring: global_seqlens={global_seqlens!r:.100} must list the unsharded length of "
            f"each of the {len(local_lens or ())} sequences (ints >= 0)")
    if problem is None and local_lens is not None:
        mine = ZigzagLayout(ring.world, gs, sharding).local_lens(ring.rank)
        if tuple(local_lens) != mine:
            problem = (f"ring: rank {ring.rank} holds {local_lens} tokens per sequence, but "
                       f"global lengths {list(gs)} shard ({sharding}) to {list(mine)}; "
                       + shard_hint(sharding))
    return gs, problem


_UNSUPPORTED = ("window", "alibi_slopes", "prefix_lens", "colmask_start", "score_mod",
                "mask_mod", "block_table")


def _call_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
                  params: AttnParams, sharding: object = "zigzag",
                  block_backward: object = "auto") -> str | None:
    """Why the ring cannot run this call on this rank (None: it can)."""
    if not isinstance(sharding, str) or sharding not in SHARDINGS:
        return (f"ring: sharding={sharding!r:.60}; pass how the ranks cut the sequence: "
                "'zigzag' (zigzag_shard, the default) or 'contiguous' (torch.tensor_split)")
    if not isinstance(block_backward, str) or block_backward not in BLOCK_CHOICES:
        return (f"ring: block_backward={block_backward!r:.60}; use "
                + ", ".join(BLOCK_CHOICES))
    used = [f for f in _UNSUPPORTED if getattr(params, f) is not None]
    if used:
        return (f"ring: {', '.join(used)} not supported across shards (masks: causal, "
                "softcap, documents via thd); bind a single-device backend instead")
    if spec.layout == "thd":
        cu_q, cu_k = params.cu_seqlens_q, params.cu_seqlens_k
        if cu_q is None or cu_k is None or not torch.equal(cu_q, cu_k):
            return ("ring: thd needs cu_seqlens_q == cu_seqlens_k (self-attention over the "
                    "local shard; see zigzag_shard_varlen)")
        if int(cu_q[-1]) != q.shape[0] or k.shape[0] != q.shape[0]:
            return (f"ring: cu_seqlens must cover the whole shard ({int(cu_q[-1])} of "
                    f"{q.shape[0]} query and {k.shape[0]} key tokens)")
    elif spec.layout == "bshd":
        if q.shape[1] != k.shape[1]:
            return (f"ring: shards self-attention, but q has {q.shape[1]} and k {k.shape[1]} "
                    "tokens in this shard; cross-attention needs a single-device backend")
    else:
        return f"ring: layout {spec.layout!r} not supported (bshd, thd)"
    return None


class _RingAttention(torch.autograd.Function):
    """(q, k, v) -> (out, lse token-major); the backward also takes the LSE's gradient."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                call: RingCall) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _forward(call, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)  # dlse stays None unless the loss uses the LSE
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        with torch.no_grad():  # create_graph=True: fused ops and hops have no derivative
            dq, dk, dv = _backward(ctx.call, q, k, v, out, lse, dout, dlse)
        # the gradients are right; differentiating them (create_graph=True) raises
        dq, dk, dv = first_order_only((dq, dk, dv), (q, k, v, dout, dlse),
                                      lambda: RingError(SECOND_ORDER))
        return dq, dk, dv, None


SECOND_ORDER = (
    "ring: second-order gradients (differentiating the gradients of ring attention, e.g. "
    "torch.autograd.grad(..., create_graph=True) then backward through them) are not "
    "supported: each block's backward is a fused kernel and the dK/dV travel between ranks, "
    "neither of which autograd can differentiate. The first-order gradients are exact; for a "
    "gradient penalty or Hessian-vector product, compute that term on unsharded inputs with "
    "a single-device backend (e.g. attnhub.attention without world_size), or detach() the "
    "gradients")


def _forward(call: RingCall, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Post the next hop, run the local kernel on the block in hand, merge, wait: the hop
    hides under the block's compute. Two K/V buffers alternate (double buffering); the one
    host sync is the closing status check (:func:`_settle`)."""
    dev = q.device
    bufs = call.kv_buffers(k, v)  # without them this rank cannot drain: raised at once
    kv = bufs[0][:call.numel(call.ring.rank)]
    failed: _Failure | None = None
    try:
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=dev)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=dev)
    except _FAILURES as exc:
        failed = _failure("allocating its output", exc)
    last = len(call.plans) - 1
    first = True  # the first block that reaches a row writes it; later ones merge
    for step, plan in enumerate(call.plans):
        hop = call.ring.hop(kv, call.numel(call.next_source(step)), _KV_TAG,
                            into=bufs[(step + 1) % 2]) if step < last else None
        if failed is None and not plan.empty:
            try:
                first = _forward_block(call, q, kv, plan, step, out, lse, first)
            except _FAILURES as exc:  # raised on every rank by _settle, after the drain
                failed = _failure(_at_block(step, plan), exc)
        if hop is not None:
            kv = hop.wait()
    result = None
    if failed is None:  # before the status check: what fails after it fails on one rank alone
        try:
            if first:  # no block reached this rank (it holds no visible pair)
                out.zero_()
                lse.fill_(float("-inf"))
            result = out.to(q.dtype), lse
        except _FAILURES as exc:
            failed = _failure("after its last block, casting its output", exc)
    _settle(call, failed, "forward", dev)
    assert result is not None  # _settle raised otherwise
    return result


def _forward_block(call: RingCall, q: torch.Tensor, kv: torch.Tensor, plan: BlockPlan,
                   step: int, out: torch.Tensor, lse: torch.Tensor, first: bool) -> bool:
    """Run one block and merge it into ``out``/``lse``; False once a block has written."""
    axis, dev = call.axis, q.device
    rows = plan.q_rows(dev)
    o_b, l_b = _local_block(call, q, *call.unpack(kv, plan.source), plan, step)
    if first and _covers(rows, q.shape[axis]):
        out.copy_(o_b)
        lse.copy_(l_b)
    else:
        if first:  # rows the block skips have seen nothing yet: (0, -inf)
            out.zero_()
            lse.fill_(float("-inf"))
        if isinstance(rows, slice):  # views: merged in place
            merge_into(_take(out, rows, axis), _take(lse, rows, axis), o_b, l_b)
        else:
            o, l = merge_partial(_take(out, rows, axis), _take(lse, rows, axis), o_b,
                                 l_b)
            _put(out, rows, axis, o)
            _put(lse, rows, axis, l)
    return False


def _local_block(call: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 plan: BlockPlan, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The local kernel on one block: out (rows, H, Dv) and token-major LSE (rows, H)."""
    axis, dev = call.axis, q.device
    qb = _take(q, plan.q_rows(dev), axis)
    kb, vb = _take(k, plan.k_rows(dev), axis), _take(v, plan.k_rows(dev), axis)
    bspec, bparams = call.block_call(step, dev)
    res = call.local.forward(qb, kb, vb, bspec, bparams)
    if res.lse is None:
        raise RingError(f"ring: local backend {call.local.name!r} returned no LSE; the ring "
                        "merges blocks by LSE, so bind a local backend that returns it")
    return res.out, (res.lse.t() if call.thd else res.lse.transpose(1, 2))


def _backward(call: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
              dlse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V go round again (double-buffered, posted before each block's compute); each
    block's dK/dV accumulator follows one hop behind, its hop posted as soon as the block is
    done, so it travels under the next block's compute. Like the forward, a rank that fails
    drains (forwarding the accumulators it receives, uncomputed) and :func:`_settle` raises
    on every rank."""
    dev = q.device
    bufs = call.kv_buffers(k, v)  # without them this rank cannot drain: raised at once
    dbufs = call.dkv_buffers(dev)  # the same
    kv = bufs[0][:call.numel(call.ring.rank)]
    failed: _Failure | None = None
    try:
        kernel, delta, lse_k, dq = _backward_setup(call, q, v, out, lse, dout, dlse)
    except _FAILURES as exc:
        # e.g. a forced kernel refused on this rank alone (its loss used the LSE, another
        # rank's did not): the others are already in their hops
        failed = _failure("before its first block", exc)
    dkv_hop = None
    last = len(call.plans) - 1
    for step, plan in enumerate(call.plans):
        nxt = call.next_source(step)
        kv_hop = call.ring.hop(kv, call.numel(nxt), _KV_TAG,
                               into=bufs[(step + 1) % 2]) if step < last else None
        dkv = None
        if failed is None:
            try:
                dkv = torch.zeros(call.numel(plan.source), dtype=torch.float32, device=dev)
                if not plan.empty:
                    dk_b, dv_b = call.unpack(dkv, plan.source)
                    k_b, v_b = call.unpack(kv, plan.source)
                    if kernel != "math":
                        _fused_block_grads(call, plan, kernel, q, k_b, v_b, dout, out, lse_k,
                                           dq, dk_b, dv_b)
                    else:
                        _block_grads(call, plan, q, k_b, v_b, dout, lse, delta, dq, dk_b,
                                     dv_b)
            except _FAILURES as exc:  # raised on every rank by _settle, after the drain
                failed, dkv = _failure(_at_block(step, plan), exc), None
        if dkv_hop is not None:  # earlier ranks' share of this block's dK/dV, one hop behind
            got = dkv_hop.wait()  # dbufs[(step - 1) % 2]
            dkv = got if dkv is None else got.add_(dkv)
        if dkv is None:  # a failed rank's first step: the next rank waits for this size
            dkv = dbufs[1][:call.numel(plan.source)]  # not received into before step 1
        # received into the buffer this rank sent from one step ago (that hop is done)
        dkv_hop = call.ring.hop(dkv, call.numel(nxt), _DKV_TAG, into=dbufs[step % 2])
        if kv_hop is not None:
            kv = kv_hop.wait()
    assert dkv_hop is not None  # W >= 1 steps: the last hop brings this rank's own dK/dV home
    mine = dkv_hop.wait()
    grads = None
    if failed is None:  # before the status check: what fails after it fails on one rank alone
        try:
            dk, dv = call.unpack(mine, call.ring.rank)
            grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        except _FAILURES as exc:
            failed = _failure("after its last block, casting its gradients", exc)
    _settle(call, failed, "backward", dev)
    assert grads is not None  # _settle raised otherwise
    return grads


def _backward_setup(call: RingCall, q: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                    ) -> tuple[str, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The block backward kernel, the math kernel's ``delta``, the LSE in the kernels'
    layout and the fp32 dQ accumulator, before the first hop."""
    # a forced kernel decides by structure (the loss used the LSE), alike on every rank: by
    # data, a rank whose dlse is empty or zero ran it while the others raised
    lse_grad = dlse is not None and (call.block_backward != "auto"
                                     or bool(dlse.ne(0).any()))  # one sync, if LSE was used
    kernel, _ = block_backward_kernel(q, v, call.params.softcap, call.params.deterministic,
                                      lse_grad, call.block_backward)
    delta = None
    if kernel == "math":
        delta = (dout.float() * out.float()).sum(-1)
        if dlse is not None:  # d lse_i / d s_ij = P_ij: the LSE's gradient enters via delta
            delta = delta - dlse.float()
    lse_k = lse if kernel == "math" else _kernel_lse(lse, call.thd)
    return kernel, delta, lse_k, torch.zeros(q.shape, dtype=torch.float32, device=q.device)


#: What a rank's block work may raise and still drain the ring (a kernel library's exit()
#: too, as the hub takes it). A Ctrl-C (KeyboardInterrupt) that lands in a block's work
#: drains too: raised at once, it left the other ranks waiting in a hop for this one until the
#: group's timeout (gloo's default: 30 minutes), and a process that caught it (a notebook, a
#: training loop's handler) and called attention again hung with them. :func:`_settle` raises
#: it again on this rank (as KeyboardInterrupt, chained to the shared RingError) and the
#: RingError on the others.
_FAILURES = (Exception, SystemExit, GeneratorExit, KeyboardInterrupt)


@dataclass(frozen=True)
class _Failure:
    """Where this rank's part of a pass stopped (``where``: a phrase) and what it raised."""

    where: str
    exc: BaseException

    def describe(self, phase: str) -> str:
        try:
            why = str(self.exc).strip() or "(no message)"
        except Exception as exc:  # noqa: BLE001 - a broken __str__ must not skip the check
            why = f"(its message could not be read: {type(exc).__name__})"
        return f"failed in the ring's {phase} {self.where}: {type(self.exc).__name__}: {why}"


def _failure(where: str, exc: BaseException) -> _Failure:
    """``exc`` as this rank's failure, the locals of the frames it unwound released: the
    rank drains the ring next (holding a failed kernel's temporaries through the traceback
    would keep the memory an out-of-memory error needs back); the traceback keeps its lines."""
    traceback.clear_frames(exc.__traceback__)
    return _Failure(where, exc)


def _at_block(step: int, plan: BlockPlan) -> str:
    return f"at step {step}, on the K/V block of rank {plan.source}"


def _has_peers(ring: Transport) -> bool:
    """A real process group (a simulated ring plays one rank: nobody to exchange with)."""
    return isinstance(ring, Ring)


def _settle(call: RingCall, failed: _Failure | None, phase: str,
            device: torch.device) -> None:
    """The end of a drained pass: every rank learns whether any failed, and if so every rank
    raises the same :class:`RingError` naming each failed rank, where and why (chained to
    the original error on that rank). One all-reduce of a flag, read once (the pass's one
    host sync); an all-gather of the reasons only when one failed."""
    ring = call.ring
    if _has_peers(ring) and ring.world > 1:
        assert isinstance(ring, Ring)
        if not ring.count(failed is not None, device,
                          f"the status check closing the ring's {phase}"):
            return
        mine = "" if failed is None else failed.describe(phase)
        said = exchange_reasons(ring, mine, device)
    elif failed is None:
        return
    else:
        said = ["" if r != ring.rank else failed.describe(phase) for r in range(ring.world)]
    ranks: dict[str, list[str]] = {}  # ranks that failed alike are named once
    for r, text in enumerate(said):
        if text:
            ranks.setdefault(text, []).append(str(r))
    err = RingError("ring: " + "; ".join(
        f"rank{'s' * (len(rs) > 1)} {', '.join(rs)} of {ring.world} {text}"
        for text, rs in ranks.items())
        + f". Every rank drained the ring and raises this; none returns a result of this "
        f"{phase}")
    if failed is not None and isinstance(failed.exc, KeyboardInterrupt):
        # the user's Ctrl-C stays one on this rank (an Exception would let `except Exception`
        # swallow it); the others raise the RingError, which names it
        err.__cause__ = failed.exc
        raise KeyboardInterrupt(str(err)) from err
    raise err from (failed.exc if failed is not None else None)


def _kernel_lse(lse: torch.Tensor, thd: bool) -> torch.Tensor:
    """Token-major LSE (B,S,H) / (T,H) in the kernels' head-major layout (B,H,S) / (H,T)."""
    return (lse.t() if thd else lse.transpose(1, 2)).contiguous()


def _fused_block_grads(call: RingCall, plan: BlockPlan, kernel: str, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, out: torch.Tensor,
                       lse_k: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                       dv: torch.Tensor) -> None:
    """One block's gradients by a fused backward (``kernel``), given the merged out and the
    global LSE (head-major ``lse_k``); added into the fp32 ``dq`` and the travelling
    ``dk``/``dv``."""
    axis, dev = call.axis, q.device
    qr, kr = plan.q_rows(dev), plan.k_rows(dev)
    qb, dob, ob = (_take(x, qr, axis) for x in (q, dout, out))
    kb, vb = _take(k, kr, axis), _take(v, kr, axis)
    lb = _take(lse_k, qr, axis + 1)
    scale, causal = call.params.scale, plan.causal
    fn = block_backward_fn(kernel)
    if call.thd:
        g = backward_segments(fn, dob, qb, kb, vb, ob, lb, causal, scale,
                              tuple(s.q_len for s in plan.segments),
                              tuple(s.k_len for s in plan.segments))
    else:
        g = fn(dob, qb, kb, vb, ob, lb, causal, scale)
    _add(dq, qr, axis, g[0])
    _add(dk, kr, axis, g[1])
    _add(dv, kr, axis, g[2])


def _block_grads(call: RingCall, plan: BlockPlan, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                 dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add one block's gradients into ``dq`` (this rank's queries) and ``dk``/``dv`` (the
    block's travelling accumulators), by the exact fp32 math backward."""
    axis, dev, thd = call.axis, q.device, call.thd
    qr, kr = plan.q_rows(dev), plan.k_rows(dev)

    def at_q(x: torch.Tensor) -> torch.Tensor:
        return _batched(_take(x, qr, axis), thd)

    def at_k(x: torch.Tensor) -> torch.Tensor:
        return _batched(_take(x, kr, axis), thd)

    grads = block_backward(at_q(q), at_k(k), at_k(v), at_q(dout), at_q(lse), at_q(delta),
                           call.params.scale, call.params.softcap,
                           lambda lo, hi: plan.allowed(lo, hi, dev))
    dq_b, dk_b, dv_b = (g[0] if thd else g for g in grads)
    _add(dq, qr, axis, dq_b)
    _add(dk, kr, axis, dk_b)
    _add(dv, kr, axis, dv_b)


# -- rows along the sequence axis --------------------------------------------------------------
def _index(rows: slice, axis: int) -> tuple[slice, ...]:
    return (slice(None),) * axis + (rows,)


def _take(x: torch.Tensor, rows: Rows, axis: int) -> torch.Tensor:
    return x[_index(rows, axis)] if isinstance(rows, slice) else x.index_select(axis, rows)


def _put(x: torch.Tensor, rows: Rows, axis: int, val: torch.Tensor) -> None:
    if isinstance(rows, slice):
        x[_index(rows, axis)] = val
    else:
        x.index_copy_(axis, rows, val)


def _add(x: torch.Tensor, rows: Rows, axis: int, val: torch.Tensor) -> None:
    if isinstance(rows, slice):
        x[_index(rows, axis)] += val
    else:
        x.index_add_(axis, rows, val.to(x.dtype))


def _batched(x: torch.Tensor, thd: bool) -> torch.Tensor:
    """thd rows get a batch axis of one so the block backward sees (B, rows, ...)."""
    return x.unsqueeze(0) if thd else x


def _covers(rows: Rows, n: int) -> bool:
    """Do ``rows`` cover every local row (the block writes them all)?"""
    return isinstance(rows, slice) and rows.start == 0 and rows.stop == n


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
