"""An LSE a backend returns outside the autograd graph, in a call that needs gradients.

Some kernels return their LSE as a plain tensor (the fused ops' LSE has no derivative). A
loss that uses it would get no gradient from it, silently: the gradients of q and k would be
wrong. The hub therefore hands such an LSE on through :func:`guard_lse`: the same values, in
the graph of the output, and a gradient that reaches it raises (naming the backend and the
fix) instead of being dropped. Backends whose LSE is differentiable (reference, torch_sdpa,
sliding_window, triton) are left alone.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InputError


class _NoGradLSE(torch.autograd.Function):
    """``lse`` as a node of ``anchor``'s graph whose backward refuses a non-zero gradient."""

    @staticmethod
    def forward(ctx: Any, lse: torch.Tensor, anchor: torch.Tensor,  # type: ignore[override]
                backend: str) -> torch.Tensor:
        ctx.backend = backend
        ctx.set_materialize_grads(False)
        return lse.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, None, None]:
        if grad is not None and bool(grad.ne(0).any()):
            raise InputError(
                f"backend {ctx.backend!r} returns an LSE without a gradient (its kernel's LSE "
                "has no derivative), and the loss differentiates it; use a backend whose LSE "
                "is differentiable (reference, torch_sdpa, sliding_window, triton) or detach "
                "the LSE")
        return None, None, None


def guard_lse(backend: str, out: torch.Tensor, lse: torch.Tensor | None) -> torch.Tensor | None:
    """``lse`` itself when it is in the autograd graph (or absent, or ``out`` is not);
    else the guarded copy of :class:`_NoGradLSE`. In the graph means a ``grad_fn``: a leaf
    that requires grad (``lse.detach().requires_grad_()``) would keep the gradient to
    itself, and q and k would get none from it, silently."""
    if lse is None or lse.grad_fn is not None or not out.requires_grad:
        return lse
    return _NoGradLSE.apply(lse.detach(), out, backend)
