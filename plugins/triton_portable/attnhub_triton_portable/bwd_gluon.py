"""Hopper (sm90) backward attention in Gluon: dK, dV and dQ from one kernel, five GEMMs.

Why: the portable backward (:mod:`.bwd`) is atomic-free, so a dQ kernel of its own recomputes
``QK^T`` and ``dP``: 7 GEMMs where FlashAttention needs 5, and its dK/dV kernel holds K and V
in registers and spills at 255. Measured on the H200 (benchmarks/bwd_probe.py, 16k full, d128,
16 heads) its two kernels run at about 555 TFLOP/s of executed work, yet count 390: no tiling
of that scheme reaches issue 16's 480. Here one program owns a key tile of one KV head (K and
V stay in shared memory), walks the query tiles that can see it (Q, dO and their rows' LSE
and delta arrive by TMA, one tile ahead) and per tile issues the five GEMMs as async wgmmas:
``S^T = K Q^T`` and ``dP^T = V dO^T`` together, the softmax under the second, ``dV += P^T dO``
from registers under the ``dS`` arithmetic, then ``dK += dS^T Q`` and ``dQ = dS K`` (dS
through shared memory). Each dQ tile leaves by one TMA reduce-add into an fp32 buffer
(FlashAttention-3's way) from one of two shared-memory buffers, so the sum runs under the
next tile's GEMMs.

The programs of the last, partial wave walk their query tiles in parts on the SMs the wave
leaves idle (:mod:`.bwd_tail`), and programs start at their KV row's first key tile (under a
causal mask, the longest walks first). H100, 16k, d128 (docs/benchmarks/h100_20261205_s18):
full 10.94 ms through the API (503 TFLOP/s; 11.20 with whole walks), causal 5.74 (479;
6.06 taking the last key tile first); cuDNN 9.81 / 5.05 in the same run.

What limited it before (H200, 16k, d128; docs/benchmarks/h200_20261205_s14): 11.45 ms at full
(480 TFLOP/s for the kernel, 476 with delta and dQ's cast), 6.02 ms causal (450), against
cuDNN's 10.16 / 5.23. The step as first written hoisted its loop invariants (the wgmma
descriptors of K, V and dS, the mask's column offsets) into registers and spilled them at
255 (12.21 / 8.43 ms): ``NO_HOIST`` keeps them in the loop (242 registers, no spill). Without
dQ the kernel runs 9.2 ms; dQ's GEMM is a fifth of the tensor work, and its buffer's wait
about 1% (docs/benchmarks/h200_20261203_s13). The rest is the step's serial chain (softmax
and dS between the GEMMs, two CTA barriers), two warpgroups and no ping-pong. A tile-
contiguous dQ buffer, a rotated walk of the query tiles, dQ's GEMM before dK's and the
pipelined step (``PIPE``) were each timed no faster.

dQ's summation order varies run to run: this kernel is not deterministic and is never picked
when ``deterministic=True`` (the dq_mode "atomic" rule of :mod:`.configs`).

Scope as the Gluon forward, bf16 only (:func:`supports` says why not): bshd, head dim 64 or
128, packed heads, Sq a multiple of BLOCK_M and Sk of BLOCK_N, causal (either alignment) and
sliding windows, GQA; no softcap, ALiBi, prefix-LM, column-sparse or varlen.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import bwd_tail, fwd_gluon
from .fastlaunch import LaunchTable, launch_on
from .gluon_compat import cta_barrier, tma_load, tma_reduce_add
from .launch import DenseArgs, sm_count

_LOG2E = 1.4426950408889634
#: The tile the kernel is written for: 128 keys per program, 64 query rows per step, 8 warps
#: (two warpgroups, 64 keys each).
BLOCK_M, BLOCK_N, NUM_WARPS = 64, 128, 8
#: Q / dO / LSE / delta ring of STAGES tiles (tile c + STAGES - 1 loads while tile c
#: computes), and DQ_BUFS fp32 dQ tiles in shared memory (each step waits for the reduce-add
#: that last read its buffer). H200, 16k full: 2 stages 12.3 ms with 1 or 2 buffers, 3
#: stages and 1 buffer 14.1 ms. 2 + 2 fill 208 of the 227 KiB at d128.
STAGES, DQ_BUFS = 2, 2
#: The step: the next tile's first two GEMMs under this tile's dQ epilogue (True), or each
#: tile's five GEMMs in its own step (False). H200, 16k (2026-12-05): pipelined 12.29 ms full,
#: 6.49 causal, against 11.55 / 6.10 for the step without hoisting.
PIPE = False
#: The step keeps its loop invariants in the loop (wgmma descriptors through one-slot buffers
#: indexed by an opaque zero, the mask's offsets from shared memory) so LLVM cannot hoist them
#: into registers that then spill. H200, 16k, d128 (2026-12-05): 11.55 ms against 12.42 at
#: full, 6.10 against 8.55 at causal (docs/benchmarks/h200_20261205_s14).
NO_HOIST = True


@gluon.jit
def _query_plan(n0, seqlen_q, q_off, left, right, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WIN_LEFT: gl.constexpr,
                WIN_RIGHT: gl.constexpr):
    """(lo, number of query tiles, full_lo, full_hi) that see keys [n0, n0 + BLOCK_N); query
    tiles in [full_lo, full_hi) see every key of the tile (no mask)."""
    n1 = n0 + BLOCK_N
    lo = n0 * 0
    hi = seqlen_q + n0 * 0
    full_lo = lo
    full_hi = hi
    if CAUSAL:  # key j visible from row i when j <= i + q_off
        lo = gl.maximum(lo, n0 - q_off)
        full_lo = gl.maximum(full_lo, n1 - 1 - q_off)
    if WIN_RIGHT:  # j <= i + q_off + right
        lo = gl.maximum(lo, n0 - right - q_off)
        full_lo = gl.maximum(full_lo, n1 - 1 - right - q_off)
    if WIN_LEFT:  # j >= i + q_off - left
        hi = gl.minimum(hi, n1 + left - q_off)
        full_hi = gl.minimum(full_hi, n0 + left - q_off + 1)
    lo = (gl.minimum(gl.maximum(lo, 0), seqlen_q) // BLOCK_M) * BLOCK_M
    hi = gl.minimum(((gl.maximum(hi, lo) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, seqlen_q)
    hi = gl.maximum(hi, lo)
    full_lo = ((gl.maximum(full_lo, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    full_lo = gl.minimum(gl.maximum(full_lo, lo), hi)
    full_hi = (gl.maximum(full_hi, 0) // BLOCK_M) * BLOCK_M
    full_hi = gl.maximum(gl.minimum(full_hi, hi), full_lo)
    return lo, (hi - lo) // BLOCK_M, full_lo, full_hi


@gluon.jit
def _load_tile(c, c0, n_tiles, lo, b, hk, group, seqlen_q, num_heads, q_desc, do_desc,
               lse_desc, delta_desc, ld_bar, q_smem, do_smem, lse_smem, delta_smem,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
               pred=True):
    """Query tile ``c`` of the walk into ring stage (c - c0) % STAGES (``c0``: the first
    tile of this program's part): Q and dO rows, and the LSE and delta of those rows (shared
    memory, so the softmax never waits on a global load). ``pred``: a predicate instead of a
    branch (ptxas drains in-flight wgmmas at a join)."""
    g = c // n_tiles
    m0 = lo + (c - g * n_tiles) * BLOCK_M
    h = hk * group + g
    st = (c - c0) % STAGES
    bar = ld_bar.index(st)
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes,
                    pred=pred)
    tma_load(q_desc, [b * seqlen_q + m0, h * HEAD_DIM], bar, q_smem.index(st), pred=pred)
    tma_load(do_desc, [b * seqlen_q + m0, h * HEAD_DIM], bar, do_smem.index(st), pred=pred)
    lrow = (b * num_heads + h) * seqlen_q + m0
    tma_load(lse_desc, [lrow], bar, lse_smem.index(st), pred=pred)
    tma_load(delta_desc, [lrow], bar, delta_smem.index(st), pred=pred)


@gluon.jit
def _scores(c, c0, k_smem, v_smem, q_smem, do_smem, ld_bar, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, st_layout: gl.constexpr):
    """Issue ``S^T = K Q^T`` and ``dP^T = V dO^T`` of tile ``c`` (async; the caller waits)."""
    stage = (c - c0) % STAGES
    mbarrier.wait(ld_bar.index(stage), ((c - c0) // STAGES) & 1)
    zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
    st = warpgroup_mma(k_smem, q_smem.index(stage).permute((1, 0)), zero_st, use_acc=False,
                       is_async=True)
    dpt = warpgroup_mma(v_smem, do_smem.index(stage).permute((1, 0)), zero_st,
                        use_acc=False, is_async=True)
    return st, dpt


@gluon.jit
def _opaque_zero(c):
    """0, from an asm with side effects that reads ``c``: an index the compiler cannot
    fold or hoist, so a buffer indexed by it has its addresses made in the loop."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [c], gl.int32, is_pure=False,
                                     pack=1)


