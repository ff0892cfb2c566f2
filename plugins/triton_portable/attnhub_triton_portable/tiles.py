"""Triton helpers shared by the dense forward and backward kernels: mask semantics per tile.

The semantics are those of ``attnhub.core.masking`` (query ``i`` sits at key position
``p = i + q_off``, ``q_off = Sk - Sq`` bottom-right, 0 top-left):

* causal: ``j <= p``, or ``j < prefix`` under prefix-LM;
* window (left, right): ``p - left <= j <= p + right`` (a side of -1 is unbounded);
* column-sparse: rows ``[start_j, end_j)`` are masked for key column ``j``;
* softcap then ALiBi: ``s = cap * tanh(scale * q.k / cap) - slope * |p - j|``.

Besides per-element visibility, the helpers give each tile loop its range: the tiles that can
hold a visible pair (``lo..hi``) and, inside it, the tiles where every pair is visible
(``full_lo..full_hi``), which run without any mask arithmetic. Scores are kept in base 2
(``exp2``), the LSE that leaves the kernels is natural-log.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def tanh(x):
    """tanh from exp2 (Triton has no portable tanh); a series near 0 avoids cancellation."""
    ax = tl.abs(x)
    e = tl.exp2(ax * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    x2 = x * x
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333
                                                          - x2 * 0.05396825396825397)))
    return tl.where(ax < 0.1, series, tl.where(x < 0, -t, t))


@triton.jit
def mma(a, b, acc, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``a @ b (+ acc)`` in fp32. DOT_UPCAST widens 16-bit operands first, which is exact
    (a bf16 x bf16 product fits fp32) and works around Triton's CPU interpreter, whose dot
    multiplies bf16 bit patterns as integers."""
    if DOT_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def narrow(x, dtype: tl.constexpr, ROUND: tl.constexpr):
    """``x.to(dtype)``; with ROUND (bf16 under Triton's CPU interpreter: DOT_UPCAST) rounded
    to nearest even first, as the GPU's cast does: the interpreter's fp32 -> bf16 cast
    truncates, which took a probability of 1 - 1e-7 to 0.996 and broke the FlashAttention
    rule on dV (bf16, one key: 2x the bound) and biased every stored output toward 0."""
    if ROUND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    return x.to(dtype)


@triton.jit
def doc_bounds(b, CU, seqlen, VARLEN: tl.constexpr):
    """(first row, length) of sequence ``b``: from cu_seqlens (thd; ``seqlen`` is then the
    longest, which sizes the grid) or the fixed length."""
    if VARLEN:
        start = tl.load(CU + b)
        n = tl.load(CU + b + 1) - start
    else:
        start = b * 0
        n = seqlen + b * 0
    return start, n


@triton.jit
def sequence(b, CU_Q, CU_K, seqlen_q, seqlen_k, VARLEN: tl.constexpr,
             BOTTOM_RIGHT: tl.constexpr):
    """(first query row, Sq, first key row, Sk, q_off) of sequence ``b``; ``q_off`` is the key
    position of query 0 (``Sk - Sq`` bottom-right, 0 top-left)."""
    q_start, sq = doc_bounds(b, CU_Q, seqlen_q, VARLEN)
    k_start, sk = doc_bounds(b, CU_K, seqlen_k, VARLEN)
    q_off = sk * 0
    if BOTTOM_RIGHT:
        q_off = sk - sq
    return q_start, sq, k_start, sk, q_off


@triton.jit
def flat_program(n, BLOCK: tl.constexpr):
    """(tile, row) of a program of a 1-D grid of ``cdiv(n, BLOCK)`` tiles x rows
    (``launch.flat_grid``), tiles fastest and reversed, so the longest (causal) tiles of a
    row start first: the order a (tiles, rows) grid had. One axis, because CUDA caps a
    grid's second axis at 65535 programs, which B x H (thd: documents x heads) passes."""
    per_row = tl.cdiv(n, BLOCK)
    pid = tl.program_id(0)
    return per_row - 1 - pid % per_row, pid // per_row


@triton.jit
def query_program(CU_Q, CU_K, seqlen_q, seqlen_k, num_heads, group, BLOCK_M: tl.constexpr,
                  VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr):
    """Where a query-tile program works: (b, h, KV head, q_start, Sq, k_start, Sk, q_off, m0).

    Grid: ``flat_program``'s over the longest query sequence (``seqlen_q``: Sq, or the
    longest document with VARLEN) and B * Hq; the caller returns when ``m0 >= Sq`` (a tile
    past a short varlen sequence)."""
    pid_m, bh = flat_program(seqlen_q, BLOCK_M)
    b = bh // num_heads
    h = bh % num_heads
    hk = h // group
    q_start, sq, k_start, sk, q_off = sequence(b, CU_Q, CU_K, seqlen_q, seqlen_k, VARLEN,
                                               BOTTOM_RIGHT)
    m0 = pid_m * BLOCK_M
    return b, h, hk, q_start, sq, k_start, sk, q_off, m0


