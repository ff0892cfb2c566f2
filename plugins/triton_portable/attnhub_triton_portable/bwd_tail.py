"""The last wave of the Hopper backward, split: its key tiles' query walks in parts.

Why: the Gluon backward (:mod:`.bwd_gluon`) runs one program per (key tile, KV head), one
program per SM (its 208 KiB of shared memory), and every program of an unmasked call does
the same work. At 16k, 16 heads that is 2048 programs on 132 SMs: 15 full waves and a 16th
with 68 programs, so half the card idles for a sixteenth of the kernel (3%). Here the
programs of that last wave each walk a part of their query tiles, the parts run side by side
on the idle SMs, and each part writes its fp32 dK and dV to a scratch slot; :func:`combine`
sums a tile's parts in a fixed order (dK and dV stay deterministic) and writes them in the
gradients' dtype. The number of parts minimises the last wave's time under a cost model
(:func:`tail_parts`). H100, 16k full (docs/benchmarks/h100_20261205_s18): the kernel 10.65
ms in 7 parts (the model's pick) against 11.09 whole, 10.94 ms through the API against 11.20;
4 and 8 parts within 0.3% of 7. Masked calls stay whole: their longest walks go first, so
their last wave is short walks already (``bwd_gluon.KEY_DESC``).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from . import tiles

#: What a part costs beyond its query tiles, in query tiles: loading its K and V tile and
#: filling the load ring before the first step (an estimate, a tile step is ~2.7 us at d128).
PART_RAMP_TILES = 1.0
#: The most parts a key tile is split into (each part's scratch is 2 x BLOCK_N x D fp32),
#: and the fewest query tiles a part walks.
MAX_PARTS, MIN_PART_TILES = 8, 4


@functools.lru_cache(maxsize=256)  # asked on every backward call of a shape
def tail_parts(units: int, sms: int, walk: int) -> int:
    """Parts each program of the last, partial wave is split into (1: none).

    ``units`` programs of ``walk`` query tiles each, on ``sms`` SMs one program a time: the
    first ``units - units % sms`` run whole; the rest are split when the split's last wave,
    ``ceil(rest * parts / sms)`` parts of ``walk / parts + PART_RAMP_TILES`` tiles, ends
    sooner than one whole program does. Ties keep fewer parts (less scratch)."""
    if units < 1 or sms < 1 or walk < 1:
        raise ValueError(f"tail_parts(units={units}, sms={sms}, walk={walk}): all must be >= 1")
    rest = units % sms
    if rest == 0:
        return 1
    best, best_cost = 1, float(walk)
    for parts in range(2, MAX_PARTS + 1):
        if walk < parts * MIN_PART_TILES:
            break
        cost = math.ceil(rest * parts / sms) * (walk / parts + PART_RAMP_TILES)
        if cost < best_cost:
            best, best_cost = parts, cost
    return best


def part_range(part: int, parts: int, walk: int) -> tuple[int, int]:
    """Query tiles [lo, hi) of the walk that part ``part`` of ``parts`` takes (the kernel
    computes the same split; every tile in exactly one part)."""
    return part * walk // parts, (part + 1) * walk // parts


def scratch(rest: int, parts: int, block_n: int, head_dim: int, device: torch.device
            ) -> torch.Tensor:
    """Uninitialised fp32 slots, one (dK, dV) pair per part: each part writes all of its."""
    return torch.empty((rest * parts, 2, block_n, head_dim), dtype=torch.float32,
                       device=device)


@triton.jit
def _combine_kernel(Scratch, DK, DV, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, full_units,
                    n_key_tiles, key_desc, num_kv_heads, PARTS: tl.constexpr,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                    ROUND: tl.constexpr):
    r = tl.program_id(0)
    which = tl.program_id(1)  # 0: dK, 1: dV
    rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, HEAD_DIM)
    # program ``full_units + r`` of the backward (its order: bwd_gluon._bwd_kernel)
    unit = full_units + r
    bh = unit // n_key_tiles
    x = unit % n_key_tiles
    n0 = (x + key_desc * (n_key_tiles - 1 - 2 * x)) * BLOCK_N
    b = (bh // num_kv_heads).to(tl.int64)
    hk = bh % num_kv_heads
    tile = rows[:, None] * HEAD_DIM + cols[None, :]
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for p in tl.static_range(PARTS):
        slot = ((r * PARTS + p) * 2 + which).to(tl.int64)
        acc += tl.load(Scratch + slot * (BLOCK_N * HEAD_DIM) + tile)
    r64 = (n0 + rows).to(tl.int64)[:, None]
    if which == 0:
        ptrs = DK + b * sdkb + hk * sdkh + r64 * sdks + cols[None, :]
        tl.store(ptrs, tiles.narrow(acc, DK.dtype.element_ty, ROUND))
    else:
        ptrs = DV + b * sdvb + hk * sdvh + r64 * sdvs + cols[None, :]
        tl.store(ptrs, tiles.narrow(acc, DV.dtype.element_ty, ROUND))


def combine(slots: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, full_units: int,
            n_key_tiles: int, parts: int, key_desc: int) -> None:
    """dK and dV of the split key tiles: each the sum of its parts' slots, parts in order.

    ``slots``: (rest * parts, 2, BLOCK_N, D) from :func:`scratch`, filled by the parts of
    programs ``full_units ..`` of the backward, which took their key tiles last first when
    ``key_desc``; ``dk``/``dv``: (B, Sk, H_kv, D). On the CPU
    (the interpreter, tests) bf16 is rounded as the GPU rounds (:func:`.tiles.narrow`)."""
    rest = slots.shape[0] // parts
    block_n, head_dim = slots.shape[2], slots.shape[3]
    rows = min(block_n, 32)
    grid = (rest, 2, block_n // rows)
    _combine_kernel[grid](slots, dk, dv, dk.stride(0), dk.stride(1), dk.stride(2),
                          dv.stride(0), dv.stride(1), dv.stride(2), full_units, n_key_tiles,
                          key_desc, dk.shape[2], PARTS=parts, BLOCK_N=block_n, HEAD_DIM=head_dim,
                          ROWS=rows,
                          ROUND=dk.device.type == "cpu" and dk.dtype == torch.bfloat16)
