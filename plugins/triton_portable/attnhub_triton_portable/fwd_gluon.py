"""Hopper (sm90) forward attention written in Gluon, Triton's explicit-layout dialect.

Why a second forward: Triton 3.6 compiles the portable kernel (:mod:`.fwd`) so that every
``QK^T`` wgmma is waited for before the softmax runs, so tensor cores and exponentials take
turns. Gluon exposes async wgmma, its wait and TMA with mbarriers, so this kernel schedules
part of what FlashAttention-3 calls intra-warpgroup overlap by hand: ``PV`` of key tile
``i-1`` runs on the tensor cores under the softmax of tile ``i`` (the SASS interleaves the
two). K and V tiles arrive by TMA, two buffers each, loaded two (K) and one (V) tiles ahead.
Measured beside the portable kernel in docs/benchmarks/triton_dense.md; the autotuner takes
whichever is faster per shape bucket.

Scope (anything else stays on :mod:`.fwd`; :func:`supports` says why not): bshd layout,
bf16/fp16, head dim 64 or 128 (the padded head dim equals the real one), heads packed
(``stride(h) == D``), Sq a multiple of BLOCK_M and Sk of BLOCK_N (so no tile crosses a
sequence of the flattened ``(B*S, H*D)`` TMA view), causal with either alignment and
sliding windows; GQA; no softcap, ALiBi, prefix-LM, column-sparse mask or varlen.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .fastlaunch import LaunchTable, launch_on
from .gluon_compat import tma_load
from .launch import DenseArgs

_LOG2E = 1.4426950408889634
#: The runtime parameters both Hopper forwards take before their constexprs: the three
#: descriptors, O, LSE, five strides, two lengths, heads, group, scale, window bounds.
_RUNTIME_ARGS = 17


@gluon.jit
def _key_plan(m0, seqlen_q, seqlen_k, q_off, left, right, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WIN_LEFT: gl.constexpr,
              WIN_RIGHT: gl.constexpr):
    """(lo, number of key tiles, full_lo, full_hi) for query rows [m0, m0 + BLOCK_M): the
    semantics of ``tiles.key_range`` (tiles in [full_lo, full_hi) need no mask)."""
    p0 = m0 + q_off
    p1 = m0 + BLOCK_M - 1 + q_off
    lo = p0 * 0
    hi = seqlen_k + p0 * 0
    full_lo = lo
    full_hi = hi
    if CAUSAL:
        hi = gl.minimum(hi, p1 + 1)
        full_hi = gl.minimum(full_hi, p0 + 1)
    if WIN_RIGHT:
        hi = gl.minimum(hi, p1 + right + 1)
        full_hi = gl.minimum(full_hi, p0 + right + 1)
    if WIN_LEFT:
        lo = gl.maximum(lo, p0 - left)
        full_lo = gl.maximum(full_lo, p1 - left)
    lo = (gl.maximum(lo, 0) // BLOCK_N) * BLOCK_N
    hi = gl.maximum(hi, lo)
    full_lo = ((gl.maximum(full_lo, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_lo = gl.minimum(gl.maximum(full_lo, lo), hi)
    full_hi = (gl.maximum(full_hi, 0) // BLOCK_N) * BLOCK_N
    full_hi = gl.maximum(gl.minimum(full_hi, hi), full_lo)
    n_tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N
    return lo, n_tiles, full_lo, full_hi


@gluon.jit
def band_mask(ok, p, jj, left, right, CAUSAL: gl.constexpr, WIN_LEFT: gl.constexpr,
              WIN_RIGHT: gl.constexpr):
    """``ok`` narrowed to the keys ``jj`` that query position ``p`` (row + q_off) sees:
    causal, then the window's left and right edges (the backward masks with it too)."""
    if CAUSAL:
        ok = ok & (jj <= p)
    if WIN_LEFT:
        ok = ok & (jj >= p - left)
    if WIN_RIGHT:
        ok = ok & (jj <= p + right)
    return ok


