"""Paged FP8 (e4m3) split-KV decode in Gluon, for Hopper: pass 1 of :mod:`.decode` for an
e4m3 paged cache on sm90 wherever ``supports`` admits the call (``gluon_fp8_row``), or asked
for with ``config.gluon``.

Why: Triton 3.6 builds e4m3 MMAs on sm90 only as 64-row wgmma (16x the 4 real rows of a
GQA-4 KV head), and its 16-bit path widens e4m3 tiles through shared memory to reach the
MMA operand layouts; the FP8 cache then runs at the bf16 cache's speed, not twice it
(docs/benchmarks/triton_decode_paged.md). Here the layouts are explicit, so e4m3 bytes go
from a 16-byte global load to an ``mma.sync m16n8k16`` fp16 operand without leaving the
registers:

* Q.K: the reduction index d may be permuted freely if q is permuted the same way. A thread
  loads 32 contiguous bytes of one key (``d = 32 * (lane % 4) + j``); relabelled
  ``d' = 16 kt + 8 t + 2 (lane % 4) + p`` for ``j = 4 kt + 2 t + p``, that is exactly the
  B-operand fragment of m16n8k16 (kWidth 2). q is loaded once with the same relabelling.
* P.V: the output column d may be permuted freely if it is undone at the store. A thread
  loads 16 contiguous bytes of each of its keys (``d = 16 * (lane // 4) + nt``), relabelled
  ``d' = 8 nt + lane // 4``: the B fragment again, its two keys per register paired in
  registers (byte permutes) before the e4m3x2 -> f16x2 conversion.
* P leaves the Q.K accumulator as the A operand of P.V in registers (the FA2 identity).

One warp per program (a 16-row MMA tile holds all query rows of a KV head); the SM's many
resident programs keep the bytes in flight (no shared memory at all). A tile that lies in
one page takes one page id and one descale pair, fetched a tile early. Latency hiding
within a warp (``PREFETCH``, ``config.prefetch_pages``): a software pipeline in registers,
the next tile's K and V bytes and descales loaded before this tile is widened, multiplied
and softmaxed (with ``V_AHEAD`` too: the next two tiles), so a warp always has one (two)
tiles of bytes in flight; the tiles in flight are held as int32 words (an e4m3 tensor
carried across a loop iteration takes a register per byte). With ``RING`` (``config.fp8_ring``) the
tiles go through a ring of that many shared-memory slots instead, copied by ``cp.async``
(16 bytes a copy, zero-filled past the sequence's end) and read back in the layout they
were copied in, so ``RING - 1`` tiles are in flight per program with no registers held
for them; each slot's 16-byte chunks are XOR-swizzled by key (``_ring_layout``), so
neither the copies nor the reads have bank conflicts. Without ``PREFETCH``,
``V_AHEAD`` loads only V a tile ahead (as e4m3: 219 registers). Host planning, scratch and
the split merge are :mod:`.decode`'s: this kernel takes ``_split_kernel``'s arguments
unchanged and refuses (``supports``) what it does not serve.

Residency: one-warp programs sit in the SM's four sub-partitions, each with 16384
registers, so an SM holds 4 x floor(16384 / (32 x registers rounded up to 8)) of them
(cuda_occupancy.h): 12 up to 168 registers, 8 up to 255. sm90 builds (Triton 3.6, page 16,
benchmarks/gluon_decode_sm90_offline.py; registers, bytes of stack): the plain loop 166-168,
0 (12 per SM; 447 SASS instructions per 16-key tile); ``PREFETCH`` 203-204, 0 (8 per SM;
476 instructions); capped at 168 by ``maxnreg`` 168, 32-40 outside the key loop (12 per
SM); ``PREFETCH`` + ``V_AHEAD`` 227-228, 0 (8); ``PREFETCH`` with 32-key tiles 255, 16-24
(8; one spill store and reload per tile); with 32-key tiles over 8-key pages (page ids per
key) 255, 176-184 (44 reloads per tile).

Run on an H200 (2026-12-02, commit ca449c7): the plain loop passed the FA-rule GPU tests
(tests/test_decode_gluon_gpu.py); 64 x 32k (32 / 8 heads, d128, page 16, random table)
1360 us, 1.62x the bf16 paged row. The ``PREFETCH`` variants are built offline only so far.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .gluon_compat import cp_async, cta_barrier

_LOG2E = gl.constexpr(1.4426950408889634)
_LN2 = gl.constexpr(0.6931471805599453)

#: query rows of one program: the M of one m16n8k16 MMA
ROWS = gl.constexpr(16)
#: head dims the layouts below are written for (d = 4 lanes x 32 bytes = 8 lanes x 16)
HEAD_DIMS = (128,)
#: key tiles the layouts are written for (multiples of the 16-key MMA K step); 64 spills
#: registers in the sm90 build, so it is refused
BLOCK_NS = (16, 32)
#: ``fp8_ring`` sizes (0: no ring): powers of two, as its shared layout's bases are
RINGS = (0, 2, 4, 8)
#: the key tile whose sm90 build holds a V tile a tile ahead (or, with PREFETCH, two K and V
#: tiles) without spilling (219 / 228 registers; 32-key tiles: 272 / 360 bytes of stack)
V_AHEAD_BLOCK_N = 16


def supports(*, arch: str, interpreted: bool, q_dtype: torch.dtype, seqlen_q: int,
             group: int, head_dim: int, paged: bool, has_seqlens: bool, kv_fp8: bool,
             window: bool, softcap: bool, alibi: bool, fused_merge: bool, block_n: int,
             num_warps: int, min_block_m: int, v_ahead: bool, ring: int = 0) -> str | None:
    """None when this kernel serves the call as :mod:`.decode` would; else why not."""
    if interpreted or arch == "cpu":
        return "Gluon kernels do not run in Triton's interpreter (needs an sm90 GPU)"
    if arch != "sm90":
        return f"built and checked for Hopper (sm90) only, not {arch}"
    if not (paged and kv_fp8 and has_seqlens):
        return "serves a paged e4m3 KV cache (block_table, seqlens_k, descales) only"
    if q_dtype not in (torch.bfloat16, torch.float16):
        return f"queries must be bf16 or fp16, not {q_dtype}"
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim}: its layouts are written for {HEAD_DIMS}"
    if seqlen_q != 1:
        return f"one query token per sequence (Sq = 1), not {seqlen_q}"
    if group > ROWS:
        return f"GQA group {group} > {ROWS.value}: one 16-row MMA tile per KV head"
    given = [n for n, on in (("window", window), ("softcap", softcap), ("alibi", alibi),
                             ("fused_merge", fused_merge)) if on]
    if given:
        return f"{', '.join(given)} not implemented in the Gluon kernel"
    if block_n not in BLOCK_NS:
        return f"block_n {block_n} not in {BLOCK_NS}"
    if v_ahead and block_n != V_AHEAD_BLOCK_N:
        return (f"fp8_v_ahead with block_n {block_n}: only {V_AHEAD_BLOCK_N} builds without "
                "spilling registers")
    if ring not in RINGS:
        return f"fp8_ring {ring}: a ring of {', '.join(map(str, RINGS[1:]))} slots, or 0"
    if ring and v_ahead:
        return ("fp8_ring with fp8_v_ahead: the ring keeps V in flight itself; drop "
                "fp8_v_ahead")
    if num_warps != 1:
        return f"one warp per program (num_warps=1), not {num_warps}"
    if min_block_m > ROWS:
        return f"min_block_m {min_block_m} > {ROWS.value} rows"
    return None


@gluon.constexpr_function
def _ring_layout(block_n, groups):
    """Shared layout of one ring slot: a K (``groups`` 4: [keys, 4, 32]) or V (8:
    [keys, 8, 16]) tile, written by ``cp.async`` and read back in the layout it was copied
    in (``KL`` / ``VL``). A key's 128 bytes are one row of eight 16-byte chunks; the
    chunk's place in the row is XORed with the key's low three bits, so the eight lanes of
    each 16-byte access phase (two keys of four K runs, or four keys of two V runs) hit
    eight different bank groups: no bank conflicts either way. As linear bases (offset bit
    -> logical [key, group, byte]); ``block_n`` a power of two. (The ring's leading slot
    dimension is outside the layout.)"""
    if groups == 4:  # K: chunk = 2 x group + byte // 16
        chunk = [[0, 0, 16], [0, 1, 0], [0, 2, 0]]
    else:  # V: chunk = group
        chunk = [[0, 1, 0], [0, 2, 0], [0, 4, 0]]
    bases = [[0, 0, 1 << b] for b in range(4)] + chunk
    for j in range(block_n.bit_length() - 1):
        key = [1 << j, 0, 0]
        bases.append([a ^ b for a, b in zip(key, chunk[j])] if j < 3 else key)
    return gl.SharedLinearLayout(bases)


@gluon.jit
def _tile_page(table, n, hi, num_pages, PAGE: gl.constexpr):
    """Page id (int64) of key ``n`` clamped to [0, num_pages); page 0 at or past ``hi``."""
    page = gl.load(table + n // PAGE, mask=n < hi, other=0)
    return gl.minimum(gl.maximum(page, 0), num_pages - 1).to(gl.int64)


@gluon.jit
def _tile_pages(table, n0, hi, num_pages, PAGE: gl.constexpr, TILE_PAGES: gl.constexpr):
    """The page ids of the key tile at ``n0`` when it spans TILE_PAGES (1 or 2) whole
    pages, as a tuple of scalars; (0,) otherwise (keys then go through the table)."""
    if TILE_PAGES == 1:
        pages = (_tile_page(table, n0, hi, num_pages, PAGE),)
    elif TILE_PAGES == 2:
        pages = (_tile_page(table, n0, hi, num_pages, PAGE),
                 _tile_page(table, n0 + PAGE, hi, num_pages, PAGE))
    else:
        pages = (n0.to(gl.int64) * 0,)
    return pages


@gluon.jit
def _page_rows(table, n, hi, num_pages, pages, stride_page, stride_row, PAGE: gl.constexpr,
               TILE_PAGES: gl.constexpr):
    """Row offsets (int64) of keys ``n``: through the tile's page ids ``pages`` (a tuple of
    TILE_PAGES scalars) when it spans one or two whole pages, else through each key's
    block-table entry (page ids clamped to [0, num_pages) as in :mod:`.decode`, keys at or
    past ``hi`` on page 0: masked)."""
    if TILE_PAGES == 1:
        page = pages[0]
    elif TILE_PAGES == 2:
        page = gl.where((n // PAGE) % 2 == 0, pages[0], pages[1])
    else:
        page = gl.load(table + n // PAGE, mask=n < hi, other=0)
        page = gl.minimum(gl.maximum(page, 0), num_pages - 1).to(gl.int64)
    return page * stride_page + (n % PAGE).to(gl.int64) * stride_row


@gluon.jit
def _scales(table, n, hi, num_pages, Scale, ssr, ssh, h, PAGE: gl.constexpr):
    """Descale of each key's (page, KV head); 0 for keys at or past ``hi``."""
    ok = n < hi
    page = gl.load(table + n // PAGE, mask=ok, other=0)
    page = gl.minimum(gl.maximum(page, 0), num_pages - 1).to(gl.int64)
    return gl.load(Scale + page * ssr + h * ssh, mask=ok, other=0.0)


@gluon.jit
def _tile_ptrs(head, table, n0, hi, num_pages, pages, stride_page, stride_row,
               PAGE: gl.constexpr, TILE_PAGES: gl.constexpr, BLOCK_N: gl.constexpr,
               GROUPS: gl.constexpr, BYTES: gl.constexpr, L: gl.constexpr):
    """(addresses, mask) of a K or V tile, [BLOCK_N, GROUPS, BYTES] in layout ``L``."""
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    grp = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    byte = gl.arange(0, BYTES, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    rows = _page_rows(table, n, hi, num_pages, pages, stride_page, stride_row, PAGE,
                      TILE_PAGES)
    off = gl.expand_dims(gl.expand_dims(rows, 1), 2) + gl.expand_dims(
        gl.expand_dims(grp * BYTES, 0), 2) + gl.expand_dims(gl.expand_dims(byte, 0), 1)
    return head + off, gl.expand_dims(gl.expand_dims(n < hi, 1), 2)


@gluon.jit
def _load_tile(head, table, n0, hi, num_pages, pages, stride_page, stride_row,
               PAGE: gl.constexpr, TILE_PAGES: gl.constexpr, BLOCK_N: gl.constexpr,
               GROUPS: gl.constexpr, BYTES: gl.constexpr, L: gl.constexpr):
    """A K or V tile as stored, [BLOCK_N keys, GROUPS, BYTES] e4m3 in layout ``L``: each key
    row's 128 bytes as GROUPS runs of BYTES contiguous bytes (K: 4 x 32, V: 8 x 16; a
    thread holds whole runs, so they load as 16-byte vectors). Keys at or past ``hi``: 0."""
    ptrs, ok = _tile_ptrs(head, table, n0, hi, num_pages, pages, stride_page, stride_row,
                          PAGE, TILE_PAGES, BLOCK_N, GROUPS, BYTES, L)
    return gl.load(ptrs, mask=ok, other=0.0)


@gluon.jit
def _copy_tile(k_slot, v_slot, k_head, v_head, table, n0, hi, num_pages, pages, skp, sks,
               svp, svs, PAGE: gl.constexpr, TILE_PAGES: gl.constexpr, BLOCK_N: gl.constexpr,
               KL: gl.constexpr, VL: gl.constexpr):
    """The K and V tiles at ``n0`` into their ring slots by ``cp.async`` (16 bytes a copy,
    keys at or past ``hi`` zero-filled), committed as one group."""
    ptrs, ok = _tile_ptrs(k_head, table, n0, hi, num_pages, pages, skp, sks, PAGE, TILE_PAGES,
                          BLOCK_N, 4, 32, KL)
    cp_async(k_slot, ptrs, mask=ok)
    ptrs, ok = _tile_ptrs(v_head, table, n0, hi, num_pages, pages, svp, svs, PAGE, TILE_PAGES,
                          BLOCK_N, 8, 16, VL)
    cp_async(v_slot, ptrs, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _words(x, BLOCK_N: gl.constexpr, GROUPS: gl.constexpr, BYTES: gl.constexpr):
    """e4m3 bytes [BLOCK_N, GROUPS, BYTES] -> int32 words [BLOCK_N, GROUPS, BYTES // 4]
    (word w is bytes 4 w .. 4 w + 3, little-endian), the same bytes per thread: a tile held
    in registers across a loop iteration then takes one register per 4 bytes (an e4m3
    tensor is carried byte by byte, a register each). The bytes of a 16-byte load come back
    as the words they were loaded in: no instructions in the sm90 build (shifts and ors
    here instead left ~70 LOP3 and 64 PRMT per 16-key tile)."""
    # one asm per 4 bytes (pack=4: they arrive as one 32-bit register); the word is the
    # first of its 4 int32 outputs, the other 3 are dropped
    w = gl.inline_asm_elementwise(
        "mov.b32 $0, $4; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;", "=r,=r,=r,=r,r",
        [x.to(gl.uint8, bitcast=True)], dtype=gl.int32, is_pure=True, pack=4)
    w = gl.reshape(w, [BLOCK_N, GROUPS, BYTES // 4, 2, 2])  # (.., word, j // 2, j % 2)
    w, _ = gl.split(w)
    w, _ = gl.split(w)
    return w


@gluon.jit
def _word_halves(w, BLOCK_N: gl.constexpr, GROUPS: gl.constexpr, WORDS: gl.constexpr):
    """int32 words [BLOCK_N, GROUPS, WORDS] of e4m3 bytes -> those bytes widened to fp16
    [BLOCK_N, GROUPS, 4 WORDS] (byte 4 w + j is bits 8 j.. of word w): each word's two
    halves go to ``cvt.rn.f16x2.e4m3x2`` as they are (no byte extraction: shifts and
    truncations here cost ~130 more instructions per 16-key tile in the sm90 build)."""
    f0, f1, f2, f3 = gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; "
        "cvt.rn.f16x2.e4m3x2 x, lo; cvt.rn.f16x2.e4m3x2 y, hi; "
        "mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
        "=h,=h,=h,=h,r", [w], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True, pack=1)
    x = gl.join(gl.join(f0, f2), gl.join(f1, f3))  # [.., word, j // 2, j % 2]
    return gl.reshape(x, [BLOCK_N, GROUPS, 4 * WORDS])


@gluon.jit
def _k_operand(k, BLOCK_N: gl.constexpr, B_OP: gl.constexpr):
    """[BLOCK_N, 4, 32] e4m3 (or fp16) -> the fp16 B operand [128 (d'), BLOCK_N] of Q.K (see
    top)."""
    k = k.to(gl.float16)
    k = gl.reshape(k, [BLOCK_N, 4, 8, 2, 2])          # (key, lane%4, kt, t, p)
    k = gl.permute(k, [0, 2, 3, 1, 4])                # (key, kt, t, lane%4, p)
    k = gl.reshape(k, [BLOCK_N, 128])
    return gl.convert_layout(gl.permute(k, [1, 0]), B_OP)


@gluon.jit
def _v_operand(v, BLOCK_N: gl.constexpr, B_OP: gl.constexpr):
    """[BLOCK_N, 8, 16] e4m3 (or fp16) -> the fp16 B operand [BLOCK_N, 128 (d')] of P.V (see
    top)."""
    v = v.to(gl.float16)
    v = gl.permute(v, [0, 2, 1])                      # (key, nt, lane//4)
    return gl.convert_layout(gl.reshape(v, [BLOCK_N, 128]), B_OP)


@gluon.jit
def _tile_scales(table, n0, hi, num_pages, pages, KScale, sksr, sksh, VScale, svsr, svsh, h,
                 PAGE: gl.constexpr, TILE_PAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                 COL: gl.constexpr):
    """(K, V) descales of the key tile at ``n0``: scalars when it lies in one page, else per
    key ([BLOCK_N] in ``COL``); 0 for a tile (key) at or past ``hi``."""
    if TILE_PAGES == 1:
        ok = n0 < hi
        k_sc = gl.load(KScale + pages[0] * sksr + h * sksh, mask=ok, other=0.0)
        v_sc = gl.load(VScale + pages[0] * svsr + h * svsh, mask=ok, other=0.0)
    elif TILE_PAGES == 2:
        n = n0 + gl.arange(0, BLOCK_N, layout=COL)
        first = (n // PAGE) % 2 == 0
        k_sc = gl.where(first, gl.load(KScale + pages[0] * sksr + h * sksh),
                        gl.load(KScale + pages[1] * sksr + h * sksh))
        v_sc = gl.where(first, gl.load(VScale + pages[0] * svsr + h * svsh),
                        gl.load(VScale + pages[1] * svsr + h * svsh))
    else:
        n = n0 + gl.arange(0, BLOCK_N, layout=COL)
        k_sc = _scales(table, n, hi, num_pages, KScale, sksr, sksh, h, PAGE)
        v_sc = _scales(table, n, hi, num_pages, VScale, svsr, svsh, h, PAGE)
    return k_sc, v_sc


@gluon.jit
def _softmax(qk, k_sc, v_sc, n0, hi, row_ok, qk_scale, m_i, l_i, acc, acc_scale,
             TILE_PAGES: gl.constexpr, BLOCK_N: gl.constexpr, COL: gl.constexpr):
    """The online softmax of one key tile's Q.K (``qk``): mask (keys at or past ``hi``),
    exp2, row sums; returns (p as fp16 with V's descales on it, new m_i, l_i, acc rescaled
    for this tile, acc_scale). V's descales go on p over the tile's largest (fp16 p in
    [0, 1]); acc is kept in units of the last tile's largest (acc_scale), so the P.V MMA
    accumulates into it."""
    n = n0 + gl.arange(0, BLOCK_N, layout=COL)
    if TILE_PAGES == 1:
        s = qk * (qk_scale * k_sc)
    else:
        s = qk * qk_scale * gl.expand_dims(k_sc, 0)
    ok = gl.expand_dims(row_ok, 1) & gl.expand_dims(n < hi, 0)
    s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    if TILE_PAGES == 1:
        v_max = gl.where(v_sc > 0, v_sc, 1.0)
        pw = (p * (v_sc / v_max)).to(gl.float16)
    else:
        v_max = gl.max(v_sc, axis=0)
        v_max = gl.where(v_max > 0, v_max, 1.0)
        pw = (p * gl.expand_dims(v_sc / v_max, 0)).to(gl.float16)
    acc = acc * gl.expand_dims(alpha * (acc_scale / v_max), 1)
    return pw, m_new, l_i, acc, v_max


@gluon.jit
def _fp8_paged_split_kernel(
    Q, K, V, Out, Lse, OP, LP, Counters, BlockTable, SeqLens, Slopes, KScale, VScale,
    sqb, sqs, sqh, skp, sks, skh, svp, svs, svh, sob, sos, soh, sbt, s_slope_b,
    sksr, sksh, svsr, svsh,
    scale, softcap, left, right,
    seqlen_q, seqlen_k, n_seqlens, table_rows, num_pages,
    num_q_heads, num_kv_heads, group, m_blocks, num_splits,
    HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr,
    HAS_SEQLENS: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, CAUSAL: gl.constexpr,
    WIN_LEFT: gl.constexpr, WIN_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
    ALIBI: gl.constexpr, KV_FP8: gl.constexpr, ONE_SPLIT: gl.constexpr,
    FUSED_MERGE: gl.constexpr, PREFETCH: gl.constexpr, FP8_F16: gl.constexpr,
    V_AHEAD: gl.constexpr, FP8_QK: gl.constexpr, FP8_PV: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    BLOCK_S: gl.constexpr, DOT_PREC: gl.constexpr, UPCAST: gl.constexpr,
    RING: gl.constexpr, GDC: gl.constexpr,
):
    """Pass 1 of :mod:`.decode` for what ``supports`` admits: one (split, sequence x KV
    head) per one-warp program, partials (normalised output, base-2 LSE) as there.

    Lengths clamp to [0, capacity] (0 past ``SeqLens`` or the table), page ids to
    [0, num_pages): nothing outside the cache is read, whatever the tables hold. ``GDC``
    (a dependent merge) needs nothing here: a programmatic dependent launch that its
    primary never releases early starts as the primary's programs exit."""
    gl.static_assert(PAGED and KV_FP8 and HAS_SEQLENS and HEAD_DIM == 128)
    gl.static_assert(not (WIN_LEFT or WIN_RIGHT or SOFTCAP or ALIBI or FUSED_MERGE))
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    KL: gl.constexpr = gl.BlockedLayout([1, 1, 32], [8, 4, 1], [1, 1, 1], [2, 1, 0])
    VL: gl.constexpr = gl.BlockedLayout([2, 1, 16], [4, 8, 1], [1, 1, 1], [2, 0, 1])
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)

    split = gl.program_id(0)
    pid = gl.program_id(1)
    b = pid // num_kv_heads
    h = pid % num_kv_heads
    seq_len = gl.load(SeqLens + gl.minimum(b, n_seqlens - 1))
    seq_len = gl.where((b < n_seqlens) & (b < table_rows), seq_len, 0)
    seq_len = gl.minimum(gl.maximum(seq_len, 0), seqlen_k)
    b64 = b.to(gl.int64)

    # q rows (one query token: row r is query head h * group + r), d relabelled as K is
    r_a = gl.arange(0, ROWS, layout=gl.SliceLayout(1, A_OP))
    d_a = gl.arange(0, 128, layout=gl.SliceLayout(0, A_OP))
    d_mem = ((d_a // 2) % 4) * 32 + (d_a // 16) * 4 + ((d_a // 8) % 2) * 2 + d_a % 2
    q = gl.load(Q + b64 * sqb + gl.expand_dims((h * group + r_a) * sqh, 1)
                + gl.expand_dims(d_mem, 0), mask=gl.expand_dims(r_a < group, 1), other=0.0)
    # fp16 q over a power of two per row (its largest |q| in [1, 2): exact, no overflow)
    qf = q.to(gl.float32)
    qa = gl.max(gl.abs(qf), axis=1)
    q_pow = gl.where(qa > 0, gl.exp2(gl.floor(gl.log2(gl.maximum(qa, 1e-30)))), 1.0)
    q = (qf / gl.expand_dims(q_pow, 1)).to(gl.float16)
    q_pow = gl.convert_layout(q_pow, ROW)  # once, outside the key loop
    qk_scale = gl.expand_dims(q_pow * (scale * _LOG2E), 1)

    n_tiles = gl.cdiv(seq_len, BLOCK_N)
    lo = (split * n_tiles // num_splits) * BLOCK_N
    hi = gl.minimum(((split + 1) * n_tiles // num_splits) * BLOCK_N, seq_len)
    if CAUSAL and not BOTTOM_RIGHT:  # top-left with one query token: key 0 only
        hi = gl.minimum(hi, 1)
    lo = gl.minimum(lo, hi)

    rows = gl.arange(0, ROWS, layout=ROW)
    row_ok = rows < group
    m_i = gl.full([ROWS], float("-inf"), gl.float32, ROW)
    l_i = gl.zeros([ROWS], gl.float32, ROW)
    acc = gl.zeros([ROWS, 128], gl.float32, MMA)
    acc_scale = scale * 0.0 + 1.0
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, MMA)
    k_head = K + h.to(gl.int64) * skh
    v_head = V + h.to(gl.int64) * svh
    table = BlockTable + b64 * sbt
    # TILE_PAGES 1 (the page size a multiple of the tile) or 2 (the tile two pages): the
    # tile's page ids and descales are scalars, fetched a tile early; 0: per key
    TILE_PAGES: gl.constexpr = 1 if PAGE % BLOCK_N == 0 else (2 if BLOCK_N == 2 * PAGE else 0)
    pages_next = _tile_pages(table, lo, hi, num_pages, PAGE, TILE_PAGES)
    if RING > 0:
        # K and V tiles through a shared-memory ring by cp.async: RING - 1 tiles in flight
        # while one is widened, multiplied and softmaxed, with no registers held for them
        # (the register pipeline below holds one tile, 64 registers, and no more fits)
        k_ring = gl.allocate_shared_memory(K.dtype.element_ty, [RING, BLOCK_N, 4, 32],
                                           _ring_layout(BLOCK_N, 4))
        v_ring = gl.allocate_shared_memory(V.dtype.element_ty, [RING, BLOCK_N, 8, 16],
                                           _ring_layout(BLOCK_N, 8))
        pages = pages_next
        sc_next = _tile_scales(table, lo, hi, num_pages, pages, KScale, sksr, sksh, VScale,
                               svsr, svsh, h, PAGE, TILE_PAGES, BLOCK_N, COL)
        for t in gl.static_range(RING - 1):
            _copy_tile(k_ring.index(t), v_ring.index(t), k_head, v_head, table,
                       lo + t * BLOCK_N, hi, num_pages, pages, skp, sks, svp, svs, PAGE,
                       TILE_PAGES, BLOCK_N, KL, VL)
            pages = _tile_pages(table, lo + (t + 1) * BLOCK_N, hi, num_pages, PAGE,
                                TILE_PAGES)
        for n0 in range(lo, hi, BLOCK_N):
            i = (n0 - lo) // BLOCK_N
            # the slot refilled now was read an iteration ago: every lane is past that read
            cta_barrier()
            ahead = n0 + (RING - 1) * BLOCK_N
            _copy_tile(k_ring.index((i + RING - 1) % RING), v_ring.index((i + RING - 1) % RING),
                       k_head, v_head, table, ahead, hi, num_pages, pages, skp, sks, svp, svs,
                       PAGE, TILE_PAGES, BLOCK_N, KL, VL)
            pages = _tile_pages(table, ahead + BLOCK_N, hi, num_pages, PAGE, TILE_PAGES)
            k_sc, v_sc = sc_next
            sc_next = _tile_scales(table, n0 + BLOCK_N, hi, num_pages,
                                   _tile_pages(table, n0 + BLOCK_N, hi, num_pages, PAGE,
                                               TILE_PAGES),
                                   KScale, sksr, sksh, VScale, svsr, svsh, h, PAGE,
                                   TILE_PAGES, BLOCK_N, COL)
            async_copy.wait_group(RING - 1)  # this tile's group, copied RING - 1 ago
            cta_barrier()
            k = _word_halves(_words(k_ring.index(i % RING).load(KL), BLOCK_N, 4, 32),
                             BLOCK_N, 4, 8)
            v = _word_halves(_words(v_ring.index(i % RING).load(VL), BLOCK_N, 8, 16),
                             BLOCK_N, 8, 4)
            qk = mma_v2(q, _k_operand(k, BLOCK_N, B_OP), zero_s)
            pw, m_i, l_i, acc, acc_scale = _softmax(qk, k_sc, v_sc, n0, hi, row_ok, qk_scale,
                                                    m_i, l_i, acc, acc_scale, TILE_PAGES,
                                                    BLOCK_N, COL)
            acc = mma_v2(gl.convert_layout(pw, A_OP), _v_operand(v, BLOCK_N, B_OP), acc)
        async_copy.wait_group(0)  # the tail's copies (past hi: zero fills) land before exit
    elif PREFETCH:
        # software pipeline in registers: the K and V bytes (as int32 words) and descales of
        # the next tile (DEPTH 1), or of the next two (DEPTH 2: with V_AHEAD), are loaded
        # before this tile is widened, multiplied and softmaxed, so that a warp always has
        # DEPTH tiles of bytes in flight; page ids come a tile earlier still. Loads of tiles
        # at or past ``hi`` are predicated off (the last tiles' "next" reads nothing)
        DEPTH: gl.constexpr = 2 if V_AHEAD else 1
        pages = pages_next
        k_next = _words(_load_tile(k_head, table, lo, hi, num_pages, pages, skp, sks, PAGE,
                                   TILE_PAGES, BLOCK_N, 4, 32, KL), BLOCK_N, 4, 32)
        v_next = _words(_load_tile(v_head, table, lo, hi, num_pages, pages, svp, svs, PAGE,
                                   TILE_PAGES, BLOCK_N, 8, 16, VL), BLOCK_N, 8, 16)
        sc_next = _tile_scales(table, lo, hi, num_pages, pages, KScale, sksr, sksh, VScale,
                               svsr, svsh, h, PAGE, TILE_PAGES, BLOCK_N, COL)
        pages_next = _tile_pages(table, lo + BLOCK_N, hi, num_pages, PAGE, TILE_PAGES)
        if DEPTH == 2:
            pages = pages_next
            k_then = _words(_load_tile(k_head, table, lo + BLOCK_N, hi, num_pages, pages, skp,
                                       sks, PAGE, TILE_PAGES, BLOCK_N, 4, 32, KL),
                            BLOCK_N, 4, 32)
            v_then = _words(_load_tile(v_head, table, lo + BLOCK_N, hi, num_pages, pages, svp,
                                       svs, PAGE, TILE_PAGES, BLOCK_N, 8, 16, VL),
                            BLOCK_N, 8, 16)
            sc_then = _tile_scales(table, lo + BLOCK_N, hi, num_pages, pages, KScale, sksr,
                                   sksh, VScale, svsr, svsh, h, PAGE, TILE_PAGES, BLOCK_N, COL)
            pages_next = _tile_pages(table, lo + 2 * BLOCK_N, hi, num_pages, PAGE, TILE_PAGES)
        for n0 in range(lo, hi, BLOCK_N):
            k = _word_halves(k_next, BLOCK_N, 4, 8)
            v = _word_halves(v_next, BLOCK_N, 8, 4)
            k_sc, v_sc = sc_next
            pages = pages_next
            nxt = n0 + DEPTH * BLOCK_N  # the tile loaded now
            if DEPTH == 2:
                k_next, v_next, sc_next = k_then, v_then, sc_then
            k_new = _words(_load_tile(k_head, table, nxt, hi, num_pages, pages, skp, sks,
                                      PAGE, TILE_PAGES, BLOCK_N, 4, 32, KL), BLOCK_N, 4, 32)
            v_new = _words(_load_tile(v_head, table, nxt, hi, num_pages, pages, svp, svs,
                                      PAGE, TILE_PAGES, BLOCK_N, 8, 16, VL), BLOCK_N, 8, 16)
            sc_new = _tile_scales(table, nxt, hi, num_pages, pages, KScale, sksr, sksh,
                                  VScale, svsr, svsh, h, PAGE, TILE_PAGES, BLOCK_N, COL)
            if DEPTH == 2:
                k_then, v_then, sc_then = k_new, v_new, sc_new
            else:
                k_next, v_next, sc_next = k_new, v_new, sc_new
            if TILE_PAGES > 0:
                pages_next = _tile_pages(table, nxt + BLOCK_N, hi, num_pages, PAGE,
                                         TILE_PAGES)
            qk = mma_v2(q, _k_operand(k, BLOCK_N, B_OP), zero_s)
            pw, m_i, l_i, acc, acc_scale = _softmax(qk, k_sc, v_sc, n0, hi, row_ok, qk_scale,
                                                    m_i, l_i, acc, acc_scale, TILE_PAGES,
                                                    BLOCK_N, COL)
            acc = mma_v2(gl.convert_layout(pw, A_OP), _v_operand(v, BLOCK_N, B_OP), acc)
    else:
        # V_AHEAD: V tiles loaded a tile ahead into registers (as decode's V_AHEAD), so that
        # a V tile's loads are in flight under the Q.K of the next
        if V_AHEAD:
            v_next = _load_tile(v_head, table, lo, hi, num_pages, pages_next, svp, svs, PAGE,
                                TILE_PAGES, BLOCK_N, 8, 16, VL)
        for n0 in range(lo, hi, BLOCK_N):
            pages = pages_next
            if TILE_PAGES > 0:
                pages_next = _tile_pages(table, n0 + BLOCK_N, hi, num_pages, PAGE, TILE_PAGES)
            k = _load_tile(k_head, table, n0, hi, num_pages, pages, skp, sks, PAGE,
                           TILE_PAGES, BLOCK_N, 4, 32, KL)
            if V_AHEAD:
                v = v_next
                v_next = _load_tile(v_head, table, n0 + BLOCK_N, hi, num_pages, pages_next,
                                    svp, svs, PAGE, TILE_PAGES, BLOCK_N, 8, 16, VL)
            else:
                v = _load_tile(v_head, table, n0, hi, num_pages, pages, svp, svs, PAGE,
                               TILE_PAGES, BLOCK_N, 8, 16, VL)
            k_sc, v_sc = _tile_scales(table, n0, hi, num_pages, pages, KScale, sksr, sksh,
                                      VScale, svsr, svsh, h, PAGE, TILE_PAGES, BLOCK_N, COL)
            qk = mma_v2(q, _k_operand(k, BLOCK_N, B_OP), zero_s)
            pw, m_i, l_i, acc, acc_scale = _softmax(qk, k_sc, v_sc, n0, hi, row_ok, qk_scale,
                                                    m_i, l_i, acc, acc_scale, TILE_PAGES,
                                                    BLOCK_N, COL)
            acc = mma_v2(gl.convert_layout(pw, A_OP), _v_operand(v, BLOCK_N, B_OP), acc)

    has = l_i > 0
    safe = gl.where(has, l_i, 1.0)
    o = acc * gl.expand_dims(acc_scale / safe, 1)
    lse2 = gl.where(has, m_i + gl.log2(safe), float("-inf"))
    hq = h * group + rows
    lse_rows = (b64 * num_q_heads + hq) * seqlen_q
    d_o = gl.arange(0, 128, layout=COL)
    d_out = gl.expand_dims((d_o % 8) * 16 + d_o // 8, 0)  # undo P.V's column relabelling
    o_ok = gl.expand_dims(row_ok, 1)
    if ONE_SPLIT:
        gl.store(Out + b64 * sob + gl.expand_dims(hq * soh, 1) + d_out,
                 o.to(Out.dtype.element_ty), mask=o_ok)
        gl.store(Lse + lse_rows, lse2 * _LN2, mask=row_ok)
    else:
        prow = lse_rows * num_splits + split
        gl.store(OP + gl.expand_dims(prow * HEAD_DIM, 1) + d_out, o, mask=o_ok)
        gl.store(LP + prow, lse2, mask=row_ok)