@gluon.jit
def _step_pipelined(c, c0, total, n_tiles, lo, g, hk, group, b, n0, num_heads, st, dpt, dk, dv,
                    k_ring, v_ring, q_smem, do_smem, lse_smem, delta_smem, ds_ring, dq_smem,
                    offs_smem, ld_bar, q_desc, do_desc, lse_desc, delta_desc, dq_desc, seqlen_q,
                    q_off, left, right, scale, scale2, HEAD_DIM: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    DQ_BUFS: gl.constexpr, MASK_TILE: gl.constexpr, CAUSAL: gl.constexpr,
                    WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr,
                    st_layout: gl.constexpr, op_layout: gl.constexpr,
                    dq_layout: gl.constexpr):
    """Tile ``c`` given its finished ``S^T`` and ``dP^T``: softmax, dS, dV, dQ and dK; dQ
    goes to shared memory under dK's GEMM, then the next tile's ``S^T`` and ``dP^T`` run on
    the tensor cores under this tile's dQ epilogue (the CTA barrier, the reduce-add, the
    next load) and are waited for before the step ends, so no wgmma is in flight across the
    loop's back edge (ptxas serializes every wgmma of a loop where one is). ``total``: the
    end of this program's part of the walk. Returns (S^T, dP^T, dK, dV).

    Registers (255 a thread, two warpgroups): dK and dV hold 128, S^T and dP^T 64, dQ 32,
    so dQ leaves for shared memory before the next tile's S^T and dP^T are issued (224
    otherwise), dS is made before dV's GEMM takes P (P, dP^T and P's bf16 copy together
    otherwise), and nothing loop-invariant may sit in registers: LLVM hoists the 32 wgmma
    descriptors of K, V and dS (fixed addresses) and the mask's 16 column offsets per thread
    out of the loop, and Triton 3.6 spilled them (49 LDL / 45 STL, full mask). Hence K, V
    and dS are read through :func:`_opaque_zero`, and the offsets from shared memory."""
    stage = (c - c0) % STAGES
    m0 = lo + (c - g * n_tiles) * BLOCK_M
    h = hk * group + g
    zero = _opaque_zero(c)
    k_smem = k_ring.index(zero)
    v_smem = v_ring.index(zero)
    ds_smem = ds_ring.index(zero)
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    offs = gl.arange(0, BLOCK_M, layout=col_layout)
    if MASK_TILE:
        offs = offs_smem.load(col_layout)  # a load in the loop: LLVM cannot hoist it
    pt = _probs(st, lse_smem, stage, m0, n0, q_off, left, right, scale2, offs, BLOCK_M,
                BLOCK_N, MASK_TILE, CAUSAL, WIN_LEFT, WIN_RIGHT, st_layout)
    qs = q_smem.index(stage)
    dos = do_smem.index(stage)
    dst = _dst(pt, dpt, delta_smem.index(stage).load(col_layout)).to(q_smem.dtype)
    dv = warpgroup_mma(gl.convert_layout(pt.to(q_smem.dtype), op_layout), dos, dv,
                       is_async=True)
    ds_smem.store(dst)
    fence_async_shared()
    cta_barrier()  # dQ's GEMM reads both warpgroups' rows of dS^T
    dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem,
                       gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout),
                       use_acc=False, is_async=True)
    dk = warpgroup_mma(gl.convert_layout(dst, op_layout), qs, dk, is_async=True)
    dq, dv = warpgroup_mma_wait(num_outstanding=1, deps=(dq, dv))
    tma.store_wait(DQ_BUFS - 1)  # the reduce-add that last read this step's dQ buffer
    dqs = dq_smem.index((c - c0) % DQ_BUFS)
    dqs.store(dq * scale)
    dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ))
    # the next tile (on the last step, this one again: a branch would drain the wgmmas)
    st, dpt = _scores(gl.minimum(c + 1, total - 1), c0, k_smem, v_smem, q_smem, do_smem, ld_bar,
                      BLOCK_M, BLOCK_N, STAGES, st_layout)
    fence_async_shared()
    # both warpgroups' dQ rows are stored, and both are done with tile c's stage and dS
    cta_barrier()
    tma_reduce_add(dq_desc, [b * seqlen_q + m0, h * HEAD_DIM], dqs)
    _load_tile(c + STAGES, c0, n_tiles, lo, b, hk, group, seqlen_q, num_heads, q_desc, do_desc,
               lse_desc, delta_desc, ld_bar, q_smem, do_smem, lse_smem, delta_smem, HEAD_DIM,
               BLOCK_M, STAGES, c + STAGES < total)
    st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
    return st, dpt, dk, dv


