"""Review 11: launch grids within CUDA's limits, and what the fix changed, under the interpreter.

CUDA caps a grid's second axis at 65535 programs. The dense kernels launched (query or key
tiles, B x heads) and the decode pass 1 (splits, B x KV heads x row blocks), so a thd batch
of 2048 documents x 32 heads, or decode at batch 8192 x 8 KV heads, failed at launch with
"Triton Error [CUDA]: invalid argument" (the interpreter has no such limit: no CPU test saw
it). Now the dense kernels take one flat axis (``launch.flat_grid``, tiles fastest: the
order the 2-D grid had), the Gluon forward (a 2-D grid, GPU-only) refuses such calls to the
portable one, and decode runs slices of the batch (``decode._chunked``). Also: decode tile
configs no kernel can run, and a softcap variant that made every score NaN, are refused."""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from attnhub_triton_portable import bwd, decode, fwd, variants
from attnhub_triton_portable.configs import bwd_config, fwd_config
from attnhub_triton_portable.decode_configs import DecodeConfig
from attnhub_triton_portable.launch import MAX_GRID_Y, DenseArgs

import attnhub
from attnhub.plugin import AttnParams
from attnhub.testing import (assert_fa_rule, assert_grads_fa_rule, assert_lse, fa_references,
                             record_launches)

#: every launch of the dense forward and backward
DENSE_KERNELS = {fwd: ["_fwd_kernel"], bwd: ["_delta_kernel", "_dkdv_kernel", "_dq_kernel"]}


def _assert_within_cuda(grids: list[tuple[int, ...]]) -> None:
    assert grids
    for grid in grids:
        assert grid[0] <= 2**31 - 1 and all(g <= MAX_GRID_Y for g in grid[1:]), grid


