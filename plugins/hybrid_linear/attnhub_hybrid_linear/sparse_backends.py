"""Backends ``sliding_window`` (exact), ``longformer`` and ``lsh`` (approximate).

* ``sliding_window``: exact attention for its mask (causal/window/softcap/ALiBi), computed
  block by block over the keys the window reaches; key tiles outside it are skipped. Equal to
  dense attention with the same mask by the FlashAttention rule; a request must carry a
  window bounded on at least one side (else nothing is skipped and an exact dense backend
  is the right choice).
* ``longformer``: the window plus designated global tokens (``extra["longformer_global"]``,
  default position 0). Exact for the mask ``causal? AND (window OR key global OR query
  global)``; approximate against dense attention. Guarantee, for any input: in each output
  row ``||o - o_dense|| <= 2 * eps * max_j ||v_j||`` (also per element with ``max|v|``), eps
  the dense attention mass the mask drops from that row.
* ``lsh``: Reformer-style hashed buckets; exact softmax over keys that share a bucket with
  the query in some round; with one bucket it is dense attention.

Budgets (relative RMSE against dense attention) hold on the inputs they are stated for
(``error_budget_inputs``, which the conformance kit builds and judges them on): a sparse
layer is only as good as its mask is for the data, which is why the resolver never binds
these to an exact request and only a policy's layer binding does.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from attnhub.plugin import (
    FLOAT_DTYPES,
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    Capabilities,
    DeviceInfo,
    InputError,
)

from . import extra as X
from .banded import banded_attention
from .layouts import Doc, serve
from .lsh import lsh_attention

#: Longformer's budget vs dense attention (relative RMSE), on local data
#: (``error_budget_inputs="local"``): inputs where the dense mass each row loses outside the
#: window and the values meet ``2 * eps * kappa <= 0.05`` (eps: RMS over rows of the mass
#: dropped; kappa: largest value norm / RMS norm of a dense output row;
#: ``metrics.local_bound``). There the budget is a consequence of the row bound above, not a
#: measurement, and the conformance kit checks it on such inputs. A share of mass alone
#: bounds nothing: with 95% kept and the other 5% on one key whose value is 100x the rest,
#: the error is about 0.05 * |v_big| / |o_dense|, near 1 (tests/test_budget_9.py). Measured
#: on smooth local inputs with unit-variance values (tests/test_sparse.py: 95% kept, 2 eps
#: kappa = 0.053): 0.010-0.015.
LONGFORMER_BUDGET = 0.05
#: Longformer's gradients vs dense attention's (relative RMSE of each of dq, dk, dv), on the
#: same local inputs (the kit's, tuned to 2 eps kappa <= 0.9 x LONGFORMER_BUDGET). Measured,
#: not a bound (2026-12-05, CPU, 384 draws: seeds 0-7, head dims 16-128, causal and not,
#: bshd and thd, heads 4:2/4:1/2:2, a 20x value on odd seeds): dq median 0.027, p99 0.072,
#: max 0.078; dk max 0.024; dv max 0.014 (the output's max 0.014). dq is further off than
#: the output because it weighs each dropped key by its value's distance from the output;
#: exact attention over the window alone is as far off (0.058 where longformer is 0.056).
LONGFORMER_GRAD_BUDGET = 0.1
#: LSH's budget vs dense, non-causal, for clustered queries/keys (each within ~6 degrees of
#: one of 2-8 centres, attention concentrated on the query's cluster), with the defaults
#: (8 buckets, 4 rounds). Random hashing has a tail: about 1 draw in 100-200 splits a
#: query's cluster across buckets in every round. Measured (2026-12-05, CPU; head dims
#: 16-128, 32-300 tokens, GQA/MQA): 400 draws at 6 degrees, median 0.001, p99 0.08, max
#: 0.127; 200 at 7 degrees, p99 0.099, max 0.134; 200 draws of 64 tokens, d=16, 2 centres,
#: max 0.165. (0.1, the budget before, was broken by 0.5-1% of draws.) At 10 degrees it
#: reaches 0.18 and at 15 0.28: the budget holds only for tight clusters. Not a bound: on
#: the conformance kit's clustered inputs (``error_budget_inputs="clustered"``: 4 centres,
#: 6 degrees, 32 tokens) 2 of 2100 draws (seeds 0-699, d 16/32/64; 2026-12-05) broke it
#: (0.27, 0.35: a cluster split in every round); p99 0.075, p99.9 0.13.
#: tests/test_adversarial_hybrid_4.py checks it on random draws at 6 and 7 degrees.
#: Causal LSH drops more: an early query may have no earlier key in its buckets.
#: Gradients are held to the same budget (no grad_error_budget): on the kit's gradient
#: cases (300 draws, seeds 0-99, d 16/32/64; 2026-12-05) dq/dk/dv p99 0.088/0.077/0.061,
#: one draw over 0.2 (dq 0.77, dv 0.35), the one whose output also broke it (0.27).
LSH_BUDGET = 0.2

_ALL_LAYOUTS = frozenset({"bshd", "thd", "paged"})


def _capabilities(masks: set[str], budget: float | None = None, inputs: str = "random",
                  grad_budget: float | None = None) -> Capabilities:
    """What the sparse backends share (any float dtype, head dims to 512, every layout,
    GQA, LSE, backward); an approximate one (``budget``: its error budget against dense,
    on the ``inputs`` class the conformance kit builds; ``grad_budget`` its gradients',
    None: ``budget``) declares no deterministic backward."""
    exact = budget is None
    return Capabilities(
        dtypes=FLOAT_DTYPES, max_head_dim=512, different_v_dim=True, masks=frozenset(masks),
        layouts=_ALL_LAYOUTS, backward=True, deterministic_backward=exact, exact=exact,
        error_budget=budget, error_budget_inputs=inputs, deterministic_forward=True,
        gqa=True, returns_lse=True, top_left_causal=True, grad_error_budget=grad_budget,
    )


def _window_reasons(spec: AttentionSpec, name: str) -> list[str]:
    w = spec.mask.window
    if w is None:
        return [f"{name} needs a sliding window in the mask (window=(left, right)); without "
                "one nothing is skipped: an exact dense backend serves this"]
    left, right = w
    if left < 0 and (right < 0 or spec.mask.causal):
        side = "causal bounds only the right" if spec.mask.causal else "nor the right"
        return [f"window {w} bounds neither the left ({side}): {name} would skip nothing; "
                "an exact dense backend serves this"]
    return []


class _BlockSparse(Backend):
    """Shared call path: layouts, LSE on request."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        def run(q1: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor, p: AttnParams,
                doc: Doc | None) -> tuple[torch.Tensor, torch.Tensor | None]:
            out, lse = self.compute(q1, k1, v1, p)
            return out, lse if p.return_lse else None

        return serve(q, k, v, spec, params, run)

    def compute(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                p: AttnParams) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class _Banded(_BlockSparse):
    """Window-based backends: refused without a bounding window, computed band by band."""

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        return _window_reasons(spec, self.name)

    def compute(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                p: AttnParams) -> tuple[torch.Tensor, torch.Tensor]:
        if p.window is None:
            raise InputError(f"{self.name}: no window given; pass window=(left, right)")
        g = self.global_positions(p, k.shape[1], q.device)
        return banded_attention(q, k, v, p, global_pos=g,
                                block=X.int_option(p.extra, X.BLOCK, 128, self.name))

    def global_positions(self, p: AttnParams, sk: int,
                         device: torch.device) -> torch.Tensor | None:
        """Key positions every query sees besides its window (None: a pure window)."""
        return None