@gluon.jit
def _probs(st, lse_smem, stage, m0, n0, q_off, left, right, scale2, offs,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK_TILE: gl.constexpr,
           CAUSAL: gl.constexpr, WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr,
           st_layout: gl.constexpr):
    """P^T of the tile from its scores ``S^T`` and its rows' LSE (masked where the tile
    needs it, query ``m0 + offs[i]`` in column i; a row with LSE -inf attends nothing and
    gets zeros)."""
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    lse = lse_smem.index(stage).load(col_layout)
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    s = st * scale2
    if MASK_TILE:
        cols = m0 + offs
        jj = gl.expand_dims(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout)), 1)
        ok = fwd_gluon.band_mask(jj >= 0, gl.expand_dims(cols, 0) + q_off, jj, left, right,
                                 CAUSAL, WIN_LEFT, WIN_RIGHT)
        s = gl.where(ok, s, float("-inf"))
    return gl.exp2(s - gl.expand_dims(lse2, 0))


@gluon.jit
def _dst(pt, dpt, delta):
    """dS^T = P^T (dP^T - delta), and 0 where P is: a row or key that sees nothing must not
    take 0 x NaN from a NaN value (dP^T's row of that key) into dQ or dK."""
    return gl.where(pt == 0.0, 0.0, pt * (dpt - gl.expand_dims(delta, 0)))


