"""Ring attention: the forward and backward passes over a ring of ranks.

Forward, on rank ``i`` of ``W``: at step ``s`` it holds the K/V block of rank ``i - s``; it
posts the hop that passes this block on (and receives the next one), runs the local kernel on
the part of the block its plan allows, merges the result into fp32 accumulators by LSE, then
waits for the hop. Backward walks the same ring: K/V blocks travel as in the forward, and
each block's dK/dV accumulator travels with it, one hop behind, collecting every rank's
contribution until it arrives back at the rank that owns the block (``W`` hops).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnhub.plugin import AttentionSpec, AttnParams, Backend, MaskSpec

from .block_backward import block_backward
from .comm import ProcessGroup, Ring, RingError, resolve_group
from .merge import merge_partial
from .plan import BlockPlan, Rows, block_plans
from .sharding import ZigzagLayout

_KV_TAG, _DKV_TAG = 0, 1


@dataclass(frozen=True)
class RingCall:
    """Everything one call needs besides the tensors: ring, plans, shapes, the local kernel."""

    ring: Ring
    local: Backend
    spec: AttentionSpec
    params: AttnParams
    layout: ZigzagLayout
    plans: tuple[BlockPlan, ...]
    thd: bool
    kv_shapes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # per rank: (k, v) shape

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
        return buf[:nk].view(ks), buf[nk:].view(vs)

    def next_source(self, step: int) -> int:
        """The rank whose block arrives for step ``step + 1``."""
        return (self.ring.rank - step - 1) % self.ring.world


def run_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, local: Backend,
             spec: AttentionSpec, params: AttnParams, group: ProcessGroup | None = None,
             global_seqlens: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of this rank's zigzag shard. Returns ``out`` (q's dtype) and the LSE in
    the contract layout ((B,Hq,S) or (Hq,T), fp32); both carry autograd."""
    _check_call(q, k, v, spec, params)
    ring = Ring(resolve_group(group))
    thd = spec.layout == "thd"
    local_lens = torch.diff(params.cu_seqlens_q).tolist() if thd else [q.shape[1]]
    if global_seqlens is not None:
        layout = ZigzagLayout(ring.world, tuple(int(n) for n in global_seqlens))
        if tuple(local_lens) != layout.local_lens(ring.rank):
            raise RingError(
                f"ring: rank {ring.rank} holds {local_lens} tokens per sequence, but global "
                f"lengths {list(global_seqlens)} shard to {list(layout.local_lens(ring.rank))}; "
                "shard inputs with attnhub_ring.zigzag_shard / zigzag_shard_varlen")
    else:
        layout = ZigzagLayout.from_local_lens(ring.gather_lengths(local_lens, q.device))
    kv_shapes = tuple(
        (_block_shape(k, layout, r, thd), _block_shape(v, layout, r, thd))
        for r in range(ring.world))
    call = RingCall(ring, local, spec, params, layout,
                    tuple(block_plans(layout, ring.rank, params.causal)), thd, kv_shapes)
    out, lse = _RingAttention.apply(q, k, v, call)
    return out, (lse.t() if thd else lse.transpose(1, 2))


_UNSUPPORTED = ("window", "alibi_slopes", "prefix_lens", "colmask_start", "score_mod",
                "mask_mod", "block_table")


def _check_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
                params: AttnParams) -> None:
    used = [f for f in _UNSUPPORTED if getattr(params, f) is not None]
    if used:
        raise RingError(f"ring: {', '.join(used)} not supported across shards (masks: causal, "
                        "softcap, documents via thd); bind a single-device backend instead")
    if spec.layout == "thd":
        cu_q, cu_k = params.cu_seqlens_q, params.cu_seqlens_k
        if cu_q is None or cu_k is None or not torch.equal(cu_q, cu_k):
            raise RingError("ring: thd needs cu_seqlens_q == cu_seqlens_k (self-attention over "
                            "the local shard; see zigzag_shard_varlen)")
        if int(cu_q[-1]) != q.shape[0] or k.shape[0] != q.shape[0]:
            raise RingError(f"ring: cu_seqlens must cover the whole shard ({int(cu_q[-1])} of "
                            f"{q.shape[0]} query and {k.shape[0]} key tokens)")
    elif spec.layout == "bshd":
        if q.shape[1] != k.shape[1]:
            raise RingError(f"ring: shards self-attention, but q has {q.shape[1]} and k "
                            f"{k.shape[1]} tokens in this shard; cross-attention needs a "
                            "single-device backend")
    else:
        raise RingError(f"ring: layout {spec.layout!r} not supported (bshd, thd)")


