"""The conformance kit judges an approximate backend's declared ``error_budget`` on inputs of
the class it is stated for (``error_budget_inputs``): a budget that does not hold there is a
FAIL naming the metric, the error, the budget and the case; an honest one passes; a missing
budget or an input class the kit cannot build is a FAIL naming the fix."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attnhub.conformance import KitReport, format_report, grid, run_kit
from attnhub.core.builtin import ReferenceBackend
from attnhub.core.device import probe
from attnhub.plugin import AttentionOutput, Capabilities

CPU = probe("cpu")
APPROX = replace(ReferenceBackend.capabilities, masks=frozenset({"causal", "sliding_window"}),
                 layouts=frozenset({"bshd", "bhsd"}), backward=False,
                 deterministic_backward=False, dropout=False, exact=False, error_budget=0.05)


class Rounded(ReferenceBackend):
    """Honest: exact attention over values rounded to bf16 (rel. RMSE ~3e-3 <= 0.01)."""

    name = "rounded"
    plugin = "test"
    capabilities = replace(APPROX, error_budget=0.01)

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        return super().forward(q, k, v.to(torch.bfloat16).to(v.dtype), spec, params)


class Noisy(ReferenceBackend):
    """Claims 0.05 on random inputs, adds 20% structured noise."""

    name = "noisy"
    plugin = "test"
    capabilities = APPROX

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        out, lse = super().forward(q, k, v, spec, params)
        wobble = torch.sin(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape)
        return AttentionOutput(out + 0.2 * out.std() * wobble, lse)


class WindowOnly(ReferenceBackend):
    """Honest local backend: exact over the call's window, claimed against dense attention
    on local inputs (where the window provably suffices)."""

    name = "window_only"
    plugin = "test"
    capabilities = replace(APPROX, error_budget_inputs="local")


class Blunt(WindowOnly):
    """Local, but a quarter of the softmax scale: flatter than dense attention in the window."""

    name = "blunt"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        return super().forward(q, k, v, spec, replace(params, scale=params.scale / 4))


def _budget(backend: ReferenceBackend) -> KitReport:
    cases = [c for c in grid(backend.capabilities, quick=True)
             if c.feature.startswith("error budget")]
    assert cases
    return run_kit(backend, CPU, cases=cases)


@pytest.mark.parametrize("backend, inputs", [(Rounded(), "random"), (WindowOnly(), "local")])
def test_an_honest_approximate_backend_passes(backend: ReferenceBackend, inputs: str) -> None:
    rep = _budget(backend)
    assert rep.ok and {r.status for r in rep.results} == {"pass"}, rep.to_json()
    budget = backend.capabilities.error_budget
    for r in rep.results:
        assert r.case.feature == f"error budget ({inputs} inputs)"
        assert r.allowed == budget and r.error is not None and r.error <= budget
        assert f"rel. RMSE {r.error:.3g} <= error_budget {budget:g}" in r.detail
    if inputs == "local":  # inputs checked to meet the class's condition, near its edge
        assert all("2 eps kappa" in r.detail for r in rep.results)


@pytest.mark.parametrize("backend, inputs", [(Noisy(), "random"), (Blunt(), "local")])
def test_a_backend_off_its_budget_fails(backend: ReferenceBackend, inputs: str) -> None:
    rep = _budget(backend)
    assert not rep.ok and {r.status for r in rep.results} == {"fail"}, rep.to_json()
    for r in rep.results:
        assert r.error is not None and r.error > 0.05 and r.allowed == 0.05
        assert f"rel. RMSE {r.error:.3g} > error_budget 0.05" in r.detail
        assert f"on {inputs} inputs" in r.detail
    row = rep.to_json()["features"][0]  # the worst case, with its full verdict line
    assert row["feature"] == f"error budget ({inputs} inputs)" and row["status"] == "fail"
    assert (f"error budget ({inputs} inputs): FAIL: {row['detail']} [case: {row['case']}]"
            in format_report(rep))


def _bent(**fields: object) -> Capabilities:
    """A declaration __post_init__ would refuse (a plugin can still hand one over)."""
    caps = replace(APPROX)
    for name, value in fields.items():
        object.__setattr__(caps, name, value)
    return caps


@pytest.mark.parametrize("caps, words", [
    (_bent(error_budget=None), "no error_budget declared: declare Capabilities(error_budget="),
    (_bent(error_budget_inputs="smooth"), "'smooth' is no input class the kit can build"),
    (replace(APPROX, masks=frozenset({"causal"}), error_budget_inputs="local"),
     "sliding_window mask is not declared"),
])
def test_a_budget_the_kit_cannot_judge_is_a_failure_naming_the_fix(caps: Capabilities,
                                                                   words: str) -> None:
    class Undeclared(ReferenceBackend):
        name = "undeclared"
        plugin = "test"
        capabilities = caps

    rep = _budget(Undeclared())
    assert not rep.ok and [r.status for r in rep.results] == ["fail"]
    assert words in rep.results[0].detail


def test_an_unknown_input_class_is_refused_at_declaration() -> None:
    with pytest.raises(TypeError, match="error_budget_inputs must be one of"):
        Capabilities(exact=False, error_budget=0.1, error_budget_inputs="smooth")


def test_declining_the_budget_inputs_while_serving_the_grid_is_a_failure() -> None:
    class Dodger(Rounded):
        name = "dodger"

        def extra_checks(self, spec, device):  # type: ignore[no-untyped-def, override]
            return ["sequences over 20 tokens"] if (spec.max_seqlen_q or 0) > 20 else []

    rep = _budget(Dodger())
    assert not rep.ok and {r.status for r in rep.results} == {"fail"}
    assert "declines the call its error budget is stated for" in rep.results[0].detail


def test_an_unbounded_budget_is_shown_not_failed_and_exact_backends_have_none() -> None:
    class Other(Noisy):
        name = "other_operator"
        capabilities = replace(APPROX, error_budget=float("inf"))

    rep = _budget(Other())
    assert rep.ok and len(rep.results) == 1
    assert "error_budget inf declares no bound" in rep.results[0].detail
    assert not [c for c in grid(ReferenceBackend.capabilities) if "budget" in c.feature]