@gluon.jit
def _step(c, c0, total, n_tiles, lo, g, hk, group, b, n0, num_heads, dk, dv, k_smem, v_smem,
          q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, offs_smem, ld_bar, q_desc,
          do_desc, lse_desc, delta_desc, dq_desc, seqlen_q, q_off, left, right, scale, scale2,
          HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, DQ_BUFS: gl.constexpr, MASK_TILE: gl.constexpr,
          CAUSAL: gl.constexpr, WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr,
          st_layout: gl.constexpr, op_layout: gl.constexpr, dq_layout: gl.constexpr,
          PROBE: gl.constexpr, NO_HOIST: gl.constexpr):
    """Query tile ``c`` of this program's walk (head g of the group, tile c - g * n_tiles;
    the part's walk is [c0, total)): its five GEMMs. Nothing is in flight across the step's
    ends but the last DQ_BUFS - 1 dQ reduce-adds and the loads of the next STAGES - 1 tiles. ``k_smem``, ``v_smem``,
    ``ds_smem``: rings of one. ``NO_HOIST``: their addresses and the mask's offsets made in
    the loop, as the pipelined step does (:func:`_step_pipelined` says why)."""
    stage = (c - c0) % STAGES
    m0 = lo + (c - g * n_tiles) * BLOCK_M
    h = hk * group + g
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    offs = gl.arange(0, BLOCK_M, layout=col_layout)
    if NO_HOIST:
        zero = _opaque_zero(c)
        if MASK_TILE:
            offs = offs_smem.load(col_layout)
    else:
        zero = 0
    k_smem = k_smem.index(zero)
    v_smem = v_smem.index(zero)
    ds_smem = ds_smem.index(zero)
    qs = q_smem.index(stage)
    dos = do_smem.index(stage)
    st, dpt = _scores(c, c0, k_smem, v_smem, q_smem, do_smem, ld_bar, BLOCK_M, BLOCK_N,
                      STAGES, st_layout)
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
    pt = _probs(st, lse_smem, stage, m0, n0, q_off, left, right, scale2, offs, BLOCK_M,
                BLOCK_N, MASK_TILE, CAUSAL, WIN_LEFT, WIN_RIGHT, st_layout)
    dv = warpgroup_mma(gl.convert_layout(pt.to(q_smem.dtype), op_layout), dos, dv,
                       is_async=True)
    delta = delta_smem.index(stage).load(col_layout)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
    dst = _dst(pt, dpt, delta).to(q_smem.dtype)
    ds_smem.store(dst)
    tma.store_wait(DQ_BUFS - 1)  # the reduce-add that last read this step's dQ buffer
    fence_async_shared()
    # dQ's GEMM reads both warpgroups' rows of dS^T; past this barrier both warpgroups are
    # done with tile c - 1, whose stage takes tile c + STAGES - 1, and this step's dQ buffer
    # is free (H200, 16k: the wait here rather than after dQ's GEMM, with its own barrier,
    # timed 0.5-1% faster at full and 2.5% at causal, in two runs).
    cta_barrier()
    if c + STAGES - 1 < total:
        _load_tile(c + STAGES - 1, c0, n_tiles, lo, b, hk, group, seqlen_q, num_heads,
                   q_desc, do_desc, lse_desc, delta_desc, ld_bar, q_smem, do_smem, lse_smem,
                   delta_smem, HEAD_DIM, BLOCK_M, STAGES)
    dk = warpgroup_mma(gl.convert_layout(dst, op_layout), qs, dk, is_async=True)
    if PROBE == 2:
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    else:
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem,
                           gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout),
                           use_acc=False, is_async=True)
        dq, dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk, dv))
        if PROBE != 1:
            dqs = dq_smem.index((c - c0) % DQ_BUFS)
            dqs.store(dq * scale)
            fence_async_shared()
            cta_barrier()
            tma_reduce_add(dq_desc, [b * seqlen_q + m0, h * HEAD_DIM], dqs)
    return dk, dv


