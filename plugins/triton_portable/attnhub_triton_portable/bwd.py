"""Backward attention kernels: delta preprocess, dk/dv, and dq.

* ``_delta_kernel``: ``delta_i = sum_d out_i * dout_i`` (fp32), in the LSE's layout.
* ``_dkdv_kernel``: one program owns a key tile of one KV head and loops over the query heads
  of its GQA group and the query tiles that can see it, so dk/dv need no atomics. Scores are
  recomputed transposed (keys x queries) so that P^T and dS^T feed the next dots from
  registers.
* ``_dq_kernel``: one program owns a query tile and walks the visible key tiles, like the
  forward. With ``dq_mode="atomic"`` dq is instead accumulated inside the dk/dv kernel with
  fp32 atomics (fewer recomputed dots, but the summation order varies run to run); the
  ``separate`` mode uses no atomic anywhere and gives bitwise-equal gradients run to run.

Fully masked rows carry LSE -inf; it is turned into +inf so their probabilities are exactly 0
and no NaN reaches a gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tiles
from attnhub.plugin import InputError

from .launch import DenseArgs, device_arch, flat_grid, launch_options

_DELTA_BLOCK = 64


@triton.jit
def _delta_kernel(O, DO, DELTA, sob, sos, soh, sdb, sds, sdh, slb, slh, CU_Q, seqlen_q_arg,
                  num_heads, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr, VARLEN: tl.constexpr):
    pid_m, bh = tiles.flat_program(seqlen_q_arg, BLOCK_M)
    b = bh // num_heads
    h = bh % num_heads
    q_start, seqlen_q = tiles.doc_bounds(b, CU_Q, seqlen_q_arg, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = tiles.load_rows(None, O + b64 * sob + q_start.to(tl.int64) * sos + h * soh, m0,
                        seqlen_q, sos, offs_r, offs_d, HEAD_DIM, False)
    do = tiles.load_rows(None, DO + b64 * sdb + q_start.to(tl.int64) * sds + h * sdh, m0,
                         seqlen_q, sds, offs_r, offs_d, HEAD_DIM, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    rows = m0 + offs_r
    tl.store(DELTA + b64 * slb + h * slh + q_start + rows, delta, mask=rows < seqlen_q)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, dq_desc, Qb, DOb, LSEb, DELTAb, DQb, sqs, sds,
                sdqs, lo, hi, offs_n,
                offs_r, offs_d, seqlen_q, seqlen_k, q_off, scale, softcap, slope, prefix,
                left, right, cs, ce, TMAX, TMIN, n0, n1,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, PREFIX_LM: tl.constexpr,
                WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                ALIBI: tl.constexpr, COLMASK: tl.constexpr, DQ_ATOMIC: tl.constexpr,
                USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Accumulate dk, dv of key tile ``[n0, n1)`` over query tiles ``[lo, hi)``."""
    j = (n0 + offs_n)[:, None]
    for m0 in tl.range(lo, hi, BLOCK_M):
        run = True
        if COLMASK:
            run = tiles.colmask_tile_kept(TMAX, TMIN, n0 // BLOCK_N, m0,
                                          tl.minimum(m0 + BLOCK_M, seqlen_q))
        if run:
            rows = m0 + offs_r
            q = tiles.load_rows(q_desc, Qb, m0, seqlen_q, sqs, offs_r, offs_d, HEAD_DIM, USE_TMA)
            lse = tl.load(LSEb + rows, mask=rows < seqlen_q, other=float("-inf"))
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * tiles.LOG2E)
            qk_t = tiles.mma(k, tl.trans(q), None, DOT_PREC, DOT_UPCAST)
            i = rows[None, :]
            s_t, dfac = tiles.scores(qk_t, i, j, q_off, scale, softcap, slope, SOFTCAP, ALIBI)
            if MASKED:
                ok = tiles.visible(i, j, seqlen_q, seqlen_k, q_off, prefix, left, right, cs, ce,
                                   CAUSAL, PREFIX_LM, WIN_LEFT, WIN_RIGHT, COLMASK)
                s_t = tl.where(ok, s_t, float("-inf"))
            p_t = tl.exp2(s_t - lse2[None, :])
            do = tiles.load_rows(do_desc, DOb, m0, seqlen_q, sds, offs_r, offs_d, HEAD_DIM,
                                 USE_TMA)
            dv = tiles.mma(tiles.narrow(p_t, do.dtype, DOT_UPCAST), do, dv, DOT_PREC, DOT_UPCAST)
            delta = tl.load(DELTAb + rows, mask=rows < seqlen_q, other=0.0)
            dp_t = tiles.mma(v, tl.trans(do), None, DOT_PREC, DOT_UPCAST)
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP:
                ds_t = ds_t * dfac
            dk = tiles.mma(tiles.narrow(ds_t, q.dtype, DOT_UPCAST), q, dk, DOT_PREC, DOT_UPCAST)
            if DQ_ATOMIC:
                ds_k = tiles.narrow(ds_t, k.dtype, DOT_UPCAST)
                dq = tiles.mma(tl.trans(ds_k), k, None, DOT_PREC, DOT_UPCAST) * scale
                if USE_TMA:  # one bulk reduce-add of the tile in L2 (FlashAttention-3's way)
                    dq_desc.atomic_add([m0, 0], dq)
                else:
                    ptrs = DQb + rows[:, None].to(tl.int64) * sdqs + offs_d[None, :]
                    tl.atomic_add(ptrs, dq,
                                  mask=(rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM))
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQACC,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, sdkb, sdks, sdkh,
    sdvb, sdvs, sdvh, sdqb, sdqs, sdqh, slb, slh,
    CU_Q, CU_K, seqlen_q_arg, seqlen_k_arg, num_kv_heads, group,
    scale, softcap, left, right, SLOPES, s_slope_b, PREFIX,
    CM_START, CM_END, scmb, scmh, cm_div, TMAX, TMIN, stmb, stmh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, PREFIX_LM: tl.constexpr, COLMASK: tl.constexpr,
    VARLEN: tl.constexpr, DQ_ATOMIC: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    pid_n, bh = tiles.flat_program(seqlen_k_arg, BLOCK_N)
    b = bh // num_kv_heads
    hk = bh % num_kv_heads
    q_start, seqlen_q, k_start, seqlen_k, q_off = tiles.sequence(
        b, CU_Q, CU_K, seqlen_q_arg, seqlen_k_arg, VARLEN, BOTTOM_RIGHT)
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:
        return
    n1 = tl.minimum(n0 + BLOCK_N, seqlen_k)
    b64 = b.to(tl.int64)
    qs64 = q_start.to(tl.int64)
    ks64 = k_start.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    Kb = K + b64 * skb + ks64 * sks + hk * skh
    Vb = V + b64 * svb + ks64 * svs + hk * svh
    k_desc = tiles.make_desc(Kb, seqlen_k, sks, BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA)
    v_desc = tiles.make_desc(Vb, seqlen_k, svs, BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA)
    k = tiles.load_rows(k_desc, Kb, n0, seqlen_k, sks, offs_n, offs_d, HEAD_DIM, USE_TMA)
    v = tiles.load_rows(v_desc, Vb, n0, seqlen_k, svs, offs_n, offs_d, HEAD_DIM, USE_TMA)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    j = n0 + offs_n
    for g in range(group):
        h = hk * group + g
        Qb = Q + b64 * sqb + qs64 * sqs + h * sqh
        DOb = DO + b64 * sdb + qs64 * sds + h * sdh
        q_desc = tiles.make_desc(Qb, seqlen_q, sqs, BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA)
        do_desc = tiles.make_desc(DOb, seqlen_q, sds, BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA)
        DQb = DQACC + b64 * sdqb + qs64 * sdqs + h * sdqh
        dq_desc = None
        if DQ_ATOMIC:
            dq_desc = tiles.make_desc(DQb, seqlen_q, sdqs, BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA)
        LSEb = LSE + b64 * slb + h * slh + q_start
        DELTAb = DELTA + b64 * slb + h * slh + q_start
        prefix, slope = tiles.head_scalars(PREFIX, SLOPES, s_slope_b, b, h, PREFIX_LM, ALIBI)
        cs = 0
        ce = 0
        TMAXh = TMAX
        TMINh = TMIN
        if COLMASK:
            CMS, CME, TMAXh, TMINh = tiles.colmask_head(CM_START, CM_END, TMAX, TMIN, b64, h,
                                                        cm_div, scmb, scmh, stmb, stmh)
            cs = tl.load(CMS + j, mask=j < seqlen_k, other=0)[:, None]
            ce = tl.load(CME + j, mask=j < seqlen_k, other=0)[:, None]
        lo, full_lo, full_hi, hi = tiles.query_range(n0, n1, seqlen_q, q_off, prefix, left,
                                                     right, BLOCK_M, CAUSAL, PREFIX_LM,
                                                     WIN_LEFT, WIN_RIGHT, COLMASK)
        for bnd in tl.static_range(3):  # masked, fully visible, masked query tiles
            start, end = tiles.band(bnd, lo, full_lo, full_hi, hi)
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, q_desc, do_desc, dq_desc, Qb, DOb, LSEb, DELTAb, DQb, sqs, sds,
                sdqs, start, end, offs_n, offs_r, offs_d, seqlen_q, seqlen_k, q_off, scale,
                softcap, slope, prefix, left, right, cs, ce, TMAXh, TMINh, n0, n1, HEAD_DIM,
                BLOCK_M, BLOCK_N, bnd != 1, CAUSAL, PREFIX_LM, WIN_LEFT, WIN_RIGHT, SOFTCAP,
                ALIBI, COLMASK, DQ_ATOMIC, USE_TMA, DOT_PREC, DOT_UPCAST)
    DKb = DK + b64 * sdkb + ks64 * sdks + hk * sdkh
    DVb = DV + b64 * sdvb + ks64 * sdvs + hk * sdvh
    dk_desc = tiles.make_desc(DKb, seqlen_k, sdks, BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA)
    dv_desc = tiles.make_desc(DVb, seqlen_k, sdvs, BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA)
    tiles.store_rows(dk_desc, DKb, tiles.narrow(dk * scale, DK.dtype.element_ty, DOT_UPCAST),
                     n0, seqlen_k, sdks,
                     offs_n, offs_d, HEAD_DIM, USE_TMA)
    tiles.store_rows(dv_desc, DVb, tiles.narrow(dv, DV.dtype.element_ty, DOT_UPCAST), n0,
                     seqlen_k, sdvs, offs_n,
                     offs_d, HEAD_DIM, USE_TMA)


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_desc, v_desc, Kb, Vb, sks, svs, lo, hi, offs_m, offs_n, offs_d,
              seqlen_q, seqlen_k, q_off, scale, softcap, slope, prefix, left, right, CMS, CME,
              TMAX, TMIN, m0, m1,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, PREFIX_LM: tl.constexpr, WIN_LEFT: tl.constexpr,
              WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
              COLMASK: tl.constexpr, USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr,
              DOT_UPCAST: tl.constexpr):
    """Accumulate dq of query rows ``[m0, m1)`` over key tiles ``[lo, hi)``."""
    i = offs_m[:, None]
    for n0 in tl.range(lo, hi, BLOCK_N):
        run = True
        if COLMASK:
            run = tiles.colmask_tile_kept(TMAX, TMIN, n0 // BLOCK_N, m0, m1)
        if run:
            k = tiles.load_rows(k_desc, Kb, n0, seqlen_k, sks, offs_n, offs_d, HEAD_DIM, USE_TMA)
            v = tiles.load_rows(v_desc, Vb, n0, seqlen_k, svs, offs_n, offs_d, HEAD_DIM, USE_TMA)
            qk = tiles.mma(q, tl.trans(k), None, DOT_PREC, DOT_UPCAST)
            j = (n0 + offs_n)[None, :]
            s, dfac = tiles.scores(qk, i, j, q_off, scale, softcap, slope, SOFTCAP, ALIBI)
            if MASKED:
                cs = 0
                ce = 0
                if COLMASK:
                    cs = tl.load(CMS + j, mask=j < seqlen_k, other=0)
                    ce = tl.load(CME + j, mask=j < seqlen_k, other=0)
                ok = tiles.visible(i, j, seqlen_q, seqlen_k, q_off, prefix, left, right, cs, ce,
                                   CAUSAL, PREFIX_LM, WIN_LEFT, WIN_RIGHT, COLMASK)
                s = tl.where(ok, s, float("-inf"))
            p = tl.exp2(s - lse2[:, None])
            dp = tiles.mma(do, tl.trans(v), None, DOT_PREC, DOT_UPCAST)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:
                ds = ds * dfac
            dq = tiles.mma(tiles.narrow(ds, k.dtype, DOT_UPCAST), k, dq, DOT_PREC, DOT_UPCAST)
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, sdqb, sdqs, sdqh, slb, slh,
    CU_Q, CU_K, seqlen_q_arg, seqlen_k_arg, num_heads, group,
    scale, softcap, left, right, SLOPES, s_slope_b, PREFIX,
    CM_START, CM_END, scmb, scmh, cm_div, TMAX, TMIN, stmb, stmh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, PREFIX_LM: tl.constexpr, COLMASK: tl.constexpr,
    VARLEN: tl.constexpr, USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    b, h, hk, q_start, seqlen_q, k_start, seqlen_k, q_off, m0 = tiles.query_program(
        CU_Q, CU_K, seqlen_q_arg, seqlen_k_arg, num_heads, group, BLOCK_M, VARLEN, BOTTOM_RIGHT)
    if m0 >= seqlen_q:
        return
    m1 = tl.minimum(m0 + BLOCK_M, seqlen_q)
    b64 = b.to(tl.int64)
    qs64 = q_start.to(tl.int64)
    ks64 = k_start.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_r
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    Qb = Q + b64 * sqb + qs64 * sqs + h * sqh
    DOb = DO + b64 * sdb + qs64 * sds + h * sdh
    q_desc = tiles.make_desc(Qb, seqlen_q, sqs, BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA)
    do_desc = tiles.make_desc(DOb, seqlen_q, sds, BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA)
    q = tiles.load_rows(q_desc, Qb, m0, seqlen_q, sqs, offs_r, offs_d, HEAD_DIM, USE_TMA)
    do = tiles.load_rows(do_desc, DOb, m0, seqlen_q, sds, offs_r, offs_d, HEAD_DIM, USE_TMA)
    lse = tl.load(LSE + b64 * slb + h * slh + q_start + offs_m, mask=offs_m < seqlen_q,
                  other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * tiles.LOG2E)
    delta = tl.load(DELTA + b64 * slb + h * slh + q_start + offs_m, mask=offs_m < seqlen_q,
                    other=0.0)
    Kb = K + b64 * skb + ks64 * sks + hk * skh
    Vb = V + b64 * svb + ks64 * svs + hk * svh
    k_desc = tiles.make_desc(Kb, seqlen_k, sks, BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA)
    v_desc = tiles.make_desc(Vb, seqlen_k, svs, BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA)
    prefix, slope, CMS, CME, TMAX, TMIN, lo, full_lo, full_hi, hi = tiles.key_plan(
        PREFIX, SLOPES, s_slope_b, CM_START, CM_END, TMAX, TMIN, b, b64, h, cm_div, scmb, scmh,
        stmb, stmh, m0, m1, seqlen_k, q_off, left, right, BLOCK_N, CAUSAL, PREFIX_LM, WIN_LEFT,
        WIN_RIGHT, ALIBI, COLMASK)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for bnd in tl.static_range(3):  # masked, fully visible, masked key tiles
        start, end = tiles.band(bnd, lo, full_lo, full_hi, hi)
        dq = _dq_tiles(dq, q, do, lse2, delta, k_desc, v_desc, Kb, Vb, sks, svs, start, end,
                       offs_m, offs_n, offs_d, seqlen_q, seqlen_k, q_off, scale, softcap, slope,
                       prefix, left, right, CMS, CME, TMAX, TMIN, m0, m1, HEAD_DIM, BLOCK_N,
                       bnd != 1, CAUSAL, PREFIX_LM, WIN_LEFT, WIN_RIGHT, SOFTCAP, ALIBI, COLMASK,
                       USE_TMA, DOT_PREC, DOT_UPCAST)
    DQb = DQ + b64 * sdqb + qs64 * sdqs + h * sdqh
    dq_desc = tiles.make_desc(DQb, seqlen_q, sdqs, BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA)
    tiles.store_rows(dq_desc, DQb, tiles.narrow(dq * scale, DQ.dtype.element_ty, DOT_UPCAST),
                     m0, seqlen_q, sdqs,
                     offs_r, offs_d, HEAD_DIM, USE_TMA)


def gluon_bwd_unsupported(args: DenseArgs) -> str | None:
    """Why the Hopper Gluon backward (:mod:`.bwd_gluon`) cannot run this call, or None."""
    arch = device_arch(args.q.device)
    if not arch.startswith("sm9"):
        return f"the Gluon backward is written for sm90 (Hopper) wgmma, not {arch}"
    try:
        from . import bwd_gluon
    except ImportError as exc:  # an older Triton without triton.experimental.gluon
        return f"triton.experimental.gluon is not importable ({exc})"
    return bwd_gluon.supports(args)


def flash_bwd(args: DenseArgs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
              config: dict, dlse: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of the forward that produced ``out``/``lse`` from ``args``;
    ``dlse``: the gradient reaching the LSE too (None: none).

    ``config`` is ``{"dkdv": cfg, "dq": cfg, "dq_mode": "separate"|"atomic"}`` (see
    :func:`.configs.bwd_config`); with ``"GLUON": True`` the Hopper kernel of
    :mod:`.bwd_gluon` computes all three (dq by TMA reduce-add: "atomic").
    """
    q, k, v = args.q, args.k, args.v
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    if q.numel() == 0 or k.numel() == 0 or args.batch == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = torch.empty_like(lse)
    heads = args.batch * args.num_heads
    _delta_kernel[flat_grid(args.max_seqlen_q, _DELTA_BLOCK, heads)](
        out, dout, delta, *args.bsh_strides(out), *args.bsh_strides(dout),
        *args.lse_strides(lse), args.cu_q, args.max_seqlen_q, args.num_heads,
        HEAD_DIM=args.head_dim, BLOCK_M=_DELTA_BLOCK, BLOCK_D=args.block_d, VARLEN=args.varlen)
    if dlse is not None:  # d lse_i / d s_ij = P_ij: dS = P (dP - (delta - dlse))
        delta.sub_(dlse)
    if config.get("GLUON"):
        why = gluon_bwd_unsupported(args)
        if why is not None:
            raise InputError(f"backward config asks GLUON=True, but {why}; drop GLUON from "
                             "the config (the portable kernels take every call)")
        from . import bwd_gluon

        return bwd_gluon.flash_bwd(args, out, lse, dout, delta)

    # the portable kernels' gradients (the Gluon one makes its own)
    zeros = args.varlen  # rows outside cu_seqlens are never written: give them 0
    dq = torch.zeros_like(q) if zeros else torch.empty_like(q)
    dk = torch.zeros_like(k) if zeros else torch.empty_like(k)
    dv = torch.zeros_like(v) if zeros else torch.empty_like(v)
    atomic = config.get("dq_mode", "separate") == "atomic"
    dqacc = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic else dq
    common = (args.cu_q, args.cu_k, args.max_seqlen_q, args.max_seqlen_k)
    masks = args.mask_scalars()
    consts, options = launch_options(config["dkdv"])
    bm, bn = consts["BLOCK_M"], consts["BLOCK_N"]
    _dkdv_kernel[flat_grid(args.max_seqlen_k, bn, args.batch * args.num_kv_heads)](
        q, k, v, dout, lse, delta, dk, dv, dqacc,
        *args.bsh_strides(q), *args.bsh_strides(k), *args.bsh_strides(v),
        *args.bsh_strides(dout), *args.bsh_strides(dk), *args.bsh_strides(dv),
        *args.bsh_strides(dqacc), *args.lse_strides(lse),
        *common, args.num_kv_heads, args.group, *masks, *args.colmask_tiles(bn),
        HEAD_DIM=args.head_dim, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=args.block_d,
        DQ_ATOMIC=atomic, USE_TMA=args.tma_ok(consts, dout, dk, dv),
        **args.mask_constants(), **options)
    if atomic:
        return dqacc.to(q.dtype), dk, dv
    consts, options = launch_options(config["dq"])
    bm, bn = consts["BLOCK_M"], consts["BLOCK_N"]
    _dq_kernel[flat_grid(args.max_seqlen_q, bm, heads)](
        q, k, v, dout, lse, delta, dq,
        *args.bsh_strides(q), *args.bsh_strides(k), *args.bsh_strides(v),
        *args.bsh_strides(dout), *args.bsh_strides(dq), *args.lse_strides(lse),
        *common, args.num_heads, args.group, *masks, *args.colmask_tiles(bn),
        HEAD_DIM=args.head_dim, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=args.block_d,
        USE_TMA=args.tma_ok(consts, dout, dq), **args.mask_constants(), **options)
    return dq, dk, dv
