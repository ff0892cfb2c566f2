"""Error measures for layers compared with a reference (fla's test metric)."""

from __future__ import annotations

import torch


def rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp64: FLA's relative RMSE, robust to chunked sums
    where a max-error rule is brittle (0 when both are 0)."""
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def local_bound(eps: torch.Tensor, v: torch.Tensor, dense: torch.Tensor) -> float:
    """``2 eps kappa``: the most that attention exact over a mask dropping a share ``eps_r``
    of each row's dense mass can be off from dense attention, in relative RMSE.

    Why: such a row is ``a / (1 - eps_r)`` where dense is ``a + b``, with
    ``||a|| <= (1 - eps_r) M`` and ``||b|| <= eps_r M`` (``M = max_j ||v_j||``), so it is off
    by at most ``2 eps_r M``. ``eps``: one share per output row and head (any layout); ``v``
    the values (..., Dv); ``dense`` the dense output (..., Dv). longformer's budget is
    stated where this is at most ``LONGFORMER_BUDGET``.
    """
    eps = eps.detach().double()
    big = v.detach().double().norm(dim=-1).max()
    rms_out = dense.detach().double().norm(dim=-1).square().mean().sqrt()
    return float(2 * eps.square().mean().sqrt() * big / rms_out.clamp_min(1e-300))