@gluon.jit
def _bwd_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_desc, delta_desc, DK, DV,
                Slots, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
                seqlen_q, seqlen_k, num_heads, num_kv_heads, group, n_key_tiles, full_units,
                tail_parts, key_desc, scale, scale2, left, right,
                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, WIN_LEFT: gl.constexpr,
                WIN_RIGHT: gl.constexpr, NUM_WARPS: gl.constexpr, STAGES: gl.constexpr,
                DQ_BUFS: gl.constexpr, PROBE: gl.constexpr, PIPE: gl.constexpr,
                NO_HOIST: gl.constexpr):
    # program ``unit`` takes key tile unit % n_key_tiles of KV row bh = unit // n_key_tiles,
    # counted from the last key tile when key_desc (KEY_DESC says why); the programs past
    # full_units are the last wave's tiles in tail_parts parts each (bwd_tail says why)
    pid = gl.program_id(0)
    tail = (pid >= full_units).to(gl.int32)
    j = gl.maximum(pid - full_units, 0)
    unit = pid + tail * (full_units + j // tail_parts - pid)
    part = tail * (j % tail_parts)
    parts = 1 + tail * (tail_parts - 1)
    x = unit % n_key_tiles
    pid_n = x + key_desc * (n_key_tiles - 1 - 2 * x)
    bh = unit // n_key_tiles
    b = bh // num_kv_heads
    hk = bh % num_kv_heads
    n0 = pid_n * BLOCK_N
    q_off = seqlen_k * 0
    if BOTTOM_RIGHT:
        q_off = seqlen_k - seqlen_q

    # S^T / dP^T: keys x queries, each warpgroup 64 keys; dK / dV: keys x d; dQ: queries x d
    # with the two warpgroups splitting d.
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
        instr_shape=[16, HEAD_DIM // (NUM_WARPS // 4), 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)

    dtype: gl.constexpr = q_desc.dtype
    # K, V and dS in rings of one: the pipelined step indexes them with _opaque_zero
    k_ring = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], v_desc.layout)
    k_smem = k_ring.index(0)  # what the TMA loads write
    v_smem = v_ring.index(0)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    ds_ring = gl.allocate_shared_memory(
        dtype, [1, BLOCK_N, BLOCK_M],
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, BLOCK_M, HEAD_DIM],
                                        dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ld_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for t in gl.static_range(STAGES):
        mbarrier.init(ld_bar.index(t), count=1)

    lo, n_tiles, full_lo, full_hi = _query_plan(n0, seqlen_q, q_off, left, right, BLOCK_M,
                                                BLOCK_N, CAUSAL, WIN_LEFT, WIN_RIGHT)
    walk = group * n_tiles
    c0 = part * walk // parts  # bwd_tail.part_range
    total = (part + 1) * walk // parts
    k_row = b * seqlen_k + n0
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [k_row, hk * HEAD_DIM], kv_bar, k_smem)
    tma_load(v_desc, [k_row, hk * HEAD_DIM], kv_bar, v_smem)
    for t in gl.static_range(STAGES if PIPE else STAGES - 1):
        if c0 + t < total:
            _load_tile(c0 + t, c0, n_tiles, lo, b, hk, group, seqlen_q, num_heads, q_desc,
                       do_desc, lse_desc, delta_desc, ld_bar, q_smem, do_smem, lse_smem,
                       delta_smem, HEAD_DIM, BLOCK_M, STAGES)

    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=kv_layout)
    mbarrier.wait(kv_bar, 0)
    MASKED: gl.constexpr = CAUSAL or WIN_LEFT or WIN_RIGHT
    t_lo = (full_lo - lo) // BLOCK_M
    t_hi = (full_hi - lo) // BLOCK_M
    offs_smem = q_smem  # unread unless the step does not hoist
    if PIPE or NO_HOIST:  # the query offsets 0..BLOCK_M-1 in S^T's columns, for the step
        offs_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_M],
                                              gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        offs_smem.store(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout)))
        cta_barrier()
    if PIPE:
        st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
        dpt = st
        if total > c0:
            st, dpt = _scores(c0, c0, k_smem, v_smem, q_smem, do_smem, ld_bar, BLOCK_M,
                              BLOCK_N, STAGES, st_layout)
            st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
    for g in range(group):
        # query tiles [0, t_lo) masked, [t_lo, t_hi) not, the rest masked
        for bnd in gl.static_range(3):
            if MASKED or bnd == 1:
                start = 0
                end = n_tiles
                if MASKED:
                    if bnd == 0:
                        end = t_lo
                    elif bnd == 1:
                        start = t_lo
                        end = t_hi
                    else:
                        start = t_hi
                # this part's tiles of head g
                start = gl.maximum(start, c0 - g * n_tiles)
                end = gl.minimum(end, total - g * n_tiles)
                for i in range(start, end):
                    if PIPE:
                        st, dpt, dk, dv = _step_pipelined(
                            g * n_tiles + i, c0, total, n_tiles, lo, g, hk, group, b, n0,
                            num_heads, st, dpt, dk, dv, k_ring, v_ring, q_smem, do_smem,
                            lse_smem, delta_smem, ds_ring, dq_smem, offs_smem, ld_bar, q_desc,
                            do_desc, lse_desc, delta_desc, dq_desc, seqlen_q, q_off, left, right,
                            scale, scale2, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_BUFS,
                            MASKED and bnd != 1, CAUSAL, WIN_LEFT, WIN_RIGHT, st_layout,
                            op_layout, dq_layout)
                    else:
                        dk, dv = _step(g * n_tiles + i, c0, total, n_tiles, lo, g, hk, group, b,
                                   n0, num_heads, dk, dv, k_ring, v_ring, q_smem, do_smem,
                                   lse_smem, delta_smem, ds_ring, dq_smem, offs_smem, ld_bar,
                                   q_desc, do_desc, lse_desc, delta_desc, dq_desc, seqlen_q,
                                   q_off, left, right, scale, scale2, HEAD_DIM, BLOCK_M,
                                   BLOCK_N, STAGES, DQ_BUFS, MASKED and bnd != 1, CAUSAL,
                                   WIN_LEFT, WIN_RIGHT, st_layout, op_layout, dq_layout,
                                   PROBE, NO_HOIST)
    tma.store_wait(0)
    mbarrier.invalidate(kv_bar)
    for t in gl.static_range(STAGES):
        mbarrier.invalidate(ld_bar.index(t))

    local = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    dcol = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    # a part's fp32 sums go to its slot j (bwd_tail.combine adds the parts), a whole walk's
    # gradients to dK and dV: masked stores, since a branch here fails Triton 3.6's lowering
    # of the masked builds (an assertion in ConvertTritonGPUToLLVM)
    tile = gl.expand_dims(local, 1) * HEAD_DIM + gl.expand_dims(dcol, 0)
    in_part = (tile * 0 + parts) > 1
    slot = Slots + j.to(gl.int64) * (2 * BLOCK_N * HEAD_DIM)
    gl.store(slot + tile, dk * scale, mask=in_part)
    gl.store(slot + BLOCK_N * HEAD_DIM + tile, dv, mask=in_part)
    b64 = b.to(gl.int64)
    r64 = gl.expand_dims((n0 + local).to(gl.int64), 1)
    dk_ptrs = DK + b64 * sdkb + hk * sdkh + r64 * sdks + gl.expand_dims(dcol, 0)
    dv_ptrs = DV + b64 * sdvb + hk * sdvh + r64 * sdvs + gl.expand_dims(dcol, 0)
    gl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=~in_part)
    gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=~in_part)