@triton.jit
def key_plan(PREFIX, SLOPES, s_slope_b, CM_START, CM_END, TMAX, TMIN, b, b64, h, cm_div, scmb,
             scmh, stmb, stmh, m0, m1, seqlen_k, q_off, left, right, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, PREFIX_LM: tl.constexpr, WIN_LEFT: tl.constexpr,
             WIN_RIGHT: tl.constexpr, ALIBI: tl.constexpr, COLMASK: tl.constexpr):
    """What query rows ``[m0, m1)`` of head ``h`` need to walk their key tiles: (prefix,
    slope, this head's column-mask start/end and tile bounds, lo, full_lo, full_hi, hi).

    Without COLMASK the four column-mask values are 0 placeholders (a jit function cannot
    return the None pointers); the tile loops never read them then."""
    prefix, slope = head_scalars(PREFIX, SLOPES, s_slope_b, b, h, PREFIX_LM, ALIBI)
    if COLMASK:
        cms, cme, tmax, tmin = colmask_head(CM_START, CM_END, TMAX, TMIN, b64, h, cm_div, scmb,
                                            scmh, stmb, stmh)
    else:
        cms = b * 0
        cme = cms
        tmax = cms
        tmin = cms
    lo, full_lo, full_hi, hi = key_range(m0, m1, seqlen_k, q_off, prefix, left, right, BLOCK_N,
                                         CAUSAL, PREFIX_LM, WIN_LEFT, WIN_RIGHT, COLMASK)
    return prefix, slope, cms, cme, tmax, tmin, lo, full_lo, full_hi, hi


@triton.jit
def head_scalars(PREFIX, SLOPES, s_slope_b, b, h, PREFIX_LM: tl.constexpr,
                 ALIBI: tl.constexpr):
    """(prefix length, ALiBi slope) of sequence ``b`` and query head ``h`` (0 when unused)."""
    prefix = b * 0
    if PREFIX_LM:
        prefix = tl.load(PREFIX + b)
    slope = b * 0.0
    if ALIBI:
        slope = tl.load(SLOPES + b * s_slope_b + h)
    return prefix, slope


@triton.jit
def colmask_head(CM_START, CM_END, TMAX, TMIN, b64, h, cm_div, scmb, scmh, stmb, stmh):
    """Column-sparse start/end rows and per-tile bounds, offset to sequence ``b64`` and the
    mask head of query head ``h`` (mask heads are 1, Hkv or Hq: ``h // cm_div``)."""
    ch = h // cm_div
    return (CM_START + b64 * scmb + ch * scmh, CM_END + b64 * scmb + ch * scmh,
            TMAX + b64 * stmb + ch * stmh, TMIN + b64 * stmb + ch * stmh)


@triton.jit
def key_range(m0, m1, seqlen_k, q_off, prefix, left, right, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, PREFIX_LM: tl.constexpr, WIN_LEFT: tl.constexpr,
              WIN_RIGHT: tl.constexpr, ALL_MASKED: tl.constexpr):
    """Key tiles for query rows ``[m0, m1)``: (lo, full_lo, full_hi, hi).

    ``[lo, hi)`` holds every visible key; tiles in ``[full_lo, full_hi)`` are visible to every
    row and need no mask. ``lo``, ``full_lo`` and ``full_hi`` are multiples of BLOCK_N.
    """
    p0 = m0 + q_off
    p1 = m1 - 1 + q_off
    lo = p0 * 0
    hi = seqlen_k + p0 * 0
    full_lo = lo
    full_hi = hi
    if CAUSAL:
        c_hi = p1 + 1
        c_full = p0 + 1
        if PREFIX_LM:
            c_hi = tl.maximum(c_hi, prefix)
            c_full = tl.maximum(c_full, prefix)
        hi = tl.minimum(hi, c_hi)
        full_hi = tl.minimum(full_hi, c_full)
    if WIN_RIGHT:
        hi = tl.minimum(hi, p1 + right + 1)
        full_hi = tl.minimum(full_hi, p0 + right + 1)
    if WIN_LEFT:
        lo = tl.maximum(lo, p0 - left)
        full_lo = tl.maximum(full_lo, p1 - left)
    return _align(lo, full_lo, full_hi, hi, BLOCK_N, ALL_MASKED)


@triton.jit
def query_range(n0, n1, seqlen_q, q_off, prefix, left, right, BLOCK_M: tl.constexpr,
                CAUSAL: tl.constexpr, PREFIX_LM: tl.constexpr, WIN_LEFT: tl.constexpr,
                WIN_RIGHT: tl.constexpr, ALL_MASKED: tl.constexpr):
    """Query tiles for key columns ``[n0, n1)``, the transpose of ``key_range``."""
    lo = n0 * 0
    hi = seqlen_q + n0 * 0
    full_lo = lo
    full_hi = hi
    if CAUSAL:
        r_lo = n0 - q_off
        f_lo = n1 - 1 - q_off
        if PREFIX_LM:
            r_lo = tl.where(n0 < prefix, 0, r_lo)
            f_lo = tl.where(n1 <= prefix, 0, f_lo)
        lo = tl.maximum(lo, r_lo)
        full_lo = tl.maximum(full_lo, f_lo)
    if WIN_RIGHT:
        lo = tl.maximum(lo, n0 - right - q_off)
        full_lo = tl.maximum(full_lo, n1 - 1 - right - q_off)
    if WIN_LEFT:
        hi = tl.minimum(hi, n1 + left - q_off)
        full_hi = tl.minimum(full_hi, n0 + left - q_off + 1)
    return _align(lo, full_lo, full_hi, hi, BLOCK_M, ALL_MASKED)


