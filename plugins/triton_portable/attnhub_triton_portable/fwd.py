"""Forward attention kernel with LSE (online softmax over key tiles), bshd and varlen thd.

One program owns ``BLOCK_M`` query rows of one (sequence, query head) and walks the key
tiles that can be visible to them in three loops: masked tiles before the fully visible
band, the band itself without any mask arithmetic, and masked tiles after it (for causal
that is: unmasked blocks, then the diagonal). Tiles outside the band are never loaded, and
column-sparse tiles that mask every row of the block are skipped whole. GQA reads the KV head
``h // group`` in place. On sm90 the tiles move through TMA descriptors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnhub.plugin import InputError

from . import tiles
from .launch import MAX_GRID_Y, DenseArgs, device_arch, flat_grid, launch_options


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, Kb, Vb, stride_ks, stride_vs, lo, hi,
               offs_m, offs_n, offs_d, seqlen_q, seqlen_k, q_off, scale, softcap, slope,
               prefix, left, right, CMS, CME, TMAX, TMIN, m0, m1,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, PREFIX_LM: tl.constexpr, WIN_LEFT: tl.constexpr,
               WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
               COLMASK: tl.constexpr, USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr,
               DOT_UPCAST: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Online-softmax update over key tiles ``[lo, hi)``; MASKED applies visibility."""
    for n0 in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        run = True
        if COLMASK:
            run = tiles.colmask_tile_kept(TMAX, TMIN, n0 // BLOCK_N, m0, m1)
        if run:
            k = tiles.load_rows(k_desc, Kb, n0, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM,
                                USE_TMA)
            qk = tiles.mma(q, tl.trans(k), None, DOT_PREC, DOT_UPCAST)
            if MASKED or SOFTCAP or ALIBI:
                s, _ = tiles.scores(qk, offs_m[:, None], (n0 + offs_n)[None, :], q_off, scale,
                                    softcap, slope, SOFTCAP, ALIBI)
                m_use = m_i
                if MASKED:
                    j = n0 + offs_n
                    cs = 0
                    ce = 0
                    if COLMASK:
                        cs = tl.load(CMS + j, mask=j < seqlen_k, other=0)[None, :]
                        ce = tl.load(CME + j, mask=j < seqlen_k, other=0)[None, :]
                    ok = tiles.visible(offs_m[:, None], j[None, :], seqlen_q, seqlen_k, q_off,
                                       prefix, left, right, cs, ce, CAUSAL, PREFIX_LM,
                                       WIN_LEFT, WIN_RIGHT, COLMASK)
                    s = tl.where(ok, s, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                else:
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    m_use = m_new
                p = tl.exp2(s - m_use[:, None])
            else:
                # The hot path: max on raw scores (scale > 0), then one FMA per score.
                scale2 = scale * tiles.LOG2E
                m_new = tl.maximum(m_i, tl.max(qk, 1) * scale2)
                m_use = m_new
                p = tl.exp2(qk * scale2 - m_new[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = tiles.load_rows(v_desc, Vb, n0, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM,
                                USE_TMA)
            acc = tiles.mma(tiles.narrow(p, v.dtype, DOT_UPCAST), v, acc, DOT_PREC, DOT_UPCAST)
            m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh,
    CU_Q, CU_K, seqlen_q_arg, seqlen_k_arg, num_heads, group,
    scale, softcap, left, right, SLOPES, s_slope_b, PREFIX,
    CM_START, CM_END, scmb, scmh, cm_div, TMAX, TMIN, stmb, stmh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, PREFIX_LM: tl.constexpr, COLMASK: tl.constexpr,
    VARLEN: tl.constexpr, USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    b, h, hk, q_start, seqlen_q, k_start, seqlen_k, q_off, m0 = tiles.query_program(
        CU_Q, CU_K, seqlen_q_arg, seqlen_k_arg, num_heads, group, BLOCK_M, VARLEN, BOTTOM_RIGHT)
    if m0 >= seqlen_q:
        return
    m1 = tl.minimum(m0 + BLOCK_M, seqlen_q)
    b64 = b.to(tl.int64)
    Qb = Q + b64 * sqb + q_start.to(tl.int64) * sqs + h * sqh
    Kb = K + b64 * skb + k_start.to(tl.int64) * sks + hk * skh
    Vb = V + b64 * svb + k_start.to(tl.int64) * svs + hk * svh
    Ob = O + b64 * sob + q_start.to(tl.int64) * sos + h * soh
    q_desc = tiles.make_desc(Qb, seqlen_q, sqs, BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA)
    k_desc = tiles.make_desc(Kb, seqlen_k, sks, BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA)
    v_desc = tiles.make_desc(Vb, seqlen_k, svs, BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = tiles.load_rows(q_desc, Qb, m0, seqlen_q, sqs, offs_r, offs_d, HEAD_DIM, USE_TMA)
    prefix, slope, CMS, CME, TMAX, TMIN, lo, full_lo, full_hi, hi = tiles.key_plan(
        PREFIX, SLOPES, s_slope_b, CM_START, CM_END, TMAX, TMIN, b, b64, h, cm_div, scmb, scmh,
        stmb, stmh, m0, m1, seqlen_k, q_off, left, right, BLOCK_N, CAUSAL, PREFIX_LM, WIN_LEFT,
        WIN_RIGHT, ALIBI, COLMASK)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for bnd in tl.static_range(3):  # masked, fully visible (warp-specialized), masked
        start, end = tiles.band(bnd, lo, full_lo, full_hi, hi)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_desc, v_desc, Kb, Vb, sks, svs, start, end, offs_m, offs_n,
            offs_d, seqlen_q, seqlen_k, q_off, scale, softcap, slope, prefix, left, right, CMS,
            CME, TMAX, TMIN, m0, m1, HEAD_DIM, BLOCK_N, bnd != 1, CAUSAL, PREFIX_LM, WIN_LEFT,
            WIN_RIGHT, SOFTCAP, ALIBI, COLMASK, USE_TMA, DOT_PREC, DOT_UPCAST,
            WARP_SPECIALIZE if bnd == 1 else False)

    # Fully masked rows end with l == 0: output 0 and LSE -inf, never 0/0 (nor their zero
    # weights times a NaN value)
    empty = l_i == 0.0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    o_desc = tiles.make_desc(Ob, seqlen_q, sos, BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA)
    tiles.store_rows(o_desc, Ob, tiles.narrow(out, O.dtype.element_ty, DOT_UPCAST), m0,
                     seqlen_q, sos, offs_r, offs_d,
                     HEAD_DIM, USE_TMA)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * tiles.LN2)
    tl.store(LSE + b64 * slb + h * slh + q_start + offs_m, lse, mask=offs_m < seqlen_q)


def flash_fwd(args: DenseArgs, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel: ``(out, lse)`` with lse fp32 natural-log in the layout's shape.

    ``config`` is a tile config from :mod:`.configs` (or a caller's own of the same form).
    """
    consts, options = launch_options(config)
    if consts.get("GLUON"):
        return _gluon_fwd(args, config)
    bm, bn = consts["BLOCK_M"], consts["BLOCK_N"]
    q, k, v = args.q, args.k, args.v
    out = torch.zeros_like(q) if args.varlen else torch.empty_like(q)
    lse = args.new_lse()
    use_tma = args.tma_ok(consts, out)
    grid = flat_grid(args.max_seqlen_q, bm, args.batch * args.num_heads)
    if grid[0] == 0:
        return out, lse
    _fwd_kernel[grid](
        q, k, v, out, lse,
        *args.bsh_strides(q), *args.bsh_strides(k), *args.bsh_strides(v),
        *args.bsh_strides(out), *args.lse_strides(lse),
        args.cu_q, args.cu_k, args.max_seqlen_q, args.max_seqlen_k, args.num_heads, args.group,
        *args.mask_scalars(), *args.colmask_tiles(bn),
        HEAD_DIM=args.head_dim, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=args.block_d,
        USE_TMA=use_tma, **args.mask_constants(),
        WARP_SPECIALIZE=bool(consts.get("WARP_SPECIALIZE", False)), **options,
    )
    return out, lse


def gluon_missing(ws: bool = False) -> str | None:
    """Why no Hopper Gluon forward (``ws``: the warp-specialised one) can run in this
    process (no sm90 GPU, or a Triton without Gluon), or None when one can."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return "needs an sm90 (Hopper) GPU"
    try:
        if ws:
            from . import fwd_gluon_ws  # noqa: F401
        else:
            from . import fwd_gluon  # noqa: F401
    except ImportError as exc:
        return f"triton.experimental.gluon is not importable ({exc})"
    return None


def gluon_unsupported(args: DenseArgs, config: dict) -> str | None:
    """Why the Hopper Gluon forward (:mod:`.fwd_gluon`) cannot run this call with ``config``,
    or None when it can."""
    if args.batch * args.num_heads > MAX_GRID_Y:  # its grid is (query tiles, B x H)
        return (f"{args.batch} x {args.num_heads} (sequence, head) pairs: the Gluon forward's "
                f"grid axis takes at most {MAX_GRID_Y} (CUDA's limit)")
    arch = device_arch(args.q.device)  # cached per device: no driver query per call
    if not arch.startswith("sm"):
        return f"the Gluon forward runs on NVIDIA GPUs only (this is {arch})"
    if not arch.startswith("sm9"):
        return f"the Gluon forward is written for sm90 (Hopper) wgmma, not {arch}"
    try:  # the warp-specialised variant only when asked: a Triton without it keeps the other
        if config.get("WS"):  # (producer warp + 2 consumer warpgroups)
            from . import fwd_gluon_ws as gluon_kernel
        else:
            from . import fwd_gluon as gluon_kernel
    except ImportError as exc:  # an older Triton without triton.experimental.gluon
        return f"triton.experimental.gluon is not importable ({exc})"
    return gluon_kernel.supports(args, config)


def _gluon_fwd(args: DenseArgs, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    why = gluon_unsupported(args, config)
    if why is not None:
        raise InputError(f"tile config asks GLUON=True, but {why}; drop GLUON from the config "
                         "(the portable kernel takes every call)")
    if config.get("WS"):
        from . import fwd_gluon_ws

        return fwd_gluon_ws.flash_fwd(args, config)
    from . import fwd_gluon

    return fwd_gluon.flash_fwd(args, config)
