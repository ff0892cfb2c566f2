"""Softmax attention over a gathered block of keys, and the LSE merge of partial results.

The sparse backends (sliding window, longformer, LSH) all reduce to: a block of queries, the
few keys it may see, a boolean mask over that block. ``attend`` does that one step in fp32
(fp64 for fp64 inputs) with the project's conventions: softcap, then bias, then mask; a row
with no visible key gives output 0 and LSE -inf (even where a value holds NaN: its weights
are 0, and 0 x NaN is NaN), and a row that sees a NaN score gives NaN output and NaN LSE, as
the reference does (the contract's "NaN in means NaN out").
"""

from __future__ import annotations

import torch

from attnhub.plugin import attends_nothing


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
        return _nothing(q, k, v, cd)
    s = torch.matmul(q.to(cd), k.to(cd).transpose(-1, -2)) * scale
    if s.dtype is not cd:  # torch.autocast ran it in its dtype: attention computes in q's
        with torch.autocast(q.device.type, enabled=False):
            return attend(q, k, v, allowed, scale, softcap, bias)
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
    out, lse = _normalise(torch.matmul(p, v.to(cd)), m, denom)
    return out, lse.squeeze(-1)


def _nothing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             cd: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Output 0 and LSE -inf for rows with no key at all, both in the autograd graph of q, k
    and v: a bare ``new_zeros`` would cut a call's graph when no row sees a key."""
    shape = torch.broadcast_shapes(q.shape[:-1], k.shape[:-2] + q.shape[-2:-1])
    zero = attends_nothing(q, k, v).to(cd)
    out = zero.expand(*shape, v.shape[-1]).contiguous()
    lse = (zero[..., :0].sum(-1) - float("inf")).expand(shape).contiguous()
    return out, lse


def no_queries(q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B,0,Hq,Dv) in q's dtype, lse (B,Hq,0) fp32) of a bshd call without queries (a
    varlen document with none), in the graph of q, k, v: if every document of a packed call
    lacks queries or keys, nothing else would keep the call's output in the graph."""
    out = attends_nothing(q, k, v)
    return out, out.new_full((q.shape[0], q.shape[2], 0), float("-inf"),
                             dtype=torch.float32) + out.sum()


def _normalise(acc: torch.Tensor, top: torch.Tensor,
               total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``acc / total`` and ``top + log(total)``, with exact 0 and -inf where ``total`` is 0
    (no key seen: ``acc`` may be NaN from 0 x a NaN value) and NaN where it is NaN."""
    dead = total == 0
    safe = torch.where(dead, torch.ones_like(total), total)
    out = torch.where(dead, torch.zeros_like(acc), acc / safe)
    lse = torch.where(dead, torch.full_like(top, float("-inf")), top + torch.log(safe))
    return out, lse


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine softmax results over disjoint key sets: weights exp(lse_i - LSE)."""
    lse_all = torch.stack(lses)  # (R, ..., Q)
    top = lse_all.detach().amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse_all - top)
    total = w.sum(dim=0)
    acc = sum(o * wi.unsqueeze(-1) for o, wi in zip(outs, w))
    out, lse = _normalise(acc, top.unsqueeze(-1), total.unsqueeze(-1))  # type: ignore[arg-type]
    return out, lse.squeeze(-1)