def supports(args: DenseArgs) -> str | None:
    """None when this kernel computes the backward of the call, else why not."""
    if args.seqlen_q == 0:
        return "empty query sequence (no TMA view to build)"
    why = fwd_gluon.supports(args, {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N})
    if why is not None:
        return why
    if args.q.dtype != torch.bfloat16:  # the H200 tests ran bf16 only
        return f"dtype {args.q.dtype}: bf16 only until fp16 is checked on a GPU"
    return None


def _dq_desc(dqacc: torch.Tensor, head_dim: int) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, head_dim], gl.float32)
    rows, cols = dqacc.shape[0] * dqacc.shape[1], dqacc.shape[2] * dqacc.shape[3]
    return TensorDescriptor(dqacc, [rows, cols], [dqacc.stride(1), 1], [BLOCK_M, head_dim],
                            layout)


def _row_desc(t: torch.Tensor) -> TensorDescriptor:
    """1-D TMA view of an LSE-shaped (B, H, Sq) fp32 tensor: one block is BLOCK_M rows."""
    flat = t.reshape(-1)  # contiguous: LSE and delta are made here and by the forward
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    return TensorDescriptor(flat, [flat.numel()], [1], [BLOCK_M], layout)


#: Programs take their KV row's key tiles last first (True) or first first (False: under a
#: causal mask the first key tile sees every query, the last the fewest, so the longest
#: walks start first and the last wave is short ones). H100, 16k causal (2026-12-05,
#: docs/benchmarks/h100_20261205_s18): 5.742 ms first first against 6.057 last first; full
#: the same (11.20 both, whole walks).
KEY_DESC = False
#: SMs of the sm90 the launch stub compiles for off CUDA (an H100's or an H200's).
STUB_SMS = 132
#: The kernel's runtime arguments (descriptors, dK/dV, the parts' slots, strides, sizes, the
#: walk's split, scales, window) come first; its constexprs follow, in parameter order.
_RUNTIME_ARGS = 29
#: Launches by what Triton specializes on: its JIT dispatch runs on a key's first call only
#: (about 240 us of host time per call for the forward's launch, measured on the H200).
_LAUNCHES = LaunchTable("bwd_gluon.flash_bwd")