def _block_shape(x: torch.Tensor, layout: ZigzagLayout, rank: int, thd: bool) -> tuple[int, ...]:
    n = sum(layout.local_lens(rank))
    return (n, *x.shape[1:]) if thd else (x.shape[0], n, *x.shape[2:])


class _RingAttention(torch.autograd.Function):
    """(q, k, v) -> (out, lse token-major); the backward also takes the LSE's gradient."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                call: RingCall) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _forward(call, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.call, q, k, v, out, lse, dout, dlse)
        return dq, dk, dv, None


def _forward(call: RingCall, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    axis, dev = call.axis, q.device
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=dev)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=dev)
    kv = torch.cat([k.reshape(-1), v.reshape(-1)])
    last = len(call.plans) - 1
    for step, plan in enumerate(call.plans):
        hop = call.ring.hop(kv, call.numel(call.next_source(step)), _KV_TAG) if step < last \
            else None
        if not plan.empty:
            rows = plan.q_rows(dev)
            o_b, l_b = _local_block(call, q, *call.unpack(kv, plan.source), plan)
            o, l = merge_partial(_take(out, rows, axis), _take(lse, rows, axis), o_b, l_b)
            _put(out, rows, axis, o)
            _put(lse, rows, axis, l)
        if hop is not None:
            kv = hop.wait()
    return out.to(q.dtype), lse


def _local_block(call: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 plan: BlockPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The local kernel on one block: out (rows, H, Dv) and token-major LSE (rows, H)."""
    axis, dev, p, spec = call.axis, q.device, call.params, call.spec
    qb = _take(q, plan.q_rows(dev), axis)
    kb, vb = _take(k, plan.k_rows(dev), axis), _take(v, plan.k_rows(dev), axis)
    cu_q, cu_k = plan.cu_seqlens(dev) if call.thd else (None, None)
    bspec = spec.with_(
        mask=MaskSpec(causal=plan.causal, alignment=spec.mask.alignment,
                      softcap=spec.mask.softcap, document=call.thd),
        max_seqlen_q=plan.max_q, max_seqlen_k=plan.max_k, needs_grad=False, return_lse=True,
        batch=len(plan.segments) if call.thd else q.shape[0])
    bparams = AttnParams(scale=p.scale, causal=plan.causal, alignment=p.alignment,
                         softcap=p.softcap, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         max_seqlen_q=plan.max_q, max_seqlen_k=plan.max_k,
                         deterministic=p.deterministic, return_lse=True)
    res = call.local.forward(qb, kb, vb, bspec, bparams)
    if res.lse is None:
        raise RingError(f"ring: local backend {call.local.name!r} returned no LSE; the ring "
                        "merges blocks by LSE, so bind a local backend that returns it")
    return res.out, (res.lse.t() if call.thd else res.lse.transpose(1, 2))


def _backward(call: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
              dlse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = q.device
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:  # d lse_i / d s_ij = P_ij: the LSE's gradient enters through delta
        delta = delta - dlse.float()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=dev)
    kv = torch.cat([k.reshape(-1), v.reshape(-1)])
    dkv_hop = None
    last = len(call.plans) - 1
    for step, plan in enumerate(call.plans):
        nxt = call.next_source(step)
        kv_hop = call.ring.hop(kv, call.numel(nxt), _KV_TAG) if step < last else None
        dkv = torch.zeros(call.numel(plan.source), dtype=torch.float32, device=dev)
        if not plan.empty:
            _block_grads(call, plan, q, *call.unpack(kv, plan.source), dout, lse, delta, dq,
                         *call.unpack(dkv, plan.source))
        if dkv_hop is not None:  # earlier ranks' share of this block's dK/dV, one hop behind
            dkv = dkv_hop.wait().add_(dkv)
        dkv_hop = call.ring.hop(dkv, call.numel(nxt), _DKV_TAG)
        if kv_hop is not None:
            kv = kv_hop.wait()
    assert dkv_hop is not None  # W >= 1 steps: the last hop brings this rank's own dK/dV home
    dk, dv = call.unpack(dkv_hop.wait(), call.ring.rank)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _block_grads(call: RingCall, plan: BlockPlan, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                 dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add one block's gradients into ``dq`` (this rank's queries) and ``dk``/``dv`` (the
    block's travelling accumulators)."""
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
        x.index_add_(axis, rows, val)


def _batched(x: torch.Tensor, thd: bool) -> torch.Tensor:
    """thd rows get a batch axis of one so the block backward sees (B, rows, ...)."""
    return x.unsqueeze(0) if thd else x


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