@gluon.jit
def _softmax(n0, s, m_i, l_i, offs_m, seqlen_q, seqlen_k, q_off, left, right, scale2,
             BLOCK_N: gl.constexpr, MASK_TILE: gl.constexpr, CAUSAL: gl.constexpr,
             WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr, s_layout: gl.constexpr):
    """Online-softmax update with the scores ``s`` of the key tile at ``n0``: (P in fp32,
    alpha to rescale the output with, new row max, new row sum). No branch inside: ptxas
    drains in-flight wgmmas at control-flow joins, which would serialise PV and softmax."""
    if MASK_TILE:
        j = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ii = gl.expand_dims(offs_m, 1)
        jj = gl.expand_dims(j, 0)
        ok = band_mask((ii < seqlen_q) & (jj < seqlen_k), ii + q_off, jj, left, right,
                       CAUSAL, WIN_LEFT, WIN_RIGHT)
        s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale2)
    m_use = m_new
    if MASK_TILE:  # a row with no visible key so far keeps max -inf: subtract 0, not -inf
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * scale2 - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _first_softmax(lo, s, m_i, l_i, offs_m, seqlen_q, seqlen_k, q_off, left, right, scale2,
                   full_lo, full_hi, BLOCK_N: gl.constexpr, MASKED: gl.constexpr,
                   CAUSAL: gl.constexpr, WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr,
                   s_layout: gl.constexpr):
    """``_softmax`` of the first key tile, masked only if it lies outside the unmasked band
    (nothing is in flight then, so the branch costs no overlap)."""
    if MASKED:
        if (lo < full_lo) | (lo >= full_hi):
            p, alpha, m_i, l_i = _softmax(lo, s, m_i, l_i, offs_m, seqlen_q, seqlen_k, q_off,
                                          left, right, scale2, BLOCK_N, True, CAUSAL,
                                          WIN_LEFT, WIN_RIGHT, s_layout)
        else:
            p, alpha, m_i, l_i = _softmax(lo, s, m_i, l_i, offs_m, seqlen_q, seqlen_k, q_off,
                                          left, right, scale2, BLOCK_N, False, CAUSAL,
                                          WIN_LEFT, WIN_RIGHT, s_layout)
    else:
        p, alpha, m_i, l_i = _softmax(lo, s, m_i, l_i, offs_m, seqlen_q, seqlen_k, q_off,
                                      left, right, scale2, BLOCK_N, False, CAUSAL, WIN_LEFT,
                                      WIN_RIGHT, s_layout)
    return p, alpha, m_i, l_i


@gluon.jit
def _program_tile(num_heads, group, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr,
                  BOTTOM_RIGHT: gl.constexpr):
    """This program's (batch, head, KV head, first query row, query offset): query tiles
    run in reverse order, so the longest causal rows start first."""
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    hk = h // group
    m0 = pid_m * BLOCK_M
    q_off = seqlen_k * 0
    if BOTTOM_RIGHT:
        q_off = seqlen_k - seqlen_q
    return b, h, hk, m0, q_off


