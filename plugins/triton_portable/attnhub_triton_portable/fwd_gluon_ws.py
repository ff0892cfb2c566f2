"""Hopper (sm90) forward attention in Gluon, warp-specialised as FlashAttention-3 lays it out.

One CTA takes 128 query rows of one head and runs three partitions (``gl.warp_specialize``):

- a producer warp that issues every TMA load: the two 64-row Q tiles, then K and V tiles into
  a ring of ``KV_STAGES`` buffers, each guarded by a ready mbarrier (TMA transaction count)
  and an empty mbarrier (both consumers arrive once they are done with the buffer);
- two consumer warpgroups (the default partition and one 4-warp worker), 64 query rows each,
  sharing every K/V tile. Each runs the intra-warpgroup overlap of :mod:`.fwd_gluon`:
  ``QK^T`` of tile i waited for, then ``PV`` of tile i-1 in flight under the softmax of tile
  i (P stays in registers: the PV wgmma takes its A operand from them);
- with ``PINGPONG`` an explicit schedule between the consumers (two mbarriers passed back
  and forth): a warpgroup issues its GEMMs of a step only once the other has handed over
  the turn, so one warpgroup's softmax runs under the other's GEMMs (FA3's inter-warpgroup
  overlap). ``PINGPONG=1`` hands it over once this step's PV is issued (FA3's place),
  ``2`` as soon as its QK^T is done, ``0`` leaves the order to the warp schedulers.

Registers are reallocated per partition (``setmaxnreg``): the producer runs on 24, the
consumers on what is left (``maxnreg`` x 12 warps spread over 9, see :func:`flash_fwd`).

Scope: that of :func:`.fwd_gluon.supports` with BLOCK_M = 128 (two 64-row halves), head dim
64 or 128, bf16/fp16, bshd with packed heads, Sq % 128 == 0, Sk % BLOCK_N == 0; full, causal
(both alignments), sliding window, GQA. Both consumers walk the key tiles of the whole
128-row block (the union of their ranges); each masks its own rows.

The order of waits and arrives is modelled on a CPU in
``tests/test_dense_gluon_ws_protocol.py`` (no deadlock, no buffer refilled under a reader,
over random interleavings): change both together. Not an autotune candidate until measured
on the GPU (``benchmarks/gluon_ws.py``; docs/benchmarks/triton_dense.md has the status).
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .fwd_gluon import (_band, _epilogue, _first_softmax, _key_plan, _load_tile,
                        _program_tile, _softmax, launch)
from .fwd_gluon import supports as _base_supports
from .gluon_compat import cta_barrier
from .launch import DenseArgs

#: query rows per consumer warpgroup (one m64 wgmma); a CTA holds two.
HALF_M = 64


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
              v_ready, v_empty, q_row0, q_col, k_row0, k_col, lo, n_tiles,
              HALF: gl.constexpr, BLOCK_N: gl.constexpr, KV_STAGES: gl.constexpr):
    for w in gl.static_range(2):
        _load_tile(q_desc, q_row0 + w * HALF, q_col, q_bar.index(w), q_smem.index(w))
    for i in range(n_tiles):
        st = i % KV_STAGES
        ph = (i // KV_STAGES) & 1
        row = k_row0 + lo + i * BLOCK_N
        mbarrier.wait(k_empty.index(st), ph ^ 1)  # a fresh barrier passes phase 1 at once
        _load_tile(k_desc, row, k_col, k_ready.index(st), k_smem.index(st))
        mbarrier.wait(v_empty.index(st), ph ^ 1)
        _load_tile(v_desc, row, k_col, v_ready.index(st), v_smem.index(st))


@gluon.jit
def _release(bar):
    """Every warp of this warpgroup is past its wait on the wgmma that read the buffer
    (the arrive is issued by one thread), then the buffer goes back to the producer."""
    cta_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _turn_wait(turn, k, W: gl.constexpr, PINGPONG: gl.constexpr):
    # Warpgroup 0 takes step k on phase (k & 1) ^ 1 of its barrier (step 0 passes at once),
    # warpgroup 1 on phase k & 1 of its own: strict alternation, at most one phase apart.
    if PINGPONG:
        mbarrier.wait(turn.index(W), (k & 1) ^ (1 - W))


@gluon.jit
def _turn_pass(turn, W: gl.constexpr, PINGPONG: gl.constexpr, WHEN: gl.constexpr):
    # PINGPONG 1 hands the turn over once this step's PV is issued (FA3's place), 2 as soon
    # as its QK^T is done (the other warpgroup's QK^T may then queue before this PV).
    if PINGPONG == WHEN:
        mbarrier.arrive(turn.index(1 - W), count=1)


@gluon.jit
def _consumer_step(i, lo, acc, p_op, alpha, m_i, l_i, zero_s, q_w, k_smem, v_smem,
                   k_ready, k_empty, v_ready, v_empty, turn, offs_m, seqlen_q, seqlen_k,
                   q_off, left, right, scale2, BLOCK_N: gl.constexpr, KV_STAGES: gl.constexpr,
                   MASK_TILE: gl.constexpr, CAUSAL: gl.constexpr, WIN_LEFT: gl.constexpr,
                   WIN_RIGHT: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
                   row_o: gl.constexpr, W: gl.constexpr, PINGPONG: gl.constexpr):
    """Key tile i >= 1: QK^T of tile i (waited), then PV of tile i-1 in flight under the
    softmax of tile i; nothing in flight across the loop's back edge."""
    ks = i % KV_STAGES
    vs = (i - 1) % KV_STAGES
    _turn_wait(turn, i, W, PINGPONG)
    mbarrier.wait(k_ready.index(ks), (i // KV_STAGES) & 1)
    s = warpgroup_mma(q_w, k_smem.index(ks).permute((1, 0)), zero_s, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    _turn_pass(turn, W, PINGPONG, 2)
    _release(k_empty.index(ks))  # K of tile i is read: the producer may refill it now
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    mbarrier.wait(v_ready.index(vs), ((i - 1) // KV_STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
    _turn_pass(turn, W, PINGPONG, 1)
    p, alpha, m_i, l_i = _softmax(lo + i * BLOCK_N, s, m_i, l_i, offs_m, seqlen_q, seqlen_k,
                                  q_off, left, right, scale2, BLOCK_N, MASK_TILE, CAUSAL,
                                  WIN_LEFT, WIN_RIGHT, s_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _release(v_empty.index(vs))
    p_op = gl.convert_layout(p.to(q_w.dtype), p_layout)
    return acc, p_op, alpha, m_i, l_i


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn, O,
              LSE, sob, sos, soh, slb, slh, b, h, m0, seqlen_q, seqlen_k, q_off, left, right,
              scale2, lo, n_tiles, full_lo, full_hi, W: gl.constexpr, HEAD_DIM: gl.constexpr,
              HALF: gl.constexpr, BLOCK_N: gl.constexpr, KV_STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr,
              PINGPONG: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    MASKED: gl.constexpr = CAUSAL or WIN_LEFT or WIN_RIGHT

    q_w = q_smem.index(W)
    mw = m0 + W * HALF
    offs_m = mw + gl.arange(0, HALF, layout=row_s)
    m_i = gl.full([HALF], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([HALF], gl.float32, layout=row_s)
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar.index(W), 0)  # always: no TMA write may land after the CTA exits
    if n_tiles > 0:
        t_lo = gl.maximum((full_lo - lo) // BLOCK_N, 1)
        t_hi = gl.maximum((full_hi - lo) // BLOCK_N, t_lo)
        _turn_wait(turn, 0, W, PINGPONG)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_w, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - W), count=1)
        _release(k_empty.index(0))
        p, alpha, m_i, l_i = _first_softmax(lo, s, m_i, l_i, offs_m, seqlen_q, seqlen_k,
                                            q_off, left, right, scale2, full_lo, full_hi,
                                            BLOCK_N, MASKED, CAUSAL, WIN_LEFT, WIN_RIGHT,
                                            s_layout)
        p_op = gl.convert_layout(p.to(q_w.dtype), p_layout)
        for bnd in gl.static_range(3):  # tiles [1, t_lo) masked, [t_lo, t_hi) not, then masked
            if MASKED or bnd == 1:
                start, end = _band(bnd, n_tiles, t_lo, t_hi, MASKED)
                for i in range(start, end):
                    acc, p_op, alpha, m_i, l_i = _consumer_step(
                        i, lo, acc, p_op, alpha, m_i, l_i, zero_s, q_w, k_smem, v_smem,
                        k_ready, k_empty, v_ready, v_empty, turn, offs_m, seqlen_q, seqlen_k,
                        q_off, left, right, scale2, BLOCK_N, KV_STAGES, MASKED and bnd != 1,
                        CAUSAL, WIN_LEFT, WIN_RIGHT, s_layout, p_layout, row_o, W, PINGPONG)
        last = n_tiles - 1
        vs = last % KV_STAGES
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        mbarrier.wait(v_ready.index(vs), (last // KV_STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _release(v_empty.index(vs))

    _epilogue(acc, m_i, l_i, mw, offs_m, b, h, O, LSE, sob, sos, soh, slb, slh, seqlen_q,
              HALF, HEAD_DIM, row_o, o_layout)


@gluon.jit
def _fwd_ws_kernel(q_desc, k_desc, v_desc, O, LSE, sob, sos, soh, slb, slh,
                   seqlen_q, seqlen_k, num_heads, group, scale2, left, right,
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, KV_STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, WIN_LEFT: gl.constexpr,
                   WIN_RIGHT: gl.constexpr, PINGPONG: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr):
    HALF: gl.constexpr = 64
    BLOCK_M: gl.constexpr = 2 * HALF
    b, h, hk, m0, q_off = _program_tile(num_heads, group, seqlen_q, seqlen_k, BLOCK_M,
                                        BOTTOM_RIGHT)

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [KV_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [KV_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(2):
        mbarrier.init(q_bar.index(t), count=1)
        mbarrier.init(turn.index(t), count=1)
    for t in gl.static_range(KV_STAGES):
        mbarrier.init(k_ready.index(t), count=1)
        mbarrier.init(v_ready.index(t), count=1)
        mbarrier.init(k_empty.index(t), count=2)  # one arrive per consumer warpgroup
        mbarrier.init(v_empty.index(t), count=2)

    lo, n_tiles, full_lo, full_hi = _key_plan(m0, seqlen_q, seqlen_k, q_off, left, right,
                                              BLOCK_M, BLOCK_N, CAUSAL, WIN_LEFT, WIN_RIGHT)
    q_row0 = b * seqlen_q + m0
    k_row0 = b * seqlen_k
    k_col = hk * HEAD_DIM
    q_col = h * HEAD_DIM
    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                     O, LSE, sob, sos, soh, slb, slh, b, h, m0, seqlen_q, seqlen_k, q_off,
                     left, right, scale2, lo, n_tiles, full_lo, full_hi, 0, HEAD_DIM, HALF,
                     BLOCK_N, KV_STAGES, CAUSAL, WIN_LEFT, WIN_RIGHT, PINGPONG)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                     O, LSE, sob, sos, soh, slb, slh, b, h, m0, seqlen_q, seqlen_k, q_off,
                     left, right, scale2, lo, n_tiles, full_lo, full_hi, 1, HEAD_DIM, HALF,
                     BLOCK_N, KV_STAGES, CAUSAL, WIN_LEFT, WIN_RIGHT, PINGPONG)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
                     v_ready, v_empty, q_row0, q_col, k_row0, k_col, lo, n_tiles, HALF,
                     BLOCK_N, KV_STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


#: The CTA's query rows (two consumer warpgroups of 64).
BLOCK_M = 2 * HALF_M


def supports(args: DenseArgs, config: dict[str, Any]) -> str | None:
    """None when this kernel computes the call with ``config``, else why not."""
    if config.get("BLOCK_M", BLOCK_M) != BLOCK_M:
        return f"the warp-specialised Gluon forward takes BLOCK_M = {BLOCK_M} only"
    if config["BLOCK_N"] not in (64, 128):
        return "BLOCK_N must be 64 or 128"
    return _base_supports(args, {**config, "BLOCK_M": BLOCK_M})


def launch_meta(config: dict[str, Any]) -> dict[str, Any]:
    """Kernel constants and launch options of a warp-specialised config."""
    regs = int(config.get("CONSUMER_REGS", 240))
    # 4 + 4 + 1 warps round up to 12: maxnreg x 12 warps is what the partitions share out
    # (producer 24, the worker consumer CONSUMER_REGS, the default consumer the rest).
    maxnreg = int(config.get("maxnreg", 168))
    return {"KV_STAGES": int(config.get("KV_STAGES", 2)),
            "PINGPONG": int(config.get("PINGPONG", 1)), "CONSUMER_REGS": regs,
            "num_warps": 4, "num_stages": 1, "maxnreg": maxnreg}


def flash_fwd(args: DenseArgs, config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` like :func:`.fwd.flash_fwd`; the caller checked :func:`supports`."""
    return launch(_fwd_ws_kernel, args, BLOCK_M, HALF_M, config["BLOCK_N"],
                  **launch_meta(config))
