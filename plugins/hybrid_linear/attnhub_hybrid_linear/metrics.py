"""Error measures for layers compared with a reference (fla's test metric)."""

from __future__ import annotations

import torch


def rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp64: FLA's relative RMSE, robust to chunked sums
    where a max-error rule is brittle (0 when both are 0)."""
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))