class SlidingWindowBackend(_Banded):
    """Exact local attention over a window; blocks outside it are never computed."""

    name = "sliding_window"
    tier = "variant"
    description = "exact sliding-window attention, blockwise, out-of-window key tiles skipped"
    capabilities: ClassVar[Capabilities] = _capabilities(
        {"causal", "sliding_window", "softcap", "alibi", "document"})


class LongformerBackend(_Banded):
    """Local window plus global tokens (Beltagy et al. 2020, "Longformer")."""

    name = "longformer"
    tier = "approximate"
    description = ("local window + global tokens (extra['longformer_global'], default 0); "
                   "exact for that mask, approximate against dense")
    capabilities: ClassVar[Capabilities] = _capabilities(
        {"causal", "sliding_window", "document"}, LONGFORMER_BUDGET, "local",
        LONGFORMER_GRAD_BUDGET)

    def global_positions(self, p: AttnParams, sk: int,
                         device: torch.device) -> torch.Tensor | None:
        return X.global_positions(p.extra, sk, device, self.name)


class LSHBackend(_BlockSparse):
    """Hash, sort, attend within buckets (Kitaev et al. 2020, "Reformer")."""

    name = "lsh"
    tier = "approximate"
    description = ("Reformer-style LSH bucketed attention (extra lsh_buckets/lsh_rounds/"
                   "lsh_seed); exact within colliding buckets, approximate against dense")
    capabilities: ClassVar[Capabilities] = _capabilities({"causal", "document"}, LSH_BUDGET,
                                                         "clustered")

    def compute(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                p: AttnParams) -> tuple[torch.Tensor, torch.Tensor]:
        e = p.extra
        return lsh_attention(
            q, k, v, p, n_buckets=X.int_option(e, X.LSH_BUCKETS, 8, self.name),
            n_rounds=X.int_option(e, X.LSH_ROUNDS, 4, self.name),
            seed=X.int_option(e, X.LSH_SEED, 0, self.name),
            block=X.int_option(e, X.LSH_BLOCK, 64, self.name))