@triton.jit
def _align(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr, ALL_MASKED: tl.constexpr):
    """Tile-align the ranges and order them: lo <= full_lo <= full_hi <= hi."""
    lo = tl.maximum(lo, 0)
    lo = (lo // BLOCK) * BLOCK
    hi = tl.maximum(hi, lo)
    if ALL_MASKED:
        full_lo = hi
        full_hi = hi
    else:
        full_lo = ((tl.maximum(full_lo, 0) + BLOCK - 1) // BLOCK) * BLOCK
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = (tl.maximum(full_hi, 0) // BLOCK) * BLOCK
        full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def band(BAND: tl.constexpr, lo, full_lo, full_hi, hi):
    """Tile range of band ``BAND`` of a ``key_range``/``query_range`` split: 0 the masked tiles
    before the fully visible band, 1 that band, 2 the masked tiles after it. A tile loop runs
    ``for bnd in tl.static_range(3)`` over them with ``MASKED = bnd != 1``."""
    if BAND == 0:
        start, end = lo, full_lo
    elif BAND == 1:
        start, end = full_lo, full_hi
    else:
        start, end = full_hi, hi
    return start, end


@triton.jit
def visible(i, j, seqlen_q, seqlen_k, q_off, prefix, left, right, cm_start, cm_end,
            CAUSAL: tl.constexpr, PREFIX_LM: tl.constexpr, WIN_LEFT: tl.constexpr,
            WIN_RIGHT: tl.constexpr, COLMASK: tl.constexpr):
    """Boolean tile of visible (query i, key j) pairs; i and j broadcast against each other
    (and ``cm_start``/``cm_end`` against j)."""
    ok = (i < seqlen_q) & (j < seqlen_k)
    p = i + q_off
    if CAUSAL:
        c = j <= p
        if PREFIX_LM:
            c = c | (j < prefix)
        ok = ok & c
    if WIN_LEFT:
        ok = ok & (j >= p - left)
    if WIN_RIGHT:
        ok = ok & (j <= p + right)
    if COLMASK:
        ok = ok & ((i < cm_start) | (i >= cm_end))
    return ok


@triton.jit
def scores(qk, i, j, q_off, scale, softcap, slope, SOFTCAP: tl.constexpr,
           ALIBI: tl.constexpr):
    """(scores in base 2, d score / d (scale*q.k)): softcap, then the ALiBi bias."""
    if SOFTCAP:
        th = tanh(qk * (scale / softcap))
        s = softcap * th
        dfac = 1.0 - th * th
    else:
        s = qk * scale
        dfac = 1.0
    if ALIBI:
        s = s - slope * tl.abs(i + q_off - j).to(tl.float32)
    return s * LOG2E, dfac


@triton.jit
def colmask_tile_kept(TMAX, TMIN, tile, r0, r1):
    """False when every column of key tile ``tile`` masks all rows ``[r0, r1)``: the tile is
    skipped whole (TMAX/TMIN hold each tile's largest start and smallest end)."""
    return (tl.load(TMAX + tile) > r0) | (tl.load(TMIN + tile) < r1)


@triton.jit
def load_rows(desc, base, row0, nrows, stride, offs_r, offs_d, HEAD_DIM: tl.constexpr,
              USE_TMA: tl.constexpr):
    """A (rows, BLOCK_D) tile from row ``row0``: through a TMA descriptor (out-of-bounds rows
    and columns read 0) or through masked pointer loads."""
    if USE_TMA:
        x = desc.load([row0, 0])
    else:
        rows = row0 + offs_r
        ptrs = base + rows[:, None].to(tl.int64) * stride + offs_d[None, :]
        x = tl.load(ptrs, mask=(rows[:, None] < nrows) & (offs_d[None, :] < HEAD_DIM),
                    other=0.0)
    return x


@triton.jit
def store_rows(desc, base, x, row0, nrows, stride, offs_r, offs_d, HEAD_DIM: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Store a (rows, BLOCK_D) tile; rows past ``nrows`` and padded columns are dropped."""
    if USE_TMA:
        desc.store([row0, 0], x)
    else:
        rows = row0 + offs_r
        ptrs = base + rows[:, None].to(tl.int64) * stride + offs_d[None, :]
        tl.store(ptrs, x, mask=(rows[:, None] < nrows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def make_desc(base, nrows, stride, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
              HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """A 2-D TMA descriptor over one head of one sequence, or None on the pointer path."""
    desc = None
    if USE_TMA:
        desc = tl.make_tensor_descriptor(base, shape=[nrows, HEAD_DIM], strides=[stride, 1],
                                         block_shape=[BLOCK_R, BLOCK_D])
    return desc