def flash_bwd(args: DenseArgs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
              delta: torch.Tensor, _probe: int = 0, _stages: int = STAGES,
              _dq_bufs: int = DQ_BUFS, _pipe: bool = PIPE, _no_hoist: bool = NO_HOIST,
              _tail_parts: int | None = None, _key_desc: bool | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the forward that produced ``out``/``lse``; ``delta`` is
    ``sum(out * dout, -1)`` in the LSE's layout. The caller checked :func:`supports`.
    ``_probe`` (timing studies only, wrong gradients): 1 skips dq's store and reduce-add,
    2 dq altogether; ``_stages`` / ``_dq_bufs`` try other ring depths, ``_pipe`` the other
    step, ``_no_hoist=False`` the step as it was before its spills were cured, ``_tail_parts``
    the last wave's split (None: :func:`.bwd_tail.tail_parts` unmasked, none masked),
    ``_key_desc`` the programs' order (None: ``KEY_DESC``) (benchmarks, tests)."""
    q, k, v = args.q, args.k, args.v
    d = args.head_dim
    if dout.stride() != q.stride():  # TMA reads dO with q's packed (B*S, H*D) view
        dout = dout.contiguous()
    lse = lse.contiguous()
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dqacc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    n_key_tiles = args.seqlen_k // BLOCK_N
    units = n_key_tiles * args.batch * args.num_kv_heads
    if units == 0:
        return dqacc.to(q.dtype), dk.zero_(), dv.zero_()
    parts, rest = _split(args, units, _tail_parts)
    full_units = units - rest
    grid = (full_units + rest * parts, )
    slots = bwd_tail.scratch(rest, parts, BLOCK_N, d, q.device) if rest else dk
    ints = (*args.bsh_strides(dk), *args.bsh_strides(dv), args.seqlen_q, args.seqlen_k,
            args.num_heads, args.num_kv_heads, args.group, n_key_tiles, full_units, parts,
            int(KEY_DESC if _key_desc is None else _key_desc))
    consts = {"HEAD_DIM": d, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "CAUSAL": args.causal,
              "BOTTOM_RIGHT": args.bottom_right, "WIN_LEFT": args.left >= 0,
              "WIN_RIGHT": args.right >= 0, "NUM_WARPS": NUM_WARPS, "STAGES": _stages,
              "DQ_BUFS": _dq_bufs, "PROBE": _probe, "PIPE": _pipe, "NO_HOIST": _no_hoist}
    options = {"num_warps": NUM_WARPS, "num_stages": 1}
    # everything Triton specializes on (dk and dv are fresh, so aligned; the descriptors'
    # strides are multiples of 16 by ``supports``)
    key = (grid, ints, args.left, args.right, q.dtype, tuple(consts.items()))
    launcher, tail = _LAUNCHES.get(key, _bwd_kernel, grid, _RUNTIME_ARGS, consts, options)
    launch_on(q.device.index, launcher, (
        fwd_gluon._desc(q, BLOCK_M, d), fwd_gluon._desc(k, BLOCK_N, d),
        fwd_gluon._desc(v, BLOCK_N, d), fwd_gluon._desc(dout, BLOCK_M, d), _dq_desc(dqacc, d),
        _row_desc(lse), _row_desc(delta), dk, dv, slots, *ints, float(args.scale),
        float(args.scale * _LOG2E), args.left, args.right, *tail))
    if rest:
        bwd_tail.combine(slots, dk, dv, full_units, n_key_tiles, parts, ints[-1])
    return dqacc.to(q.dtype), dk, dv


def _split(args: DenseArgs, units: int, parts: int | None) -> tuple[int, int]:
    """(parts, programs split): the last, partial wave of ``units`` programs in ``parts``
    parts each, by :func:`.bwd_tail.tail_parts` unless the caller names ``parts``."""
    dev = args.q.device  # off CUDA: the launch stub's sm90 (offline builds, tests), 132 SMs
    sms = sm_count(dev.index or 0) if dev.type == "cuda" else STUB_SMS
    walk = args.group * (args.seqlen_q // BLOCK_M)
    if parts is None:
        # masked walks differ in length, and the longest go first (KEY_DESC): the last wave
        # is short walks. H100, 16k causal: 5.759 ms in parts, 5.742 whole (s18)
        masked = args.causal or args.left >= 0 or args.right >= 0
        parts = 1 if masked else bwd_tail.tail_parts(units, sms, walk)
    if parts < 1:
        raise ValueError(f"_tail_parts={parts}: a key tile's walk splits into >= 1 parts")
    rest = units % sms if parts > 1 else 0
    return (parts if rest else 1), rest
