"""Plugin kernels called directly (as a third party's hub would) keep the contract at the
edges the hub answers itself: large finite fp16 queries are not NaN (the CPU flash
backend's NaN-keeping once summed a row, which overflows), and calls or documents without
queries or keys give zeros in the autograd graph (zero gradients, not a cut graph)."""

from __future__ import annotations

import pytest
import torch

from attnhub.plugin import AttnParams

local_cpu = pytest.importorskip("attnhub_ring.local_cpu")
flex = pytest.importorskip("attnhub_triton_portable.flex")


def _flash_cpu():
    cls = next(c for c in vars(local_cpu).values()
               if isinstance(c, type) and getattr(c, "name", None) == "torch_flash_cpu")
    return cls()


def test_large_finite_fp16_queries_are_not_nan() -> None:
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 9, 2, 16, generator=g) * 1e4).half()
    k, v = (torch.randn(2, 9, 2, 16, generator=g).half() for _ in range(2))
    params = AttnParams(scale=16 ** -0.5, return_lse=True)
    out, lse = _flash_cpu()._dense(q, k, v, params)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref = torch.softmax((q.double().transpose(1, 2) @ k.double().transpose(1, 2).mT) * 0.25,
                        -1) @ v.double().transpose(1, 2)
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), atol=2e-2, rtol=2e-2)
    q[0, 3, 1, 5] = float("nan")  # NaN in still means NaN out, on that row only
    out, _ = _flash_cpu()._dense(q, k, v, params)
    assert torch.isnan(out[0, 3, 1]).all() and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("shape", [(2, 0, 2, 8), (0, 4, 2, 8)])
def test_flex_without_queries_or_batch_keeps_the_graph(shape: tuple[int, ...]) -> None:
    q = torch.randn(*shape, requires_grad=True)
    k, v = (torch.randn(shape[0], 4, 2, 8, requires_grad=True) for _ in range(2))
    out, lse = flex.flex_attention(q, k, v, AttnParams(scale=0.3), "bshd", flex.ModCache(),
                                   compiled=False, want_lse=True)
    assert out.shape == shape and lse.shape == (shape[0], 2, shape[1])
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert not gk.any() and not gv.any() and gq.shape == q.shape


def test_flash_cpu_documents_without_keys_keep_the_graph() -> None:
    q = torch.randn(4, 2, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, requires_grad=True) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([0, 0, 2],
                                                                          dtype=torch.int32)
    params = AttnParams(scale=0.3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=2,
                        max_seqlen_k=2)
    dense = _flash_cpu()._dense
    o0, _ = dense(q[None, 0:2], k[None, 0:0], v[None, 0:0], params)  # the keyless document
    assert o0.grad_fn is not None and not o0.any()
    o1, _ = dense(q[None, 2:4], k[None, 0:2], v[None, 0:2], params)
    out = torch.cat([o0[0], o1[0]])
    gq, = torch.autograd.grad(out.sum(), (q,))
    assert not gq[:2].any() and gq[2:].any()
