"""Launch configurations of the split-KV decode kernel, and how many splits to use.

Decode reads the whole KV cache once and does little arithmetic on it, so the kernel is
bound by memory bandwidth: what matters is that enough bytes are in flight on every SM for
the whole run. The configuration fixes the key tile (``block_n``), the pipeline depth
(``num_stages``) and how many programs one SM should be given (``ctas_per_sm``: what fits
in shared memory for a contiguous cache, more for a paged one, whose programs stall on
block-table loads); ``choose_splits`` then cuts each sequence into as many key ranges as it
takes to fill that once, no more, because every extra split costs a partial write and a
share of the merge.

Pure Python: importing this module imports neither Triton nor a GPU library.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """One launch configuration of the decode kernels.

    ``ctas_per_sm`` is how many programs per SM one round of the grid should hold (used by
    ``choose_splits``): what fits at once for a contiguous cache, more where programs stall
    on dependent loads (paged caches) so that the SM can switch between them.
    ``overhead_tiles`` is the fixed cost of one program (query load, partial write, its share
    of the merge) counted in key tiles. ``fused_merge`` lets the last split of a (sequence,
    KV head) merge the partials itself instead of a second launch: one launch less on the
    host, but on the H200 the serial merge in that last program cost more GPU time than the
    second launch (1 x 32k: 41.0 vs 36.0 us), so it is off by default. ``prefetch_pages``
    (paged caches) loads the next key tile's page ids one loop iteration early, so that a
    tile's K/V addresses never wait on a block-table load in the same iteration.
    ``fp8_dot`` (FP8 caches): what e4m3 tiles are widened to for the dots: ``"q"`` the
    query dtype, ``"fp16"`` fp16 (one native conversion per two values; q is scaled into
    fp16 by a power of two per row, p by the tile's largest V descale), ``"fp8qk"`` the
    Q.K dot in e4m3 x e4m3 (q quantized to e4m3 per row, K as stored: never widened) and
    P.V as ``"fp16"``, ``"fp8qk2"`` the same with q's e4m3 rounding error as a second
    e4m3 term (two dots on the K tile, q to ~2^-8), ``"fp8"`` / ``"fp8_2"`` both dots in
    e4m3 (p quantized too, V as stored; q in one / two terms); the
    e4m3 dots take Hopper's wgmma only with ``min_block_m=64`` (below it Triton widens the
    operands to fp16 itself). ``min_block_m``: the smallest query-row tile (padded rows;
    0: ``block_m``'s choice). ``fp8_v_ahead``
    (FP8 caches): V tiles are loaded one key tile ahead into registers and widened there.
    ``one_round``: ``choose_splits`` only considers split counts whose programs fit one
    round of ``ctas_per_sm`` per SM, so that every program is resident from the start (no
    second, partly filled round whose tail leaves SMs idle), and takes the most on ties.
    ``maxnreg``: a register cap for pass 1 (0: the compiler's choice), to fit more
    programs per SM. ``gluon`` (paged e4m3 caches on sm90): pass 1 is the Gluon kernel of
    :mod:`.decode_gluon`; the table never holds it, but an e4m3 paged call on sm90 with no
    ``config`` takes ``gluon_fp8_row``'s row wherever the kernel serves it. ``fp8_ring``
    (Gluon pass 1, a power of two, 0: off): K and V tiles go through a shared-memory ring
    of this many slots by ``cp.async``, ``fp8_ring - 1`` tiles in flight per program
    without registers to hold them (it takes the place of ``prefetch_pages``' register
    pipeline). ``pdl`` (sm90 and later, CUDA, two launches): the merge is a programmatic
    dependent launch; pass 1's programs allow it as they start, so its programs are placed
    while pass 1's last ones run and wait there (``griddepcontrol.wait``) until every
    partial is written: the second launch's latency hides behind pass 1 (FlashAttention-3
    launches its combine kernel this way). Elsewhere it does nothing.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    ctas_per_sm: int = 2
    overhead_tiles: float = 2.0
    fused_merge: bool = False
    max_splits: int = 128
    merge_warps: int = 4
    prefetch_pages: bool = False
    fp8_dot: str = "q"
    fp8_v_ahead: bool = False
    one_round: bool = False
    min_block_m: int = 0
    maxnreg: int = 0
    gluon: bool = False
    fp8_ring: int = 0
    pdl: bool = True

    def __post_init__(self) -> None:
        # the kernels' tiles: a non-power of two failed inside the launch (Triton: "arange's
        # range must be a power of 2"), 0 divided by zero while planning the splits
        for name in ("block_n", "num_warps", "merge_warps"):
            n = getattr(self, name)
            low = 16 if name == "block_n" else 1  # 16: the smallest tl.dot tile
            if not isinstance(n, int) or n < low or n & (n - 1):
                raise ValueError(f"DecodeConfig: {name}={n!r}; use a power of two >= {low}")
        if self.fp8_ring not in (0, 2, 4, 8):
            raise ValueError(f"DecodeConfig: fp8_ring={self.fp8_ring}; use 0 (none) or a ring "
                             "of 2, 4 or 8 slots")
        if self.fp8_ring and not self.gluon:
            raise ValueError(f"DecodeConfig: fp8_ring={self.fp8_ring} without gluon=True: the "
                             "ring is the Gluon pass 1's (the portable kernel's pipeline is "
                             "the compiler's, num_stages); set gluon=True or fp8_ring=0")

    def with_(self, **changes: object) -> DecodeConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


#: Per architecture family. The sm90 rows come from the sweep on an H200 in
#: docs/benchmarks/triton_decode.md; the other rows are starting points, not measurements.
_TABLE: dict[str, DecodeConfig] = {
    # Interpreter: 16-key tiles so that contexts of 20..100 keys cross several tiles and
    # several splits in the tests; sm_count is small there too (``INTERPRETER_SM_COUNT``).
    "cpu": DecodeConfig(block_n=16, num_warps=1, num_stages=1, ctas_per_sm=1,
                        overhead_tiles=0.5),
    "sm80": DecodeConfig(block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2),
    # 4 stages of 64-key K and V tiles (128 KB of shared memory): one program per SM keeps
    # enough bytes in flight (1 x 32k: 16 splits, 3.7 TB/s; 33 splits: 3.4).
    "sm90": DecodeConfig(block_n=64, num_warps=4, num_stages=4, ctas_per_sm=1),
    "rocm": DecodeConfig(block_n=64, num_warps=4, num_stages=1, ctas_per_sm=2),
    "generic": DecodeConfig(block_n=32, num_warps=4, num_stages=2, ctas_per_sm=2),
}
#: Paged caches: each key's address waits on a block-table load, so a program stalls more
#: and it takes about four programs per SM to hide it (H200, page 16: 1 x 32k went from
#: 1.9 TB/s at 16 splits to 3.3 at 66; 16 x 8k from 2.2 at 1 split to 4.0 at 4).
#: Prefetching the next tile's page ids (``prefetch_pages``) measured on an H200 on
#: 2026-12-01 (docs/benchmarks/triton_decode_paged.md), random table: 1 x 128k at 64 splits
#: 174.6 -> 138.4 us, 1 x 32k 50.7 -> 47.7 us, 64 x 32k 1928 -> 1926 us (no loss anywhere).
#: Its sm90 binary (104 KB of shared memory) fits two programs per SM, not four: grids it
#: plans as one round run as two; those that fit one round take ``_PAGED_FEW`` (sweep 3).
_PAGED: dict[str, DecodeConfig] = {
    "sm90": DecodeConfig(block_n=64, num_warps=4, num_stages=4, ctas_per_sm=4,
                         prefetch_pages=True),
}
#: Paged caches whose (sequence, KV head) pairs all fit in one round of two programs per SM
#: (``decode_config``): 3 stages (70 KB of shared memory and 110 registers in the sm90
#: binary: up to three programs per SM), splits that fill one round of two programs per SM
#: (``one_round``; 1 x 8 KV heads: 33 splits, 264 programs). H200 2026-12-01, random table,
#: GPU time (docs/benchmarks/triton_decode_paged.md, sweep 3): 1 x 32k 44.4-44.7 -> 40.2 us,
#: 1 x 128k 137.6-137.8 -> 129.4-129.5 us (4.15 TB/s), 32 x 4k (1 split) 135.8-135.9 ->
#: 127.6-127.7 us. More programs lose whenever they make a second, partly filled round
#: (1 x 128k at 64 / 128 splits: 162 / 138 us); 32-key tiles with 2 warps at 66 splits, 2
#: stages at 64, 4 stages at 33 ran 0.6% faster to 3.2% slower. At 64 x 32k (512 pairs, this
#: row would make 1.3 rounds) these tiles lose (1922 -> 2414 us): the 4-stage row stays.
_PAGED_FEW: dict[str, DecodeConfig] = {
    "sm90": DecodeConfig(block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2,
                         prefetch_pages=True, one_round=True),
}

#: FP8 (e4m3) paged caches: half the bytes per key, tiles widened in registers before the
#: dots. H200, 2026-12-01, random table, GPU time (docs/benchmarks/triton_decode_paged.md):
#: e4m3 widened to bf16 through the compiler's pipeline ran 64 x 32k at 2384-2409 us (0.80x
#: the bf16 cache): the V tile, the P.V dot's transposed operand, was read from shared
#: memory one byte at a time (there is no 8-bit ldmatrix.trans). Widening to fp16 instead
#: 2120-2137 us; V tiles loaded a tile ahead into registers and widened there
#: (``fp8_v_ahead``) 1997 us, with 3 K stages 1967 us (bf16 cache 1921 us); 1 x 128k
#: 130.8 us (bf16 137.7), 1 x 32k 43.6 us (bf16 44.5). 64-key tiles (2647 us), 8 warps
#: (3101) and 256-key tiles (2397) lost. Sweep 4 (same day, 20:27 UTC, bf16 row 1932 us in
#: that run): every e4m3 tensor-core variant lost; Triton 3.6 emits e4m3 MMAs on sm90 only
#: as 64-row wgmma (``min_block_m=64``), 16x the 4 real rows: Q.K in e4m3 3652-3968 us, both
#: dots in e4m3 3914-5818, the fp16 row on 64 rows 4207; Q.K in e4m3 on 16 rows (widened by
#: Triton) 2690; 2 warps with 64-key tiles at 2 splits 1934 (row 1968): within noise, not
#: taken. This row stays.
_FP8_PAGED: dict[str, DecodeConfig] = {
    "sm90": DecodeConfig(block_n=128, num_warps=4, num_stages=3, ctas_per_sm=4,
                         prefetch_pages=True, fp8_dot="fp16", fp8_v_ahead=True),
}

#: The Gluon pass 1 for paged e4m3 caches (:mod:`.decode_gluon`): one warp per program,
#: 16-key tiles (with pages of 16 keys or a multiple, a tile lies in one page: one page id
#: and one descale pair per tile), no stages (loads go straight to registers). Its sm90
#: build takes 168 registers, so 12 one-warp programs fit an SM: 12 per SM plan the splits.
#: H200, 2026-12-02 (ca449c7, random table, GPU time; bf16 row / portable e4m3 row / this):
#: 64 x 32k 2204 / 1949 / 1360 us, 1 x 128k 147 / 129 / 121, 32 x 4k 131 / 129 / 100; it
#: passed the FlashAttention-rule GPU tests. ``gluon_fp8_row`` binds its cp.async ring.
GLUON_FP8_PAGED = DecodeConfig(block_n=16, num_warps=1, num_stages=1, ctas_per_sm=12,
                               fp8_dot="fp16", gluon=True)
#: The software-pipelined loop (``prefetch_pages``, not a row: ``config`` asks for it) ran
#: 64 x 32k in 1153 us capped at 168 registers (d9fd75b; 1.87x that run's bf16 row), 32 x
#: 4k in 86.5 us; uncapped (203 registers, 8 per SM) 1 x 128k in 89.5 us.
#: The cp.async ring (``fp8_ring``): K and V tiles through shared memory instead of the
#: register pipeline above (which holds one tile in 64 registers and needs the 168 cap to
#: keep 12 programs per SM). sm90 builds (Triton 3.6, page 16, 16-key tiles): 155-163
#: registers, no stack, 499 instructions per tile (485 pipelined), 4 KB of shared memory
#: per slot. H200, 2026-12-02 (d6cb600, random table, GPU time, bf16 row 2172 / 145.3 /
#: 128.1 us in that run; 7e02af2, docs/benchmarks/h200_20261202_s9): 64 x 32k 2 slots 1051 us (2.07x
#: the bf16 row), 4 slots 1071, pipelined capped 1123, uncapped 1207; 1 x 128k 88.4 / 89.1 /
#: 99.5 / 88.8; 32 x 4k 81.7 / 83.2 / 85.3 / 89.0. 8 slots (32 KB: 7 programs per SM) lost
#: everywhere (1503 / 149.5 / 131.1), as did 32-key tiles in 4 slots (1489 / 138.7 / 128.2)
#: and twice the splits (1072 / 107.1 / 95.3). Two slots win every cell: what this pass
#: needed was its registers back, not more tiles in flight.
GLUON_FP8_PAGED_RING = GLUON_FP8_PAGED.with_(fp8_ring=2)


def gluon_fp8_row(arch: str) -> DecodeConfig | None:
    """The Gluon row for a paged e4m3 cache (None off sm90): the two-slot cp.async ring,
    12 programs per SM. The caller checks that the kernel serves the call
    (``decode_gluon.supports``)."""
    if arch != "sm90":  # built and checked for Hopper only
        return None
    return GLUON_FP8_PAGED_RING


#: SM count assumed under the CPU interpreter: small, so that the tests exercise splitting.
INTERPRETER_SM_COUNT = 4


def _family(arch: str) -> str:
    if arch == "cpu":
        return "cpu"
    if arch.startswith("gfx"):
        return "rocm"
    if arch.startswith("sm"):
        try:
            return "sm90" if int(arch[2:]) >= 90 else "sm80"
        except ValueError:
            return "generic"
    return "generic"


def decode_config(arch: str, dtype: str = "bf16", paged: bool = False,
                  kv_fp8: bool = False, programs: tuple[int, int] | None = None
                  ) -> DecodeConfig:
    """The table's configuration for ``arch`` (``cpu``, ``sm90``, ``gfx942``...); ``kv_fp8``
    for an e4m3 cache (its own row where one was measured: paged on sm90). ``programs``:
    (batch x KV heads x row blocks, SM count); a 16-bit paged cache whose pairs all fit in
    one round of the few-programs row (``_PAGED_FEW``, where there is one) takes it.

    fp32 tiles take twice the shared memory of 16-bit ones, so the key tile is halved there
    (on GPUs) to keep the same number of programs resident.
    """
    family = _family(arch)
    cfg = _PAGED.get(family, _TABLE[family]) if paged else _TABLE[family]
    if kv_fp8 and paged:
        cfg = _FP8_PAGED.get(family, cfg)
    elif paged and programs is not None:
        few = _PAGED_FEW.get(family)
        if few is not None and programs[0] <= programs[1] * few.ctas_per_sm:
            cfg = few
    if dtype == "fp32" and arch != "cpu":
        cfg = cfg.with_(block_n=max(16, cfg.block_n // 2))
    return cfg


def block_m(rows: int) -> int:
    """Query-row tile for ``rows`` = query tokens x GQA group: a power of two in [16, 64].

    16 is the smallest ``tl.dot`` tile; above 64 rows the rows are split over several
    programs (each re-reads its KV head, from L2 when they run together).
    """
    return min(64, max(16, 1 << (max(rows, 1) - 1).bit_length()))


@functools.lru_cache(maxsize=4096)
def choose_splits(batch: int, kv_heads: int, max_seqlen_k: int, sm_count: int,
                  cfg: DecodeConfig, m_blocks: int = 1) -> int:
    """How many key ranges each (sequence, KV head) is cut into.

    Programs = batch x kv_heads x m_blocks x splits. With ``capacity = sm_count x
    ctas_per_sm`` programs per round, the run takes ``ceil(programs / capacity)``
    rounds, each as long as one program's key tiles plus its fixed overhead; the merge adds
    one more overhead when splits > 1. The cheapest split count under that model wins, the
    smallest on ties (fewer partials to write and merge). A ``one_round`` config stays in one
    round and takes the most splits on ties: there a tie means the same longest program,
    and the extra split only evens out the others. Examples on an H200 (132 SMs, 32/8 heads):
    1 x 32k context -> 16 splits contiguous, 33 paged (the few-programs row); 64 x 32k -> 1
    either way.
    """
    tiles = math.ceil(max(max_seqlen_k, 0) / cfg.block_n)
    base = max(1, batch * kv_heads * m_blocks)
    capacity = max(1, sm_count * cfg.ctas_per_sm)
    if tiles <= 1 or sm_count <= 0:
        return 1
    limit = max(1, min(cfg.max_splits, tiles))
    if cfg.one_round:
        limit = max(1, min(limit, capacity // base))
    best, best_cost = 1, math.inf
    for s in range(1, limit + 1):
        rounds = math.ceil(base * s / capacity)
        cost = rounds * (math.ceil(tiles / s) + cfg.overhead_tiles)
        if s > 1:
            cost += cfg.overhead_tiles
        if cost < best_cost - 1e-9 or (cfg.one_round and cost <= best_cost + 1e-9):
            best, best_cost = s, cost
    return best
