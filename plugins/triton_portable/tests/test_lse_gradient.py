"""A gradient through the LSE the ``triton`` backend returns reaches q and k (found by the
FlashAttention-grid sweep: the LSE was marked non-differentiable, so a loss using it got no
gradient from it, silently). Interpreter on the CPU: tiny shapes."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import attnhub
from attnhub.plugin import AttnParams, reference_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_lse_gradient_matches_the_maths(layout: str) -> None:
    g = torch.Generator().manual_seed(0)
    if layout == "bshd":
        shapes, kw = [(1, 9, 2, 16), (1, 13, 1, 16), (1, 13, 1, 16)], {}
    else:
        shapes = [(9, 2, 16), (13, 1, 16), (13, 1, 16)]
        kw = {"layout": "thd",
              "cu_seqlens_q": torch.tensor([0, 4, 4, 9], dtype=torch.int32, device=DEV),
              "cu_seqlens_k": torch.tensor([0, 6, 8, 13], dtype=torch.int32, device=DEV)}
    qkv = tuple(torch.randn(*s, generator=g).to(DEV).requires_grad_() for s in shapes)
    out, lse = attnhub.attention(*qkv, backend="triton", causal=True, return_lse=True, **kw)
    w_out = torch.randn(out.shape, generator=g).to(DEV)
    w_lse = torch.randn(lse.shape, generator=g).to(DEV)
    got = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), qkv)
    params = AttnParams(scale=0.25, causal=True, cu_seqlens_q=kw.get("cu_seqlens_q"),
                        cu_seqlens_k=kw.get("cu_seqlens_k"))
    leaves = tuple(t.detach().double().requires_grad_() for t in qkv)
    r_out, r_lse = reference_attention(*leaves, params, layout=layout)
    want = torch.autograd.grad((r_out * w_out.double()).sum()
                               + (r_lse.double() * w_lse.double()).sum(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)
