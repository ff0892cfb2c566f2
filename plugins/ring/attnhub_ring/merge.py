"""Merging partial attention results by their log-sum-exp.

Attention over a union of key blocks is the LSE-weighted mean of the per-block outputs:
``lse = log(sum_b exp(lse_b))`` and ``out = sum_b exp(lse_b - lse) * out_b``. Weights are
taken relative to the running maximum so nothing overflows, and a row that no block has seen
yet (LSE -inf on both sides) stays exactly (0, -inf) instead of ``exp(-inf - -inf) = NaN``.
"""

from __future__ import annotations

import torch


def merge_partial(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor,
                  lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial results over disjoint key sets.

    ``out_*`` (..., H, Dv) and ``lse_*`` (..., H), token-major, fp32. Returns fp32 results.
    """
    lse_b = lse_b.float()
    m = torch.maximum(lse_acc, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # both -inf: any finite shift
    w_acc = torch.exp(lse_acc - m)
    w_b = torch.exp(lse_b - m)
    total = w_acc + w_b  # >= 1 where either side is finite (its weight is exp(0)), else 0
    # a kernel may leave garbage in rows it reports fully masked: never let it through
    out_b = torch.where(torch.isfinite(lse_b).unsqueeze(-1), out_b.float(), 0.0)
    out = (w_acc.unsqueeze(-1) * out_acc + w_b.unsqueeze(-1) * out_b) / total.clamp(
        min=1.0).unsqueeze(-1)
    return out, m + torch.log(total)


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor,
               lse_b: torch.Tensor) -> None:
    """In place, the ring's hot path: ``out_acc``/``lse_acc`` (fp32, views of the ring's
    accumulators) absorb a block whose rows each saw at least one key (finite ``lse_b``;
    true of every ring block plan). Accumulator rows may still be (0, -inf). Two passes over
    ``out_acc`` (scale, then add the weighted block) instead of :func:`merge_partial`'s
    temporaries: the merge is memory-bound and runs once per ring step."""
    lse = torch.logaddexp(lse_acc, lse_b.float())
    out_acc.mul_(torch.exp(lse_acc - lse).unsqueeze(-1))
    out_acc.addcmul_(out_b, torch.exp(lse_b - lse).unsqueeze(-1))
    lse_acc.copy_(lse)
