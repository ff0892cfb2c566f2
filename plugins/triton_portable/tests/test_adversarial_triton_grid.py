"""FlashAttention's test grid on the ``triton`` backend through the public API, under the
interpreter on tiny shapes: what tests/test_adversarial_fa_grid_3.py runs on the other CPU
backends (empty documents, strided inputs and output gradients, fully masked rows, odd head
dims with every mask kind), plus bitwise-equal gradients with ``deterministic=True``.

Found: a fully masked row whose tile held a NaN value came back NaN, not 0 (``triton``'s
forward and ``triton_decode``'s split kernel: zero weights times NaN, divided by a guarded
1)."""

from __future__ import annotations

import math

import pytest
import torch

import attnhub
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.testing import assert_fa_rule, assert_lse, fa_references


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub(hardware="cpu")


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_()


def _check(hub: attnhub.Hub, qkv: tuple[torch.Tensor, ...], params: AttnParams,
           dout: torch.Tensor, layout: str = "bshd", **kw: object) -> tuple[torch.Tensor, ...]:
    """triton's out, LSE and dq, dk, dv for ``qkv`` as given (strides kept) by the
    FlashAttention rule against the fp64 reference; returns (out, lse, dq, dk, dv)."""
    out, lse = hub.attention(*qkv, backend="triton", return_lse=True, layout=layout, **kw)
    leaves = tuple(t.detach().clone().requires_grad_() for t in qkv)
    ref64, ref_lse, same = fa_references(*leaves, params, layout=layout)
    assert_fa_rule(out, ref64, same)
    assert_lse(lse, ref_lse, atol=2e-2 if qkv[0].dtype != torch.float32 else 1e-4)
    grads = torch.autograd.grad(out, qkv, dout)
    want = torch.autograd.grad(ref64, leaves, dout.double(), retain_graph=True)
    want_same = torch.autograd.grad(same, leaves, dout.contiguous())
    for what, got, r64, rs in zip("qkv", grads, want, want_same):
        assert_fa_rule(got, r64, rs, mult=3.0, what=f"d{what}")
    return (out, lse, *grads)


