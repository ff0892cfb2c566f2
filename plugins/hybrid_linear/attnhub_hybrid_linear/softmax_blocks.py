"""Softmax attention over a gathered block of keys, and the LSE merge of partial results.

The sparse backends (sliding window, longformer, LSH) all reduce to: a block of queries, the
few keys it may see, a boolean mask over that block. ``attend`` does that one step in fp32
(fp64 for fp64 inputs) with the project's conventions: softcap, then bias, then mask; a row
with no visible key gives output 0 and LSE -inf, and no NaN in values or gradients.
"""

from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
           scale: float, softcap: float | None = None,
           bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (..., Q, D), k/v (..., L, D) (broadcastable leading dims), ``allowed`` (..., Q, L).

    Returns (out (..., Q, Dv), lse (..., Q)) in the compute dtype.
    """
    cd = compute_dtype(q)
    if k.shape[-2] == 0:  # no key in reach: every row is fully masked
        shape = torch.broadcast_shapes(q.shape[:-1], k.shape[:-2] + q.shape[-2:-1])
        return (q.new_zeros(*shape, v.shape[-1], dtype=cd),
                q.new_full(shape, float("-inf"), dtype=cd))
    s = torch.matmul(q.to(cd), k.to(cd).transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias.to(cd)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    seen = denom > 0
    safe = torch.where(seen, denom, torch.ones_like(denom))
    out = torch.matmul(p / safe, v.to(cd))
    lse = torch.where(seen, m + torch.log(safe), torch.full_like(m, float("-inf")))
    return out, lse.squeeze(-1)


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine softmax results over disjoint key sets: weights exp(lse_i - LSE)."""
    lse_all = torch.stack(lses)  # (R, ..., Q)
    top = lse_all.detach().amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse_all - top)
    total = w.sum(dim=0)
    seen = total > 0
    safe = torch.where(seen, total, torch.ones_like(total))
    out = sum(o * (wi / safe).unsqueeze(-1) for o, wi in zip(outs, w))
    lse = torch.where(seen, top + torch.log(safe), torch.full_like(top, float("-inf")))
    return out, lse  # type: ignore[return-value]
