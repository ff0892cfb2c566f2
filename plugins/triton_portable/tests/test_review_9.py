"""Review 9: window edges past every key on this plugin's backends, under the interpreter.

A window edge at or past max(Sq, Sk) means "unbounded", and "unbounded" is often written as a
large sentinel. Found: ``triton`` and ``triton_decode`` add the edges to positions in int32,
so a window of (2**31 - 1, 2**31 - 1) wrapped ``pos + right + 1`` negative: every row came
back fully masked (0 out, LSE -inf), silently; ``flex`` wrapped int64 at ``sys.maxsize``; and
2**64 raised OverflowError inside every kernel launch (charged to the backends). Now such
edges become -1 before the launch (``attnhub.plugin.window_within``), which is exact."""

from __future__ import annotations

import itertools
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import attnhub
from attnhub.plugin import AttnParams, reference_attention
from attnhub.testing import assert_fa_rule, assert_grads_fa_rule, assert_lse, fa_references

BIG = [2**31 - 1, 2**31, sys.maxsize, 2**64]


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub(hardware="cpu")


@pytest.mark.parametrize("big", BIG)
def test_triton_big_window_edges_mean_unbounded(hub: attnhub.Hub, big: int) -> None:
    """Dense, Sq > Sk bottom-right (rows that see no key stay so), GQA 4:2, bf16: out, LSE
    and dq, dk, dv of window (big, big) by the FlashAttention rule against the fp64
    reference of the unwindowed call; causal (big, 0) likewise against plain causal."""
    g = torch.Generator().manual_seed(big % 1009)
    dt = torch.bfloat16
    base = [torch.randn(1, s, h, 16, generator=g).to(dt) for s, h in ((7, 4), (5, 2), (5, 2))]
    dout = torch.randn(1, 7, 4, 16, generator=g).to(dt)
    for window, causal in (((big, big), False), ((big, 0), True)):
        qkv = [t.clone().requires_grad_() for t in base]
        out, lse = hub.attention(*qkv, backend="triton", window=window, causal=causal,
                                 return_lse=True)
        leaves = [t.clone().requires_grad_() for t in base]
        ref64, ref_lse, same = fa_references(*leaves, AttnParams(scale=0.25, causal=causal))
        assert_fa_rule(out, ref64, same)
        assert_lse(lse, ref_lse, atol=2e-2)
        assert_grads_fa_rule(out, ref64, same, qkv, ref_inputs=leaves, dout=dout)


def test_triton_big_window_edges_on_packed_documents(hub: attnhub.Hub) -> None:
    """thd with documents Sq > Sk, empty and Sq < Sk: window (2**31 - 1, 1) is (-1, 1)."""
    g = torch.Generator().manual_seed(3)
    lq, lk = [4, 0, 2], [2, 3, 5]
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], dtype=torch.int32)
    q = torch.randn(sum(lq), 2, 16, generator=g)
    k, v = (torch.randn(sum(lk), 1, 16, generator=g) for _ in "kv")
    ref, ref_lse = reference_attention(q, k, v, AttnParams(
        scale=0.25, window=(-1, 1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), layout="thd")
    out, lse = hub.attention(q, k, v, backend="triton", layout="thd", window=(2**31 - 1, 1),
                             cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    assert_lse(lse, ref_lse, atol=1e-5)


@pytest.mark.parametrize("big", [2**31 - 1, sys.maxsize])
def test_decode_and_flex_big_window_edges(hub: attnhub.Hub, big: int) -> None:
    """triton_decode on a paged cache (lengths 0, 3, 6 of a capacity of 8) and flex on a
    dense call: window (big, big) is no window, (2, big) keeps its left edge."""
    g = torch.Generator().manual_seed(5)
    kc, vc = (torch.randn(7, 4, 2, 16, generator=g) for _ in "kv")
    table = torch.tensor([[0, 3], [5, 1], [2, 6]], dtype=torch.int32)
    lens = torch.tensor([0, 3, 6], dtype=torch.int32)
    q = torch.randn(3, 2, 4, 16, generator=g)
    for window in ((big, big), (2, big)):
        want = tuple(-1 if w == big else w for w in window)
        out, lse = hub.attention(q, kc, vc, backend="triton_decode", layout="paged",
                                 block_table=table, seqlens_k=lens, window=window,
                                 causal=False, phase="decode", return_lse=True)
        ref, ref_lse = hub.attention(q, kc, vc, backend="reference", layout="paged",
                                     block_table=table, seqlens_k=lens, window=want,
                                     return_lse=True)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert_lse(lse, ref_lse, atol=1e-5)
        qd, kd, vd = q, kc[:3], vc[:3]
        out = hub.attention(qd, kd, vd, backend="flex", window=window)
        ref = hub.attention(qd, kd, vd, backend="reference", window=want)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sq,hq", [(7, 2), (1, 6)])
def test_bf16_casts_round_to_nearest_under_the_interpreter(hub: attnhub.Hub, sq: int,
                                                           hq: int) -> None:
    """Triton's CPU interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even):
    with one key, P = exp2(s - lse) is 1 - 1e-7, which truncated to 0.996 and took dV a
    full bf16 ulp off (outside the FlashAttention rule: 2x its bound). The kernels now
    round as the GPU does (``tiles.narrow``): dV is the correctly rounded sum of dO."""
    g = torch.Generator().manual_seed(5)
    dt = torch.bfloat16
    base = [torch.randn(1, s, h, 32, generator=g).to(dt) for s, h in ((sq, hq), (1, 2), (1, 2))]
    dout = torch.randn(1, sq, hq, 32, generator=g).to(dt)
    qkv = [t.clone().requires_grad_() for t in base]
    out = hub.attention(*qkv, backend="triton")
    assert torch.equal(out, base[2].repeat_interleave(hq // 2, 2).expand_as(out))
    dv = torch.autograd.grad(out, qkv[2], dout)[0]
    exact = dout.double().view(1, sq, 2, hq // 2, 32).sum((1, 3)).unsqueeze(1)
    assert torch.equal(dv, exact.to(dt)), float((dv.double() - exact).abs().max())


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_bf16_stores_round_to_nearest_under_the_interpreter(splits: int) -> None:
    """``triton_decode``'s stores (one split's output, the merge's) round as the GPU does:
    two equal keys give the mean of their values, exact in fp32, whose bf16 is torch's
    round-to-nearest-even; the interpreter's truncating cast took about half of them one
    ulp toward zero."""
    from attnhub_triton_portable import decode

    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 1, 4, 32, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 1, 2, 32, generator=g).to(torch.bfloat16).expand(2, 2, 2, 32)
    v = torch.randn(2, 2, 2, 32, generator=g).to(torch.bfloat16)
    out, _ = decode.decode_attention(q, k.contiguous(), v, scale=32 ** -0.5,
                                     num_splits=splits)
    mean = v.double().mean(1, keepdim=True).repeat_interleave(2, 2)
    assert torch.equal(out, mean.to(torch.bfloat16)), int((out != mean.to(out.dtype)).sum())
