"""The input classes an approximate backend's ``error_budget`` is stated on, built by the kit.

A budget (relative RMSE against dense attention) is only true on some inputs: a sparse mask
is as good as the data is local, hashing as good as the data is clustered. So a backend
declares the class (``Capabilities.error_budget_inputs``) and the kit, not the plugin,
draws inputs of that class, checks that they meet its condition and judges the budget there
(``kit._judge_budget``), the same for a third party's backend as for ours:

* ``random``: i.i.d. N(0, 1) q, k, v at the kit's scale; dense attention is exact attention
  with the call's own mask (FP8, low-rank and other numerical approximations).
* ``local``: queries and keys share a smooth position code, so scores fall with distance;
  the call carries a window, and dense attention is the call's mask *without* the window.
  Any attention that is exact over a mask containing the window, dropping a share ``eps_r``
  of row r's dense mass, is off by at most ``2 eps_r max_j |v_j|`` in row r (L2 over the
  value dim), so its relative RMSE is at most ``2 eps kappa`` (``eps``: RMS of ``eps_r``,
  ``kappa``: largest value norm / RMS norm of a dense output row). The kit sharpens the code
  until that bound is just below the budget (:data:`LOCAL_TARGET`) and checks it: the
  class is "the budget is provably met by exact attention over the window". Dropped mass
  alone bounds nothing: 5% of it on a key with a large value moves the output by
  ``0.05 |v|``. One case puts a 20x value on a key outside most windows for that reason.
* ``clustered``: q and k within :data:`CLUSTER_DEGREES` of one of :data:`CLUSTER_CENTRES`
  random directions, scores ``scale q.k`` up to ``CLUSTER_SCORE / sqrt(D)`` (norm 8 at the
  default scale), so attention concentrates on the query's cluster; dense attention is the
  call's mask.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..core.spec import AttnParams
from .cases import LOCAL_WINDOW, Case

__all__ = ["LOCAL_WINDOW", "class_data", "dense_params", "local_bound", "rel_rmse"]

#: ``local``: the kit sharpens the inputs until 2 eps kappa <= this share of the budget.
LOCAL_TARGET = 0.9
#: ``local``: a value this many times larger on one key (the second case).
HEAVY_VALUE = 20.0
CLUSTER_CENTRES = 4
CLUSTER_DEGREES = 6.0
CLUSTER_SCORE = 64.0


def class_data(case: Case, qs: list[torch.Tensor], ks: list[torch.Tensor],
               vs: list[torch.Tensor], gen: torch.Generator, scale: float
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per-sequence q, k, v (fp32, (n, H, D)) of ``case.budget_inputs``; ``random`` keeps
    the kit's draws."""
    if case.budget_inputs == "local":
        return _local(case, qs, ks, vs, gen)
    if case.budget_inputs == "clustered":
        d = qs[0].shape[-1]
        centres = torch.nn.functional.normalize(
            torch.randn(CLUSTER_CENTRES, d, generator=gen, dtype=torch.float32), dim=-1)
        return _clustered(qs, centres, gen, scale), _clustered(ks, centres, gen, scale), vs
    return qs, ks, vs


def _code(pos: torch.Tensor, d: int) -> torch.Tensor:
    """A unit-norm position code (n, d): sinusoids with periods 8..256 (similarity falls
    with distance over the kit's lengths and is 1 only at distance 0)."""
    periods = torch.logspace(math.log10(8), math.log10(256), max(-(-d // 2), 1),
                             dtype=torch.float32)
    ang = 2 * math.pi * pos[:, None].float() / periods[None, :]
    code = torch.cat([ang.cos(), ang.sin()], -1)[:, :d]
    return code / code.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def _local(case: Case, qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor],
           gen: torch.Generator
           ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """q and k: ``case.sharpness`` times the code of their (aligned) positions, plus 10%
    noise, so the kit can sharpen the scores by one number; v as drawn (one heavy key)."""
    a = case.sharpness or 1.0
    out_q, out_k, out_v = [], [], []
    for q, k, v in zip(qs, ks, vs):
        sq, sk, d = q.shape[0], k.shape[0], q.shape[-1]
        off = sk - sq if case.alignment == "bottom_right" else 0  # aligned query positions
        noise = 0.1 / math.sqrt(d)
        cq = _code(torch.arange(sq) + off, d)[:, None]
        ck = _code(torch.arange(sk), d)[:, None]
        out_q.append(a * (cq + noise * torch.randn(q.shape, generator=gen, dtype=torch.float32)))
        out_k.append(a * (ck + noise * torch.randn(k.shape, generator=gen, dtype=torch.float32)))
        if case.heavy_value and sk:
            v = v.clone()
            v[sk // 3] *= HEAVY_VALUE  # outside the windows of the later rows
        out_v.append(v)
    return out_q, out_k, out_v


def _clustered(xs: list[torch.Tensor], centres: torch.Tensor, gen: torch.Generator,
               scale: float) -> list[torch.Tensor]:
    """Rows (n, H, D) near one of ``centres`` (q and k share them)."""
    d = xs[0].shape[-1] if xs else 1
    norm = math.sqrt(CLUSTER_SCORE / (math.sqrt(d) * scale))
    spread = math.tan(math.radians(CLUSTER_DEGREES)) / math.sqrt(d)
    out = []
    for x in xs:
        at = centres[torch.randint(0, CLUSTER_CENTRES, x.shape[:-1], generator=gen)]
        out.append(norm * (at + spread * torch.randn(x.shape, generator=gen, dtype=torch.float32)))
    return out


def dense_params(case: Case, params: AttnParams) -> AttnParams:
    """What the budget is against: ``local`` drops the window (the window is how such a
    backend approximates dense attention); the other classes keep the call's mask."""
    return replace(params, window=None) if case.budget_inputs == "local" else params


def rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp64, the metric ``error_budget`` is stated in."""
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def local_bound(o_dense: torch.Tensor, lse_dense: torch.Tensor, lse_window: torch.Tensor,
                v: torch.Tensor) -> tuple[float, float, float]:
    """(2 eps kappa, eps, kappa): the most exact attention over any mask containing the
    window can be off from dense attention, in relative RMSE (module docstring). ``eps``
    per row is read off the LSEs: the window keeps ``exp(lse_window - lse_dense)``."""
    lse_d = lse_dense.double()
    eps = (1 - torch.exp(lse_window.double() - lse_d)).clamp(0, 1)
    eps = torch.where(torch.isfinite(lse_d), eps, torch.zeros_like(eps))
    eps_rms = float(eps.square().mean().sqrt())
    big = float(v.detach().double().norm(dim=-1).max()) if v.numel() else 0.0
    rms_o = float(o_dense.detach().double().norm(dim=-1).square().mean().sqrt())
    kappa = big / max(rms_o, 1e-300)
    return 2 * eps_rms * kappa, eps_rms, kappa
