"""Split-KV decode (Flash-Decoding) over a contiguous or a paged KV cache, in Triton.

Decode has 1..16 query tokens per sequence against a long cache, so one program per query
head would leave most of the GPU idle and read each KV head ``Hq / Hkv`` times. Here one
program owns every query row of one KV head (GQA group x query tokens, packed into the M
side of the dot), reads that head's keys once, and covers one key range ("split") of the
sequence; the splits of a sequence run in parallel and write partial outputs with their
base-2 log-sum-exp. Pass 2 merges the partials of each row by LSE, either as a second
launch or, with ``fused_merge``, in the last program of a (sequence, KV head) to finish.

Paged caches are read through the block table key by key (``page = table[b, j // PAGE]``),
so any page size >= 1 works and a key tile may span pages. Per-sequence lengths give each
sequence its own balanced splits. Multi-token queries use the mask semantics of
``attnhub.core.masking`` (bottom-right by default: token t sits at key ``t + L - Sq``).

Whatever the block table and lengths hold, the kernel reads nothing outside the cache: it
clamps lengths and page ids itself. An FP8 (e4m3) cache is read with per-(page or sequence,
KV head) descales, widened in registers (``KV_FP8``; to fp16 with ``FP8_F16``, V tiles a
tile ahead with ``V_AHEAD``); on an H200 that path runs at about the bf16 cache's speed
(0.98-1.05x), not twice it: it saves memory (docs/benchmarks/triton_decode_paged.md).
On sm90, a paged e4m3 cache takes :mod:`.decode_gluon`'s Hopper pass 1 wherever it serves
the call (``gluon_fp8_row``: 1.6-2.1x the bf16 cache's throughput on an H200), the portable
FP8 path elsewhere; ``config.gluon`` asks for it explicitly (same arguments).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from attnhub.plugin import window_within

from . import fastlaunch, scratch, tiles
from .configs import block_d
from .decode_configs import (
    INTERPRETER_SM_COUNT,
    DecodeConfig,
    block_m,
    choose_splits,
    decode_config,
    gluon_fp8_row,
)
from .fastlaunch import Launcher
from .launch import MAX_GRID_Y as _MAX_GRID_Y
from .launch import device_arch
from .launch import sm_count as _sm_count


@triton.jit
def _merge_row(OP, LP, prow, num_splits, Out, out_off, Lse, lse_off,
               HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
               CACHE: tl.constexpr, ROUND: tl.constexpr):
    """Merge the ``num_splits`` partials of one row (starting at partial row ``prow``).

    Partials are normalised outputs with base-2 LSEs; empty splits carry -inf and weigh 0,
    so a row no split saw ends as output 0, LSE -inf.
    """
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    lse = tl.load(LP + prow + s, mask=s_ok, other=float("-inf"), cache_modifier=CACHE)
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_use)
    total = tl.sum(w, 0)
    o = tl.load(OP + (prow + s)[:, None] * HEAD_DIM + d[None, :],
                mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0, cache_modifier=CACHE)
    acc = tl.sum(o * w[:, None], 0)
    has = total > 0
    safe = tl.where(has, total, 1.0)
    tl.store(Out + out_off + d, tiles.narrow(acc / safe, Out.dtype.element_ty, ROUND),
             mask=d < HEAD_DIM)
    tl.store(Lse + lse_off, tl.where(has, (m_use + tl.log2(safe)) * tiles.LN2, float("-inf")))


@triton.jit
def _page_ids(table, n, hi, num_pages, PAGE: tl.constexpr, LOAD: tl.constexpr):
    """Page id (int64) of each key ``n`` (< ``hi``) from a block-table row, clamped to
    [0, num_pages); keys at or past ``hi`` get page 0 (their loads are masked anyway).
    The clamp costs nothing measurable (H200: 1 x 32k/128k and 64 x 32k within 0.5% of
    the same kernel without it, docs/benchmarks/triton_decode_paged.md)."""
    if LOAD:
        page = tl.load(table + n // PAGE, mask=n < hi, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
    else:
        page = (n * 0).to(tl.int64)
    return page


@triton.jit
def _v_rows(table, n, hi, num_pages, b64, svp, svs, PAGE: tl.constexpr, PAGED: tl.constexpr):
    """Row offsets of keys ``n`` in V (a page's rows through the table when paged)."""
    if PAGED:
        return _page_ids(table, n, hi, num_pages, PAGE, True) * svp + (n % PAGE) * svs
    return b64 * svp + n.to(tl.int64) * svs


@triton.jit
def _split_kernel(
    Q, K, V, Out, Lse, OP, LP, Counters, BlockTable, SeqLens, Slopes, KScale, VScale,
    sqb, sqs, sqh, skp, sks, skh, svp, svs, svh, sob, sos, soh, sbt, s_slope_b,
    sksr, sksh, svsr, svsh,
    scale, softcap, left, right,
    seqlen_q, seqlen_k, n_seqlens, table_rows, num_pages,
    num_q_heads, num_kv_heads, group, m_blocks, num_splits,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, CAUSAL: tl.constexpr,
    WIN_LEFT: tl.constexpr, WIN_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, KV_FP8: tl.constexpr, ONE_SPLIT: tl.constexpr,
    FUSED_MERGE: tl.constexpr, PREFETCH: tl.constexpr, FP8_F16: tl.constexpr,
    V_AHEAD: tl.constexpr, FP8_QK: tl.constexpr, FP8_PV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    RING: tl.constexpr, GDC: tl.constexpr,
):
    """Pass 1: one (split, sequence x KV head x row block) per program. (``RING`` is the
    Gluon pass 1's, :mod:`.decode_gluon`: the argument lists are one; 0 here.) ``GDC``: the
    merge is a programmatic dependent launch (``DecodeConfig.pdl``), allowed from here on.

    ``seqlen_k`` is the cache's capacity per sequence (keys of a contiguous cache, table
    width x PAGE of a paged one). Lengths and page ids are clamped in here, whatever the
    tables hold: a length to [0, capacity] (0 for a sequence past the end of ``SeqLens`` or
    of the block table), a page id to [0, num_pages). A bad table gives a wrong answer for
    its sequence, never a read outside the cache (the hub rejects such tables before).
    """
    if GDC:  # the merge may be placed now; it waits for every partial itself
        tl.extra.cuda.gdc_launch_dependents()
    split = tl.program_id(0)
    pid = tl.program_id(1)
    mb = pid % m_blocks
    b = pid // (m_blocks * num_kv_heads)
    h = (pid // m_blocks) % num_kv_heads
    if HAS_SEQLENS:  # an in-bounds load, then 0 past the end (n_seqlens >= 1, see host)
        seq_len = tl.load(SeqLens + tl.minimum(b, n_seqlens - 1))
        seq_len = tl.where(b < n_seqlens, seq_len, 0)
    else:
        seq_len = seqlen_k + b * 0
    if PAGED:
        seq_len = tl.where(b < table_rows, seq_len, 0)
    seq_len = tl.minimum(tl.maximum(seq_len, 0), seqlen_k)
    q_off = b * 0
    if BOTTOM_RIGHT:
        q_off = seq_len - seqlen_q

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seqlen_q * group
    t = rows // group
    hq = h * group + rows % group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * sqb + t[:, None] * sqs + hq[:, None] * sqh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # FP8 cache with fp16 dots (FP8_F16): e4m3 widens to fp16 in one conversion per two
    # values (to bf16 it takes one more per value); q goes to fp16 divided by a power of two
    # per row (its largest |q| lands in [1, 2): exact, nothing overflows), put back on qk
    # FP8_QK: q quantized to e4m3 per row instead (its largest |q| to 448; the row's scale
    # goes on qk) and the K tile fed to an e4m3 x e4m3 dot as stored, never widened (a
    # Hopper wgmma reads it straight from the copy pipeline's shared memory: BLOCK_M 64).
    # FP8_QK == 2: q's rounding error too, as a second e4m3 dot on the same K tile.
    # FP8_PV: p quantized to e4m3 (x 256) and the V tile fed to the P.V dot as stored.
    F16: tl.constexpr = KV_FP8 and FP8_F16
    Q8: tl.constexpr = KV_FP8 and FP8_QK
    P8: tl.constexpr = KV_FP8 and FP8_PV
    WDT: tl.constexpr = tl.float16 if F16 else Out.dtype.element_ty
    q_pow = 1.0
    if Q8:
        qf = q.to(tl.float32)
        qa = tl.max(tl.abs(qf), 1)
        q_pow = tl.where(qa > 0, qa * (1.0 / 448.0), 1.0)[:, None]
        qs = tl.minimum(tl.maximum(qf / q_pow, -448.0), 448.0)
        q = qs.to(tl.float8e4nv)
        if FP8_QK == 2:  # and its rounding error, in e4m3 on the same scale: a second dot
            q_lo = (qs - q.to(tl.float32)).to(tl.float8e4nv)  # (q ~ 2^-8 relative)
            if UPCAST:
                q_lo = q_lo.to(tl.float32)
    elif F16:
        qf = q.to(tl.float32)
        qa = tl.max(tl.abs(qf), 1)
        q_pow = tl.where(qa > 0, tl.exp2(tl.floor(tl.log2(tl.maximum(qa, 1e-30)))), 1.0)
        q_pow = q_pow[:, None]
        q = (qf / q_pow).to(tl.float16)
    if UPCAST:
        q = q.to(tl.float32)
    slope = 0.0
    if ALIBI:
        slope = tl.load(Slopes + b * s_slope_b + hq, mask=row_ok, other=0.0)[:, None]

    # This split's keys: a balanced share of the sequence's tiles, then cut to what the
    # causal / window masks of the rows of this block can see.
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    lo = (split * n_tiles // num_splits) * BLOCK_N
    hi = tl.minimum(((split + 1) * n_tiles // num_splits) * BLOCK_N, seq_len)
    t_first = (mb * BLOCK_M) // group
    t_last = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // group, seqlen_q - 1)
    if CAUSAL:
        hi = tl.minimum(hi, t_last + q_off + 1)
    if WIN_RIGHT:
        hi = tl.minimum(hi, t_last + q_off + right + 1)
    if WIN_LEFT:
        lo = tl.maximum(lo, t_first + q_off - left)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_head = K + h.to(tl.int64) * skh
    v_head = V + h.to(tl.int64) * svh
    table = BlockTable + b64 * sbt
    ks_seq = 1.0
    vs_seq = 1.0
    if KV_FP8 and not PAGED:  # one scale per (sequence, KV head)
        ks_seq = tl.load(KScale + b64 * sksr + h * sksh)
        vs_seq = tl.load(VScale + b64 * svsr + h * svsh)
    pages_next = _page_ids(table, lo + tl.arange(0, BLOCK_N), hi, num_pages, PAGE,
                           PAGED and PREFETCH)
    # V_AHEAD (FP8): V tiles are loaded one iteration ahead into registers, not through the
    # compiler's shared-memory pipeline, whose MMA-operand read of a transposed e4m3 tile
    # goes byte by byte; widened here, the tile reaches the MMA as fp16 (ldmatrix.trans)
    if V_AHEAD:
        n1 = lo + tl.arange(0, BLOCK_N)
        v_next = tl.load(v_head + _v_rows(table, n1, hi, num_pages, b64, svp, svs, PAGE,
                                          PAGED)[:, None] + d[None, :],
                         mask=(n1 < hi)[:, None] & d_ok[None, :], other=0.0)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        if PAGED:
            if PREFETCH:  # this tile's ids came a tile early; fetch the next tile's now
                page = pages_next
                pages_next = _page_ids(table, n + BLOCK_N, hi, num_pages, PAGE, True)
            else:
                page = _page_ids(table, n, hi, num_pages, PAGE, True)
            k_rows = page * skp + (n % PAGE) * sks
            v_rows = page * svp + (n % PAGE) * svs
            if KV_FP8:  # one scale per (page, KV head), per key of the tile
                k_sc = tl.load(KScale + page * sksr + h * sksh, mask=n_ok, other=0.0)
                v_sc = tl.load(VScale + page * svsr + h * svsh, mask=n_ok, other=0.0)
        else:
            k_rows = b64 * skp + n.to(tl.int64) * sks
            v_rows = b64 * svp + n.to(tl.int64) * svs
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8 and not Q8:
            k = k.to(WDT)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if Q8 and FP8_QK == 2:
            qk = tl.dot(q_lo, tl.trans(k), qk, input_precision=DOT_PREC)
        if KV_FP8:
            if PAGED:
                qk = qk * (k_sc[None, :] * q_pow)
            else:
                qk = qk * (ks_seq * q_pow)
        s, _ = tiles.scores(qk, t[:, None], n[None, :], q_off, scale, softcap, slope,
                            SOFTCAP, ALIBI)
        ok = tiles.visible(t[:, None], n[None, :], seqlen_q, hi, q_off, 0, left, right, 0, 0,
                           CAUSAL, False, WIN_LEFT, WIN_RIGHT, False)
        s = tl.where(ok & row_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_AHEAD:
            v = v_next
            n2 = n + BLOCK_N
            v_next = tl.load(v_head + _v_rows(table, n2, hi, num_pages, b64, svp, svs, PAGE,
                                              PAGED)[:, None] + d[None, :],
                             mask=(n2 < hi)[:, None] & d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_head + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        pw = p
        v_max = 1.0
        if KV_FP8:  # V's scale goes on p (BLOCK_M x BLOCK_N) rather than on v (BLOCK_N x D)
            if PAGED:
                if F16:  # fp16 p: the scales over the tile's largest, which goes on after
                    v_max = tl.max(v_sc, 0)
                    v_max = tl.where(v_max > 0, v_max, 1.0)
                    pw = p * (v_sc / v_max)[None, :]
                else:
                    pw = p * v_sc[None, :]
            elif not F16:
                pw = p * vs_seq
            if P8:  # e4m3 p over [0, 256]: subnormals from 2^-17 of the row's max
                pw = tl.minimum(pw * 256.0, 448.0)
                v_max = v_max * (1.0 / 256.0)
            elif V_AHEAD:  # between two transposes: the compiler keeps the widening before
                v = tl.trans(tl.trans(v).to(WDT))  # the layout change to the MMA operand
            else:
                v = v.to(WDT)
        pv = tiles.narrow(pw, v.dtype, UPCAST)
        if UPCAST:  # same rounding of p as on the GPU, then an fp32 dot
            pv = pv.to(tl.float32)
            v = v.to(tl.float32)
        if F16:
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC) * v_max
        else:
            acc = tl.dot(pv, v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    has = l_i > 0
    safe = tl.where(has, l_i, 1.0)
    # no key seen (l == 0; NaN scores leave l NaN, and NaN out): 0, even times a NaN value
    o = tl.where((l_i == 0.0)[:, None], 0.0, acc / safe[:, None])
    if F16 and not PAGED:  # the per-sequence V scale, once
        o = o * vs_seq
    lse2 = tl.where(has, m_i + tl.log2(safe), float("-inf"))
    lse_rows = (b64 * num_q_heads + hq) * seqlen_q + t
    if ONE_SPLIT:
        tl.store(Out + b64 * sob + t[:, None] * sos + hq[:, None] * soh + d[None, :],
                 tiles.narrow(o, Out.dtype.element_ty, UPCAST),
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(Lse + lse_rows, lse2 * tiles.LN2, mask=row_ok)
    else:
        prow = lse_rows * num_splits + split
        tl.store(OP + prow[:, None] * HEAD_DIM + d[None, :], o,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LP + prow, lse2, mask=row_ok)
        if FUSED_MERGE:
            # The last program of this (sequence, head, rows) to finish merges for all:
            # the barrier orders every thread's partial stores before the release.
            tl.debug_barrier()
            done = tl.atomic_add(Counters + pid, 1, sem="acq_rel")
            if done == num_splits - 1:
                n_rows = tl.minimum(seqlen_q * group - mb * BLOCK_M, BLOCK_M)
                for r in range(n_rows):
                    row = mb * BLOCK_M + r
                    tr = row // group
                    hr = h * group + row % group
                    lrow = (b64 * num_q_heads + hr) * seqlen_q + tr
                    _merge_row(OP, LP, lrow * num_splits, num_splits, Out,
                               b64 * sob + tr * sos + hr * soh, Lse, lrow,
                               HEAD_DIM, BLOCK_S, BLOCK_D, ".cg", UPCAST)
                tl.atomic_xchg(Counters + pid, 0)


@triton.jit
def _merge_kernel(OP, LP, Out, Lse, sob, sos, soh, seqlen_q, num_q_heads, num_splits,
                  HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  GDC: tl.constexpr, ROUND: tl.constexpr):
    """Pass 2 as its own launch: one program per (sequence, query head, query token).
    ``GDC``: launched as pass 1's programmatic dependent, so first wait until pass 1 has
    finished and its partials are visible. ``ROUND``: bf16 under the interpreter (its cast
    truncates; ``tiles.narrow``)."""
    if GDC:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    t = row % seqlen_q
    hq = (row // seqlen_q) % num_q_heads
    b = row // (seqlen_q * num_q_heads)
    _merge_row(OP, LP, row * num_splits, num_splits, Out, b * sob + t * sos + hq * soh,
               Lse, row, HEAD_DIM, BLOCK_S, BLOCK_D, "", ROUND)


def _pdl_arch(arch: str) -> bool:
    """Whether ``arch`` (``device_arch``) has programmatic dependent launch: NVIDIA sm90+."""
    return arch.startswith("sm") and arch[2:].isdigit() and int(arch[2:]) >= 90


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_interpreter(device: torch.device) -> None:
    """CPU tensors need the kernels built for the interpreter (imported with it on)."""
    if device.type == "cpu" and not isinstance(_split_kernel, InterpretedFunction):
        raise RuntimeError(
            "attnhub_triton_portable.decode: tensors are on the CPU but the kernels were "
            "compiled for a GPU; set TRITON_INTERPRET=1 before this module is imported, or "
            "run on a GPU")


class _Plan(NamedTuple):
    """Everything about a launch that follows from shapes alone, computed once per shape."""

    cfg: DecodeConfig
    block_m: int
    m_blocks: int
    splits: int
    block_s: int
    upcast: bool


@functools.lru_cache(maxsize=256)
def _plan_base(device: torch.device, dtype: torch.dtype, batch: int, seqlen_q: int, hq: int,
               hkv: int, paged: bool, config: DecodeConfig | None,
               kv_fp8: bool) -> tuple[DecodeConfig, int, int, int, bool]:
    """What a plan takes from everything but the context length: (config, block_m, row
    blocks, SM count, bf16 upcast)."""
    arch = device_arch(device)
    dname = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    rows = seqlen_q * (hq // hkv)
    bm = block_m(rows)
    m_blocks = -(-rows // bm)
    sms = INTERPRETER_SM_COUNT if arch == "cpu" else _sm_count(device.index or 0)
    cfg = config or decode_config(arch, dname, paged, kv_fp8,
                                  programs=(batch * hkv * m_blocks, sms))
    if cfg.min_block_m > bm:  # e.g. 64: the M of one Hopper wgmma (4 warps), rows padded
        bm = min(64, cfg.min_block_m)
        m_blocks = -(-rows // bm)
    # Triton 3.9's interpreter computes bf16 dots wrongly (garbage of order 1e10): the
    # interpreter path feeds them fp32 copies instead, keeping the bf16 rounding of p.
    upcast = arch == "cpu" and dtype == torch.bfloat16
    return cfg, bm, m_blocks, sms, upcast


@functools.lru_cache(maxsize=1024)
def _plan(device: torch.device, dtype: torch.dtype, batch: int, seqlen_q: int, hq: int,
          hkv: int, longest: int, paged: bool, num_splits: int | None,
          config: DecodeConfig | None, kv_fp8: bool = False) -> _Plan:
    # integer maths here, not triton.cdiv/next_power_of_2 (Triton functions, slow to call
    # from Python): a growing cache plans a new length every step
    cfg, bm, m_blocks, sms, upcast = _plan_base(device, dtype, batch, seqlen_q, hq, hkv,
                                                paged, config, kv_fp8)
    splits = num_splits or choose_splits(batch, hkv, longest, sms, cfg, m_blocks)
    splits = max(1, min(splits, -(-max(longest, 1) // cfg.block_n)))
    return _Plan(cfg, bm, m_blocks, splits, max(2, 1 << (splits - 1).bit_length()), upcast)


class _Launches(NamedTuple):
    """The launches of one split count, each with its constant trailing arguments."""

    split: Launcher
    split_tail: tuple[Any, ...]
    merge: Launcher | None
    merge_tail: tuple[Any, ...]
    #: fp32 scratch sizes: the partial outputs and their LSEs, () with one split (none
    #: written); ``no_lse`` adds the LSE rows, for calls whose LSE nobody reads
    partials: tuple[int, ...]
    no_lse: tuple[int, ...]
    counters: int  # fused-merge tickets; 0 without the fused merge


#: Entries kept per cache below before it is cleared (a growing contiguous cache makes a
#: new shape every step; each is rebuilt on its first call, no more).
_CACHE_LIMIT = 1024


def _kv_disagree(k_shape: torch.Size, v_shape: torch.Size) -> None:
    raise ValueError(f"decode_attention: k {tuple(k_shape)} and v {tuple(v_shape)} must be "
                     "4-D and agree in all but the head dim")


class _Shape:
    """What all calls with one key share (see ``decode_attention``): the checks, the output
    shapes, the strides, and per context length the launches of its split count.

    The key fixes every integer the kernels receive except those that follow from the
    context length (through the split count), so a launch built here is launched again with
    the same specialization, which is what lets ``Launcher`` skip Triton's dispatch.
    """

    __slots__ = ("block_n", "by_longest", "by_splits", "cap_k", "chunk", "consts", "copy",
                 "cuda_index", "device", "dim", "empty", "interpreted", "ints", "launchers",
                 "new_lse", "new_out", "plan_args", "plan_opts", "strides", "templates")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 alignment: str, window: tuple[int, int] | None, softcap: bool,
                 slopes: torch.Tensor | None, block_table: torch.Tensor | None,
                 seqlens_k: torch.Tensor | None, descales: tuple[torch.Tensor, ...] | None,
                 num_splits: int | None, config: DecodeConfig | None) -> None:
        _check_interpreter(q.device)
        paged = block_table is not None
        if paged and seqlens_k is None:
            raise ValueError("decode_attention: a paged cache needs seqlens_k (B,) int32")
        batch, seqlen_q, hq, dim = q.shape
        _check_shapes(q, k, v, paged, slopes, block_table, seqlens_k)
        self.device, self.dim = q.device, dim
        self.cuda_index = q.device.index if q.device.type == "cuda" else None
        self.interpreted = isinstance(_split_kernel, InterpretedFunction)
        self.new_out = _allocator((batch, seqlen_q, hq, dim), q.dtype, q.device)
        self.new_lse = _allocator((batch, hq, seqlen_q), torch.float32, q.device)
        self.empty = batch * seqlen_q * hq * dim == 0
        self.chunk = _batch_chunk(batch, seqlen_q, hq, k.shape[2])
        self.copy = q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
        hkv = k.shape[2]
        page = k.shape[1] if paged else 1
        self.cap_k = block_table.shape[1] * page if paged else k.shape[1]
        scale_strides = (0, 0, 0, 0) if descales is None else _broadcast_descales(
            k, paged, batch, descales)
        # q, k, v, out (a new tensor: contiguous), block table and ALiBi batch strides, then
        # the (row, head) strides of the K and V descales
        self.strides = (
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), seqlen_q * hq * dim, hq * dim, dim,
            block_table.stride(0) if paged else 0,
            hq if slopes is not None and slopes.dim() == 2 else 0, *scale_strides)
        left, right = window if window is not None else (-1, -1)
        self.plan_args = (q.device, q.dtype, batch, seqlen_q, hq, hkv)
        self.plan_opts = (paged, num_splits, config, descales is not None)
        # the split kernel's integer arguments after scale and softcap, up to m_blocks: the
        # capacity and table sizes are what the kernel clamps lengths and page ids to
        self.ints = (left, right, seqlen_q, self.cap_k,
                     seqlens_k.numel() if seqlens_k is not None else 0,
                     block_table.shape[0] if paged else 0, k.shape[0] if paged else 0,
                     hq, hkv, hq // hkv)
        # its constants from HEAD_DIM to KV_FP8
        self.consts = (dim, page, paged, seqlens_k is not None, alignment == "bottom_right",
                       causal, left >= 0, right >= 0, softcap, slopes is not None,
                       descales is not None)
        if config is None and paged and descales is not None:  # e4m3 pages: Gluon on sm90
            self.plan_opts = (paged, num_splits, self._gluon_default(), True)
        #: the plan's key tile (0 until the first ``launches``; rebased shapes share it)
        self.block_n = 0
        self.by_longest: dict[int, _Launches] = {}
        self.by_splits: dict[int, _Launches] = {}
        #: split count -> launches as first built for this shape or one ``rebased`` from it
        #: (shared): another length's differ only in the capacity of the split kernel's tail
        self.templates: dict[int, _Launches] = {}
        #: (split count, config) -> the split and merge ``Launcher``: shared with the shapes
        #: ``rebased`` from this one, which launch the same binaries
        self.launchers: dict[tuple[Any, ...], tuple[Launcher, Launcher | None]] = {}

    def rebased(self, k_shape: torch.Size, k_stride: tuple[int, ...], v_shape: torch.Size,
                v_stride: tuple[int, ...]) -> _Shape:
        """This shape for a contiguous cache of another length (a cache that grows by a key
        per decode step), sharing its launchers: the caller's family key guarantees that
        every integer that changes with the length (the capacity and the k/v strides) keeps
        its Triton specialization (== 1, divisible by 16, integer width), so the binaries
        stay valid and only the arguments change. Takes k's and v's shapes and strides as
        the caller's key holds them (reading them from the tensors again costs ~2 us)."""
        if k_shape[:3] != v_shape[:3]:
            _kv_disagree(k_shape, v_shape)
        new = object.__new__(_Shape)  # every slot set here, by hand: a loop costs ~2 us more
        new.consts, new.copy, new.cuda_index = self.consts, self.copy, self.cuda_index
        new.chunk = self.chunk
        new.device, new.dim, new.empty = self.device, self.dim, self.empty
        new.interpreted, new.launchers, new.templates = (self.interpreted, self.launchers,
                                                         self.templates)
        new.new_lse, new.new_out = self.new_lse, self.new_out
        new.plan_args, new.plan_opts, new.block_n = self.plan_args, self.plan_opts, self.block_n
        new.cap_k = cap_k = k_shape[1]
        new.strides = (*self.strides[:3], *k_stride[:3], *v_stride[:3], *self.strides[9:])
        new.ints = (*self.ints[:3], cap_k, *self.ints[4:])
        new.by_longest, new.by_splits = {}, {}
        return new

    def launches(self, longest: int) -> _Launches:
        """The launches for a call whose longest sequence is ``longest`` keys."""
        if len(self.by_longest) >= _CACHE_LIMIT:
            self.by_longest.clear()
        # a plan depends on the length only through its key tiles: lengths rounded up to
        # whole tiles share one (a growing cache plans anew once per tile, not per key)
        block_n = self.block_n
        if block_n == 0:  # the first length of this family (shared by its rebased shapes)
            paged, _, config, kv_fp8 = self.plan_opts
            block_n = self.block_n = _plan_base(*self.plan_args, paged, config,
                                                kv_fp8)[0].block_n
        plan = _plan(*self.plan_args, -(-longest // block_n) * block_n, *self.plan_opts)
        hit = self.by_splits.get(plan.splits)
        if hit is None:
            hit = self.templates.get(plan.splits)
            if hit is None:
                hit = self.templates[plan.splits] = self._build(plan)
            tail = hit.split_tail
            if tail[3] != self.cap_k:  # built for another length of this family
                # tuple.__new__: ``_replace`` costs ~3 us, the NamedTuple's __new__ 0.2 more
                hit = tuple.__new__(_Launches, (hit[0], (*tail[:3], self.cap_k, *tail[4:]),
                                                *hit[2:]))
            self.by_splits[plan.splits] = hit
        self.by_longest[longest] = hit
        return hit

    def _gluon_refusal(self, cfg: DecodeConfig, fused: bool) -> str | None:
        """Why :mod:`.decode_gluon`'s pass 1 cannot serve this shape with ``cfg`` (None: it
        can)."""
        try:
            from . import decode_gluon  # Gluon only where it can serve
        except ImportError as exc:  # a Triton without triton.experimental.gluon
            return f"this Triton has no Gluon ({exc})"
        _, dtype, _, seqlen_q, hq, hkv = self.plan_args
        (dim, _, paged, has_lens, _, _, win_left, win_right, softcap, alibi,
         kv_fp8) = self.consts
        return decode_gluon.supports(
            arch=device_arch(self.device), interpreted=self.interpreted, q_dtype=dtype,
            seqlen_q=seqlen_q, group=hq // hkv, head_dim=dim, paged=paged,
            has_seqlens=has_lens, kv_fp8=kv_fp8, window=win_left or win_right,
            softcap=softcap, alibi=alibi, fused_merge=fused, block_n=cfg.block_n,
            num_warps=cfg.num_warps, min_block_m=cfg.min_block_m,
            v_ahead=cfg.fp8_v_ahead, ring=cfg.fp8_ring)

    def _gluon_default(self) -> DecodeConfig | None:
        """The Gluon row for a paged e4m3 cache where the kernel serves this shape, else
        None (the table's portable FP8 row)."""
        if self.interpreted:
            return None
        row = gluon_fp8_row(device_arch(self.device))
        return row if row is not None and self._gluon_refusal(row, False) is None else None

    def _gluon_kernel(self, cfg: DecodeConfig, fused: bool) -> Any:
        """``config.gluon``'s pass 1 (same arguments as ``_split_kernel``), or a ValueError
        that says why this call cannot take it."""
        why = self._gluon_refusal(cfg, fused)
        if why is None:
            from . import decode_gluon

            return decode_gluon._fp8_paged_split_kernel
        raise ValueError(f"decode_attention: config.gluon asks for the Gluon pass 1, but "
                         f"{why}; drop gluon from the config (the portable kernel takes "
                         "every call)")

    def _build(self, plan: _Plan) -> _Launches:
        _, dtype, batch, seqlen_q, hq, hkv = self.plan_args
        cfg, splits, dim = plan.cfg, plan.splits, self.consts[0]
        fused = cfg.fused_merge and splits > 1
        bd = block_d(dim)
        prec = "ieee" if dtype == torch.float32 or plan.upcast else "tf32"
        shared = self.launchers.get((splits, cfg))
        kernel = self._gluon_kernel(cfg, fused) if cfg.gluon else _split_kernel
        # the merge as pass 1's programmatic dependent (``DecodeConfig.pdl``)
        gdc = (cfg.pdl and splits > 1 and not fused and not self.interpreted
               and _pdl_arch(device_arch(self.device)))
        options: dict[str, Any] = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        if cfg.maxnreg:
            options["maxnreg"] = cfg.maxnreg
        split = shared[0] if shared else Launcher(
            kernel, (splits, batch * hkv * plan.m_blocks), options)
        split_tail = (*self.ints, plan.m_blocks, splits, *self.consts, splits == 1, fused,
                      cfg.prefetch_pages, cfg.fp8_dot != "q",
                      cfg.fp8_v_ahead and self.consts[-1],
                      _Q_TERMS.get(cfg.fp8_dot, 0) if self.consts[-1] else 0,
                      cfg.fp8_dot in ("fp8", "fp8_2") and self.consts[-1], plan.block_m,
                      cfg.block_n, bd, plan.block_s, prec, plan.upcast,
                      cfg.fp8_ring if cfg.gluon else 0, gdc)
        merge = None
        if shared:
            merge = shared[1]
        elif splits > 1 and not fused:
            merge_opts: dict[str, Any] = {"num_warps": cfg.merge_warps}
            if gdc:
                merge_opts["launch_pdl"] = True
            merge = Launcher(_merge_kernel, (batch * hq * seqlen_q,), merge_opts)
        self.launchers[(splits, cfg)] = (split, merge)
        merge_tail = (*self.strides[9:12], seqlen_q, hq, splits, dim, plan.block_s, bd, gdc,
                      plan.upcast)
        rows = batch * hq * seqlen_q
        partials = (rows * splits * dim, rows * splits) if splits > 1 else ()
        return _Launches(split, split_tail, merge, merge_tail, partials, (*partials, rows),
                         batch * hkv * plan.m_blocks if fused else 0)


#: e4m3 terms of q in the Q.K dot per ``fp8_dot`` (0: that dot widens K instead).
_Q_TERMS = {"fp8qk": 1, "fp8qk2": 2, "fp8": 1, "fp8_2": 2}

_shapes: dict[tuple[Any, ...], _Shape] = {}
#: Contiguous caches by everything but their length (see ``_family``): a new length of a
#: growing cache is ``rebased`` from the shape of an earlier one, not built afresh (which
#: cost ~200 us a call on the CPU box, each call launching through Triton's dispatch).
_families: dict[tuple[Any, ...], _Shape] = {}
#: The keys of the ``rebased`` shapes in ``_shapes``, oldest first (at most _RECENT_LIMIT).
_recent: collections.deque[tuple[Any, ...]] = collections.deque()
_RECENT_LIMIT = 16
#: The key of the last new length served from its family without a shape of its own (a
#: one-layer walk never stores one; a model's next layer at that length does)
_first_sight: list[Any] = [None]


#: CUDA's limit on a grid's second axis (``launch.MAX_GRID_Y``), where pass 1 puts its
#: (sequence, KV head, row block) programs: a call with more runs as several, each on a
#: slice of the batch.
MAX_GRID_Y = _MAX_GRID_Y


def _batch_chunk(batch: int, seqlen_q: int, hq: int, hkv: int) -> int:
    """Sequences per launch when pass 1's programs of one split (``batch`` x ``hkv`` x row
    blocks) exceed ``MAX_GRID_Y`` (a launch with more failed: "invalid argument"; batch
    8192 x 8 KV heads is 65536), else 0: the whole batch in one launch. A ValueError where
    one sequence's programs alone exceed it (no slice would launch)."""
    rows = seqlen_q * (hq // max(hkv, 1))
    per_seq = max(hkv, 1) * -(-rows // block_m(rows))
    if batch and per_seq > MAX_GRID_Y:  # no slice of the batch launches: refused by name
        raise ValueError(f"decode_attention: one sequence's {hkv} KV heads x "
                         f"{per_seq // max(hkv, 1)} query-row blocks ({seqlen_q} query tokens) "
                         f"are {per_seq} programs, past a grid axis's {MAX_GRID_Y} (CUDA's "
                         "limit); use fewer query tokens per call")
    if batch * per_seq <= MAX_GRID_Y:
        return 0
    return MAX_GRID_Y // per_seq


def _chunked(chunk: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             block_table: torch.Tensor | None, seqlens_k: torch.Tensor | None,
             slopes: torch.Tensor | None, k_descale: torch.Tensor | None,
             v_descale: torch.Tensor | None, return_lse: bool, **kw: Any
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``decode_attention`` in slices of ``chunk`` sequences, concatenated: what is per
    sequence (q, a contiguous cache and its (B, Hkv) descales, the table, lengths, (B, Hq)
    slopes) is sliced; a paged cache and its per-page descales are shared by every slice."""
    batch, paged = q.shape[0], block_table is not None
    seqlens_k, block_table = _row_per_sequence(batch, seqlens_k, block_table)

    def per_seq(x: torch.Tensor | None) -> bool:  # a descale with a row per sequence
        return not paged and x is not None and x.dim() == 2 and x.shape[0] == batch > 1

    def rows(x: torch.Tensor | None, lo: int, hi: int, sliced: bool) -> torch.Tensor | None:
        return x[lo:hi] if sliced and x is not None else x

    outs, lses = [], []
    for lo in range(0, batch, chunk):
        hi = min(lo + chunk, batch)
        out, lse = decode_attention(
            q[lo:hi], rows(k, lo, hi, not paged), rows(v, lo, hi, not paged),
            block_table=rows(block_table, lo, hi, True), seqlens_k=rows(seqlens_k, lo, hi, True),
            alibi_slopes=rows(slopes, lo, hi, slopes is not None and slopes.dim() == 2),
            k_descale=rows(k_descale, lo, hi, per_seq(k_descale)),
            v_descale=rows(v_descale, lo, hi, per_seq(v_descale)), return_lse=return_lse,
            **kw)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses) if return_lse else None


def _row_per_sequence(batch: int, lens: torch.Tensor | None, table: torch.Tensor | None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Lengths and block table with a row for each of ``batch`` sequences, as the kernel
    reads shorter ones (a sequence past the end of either has length 0): a slice of
    ``_chunked`` past their end was an empty tensor, which ``_check_shapes`` refused."""
    if table is not None and table.shape[0] < batch:
        rows = table.shape[0]
        table = torch.nn.functional.pad(table, (0, 0, 0, batch - rows))
        if lens is not None:  # (a paged call has lengths) the padded rows keep length 0
            keep = torch.arange(lens.numel(), device=lens.device) < rows
            lens = torch.where(keep, lens, torch.zeros((), dtype=lens.dtype,
                                                       device=lens.device))
    if lens is not None and lens.numel() < batch:
        lens = torch.nn.functional.pad(lens, (0, batch - lens.numel()))
    return lens, table


def _spec_class(x: int) -> int:
    """What Triton specializes an integer argument on, as one small int: == 1, divisibility
    by 16, and its width (i32, i64, u64)."""
    return (x == 1) | (x % 16 == 0) << 1 | (0 if -2**31 <= x < 2**31 else
                                             4 if x < 2**63 else 8)


def _family(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """``key`` of a contiguous-cache call (k's and v's last strides 1) with the length and
    the k/v strides replaced by their Triton specialization (``_spec_class``, here as bit
    sets: == 1 and divisible by 16, and the integers' widths where one is past i32; the
    length is the kernel's capacity argument). Inline arithmetic on the key's own sizes:
    this runs once per length of a growing cache, where nine calls of ``_spec_class`` cost
    ~1 us."""
    (kb, sk, kh, kd), (k0, k1, k2, _), (vb, _, vh, vd), (v0, v1, v2, _) = key[2:6]
    div = ((sk & 15 == 0) | (k0 & 15 == 0) << 1 | (k1 & 15 == 0) << 2 | (k2 & 15 == 0) << 3
           | (v0 & 15 == 0) << 4 | (v1 & 15 == 0) << 5 | (v2 & 15 == 0) << 6)
    one = ((sk == 1) | (k0 == 1) << 1 | (k1 == 1) << 2 | (k2 == 1) << 3 | (v0 == 1) << 4
           | (v1 == 1) << 5 | (v2 == 1) << 6)
    ints = (sk, k0, k1, k2, v0, v1, v2)
    # each integer's width where one is past i32 (sizes and strides are never negative)
    wide = tuple(map(_spec_class, ints)) if max(ints) >> 31 else 0
    return (key[:2], kb, kh, kd, vb, vh, vd, div, one, wide, key[6:])


@functools.cache
def _one(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One element that the allocation templates of all shapes broadcast."""
    return torch.empty((), dtype=dtype, device=device)


def _allocator(shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> Callable[[], torch.Tensor]:
    """A maker of new contiguous ``shape`` tensors, as ``torch.empty`` but cheaper per call:
    ``torch.empty_like`` of one element broadcast to ``shape`` (a broadcast is not dense,
    so the new tensor gets contiguous strides) skips parsing size, dtype and device (on this
    box 2.5-5 us against 5-7 us). Where that would not give ``torch.empty``'s strides
    (one element or none: ``empty_like`` copies the broadcast's zero strides), ``torch.empty``."""
    template = _one(dtype, device).expand(shape)
    want = torch.empty(shape, dtype=dtype, device="meta").stride()
    if torch.empty_like(template).stride() == want:
        return functools.partial(torch.empty_like, template)
    return functools.partial(torch.empty, shape, dtype=dtype, device=device)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: bool,
                  slopes: torch.Tensor | None, block_table: torch.Tensor | None,
                  seqlens_k: torch.Tensor | None) -> None:
    """Shape agreement the kernel's addressing relies on (once per shape key): the kernel
    trusts these sizes, and clamps only what tensors' values can hold (lengths, page ids)."""
    batch, _, hq, dim = q.shape
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"decode_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must "
                         "be 4-D and agree in all but the head dim")
    if v.shape[-1] != dim or k.shape[-1] != dim:
        raise ValueError(f"decode_attention: k/v head dims {k.shape[-1]}/{v.shape[-1]} != "
                         f"{dim}; the decode kernel needs equal head dims (use another backend)")
    if k.shape[2] == 0 or hq % k.shape[2]:
        raise ValueError(f"decode_attention: {hq} query heads are not a multiple of "
                         f"{k.shape[2]} KV heads")
    if not paged and k.shape[0] != batch:
        raise ValueError(f"decode_attention: q has batch {batch}, k/v {k.shape[0]}")
    for name, t in (("block_table", block_table), ("seqlens_k", seqlens_k)):
        if t is not None and (t.dtype != torch.int32 or t.dim() != (2 if name[0] == "b" else 1)
                              or t.device != q.device or t.numel() == 0 < batch):
            raise ValueError(f"decode_attention: {name} must be a non-empty "
                             f"{2 if name[0] == 'b' else 1}-D int32 tensor on {q.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if slopes is not None and tuple(slopes.shape) not in ((hq,), (batch, hq)):
        raise ValueError(f"decode_attention: alibi_slopes {tuple(slopes.shape)} must be "
                         f"({hq},) or ({batch}, {hq})")


#: KV dtypes read through per-(page or sequence, KV head) descales (Triton: float8e4nv).
FP8_KV_DTYPES = (torch.float8_e4m3fn,)


def _descales(k: torch.Tensor, paged: bool, k_descale: torch.Tensor | None,
              v_descale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per call: the descales of an FP8 cache as float32 tensors (as given, or converted);
    None for a 16/32-bit cache. Their shapes and devices are checked once per shape key
    (``_broadcast_descales``)."""
    if k.dtype not in FP8_KV_DTYPES:
        if k_descale is not None or v_descale is not None:
            raise ValueError(f"decode_attention: k_descale/v_descale given for a {k.dtype} "
                             "cache; descales belong to an FP8 (e4m3) cache only")
        return None
    if k_descale is None or v_descale is None:
        raise ValueError(f"decode_attention: an {k.dtype} cache needs k_descale and v_descale "
                         f"(float32, broadcastable to ({'num_pages' if paged else 'B'}, Hkv))")
    return (k_descale if k_descale.dtype is torch.float32 else k_descale.float(),
            v_descale if v_descale.dtype is torch.float32 else v_descale.float())


def _broadcast_descales(k: torch.Tensor, paged: bool, batch: int,
                        descales: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, ...]:
    """The (row, head) strides of the K and V descales broadcast to (rows, Hkv) (rows:
    pages when paged, sequences otherwise; broadcast rows/heads get stride 0). A broadcast
    keeps the data pointer, so the kernel reads the given tensors with these strides."""
    rows = k.shape[0] if paged else batch
    strides: list[int] = []
    for name, x in zip(("k_descale", "v_descale"), descales):
        if x.device != k.device:
            raise ValueError(f"decode_attention: {name} is on {x.device}, the cache on "
                             f"{k.device}")
        try:
            strides += torch.broadcast_to(x, (rows, k.shape[2])).stride()
        except RuntimeError:
            raise ValueError(f"decode_attention: {name} {tuple(x.shape)} does not broadcast "
                             f"to ({rows}, {k.shape[2]}) = ({'num_pages' if paged else 'B'}, "
                             "Hkv)") from None
    return tuple(strides)


def _aligned(*tensors: torch.Tensor | None) -> tuple[bool, ...]:
    """Which pointers Triton sees as 16-byte aligned (it specializes kernels on that)."""
    return tuple(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
    causal: bool = False, alignment: str = "bottom_right",
    window: tuple[int, int] | None = None, softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    seqlens_k: torch.Tensor | None = None, max_seqlen_k: int | None = None,
    k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
    num_splits: int | None = None, config: DecodeConfig | None = None,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention; returns (out like q, LSE (B, Hq, Sq) fp32, natural log); the LSE
    is None with ``return_lse=False`` (the kernels then write it to reused scratch, which
    saves an allocation per call).

    q (B, Sq, Hq, D). Contiguous cache: k/v (B, Sk, Hkv, D), optionally ``seqlens_k`` (B,)
    int32 for per-sequence lengths <= Sk. Paged cache: k/v (num_pages, page_size, Hkv, D)
    with ``block_table`` (B, P) int32 and ``seqlens_k`` (B,) int32. ``max_seqlen_k`` (the
    longest length, when the caller knows it) only sizes the splits; without it the cache
    capacity is used, which never syncs with the device. ``num_splits``/``config`` override
    the heuristic and the table (benchmarks, tests). No host sync, so CUDA graphs capture it.

    FP8 cache: k/v ``torch.float8_e4m3fn`` with ``k_descale``/``v_descale`` float32 such
    that a key is ``k * k_descale``: per (page, KV head) (num_pages, Hkv) for a paged cache,
    per (sequence, KV head) (B, Hkv) for a contiguous one, or anything that broadcasts to
    that (per head (Hkv,), one scalar). q stays 16-bit; the tiles are widened in registers
    (to q's dtype, or to fp16 with ``config.fp8_dot="fp16"``, the sm90 paged row) and the
    descales are applied to the scores and to p (not to the tiles).

    Lengths and page ids are clamped inside the kernel (see ``_split_kernel``): whatever
    ``seqlens_k``/``block_table`` hold, nothing outside k/v is read.

    Host work per call is kept small for eager decode loops: everything that follows from
    shapes, strides, dtypes, flags and pointer alignment is computed once per such key
    (``_Shape``, which also holds cheap allocators for the outputs; a contiguous cache of a
    new length, as a decode loop's growing cache, launches from an earlier length's shape
    with its own capacity and strides, and the next call of that length, the next layer's,
    stores a shape ``rebased`` from it, keeping the launchers); the device's stream and
    the launch-hook state are read once per call and shared by both launches; the kernels
    are launched through ``Launcher`` (Triton's dispatch skipped once the binary is known);
    and the partial outputs live in reused per-thread, per-stream scratch (``scratch.fp32``).
    ``out``, and ``lse`` when returned, are new tensors on every call. A q on a CUDA device
    other than the current one is run under ``torch.cuda.device(q.device)``.
    """
    if window is not None:  # edges past every key as -1: the kernel adds them in int32
        cap = k.shape[1] * (block_table.shape[1] if block_table is not None else 1)
        window = window_within(window, max(q.shape[1], cap))
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=torch.float32).contiguous()
    ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr()
    # block table and lengths as (shape, strides, dtype), each read once; the kernel indexes
    # them with unit inner stride: strided views are copied
    table_meta = lens_meta = None
    if block_table is not None:
        strides = block_table.stride()
        if strides and strides[-1] != 1:
            block_table = block_table.contiguous()
            strides = block_table.stride()
        table_meta = (block_table.shape, strides, block_table.dtype)
        ptrs |= block_table.data_ptr()
    if seqlens_k is not None:
        strides = seqlens_k.stride()
        if len(strides) == 1 and strides[0] != 1:
            seqlens_k = seqlens_k.contiguous()
            strides = seqlens_k.stride()
        lens_meta = (seqlens_k.shape, strides, seqlens_k.dtype)
        ptrs |= seqlens_k.data_ptr()
    descales = None
    if k_descale is not None or v_descale is not None or k.dtype in FP8_KV_DTYPES:
        descales = _descales(k, block_table is not None, k_descale, v_descale)
        if descales is not None:
            ptrs |= descales[0].data_ptr() | descales[1].data_ptr()
    if slopes is not None:
        ptrs |= slopes.data_ptr()
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
           v.dtype, q.device, causal, alignment, window, bool(softcap), num_splits, config,
           table_meta, lens_meta, None if slopes is None else slopes.shape,
           None if descales is None else (descales[0].shape, descales[0].stride(),
                                          descales[0].device, descales[1].shape,
                                          descales[1].stride(), descales[1].device),
           ptrs % 16 == 0 or _aligned(q, k, v, block_table, seqlens_k, slopes,
                                      *(descales or ())))
    shape = _shapes.get(key)
    grown = None  # a new length served from its family's shape: (capacity, strides)
    if shape is None:
        # (a cache copied for its last dim keeps the copy's strides: not rebased)
        family = _family(key) if (block_table is None and len(key[2]) == 4 == len(key[4])
                                  and key[3][-1] == 1 == key[5][-1]) else None
        base = _families.get(family) if family is not None else None
        if base is not None and base.block_n and key != _first_sight[0]:
            # the first call of a new length (one layer of a decode step): the family's
            # launches with this length's capacity and strides, nothing stored; the next
            # call of the same length (the next layer) stores a shape for it below
            if key[2][1] != key[4][1]:  # the family fixes the rest of k's and v's shapes
                _kv_disagree(key[2], key[4])
            _first_sight[0] = key
            shape = base
            kst, vst = key[3], key[5]
            grown = (key[2][1], (*base.strides[:3], kst[0], kst[1], kst[2], vst[0], vst[1],
                                 vst[2], *base.strides[9:]))
        elif base is not None:
            shape = base.rebased(*key[2:6])
            # a growing cache's lengths are each called for one step (by every layer),
            # then never again: only the last few stay, so that they die young instead of
            # piling up to the limit, where the garbage collector's full passes over them
            # and their clearing cost a walk ~5 us a call on the CPU box
            _recent.append(key)
            if len(_recent) > _RECENT_LIMIT:
                _shapes.pop(_recent.popleft(), None)
        else:
            shape = _Shape(q, k, v, causal=causal, alignment=alignment, window=window,
                           softcap=bool(softcap), slopes=slopes, block_table=block_table,
                           seqlens_k=seqlens_k, descales=descales, num_splits=num_splits,
                           config=config)
            if family is not None:
                if len(_families) >= _CACHE_LIMIT:
                    _families.clear()
                _families[family] = shape
        if grown is None:
            if len(_shapes) >= _CACHE_LIMIT:
                _shapes.clear()
            _shapes[key] = shape
    if shape.chunk:  # more programs than a grid axis takes: slices of the batch
        return _chunked(shape.chunk, q, k, v, block_table, seqlens_k, slopes, k_descale,
                        v_descale, return_lse, scale=scale, causal=causal,
                        alignment=alignment, window=window, softcap=softcap,
                        max_seqlen_k=max_seqlen_k, num_splits=num_splits, config=config)
    if shape.interpreted:
        device, stream, direct = -1, 0, False  # the interpreter launches on neither
    else:
        state = fastlaunch.launch_state(shape.cuda_index)
        if state is None:  # q is not on the current device: launch where it is
            with torch.cuda.device(shape.device):
                return decode_attention(
                    q, k, v, scale=scale, causal=causal, alignment=alignment, window=window,
                    softcap=softcap, alibi_slopes=slopes, block_table=block_table,
                    seqlens_k=seqlens_k, max_seqlen_k=max_seqlen_k, k_descale=k_descale,
                    v_descale=v_descale, num_splits=num_splits, config=config,
                    return_lse=return_lse)
        device, stream, direct = state
    out = shape.new_out()
    if shape.empty:
        return out, shape.new_lse() if return_lse else None
    if shape.copy:
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    cap_k, arg_strides = (shape.cap_k, shape.strides) if grown is None else grown
    longest = cap_k if max_seqlen_k is None else min(max_seqlen_k, cap_k)
    if grown is not None:  # the family's launches by whole key tiles (the plan reads no finer)
        longest = -(-longest // shape.block_n) * shape.block_n
    run = shape.by_longest.get(longest) or shape.launches(longest)
    tail = run.split_tail
    if grown is not None:  # with this length's capacity
        tail = (tail[0], tail[1], tail[2], cap_k, *tail[4:])
    cuda = shape.cuda_index is not None
    if return_lse:
        lse = shape.new_lse()
        bufs = scratch.fp32(shape.device, stream, run.partials, cuda) if run.partials else ()
    else:  # the kernels still write one: to scratch
        bufs = scratch.fp32(shape.device, stream, run.no_lse, cuda)
        lse = bufs[-1]
    # tensors the kernel does not read (no split, no fused merge...) are passed as lse
    opart, lpart = bufs[:2] if run.partials else (lse, lse)
    counters = lse
    if run.counters:
        counters = scratch.zeroed_counters(shape.device, stream, run.counters, cuda)
    ks, vs = descales if descales is not None else (lse, lse)
    args = (q, k, v, out, lse, opart, lpart, counters,
            lse if block_table is None else block_table, lse if seqlens_k is None else seqlens_k,
            lse if slopes is None else slopes, ks, vs, *arg_strides, float(scale),
            float(softcap) if softcap else 1.0, *tail)
    # the binaries' direct launches where known and allowed (``Launcher`` without its frame)
    go = run.split.ready.get(device) if direct else None
    if go is None:
        run.split(device, stream, direct, args)
    else:
        go(stream, args)
    if run.merge is not None:
        args = (opart, lpart, out, lse, *run.merge_tail)
        go = run.merge.ready.get(device) if direct else None
        if go is None:
            run.merge(device, stream, direct, args)
        else:
            go(stream, args)
    return out, lse if return_lse else None