@gluon.jit
def _epilogue(acc, m_i, l_i, m0, offs_m, b, h, O, LSE, sob, sos, soh, slb, slh, seqlen_q,
              ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, row_o: gl.constexpr,
              o_layout: gl.constexpr):
    """Rows [m0, m0 + ROWS) of the output (acc / l) and their natural-log LSE, stored.
    Fully masked rows end with l == 0: output 0 and LSE -inf, never 0/0, nor their zero
    weights times a NaN value of a key they load but cannot see (as :mod:`.fwd`)."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    l_o = gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    out = gl.where(l_o == 0.0, 0.0, acc / gl.where(l_o == 0.0, 1.0, l_o))
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    rows_o = m0 + gl.arange(0, ROWS, layout=row_o)
    cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    b64 = b.to(gl.int64)
    ob = O + b64 * sob + h * soh
    ptrs = ob + gl.expand_dims(rows_o.to(gl.int64) * sos, 1) + gl.expand_dims(cols_o, 0)
    gl.store(ptrs, out.to(O.dtype.element_ty), mask=gl.expand_dims(rows_o < seqlen_q, 1))
    gl.store(LSE + b64 * slb + h * slh + offs_m, lse, mask=offs_m < seqlen_q)


@gluon.jit
def _band(bnd: gl.constexpr, n_tiles, t_lo, t_hi, MASKED: gl.constexpr):
    """Key tiles [start, end) of band ``bnd`` after the first tile: [1, t_lo) masked,
    [t_lo, t_hi) not, [t_hi, n_tiles) masked; without a mask, band 1 takes them all."""
    if not MASKED:
        start = 1
        end = n_tiles
    elif bnd == 0:
        start = 1
        end = t_lo
    elif bnd == 1:
        start = t_lo
        end = t_hi
    else:
        start = t_hi
        end = n_tiles
    return start, end


@gluon.jit
def _stage_p(p, p_smem, dtype: gl.constexpr, p_layout: gl.constexpr, P_SMEM: gl.constexpr):
    """The PV wgmma's A operand: P written to shared memory (P_SMEM), or P in registers
    (one conversion, no shared-memory round trip). Called after the previous PV finished."""
    if P_SMEM:
        p_smem.store(p.to(dtype))
        fence_async_shared()
        p_op = p_smem
    else:
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    return p_op


@gluon.jit
def _load_tile(desc, row, col, bar, buf):
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma_load(desc, [row, col], bar, buf)


@gluon.jit
def _tile_step(i, n_tiles, lo, acc, p_op, alpha, m_i, l_i, zero_s, q_smem, k_smem, v_smem,
               p_smem, k_bar, v_bar, k_desc, v_desc, k_row0, k_col, offs_m, seqlen_q,
               seqlen_k, q_off, left, right, scale2, BLOCK_N: gl.constexpr,
               MASK_TILE: gl.constexpr, CAUSAL: gl.constexpr, WIN_LEFT: gl.constexpr,
               WIN_RIGHT: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
               row_o: gl.constexpr, P_SMEM: gl.constexpr):
    """Key tile ``i`` >= 1: QK^T of tile i, then PV of tile i-1 in flight under the softmax
    of tile i, waited for before the step ends (no wgmma in flight across the loop's back
    edge or a branch). FlashAttention-3 also keeps QK^T of tile i in flight under the output
    rescale; with two wgmma groups in flight, ptxas (Triton 3.6's) drains both before the
    softmax, so that order measured no overlap at all."""
    kb = i % 2
    vb = (i - 1) % 2
    mbarrier.wait(k_bar.index(kb), (i // 2) & 1)
    s = warpgroup_mma(q_smem, k_smem.index(kb).permute((1, 0)), zero_s, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    mbarrier.wait(v_bar.index(vb), ((i - 1) // 2) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(vb), acc, is_async=True)
    p, alpha, m_i, l_i = _softmax(lo + i * BLOCK_N, s, m_i, l_i, offs_m, seqlen_q, seqlen_k,
                                  q_off, left, right, scale2, BLOCK_N, MASK_TILE, CAUSAL,
                                  WIN_LEFT, WIN_RIGHT, s_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    p_op = _stage_p(p, p_smem, q_smem.dtype, p_layout, P_SMEM)
    # Both buffers of this step are free now: K of tile i takes tile i + 2, V of i - 1 tile i + 1.
    if i + 2 < n_tiles:
        _load_tile(k_desc, k_row0 + lo + (i + 2) * BLOCK_N, k_col, k_bar.index(kb),
                   k_smem.index(kb))
    if i + 1 < n_tiles:
        _load_tile(v_desc, k_row0 + lo + (i + 1) * BLOCK_N, k_col, v_bar.index(vb),
                   v_smem.index(vb))
    return acc, p_op, alpha, m_i, l_i


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, O, LSE, sob, sos, soh, slb, slh,
                seqlen_q, seqlen_k, num_heads, group, scale2, left, right,
                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, WIN_LEFT: gl.constexpr,
                WIN_RIGHT: gl.constexpr, NUM_WARPS: gl.constexpr,
                P_SMEM: gl.constexpr):
    b, h, hk, m0, q_off = _program_tile(num_heads, group, seqlen_q, seqlen_k, BLOCK_M,
                                        BOTTOM_RIGHT)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
    p_smem = q_smem  # placeholder when P stays in registers (never written then)
    if P_SMEM:
        p_smem = gl.allocate_shared_memory(
            dtype, [BLOCK_M, BLOCK_N],
            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for t in gl.static_range(2):
        mbarrier.init(k_bar.index(t), count=1)
        mbarrier.init(v_bar.index(t), count=1)

    lo, n_tiles, full_lo, full_hi = _key_plan(m0, seqlen_q, seqlen_k, q_off, left, right,
                                              BLOCK_M, BLOCK_N, CAUSAL, WIN_LEFT, WIN_RIGHT)
    q_row0 = b * seqlen_q + m0
    k_row0 = b * seqlen_k
    k_col = hk * HEAD_DIM
    _load_tile(q_desc, q_row0, h * HEAD_DIM, q_bar, q_smem)
    if n_tiles > 0:
        _load_tile(k_desc, k_row0 + lo, k_col, k_bar.index(0), k_smem.index(0))
        _load_tile(v_desc, k_row0 + lo, k_col, v_bar.index(0), v_smem.index(0))
    if n_tiles > 1:
        _load_tile(k_desc, k_row0 + lo + BLOCK_N, k_col, k_bar.index(1), k_smem.index(1))
        _load_tile(v_desc, k_row0 + lo + BLOCK_N, k_col, v_bar.index(1), v_smem.index(1))

    offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    if n_tiles > 0:
        MASKED: gl.constexpr = CAUSAL or WIN_LEFT or WIN_RIGHT
        # tiles [1, t_lo) and [t_hi, n_tiles) need the mask, [t_lo, t_hi) do not
        t_lo = gl.maximum((full_lo - lo) // BLOCK_N, 1)
        t_hi = gl.maximum((full_hi - lo) // BLOCK_N, t_lo)
        mbarrier.wait(k_bar.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        if n_tiles > 2:
            _load_tile(k_desc, k_row0 + lo + 2 * BLOCK_N, k_col, k_bar.index(0),
                       k_smem.index(0))
        p, alpha, m_i, l_i = _first_softmax(lo, s, m_i, l_i, offs_m, seqlen_q, seqlen_k,
                                            q_off, left, right, scale2, full_lo, full_hi,
                                            BLOCK_N, MASKED, CAUSAL, WIN_LEFT, WIN_RIGHT,
                                            s_layout)
        p_op = _stage_p(p, p_smem, dtype, p_layout, P_SMEM)
        for bnd in gl.static_range(3):  # tiles [1, t_lo) masked, [t_lo, t_hi) not, then masked
            if MASKED or bnd == 1:
                start, end = _band(bnd, n_tiles, t_lo, t_hi, MASKED)
                for i in range(start, end):
                    acc, p_op, alpha, m_i, l_i = _tile_step(
                        i, n_tiles, lo, acc, p_op, alpha, m_i, l_i, zero_s, q_smem, k_smem,
                        v_smem, p_smem, k_bar, v_bar, k_desc, v_desc, k_row0, k_col, offs_m,
                        seqlen_q, seqlen_k, q_off, left, right, scale2, BLOCK_N,
                        MASKED and bnd != 1, CAUSAL, WIN_LEFT, WIN_RIGHT, s_layout, p_layout,
                        row_o, P_SMEM)
        last = n_tiles - 1
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        mbarrier.wait(v_bar.index(last % 2), (last // 2) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(last % 2), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.invalidate(q_bar)
    for t in gl.static_range(2):
        mbarrier.invalidate(k_bar.index(t))
        mbarrier.invalidate(v_bar.index(t))

    _epilogue(acc, m_i, l_i, m0, offs_m, b, h, O, LSE, sob, sos, soh, slb, slh, seqlen_q,
              BLOCK_M, HEAD_DIM, row_o, o_layout)


_SCOPE_DTYPES = (torch.bfloat16, torch.float16)


def supports(args: DenseArgs, config: dict[str, Any]) -> str | None:
    """None when this kernel computes the call, else why not (the portable kernel runs)."""
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    if args.varlen:
        return "varlen (thd) layout"
    if args.q.dtype not in _SCOPE_DTYPES:
        return f"dtype {args.q.dtype}"
    if args.head_dim not in (64, 128):
        return f"head dim {args.head_dim} (64 or 128 only)"
    if args.softcap > 0 or args.slopes is not None or args.prefix is not None or args.colmask:
        return "softcap/ALiBi/prefix-LM/column-sparse masks"
    if args.seqlen_k == 0:
        return "empty key sequence (no TMA view to build)"
    if args.seqlen_q % bm or args.seqlen_k % bn:
        return f"Sq={args.seqlen_q} not a multiple of {bm} or Sk={args.seqlen_k} of {bn}"
    for t in (args.q, args.k, args.v):
        sb, ss, sh, _ = t.stride()
        if sh != args.head_dim or sb != t.shape[1] * ss:
            return "q/k/v heads not packed (need stride(h) == D, stride(b) == S * stride(s))"
        if t.data_ptr() % 16 or (ss * t.element_size()) % 16:
            return "q/k/v not 16-byte aligned for TMA"
    return None


@functools.cache
def _smem_layout(block_rows: int, head_dim: int, bf16: bool) -> Any:
    """The swizzled shared-memory layout of one tile (cached: building it costs ~18 us)."""
    return gl.NVMMASharedLayout.get_default_for([block_rows, head_dim],
                                                gl.bfloat16 if bf16 else gl.float16)


def _desc(t: torch.Tensor, block_rows: int, head_dim: int) -> TensorDescriptor:
    """TMA view of a (B, S, H, D) tensor as (B*S, H*D): one block is one head's rows."""
    layout = _smem_layout(block_rows, head_dim, t.dtype == torch.bfloat16)
    rows, cols = t.shape[0] * t.shape[1], t.shape[2] * t.shape[3]
    return TensorDescriptor(t, [rows, cols], [t.stride(1), 1], [block_rows, head_dim], layout)


#: Launch options among a config's ``meta`` (the rest are the kernel's constexprs).
_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")
#: (kernel, grid, integer arguments, tile geometry, dtype, constexprs, options) -> the launch
_LAUNCHES = LaunchTable("fwd_gluon.launch")


def launch(kernel: Any, args: DenseArgs, block_m: int, q_rows: int, block_n: int,
           **meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a Gluon forward ``kernel`` over query tiles of ``block_m`` rows, q
    loaded ``q_rows`` at a time: the arguments both Hopper forwards take, then ``meta``.

    Launched through ``fastlaunch.Launcher`` under a key that fixes everything Triton
    specializes on (every integer argument, the descriptors' block shapes and dtype, the
    constexprs and options; ``out`` and ``lse`` are fresh allocations, so aligned): Triton's
    JIT dispatch, the bulk of the ~240 us of host time per call measured on the H200 for a
    16k prefill, runs on the first call of a key only. The descriptors are built per call
    (their base and shape are runtime arguments)."""
    out = torch.empty_like(args.q)
    lse = args.new_lse()
    grid = (triton.cdiv(args.seqlen_q, block_m), args.batch * args.num_heads)
    if grid[0] == 0 or grid[1] == 0:
        return out, lse
    d = args.head_dim
    ints = (*args.bsh_strides(out), *args.lse_strides(lse), args.seqlen_q, args.seqlen_k,
            args.num_heads, args.group)
    consts = {"HEAD_DIM": d, "BLOCK_N": block_n, "CAUSAL": args.causal,
              "BOTTOM_RIGHT": args.bottom_right, "WIN_LEFT": args.left >= 0,
              "WIN_RIGHT": args.right >= 0}
    options = {}
    for name, value in meta.items():
        (options if name in _OPTIONS else consts)[name] = value
    key = (kernel, grid, ints, args.left, args.right, q_rows, block_n, args.q.dtype,
           tuple(consts.items()), tuple(options.items()))
    launcher, tail = _LAUNCHES.get(key, kernel, grid, _RUNTIME_ARGS, consts, options)
    launch_on(args.q.device.index, launcher, (
        _desc(args.q, q_rows, d), _desc(args.k, block_n, d), _desc(args.v, block_n, d), out,
        lse, *ints, args.scale * _LOG2E, args.left, args.right, *tail))
    return out, lse


def flash_fwd(args: DenseArgs, config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` like :func:`.fwd.flash_fwd`; the caller checked :func:`supports`."""
    bm, warps = config["BLOCK_M"], config["num_warps"]
    return launch(_fwd_kernel, args, bm, bm, config["BLOCK_N"], BLOCK_M=bm, NUM_WARPS=warps,
                  P_SMEM=bool(config.get("P_SMEM", True)), num_warps=warps, num_stages=1)
