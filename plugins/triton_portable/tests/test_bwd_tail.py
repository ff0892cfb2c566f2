"""The Hopper backward's last wave in parts (:mod:`attnhub_triton_portable.bwd_tail`), on
the CPU: how many parts the cost model picks, that the parts cover each walk once, and the
combine kernel (under the interpreter) that sums a key tile's parts into dK and dV. The
Gluon kernel that fills the parts' slots runs on an sm90 GPU (test_dense_gluon_gpu.py)."""

from __future__ import annotations

import math

import pytest
import torch
from attnhub_triton_portable import bwd_tail


def test_an_even_last_wave_is_not_split() -> None:
    for units, sms in ((264, 132), (132, 132), (2 * 114, 114)):
        assert bwd_tail.tail_parts(units, sms, 256) == 1


def test_the_16k_backward_last_wave_is_split_and_beats_the_whole_walk() -> None:
    """16k, 16 heads on 132 SMs: 2048 programs, 68 in the last wave."""
    units, sms, walk = 2048, 132, 256
    parts = bwd_tail.tail_parts(units, sms, walk)
    assert 1 < parts <= bwd_tail.MAX_PARTS
    rest = units % sms
    cost = math.ceil(rest * parts / sms) * (walk / parts + bwd_tail.PART_RAMP_TILES)
    assert cost < 0.7 * walk  # the last wave takes under 70% of a whole program's time


def test_short_walks_are_not_split_below_the_smallest_part() -> None:
    for walk in range(1, 64):
        parts = bwd_tail.tail_parts(100, 132, walk)
        assert parts == 1 or walk // parts >= bwd_tail.MIN_PART_TILES


@pytest.mark.parametrize("bad", [(0, 132, 8), (10, 0, 8), (10, 132, 0)])
def test_sizes_below_one_are_refused(bad: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        bwd_tail.tail_parts(*bad)


def test_the_parts_cover_each_walk_once() -> None:
    for walk in (1, 5, 16, 255):
        for parts in range(1, 12):
            ranges = [bwd_tail.part_range(p, parts, walk) for p in range(parts)]
            assert ranges[0][0] == 0 and ranges[-1][1] == walk
            assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("key_desc", [1, 0])
def test_combine_sums_each_split_tile_in_order_and_touches_nothing_else(
        dtype: torch.dtype, key_desc: int) -> None:
    """4 key tiles x 3 KV heads x 2 batches = 24 programs, the last 5 in 3 parts: their
    tiles of dK and dV become the parts' fp32 sums (in part order, then cast); every other
    row keeps what the main kernel wrote."""
    g = torch.Generator().manual_seed(3)
    block_n, d, parts, batch, hkv, n_key_tiles = 16, 16, 3, 2, 3, 4
    units = n_key_tiles * batch * hkv
    rest = 5
    full_units = units - rest
    dk = torch.randn(batch, n_key_tiles * block_n, hkv, d, generator=g).to(dtype)
    dv = torch.randn(batch, n_key_tiles * block_n, hkv, d, generator=g).to(dtype)
    before = dk.clone(), dv.clone()
    slots = bwd_tail.scratch(rest, parts, block_n, d, torch.device("cpu"))
    slots.copy_(torch.randn(slots.shape, generator=g))
    bwd_tail.combine(slots, dk, dv, full_units, n_key_tiles, parts, key_desc)
    touched = torch.zeros(batch, n_key_tiles * block_n, hkv, dtype=torch.bool)
    for r in range(rest):
        unit = full_units + r
        bh, x = divmod(unit, n_key_tiles)
        b, hk = divmod(bh, hkv)
        n0 = (n_key_tiles - 1 - x if key_desc else x) * block_n
        for which, grad in enumerate((dk, dv)):
            want = slots[r * parts, which].clone()
            for p in range(1, parts):
                want += slots[r * parts + p, which]
            assert torch.equal(grad[b, n0:n0 + block_n, hk], want.to(dtype))
        touched[b, n0:n0 + block_n, hk] = True
    assert int(touched.sum()) == rest * block_n
    for grad, old in zip((dk, dv), before):
        assert torch.equal(grad[~touched], old[~touched])
