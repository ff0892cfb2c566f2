"""Gradients from a fused backward that refuse to be differentiated again.

A backward that runs fused kernels (or communication) under ``no_grad`` returns exact
first-order gradients that autograd would take as constants under ``create_graph=True``: a
gradient penalty or Hessian-vector product through them would be silently partial. Passing
them through :func:`first_order_only` connects them to the inputs they depend on, so a second
backward reaches a node that raises the backend's own error instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class _FirstOrderOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, refuse: Callable[[], BaseException], n: int,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.refuse = refuse
        return tuple(g.view_as(g) for g in tensors[:n])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[None, ...]:
        raise ctx.refuse()


def first_order_only(grads: tuple[torch.Tensor | None, ...],
                     inputs: tuple[torch.Tensor | None, ...],
                     refuse: Callable[[], BaseException]) -> tuple[torch.Tensor | None, ...]:
    """``grads`` as they are, unless autograd is recording (``create_graph=True``) and some
    of ``inputs`` (what the gradients depend on: q, k, v, the output's gradient...) need
    gradients: then views of them whose backward raises ``refuse()``."""
    anchors = [x for x in inputs if x is not None and x.requires_grad]
    if not torch.is_grad_enabled() or not anchors:
        return grads
    present = [i for i, g in enumerate(grads) if g is not None]
    views = _FirstOrderOnly.apply(refuse, len(present), *(grads[i] for i in present),
                                  *anchors)
    out = list(grads)
    for i, g in zip(present, views):
        out[i] = g
    return tuple(out)