def test_thd_empty_documents_with_window(hub):
    """Documents without queries, and queries without keys, beside square and Sq != Sk ones:
    keyless rows 0 with LSE -inf and zero dq, the others by the FlashAttention rule."""
    g = torch.Generator().manual_seed(41)
    cu_q = torch.tensor([0, 0, 3, 5, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 11, 11, 14], dtype=torch.int32)
    dt = torch.bfloat16
    qkv = (_randn(g, 10, 6, 24, dtype=dt), _randn(g, 14, 2, 24, dtype=dt),
           _randn(g, 14, 2, 24, dtype=dt))
    params = AttnParams(scale=1 / math.sqrt(24), causal=True, window=(2, 0),
                        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    dout = torch.randn(10, 6, 24, generator=g).to(dt)
    out, lse, dq, *_ = _check(hub, qkv, params, dout, layout="thd", causal=True,
                              window=(2, 0), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert not bool(out[3:5].any()) and bool(torch.isneginf(lse[:, 3:5]).all())
    assert not bool(dq[3:5].any())


def test_strided_inputs_and_output_gradient(hub):
    """q with a last-dim stride of 2, k/v transposed views (BHSD storage), a transposed
    output gradient (FlashAttention#355), odd head dim 59, GQA 6:2, fp16, softcap and ALiBi
    under a top-left causal mask with Sq > Sk."""
    g = torch.Generator().manual_seed(43)
    dt, d = torch.float16, 59
    q = _randn(g, 2, 7, 6, 2 * d, dtype=dt)[..., ::2]
    k = _randn(g, 2, 2, 5, d, dtype=dt).transpose(1, 2)
    v = _randn(g, 2, 2, 5, d, dtype=dt).transpose(1, 2)
    slopes = torch.rand(6, generator=g) * 0.3
    kw = {"causal": True, "causal_alignment": "top_left", "softcap": 20.0,
          "alibi_slopes": slopes}
    params = AttnParams(scale=1 / math.sqrt(d), causal=True, alignment="top_left",
                        softcap=20.0, alibi_slopes=slopes)
    dout = torch.randn(2, 6, 7, d, generator=g).to(dt).transpose(1, 2)
    _check(hub, (q, k, v), params, dout, **kw)


@pytest.mark.parametrize("sq,sk", [(1, 23), (23, 3)])
def test_odd_head_dim_swapped_lengths(hub, sq, sk):
    """Head dim 111, MQA 6:1, (1, Sk)-style lengths and swapped, bottom-right causal with
    a window and per-batch ALiBi, bf16 (the second has rows that see no key)."""
    g = torch.Generator().manual_seed(sq * 100 + sk)
    dt, d = torch.bfloat16, 111
    qkv = (_randn(g, 2, sq, 6, d, dtype=dt), _randn(g, 2, sk, 1, d, dtype=dt),
           _randn(g, 2, sk, 1, d, dtype=dt))
    slopes = torch.rand(2, 6, generator=g) * 0.3
    params = AttnParams(scale=1 / math.sqrt(d), causal=True, window=(4, 0),
                        alibi_slopes=slopes)
    dout = torch.randn(2, sq, 6, d, generator=g).to(dt)
    out, lse, dq, *_ = _check(hub, qkv, params, dout, causal=True, window=(4, 0),
                              alibi_slopes=slopes)
    dead = torch.isneginf(reference_attention(*qkv, params)[1]).transpose(1, 2)
    assert not bool(out[dead].any()) and not bool(dq[dead].any())


def test_deterministic_gradients_are_bitwise_equal(hub):
    """``deterministic=True`` (declared): repeated backward passes of a windowed MQA call
    with ALiBi give bitwise-equal dq, dk, dv (and out, LSE)."""
    g = torch.Generator().manual_seed(47)
    dt = torch.float32
    base = [torch.randn(2, s, h, 16, generator=g).to(dt) for s, h in ((9, 6), (9, 1), (9, 1))]
    slopes = torch.rand(6, generator=g) * 0.3
    dout = torch.randn(2, 9, 6, 16, generator=g)
    runs = []
    for _ in range(3):
        qkv = [t.clone().requires_grad_() for t in base]
        out, lse = hub.attention(*qkv, backend="triton", deterministic=True, return_lse=True,
                                 window=(3, 1), alibi_slopes=slopes)
        runs.append((out, lse, *torch.autograd.grad(out, qkv, dout)))
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    assert all(bool(t.ne(0).any()) for t in runs[0][2:])


@pytest.mark.parametrize("backend,sq,kw", [
    ("triton", 9, {"causal": True}),
    ("triton", 9, {"window": (0, 0), "causal_alignment": "top_left"}),
    ("triton_decode", 4, {"causal": True, "window": (1, 0)}),
])
def test_fully_masked_rows_stay_zero_under_nan_values(hub, backend, sq, kw):
    """A NaN value in a tile that a fully masked row loads: the row is still 0 with LSE -inf
    (the kernels divided its acc, zero weights times NaN = NaN, by a guarded 1)."""
    g = torch.Generator().manual_seed(59)
    q, k, v = (torch.randn(2, s, 4, 16, generator=g) for s in (sq, 3, 3))
    params = AttnParams(scale=0.25, causal=kw.get("causal", False), window=kw.get("window"),
                        alignment=kw.get("causal_alignment", "bottom_right"))
    dead = torch.isneginf(reference_attention(q, k, v, params)[1])
    v[:, 0, :, 2] = math.nan
    phase = "decode" if backend == "triton_decode" else None
    out, lse = hub.attention(q, k, v, backend=backend, return_lse=True, phase=phase, **kw)
    assert bool(dead.any())
    rows = out.transpose(1, 2)[dead]
    assert not bool(rows.isnan().any()) and not bool(rows.any())
    assert bool(torch.isneginf(lse[dead]).all())