def test_dense_grids_fit_cuda_with_65600_document_heads(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """thd, 1025 one-token documents x 64 heads: every forward and backward launch's grid
    is within CUDA's axes (was (1, 65600)), and the Gluon forward declines the call."""
    grids = record_launches(monkeypatch, DENSE_KERNELS)
    docs, hq = 1025, 64
    q = torch.zeros(docs, hq, 16)
    k = v = torch.zeros(docs, 8, 16)
    cu = torch.arange(docs + 1, dtype=torch.int32)
    args = DenseArgs.from_params(q, k, v, AttnParams(scale=0.25, cu_seqlens_q=cu,
                                                     cu_seqlens_k=cu), "thd")
    out, lse = fwd.flash_fwd(args, fwd_config("cpu", 16, "fp32", False))
    bwd.flash_bwd(args, out, lse, torch.zeros_like(out), bwd_config("cpu", 16, "fp32", False))
    _assert_within_cuda(grids)
    assert len(grids) == 4
    assert "65535" in (fwd.gluon_unsupported(args, {"GLUON": True}) or "")


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub(hardware="cpu")


def test_flat_grid_keeps_every_tile_of_every_document(hub: attnhub.Hub) -> None:
    """The flat grid's (tile, row) mapping on uneven documents of several tiles (16-row
    tiles on the CPU), GQA 4:2, causal bottom-right: out, LSE and dq, dk, dv by the
    FlashAttention rule against the fp64 reference."""
    g = torch.Generator().manual_seed(11)
    lq, lk = [17, 0, 33, 5], [40, 3, 33, 0]
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], dtype=torch.int32)
    base = [torch.randn(sum(n), h, 16, generator=g) for n, h in ((lq, 4), (lk, 2), (lk, 2))]
    qkv = [t.clone().requires_grad_() for t in base]
    out, lse = hub.attention(*qkv, backend="triton", layout="thd", causal=True,
                             cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    leaves = [t.clone().requires_grad_() for t in base]
    params = AttnParams(scale=0.25, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref64, ref_lse, same = fa_references(*leaves, params, layout="thd")
    assert_fa_rule(out, ref64, same)
    assert_lse(lse, ref_lse, atol=1e-4)
    assert_grads_fa_rule(out, ref64, same, qkv, ref_inputs=leaves)


def test_decode_grid_fits_cuda_at_batch_8193(recorded: list[tuple[Any, ...]]) -> None:
    """Paged decode at batch 8193 x 8 KV heads (65544 programs a split) on the stub sm90:
    every pass-1 launch has at most 65535 programs on its second axis (was 65544), and the
    output and LSE cover the whole batch."""
    b, hkv = 8193, 8
    q = torch.zeros(b, 1, 2 * hkv, 16, dtype=torch.bfloat16)
    kc = torch.zeros(4, 16, hkv, 16, dtype=torch.bfloat16)
    table = torch.zeros(b, 2, dtype=torch.int32)
    lens = torch.full((b,), 20, dtype=torch.int32)
    out, lse = decode.decode_attention(q, kc, kc, scale=0.25, block_table=table,
                                       seqlens_k=lens)
    assert out.shape == q.shape and lse is not None and lse.shape == (b, 2 * hkv, 1)
    _assert_within_cuda([launch[1] for launch in recorded])
    assert len({launch[1] for launch in recorded if launch[0] is decode._split_kernel}) == 2


@pytest.mark.parametrize("cache", ["paged", "contiguous", "contiguous_e4m3"])
def test_decode_in_batch_slices_equals_one_launch(monkeypatch: pytest.MonkeyPatch,
                                                  cache: str) -> None:
    """With the grid limit lowered to 5, a batch of 5 x 2 KV heads runs in slices of 2
    sequences: out and LSE bitwise those of one launch (same splits), with per-sequence
    lengths, per-sequence ALiBi slopes, a table repeating a page, an e4m3 cache's
    per-sequence descales; and without the LSE."""
    g = torch.Generator().manual_seed(3)
    b, hkv, hq, d = 5, 2, 4, 16
    q = torch.randn(b, 2, hq, d, generator=g)
    slopes = torch.rand(b, hq, generator=g)
    lens = torch.tensor([0, 7, 20, 33, 1], dtype=torch.int32)
    kw: dict[str, Any] = {}
    if cache == "paged":
        k, v = (torch.randn(9, 5, hkv, d, generator=g) for _ in "kv")
        kw["block_table"] = torch.randint(0, 9, (b, 7), generator=g, dtype=torch.int32)
        kw["block_table"][2] = 4  # one page repeated
    else:
        k, v = (torch.randn(b, 35, hkv, d, generator=g) for _ in "kv")
    if cache == "contiguous_e4m3":
        q, k, v = q.bfloat16(), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        kw.update(k_descale=torch.rand(b, hkv, generator=g) + 0.5,
                  v_descale=torch.rand(b, hkv, generator=g) + 0.5)
    kw.update(scale=0.3, causal=True, alibi_slopes=slopes, seqlens_k=lens, num_splits=2)
    whole = decode.decode_attention(q, k, v, **kw)
    monkeypatch.setattr(decode, "MAX_GRID_Y", 5)
    monkeypatch.setattr(decode, "_shapes", {})
    monkeypatch.setattr(decode, "_families", {})
    assert decode._batch_chunk(b, 2, hq, hkv) == 2
    sliced = decode.decode_attention(q, k, v, **kw)
    assert torch.equal(sliced[0], whole[0]) and torch.equal(sliced[1], whole[1])
    out, lse = decode.decode_attention(q, k, v, return_lse=False, **kw)
    assert lse is None and torch.equal(out, whole[0])


@pytest.mark.parametrize("field,value", [("block_n", 24), ("block_n", 8), ("block_n", 0),
                                         ("num_warps", 3), ("merge_warps", 0)])
def test_decode_config_refuses_tiles_no_kernel_runs(field: str, value: int) -> None:
    """A decode tile of 24 keys failed inside the launch ("arange's range must be a power
    of 2"), one of 0 with ZeroDivisionError in ``choose_splits``, 8 runs under the
    interpreter only (a GPU dot needs 16): refused when the config is made, naming it."""
    with pytest.raises(ValueError, match=f"{field}={value}; use a power of two"):
        DecodeConfig(**{field: value})


@pytest.mark.parametrize("cap", [math.inf, math.nan])
def test_softcap_variant_refuses_a_cap_that_makes_nan(cap: float) -> None:
    """``variants.softcap(inf)`` (read as "no cap") gave NaN for every score (0 * inf), and
    NaN passed ``cap <= 0``: both refused."""
    with pytest.raises(ValueError, match="finite and > 0"):
        variants.softcap(cap)
