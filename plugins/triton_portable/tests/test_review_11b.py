"""Review 11, second pass over the grid-limit fix (``launch.flat_grid``, ``tiles.flat_program``,
``decode._chunked``), under the interpreter.

Found: a flat grid past the first axis's 2**31 - 1 programs (a thd batch of many documents
beside one very long one: every document gets the longest's tiles) went to the driver;
decode in batch slices refused lengths or a block table shorter than the batch (the kernel
reads such sequences as length 0, a slice past their end was an empty tensor); and a decode
call whose one sequence alone exceeds the grid axis was sliced into launches still past it.
Checked too: the flat index keeps the 2-D grid's program order, and the dense kernels'
answers with Sq != Sk on bshd, where the kernels now read the longest lengths."""

from __future__ import annotations

import os
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import triton
import triton.language as tl
from attnhub_triton_portable import bwd, decode, fwd, tiles
from attnhub_triton_portable.configs import bwd_config, fwd_config
from attnhub_triton_portable.launch import DenseArgs, flat_grid

import attnhub
from attnhub.plugin import AttnParams, InputError
from attnhub.testing import (assert_fa_rule, assert_grads_fa_rule, assert_lse, fa_references,
                             record_launches)

#: every launch of the dense forward and backward
DENSE_KERNELS = {fwd: ["_fwd_kernel"], bwd: ["_delta_kernel", "_dkdv_kernel", "_dq_kernel"]}


@triton.jit
def _where_kernel(OUT, n, BLOCK: tl.constexpr):
    """Each program's (tile, row) by ``tiles.flat_program``."""
    tile, row = tiles.flat_program(n, BLOCK)
    pid = tl.program_id(0)
    tl.store(OUT + pid * 2, tile)
    tl.store(OUT + pid * 2 + 1, row)


def test_flat_program_keeps_the_2d_grid_order() -> None:
    """Program p of the flat grid is the p-th of the old (tiles, rows) grid in CUDA's order
    (first axis fastest), the tile reversed: (3, 0), (2, 0), (1, 0), (0, 0), (3, 1), ..."""
    n, block, rows = 50, 16, 5  # 4 tiles, the last partial
    grid = flat_grid(n, block, rows)
    out = torch.full((grid[0], 2), -1, dtype=torch.int32)
    _where_kernel[grid](out, n, BLOCK=block)
    tiles_ = -(-n // block)
    assert out.tolist() == [[tiles_ - 1 - x, y] for y in range(rows) for x in range(tiles_)]


def test_a_flat_grid_past_int32_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """thd, 1025 documents x 64 heads with a longest document of 2**26 rows: 2**22 tiles x
    65600 rows is past 2**31 - 1 programs; forward and backward refuse it by name (it went
    to the launch), and nothing is launched."""
    grids = record_launches(monkeypatch, DENSE_KERNELS)
    docs, hq = 1025, 64
    q = torch.zeros(docs, hq, 16)
    k = torch.zeros(docs, 8, 16)
    cu = torch.arange(docs + 1, dtype=torch.int32)
    params = AttnParams(scale=0.25, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2**26,
                        max_seqlen_k=2**26)
    args = DenseArgs.from_params(q, k, k, params, "thd")
    with pytest.raises(InputError, match="split the batch"):
        fwd.flash_fwd(args, fwd_config("cpu", 16, "fp32", False))
    lse = torch.zeros(hq, docs)
    with pytest.raises(InputError, match="split the batch"):
        bwd.flash_bwd(args, q, lse, q, bwd_config("cpu", 16, "fp32", False))
    assert grids == []


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub(hardware="cpu")


@pytest.mark.parametrize("sq,sk", [(37, 20), (20, 37)])
def test_dense_bshd_with_unequal_lengths(hub: attnhub.Hub, sq: int, sk: int) -> None:
    """bshd, 2 sequences, GQA 4:2, causal bottom-right with a window, several 16-row tiles
    on either side: out, LSE, dq, dk, dv by the FlashAttention rule against fp64 (the
    kernels' per-row tile count and lengths now come from ``max_seqlen_q/k``)."""
    g = torch.Generator().manual_seed(sq)
    base = [torch.randn(2, n, h, 16, generator=g) for n, h in ((sq, 4), (sk, 2), (sk, 2))]
    qkv = [t.clone().requires_grad_() for t in base]
    out, lse = hub.attention(*qkv, backend="triton", causal=True, window=(9, 0),
                             return_lse=True)
    leaves = [t.clone().requires_grad_() for t in base]
    params = AttnParams(scale=0.25, causal=True, window=(9, 0))
    ref64, ref_lse, same = fa_references(*leaves, params)
    assert_fa_rule(out, ref64, same)
    assert_lse(lse, ref_lse, atol=1e-4)
    assert_grads_fa_rule(out, ref64, same, qkv, ref_inputs=leaves)


def _sliced(monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    """Lower decode's grid limit and forget its shapes: later calls take the sliced path."""
    monkeypatch.setattr(decode, "MAX_GRID_Y", limit)
    monkeypatch.setattr(decode, "_shapes", {})
    monkeypatch.setattr(decode, "_families", {})


@pytest.mark.parametrize("case", ["lens_short", "table_short", "lens_short_paged"])
def test_decode_slices_read_short_lengths_and_tables_as_one_launch(
        monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Batch 5 x 2 KV heads in slices of 2 (limit 5): lengths or a block table with fewer
    rows than the batch give out and LSE bitwise those of one launch, the sequences past
    their end with length 0 (a slice past their end raised "must be a non-empty")."""
    g = torch.Generator().manual_seed(5)
    b, hkv, hq, d = 5, 2, 4, 16
    q = torch.randn(b, 1, hq, d, generator=g)
    kw: dict[str, Any] = {"scale": 0.3, "num_splits": 2}
    if case == "lens_short":
        k, v = (torch.randn(b, 33, hkv, d, generator=g) for _ in "kv")
        kw["seqlens_k"] = torch.tensor([7, 33, 20], dtype=torch.int32)
    else:
        k, v = (torch.randn(9, 8, hkv, d, generator=g) for _ in "kv")
        table = torch.randint(0, 9, (b, 4), generator=g, dtype=torch.int32)
        lens = torch.tensor([30, 3, 17, 25, 9], dtype=torch.int32)
        short = case == "table_short"
        kw.update(block_table=table[:3] if short else table, seqlens_k=lens if short
                  else lens[:2])
    whole = decode.decode_attention(q, k, v, **kw)
    assert whole[1] is not None and (whole[1][3:] == float("-inf")).all()
    _sliced(monkeypatch, 5)
    assert decode._batch_chunk(b, 1, hq, hkv) == 2
    out, lse = decode.decode_attention(q, k, v, **kw)
    assert torch.equal(out, whole[0]) and torch.equal(lse, whole[1])


def test_decode_one_sequence_past_the_grid_axis_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One sequence's programs (2 KV heads x 1 row block) above the limit (here 1): no slice
    of the batch fits, so the call is refused by name instead of launched past it."""
    _sliced(monkeypatch, 1)
    q = torch.zeros(3, 1, 4, 16)
    k = torch.zeros(3, 8, 2, 16)
    with pytest.raises(ValueError, match="past a grid axis's 1"):
        decode.decode_attention(q, k, k, scale=0.25)
