"""Review 10b of the policy/lock/registry change (763037d) and the kit's gradient budget
(72ee1f7): what a second pass found, each test failing before its fix."""

from __future__ import annotations

from attnhub.conformance.cases import Case
from attnhub.conformance.kit import CaseResult, KitReport
from attnhub.conformance.report import format_report
from attnhub.core.device import simulate
from attnhub.core.registry import Registry
from attnhub.policy import load_policy
from attnhub.policy.cells import cells
from attnhub.policy.lock import build_lock, check_lock

# ---------------------------------------------------------------- kit report


def test_a_gradient_budget_verdict_is_printed_in_full() -> None:
    """The table cuts details at 110 characters; the error budget's verdict is printed in
    full below it, but the gradient budget's was not: which of dq, dk, dv broke it and the
    fix (``declare the grad_error_budget it meets``) were cut off."""
    detail = ("gradient dq: rel. RMSE 0.31 > grad_error_budget 0.1 vs dense attention's "
              "gradients (fp64) on local inputs (window 4); dq 0.31, dk 0.02, dv 0.01: fix "
              "the backward, or declare the grad_error_budget it meets")
    case = Case(feature="gradient budget (local inputs)", phase="train", backward=True,
                budget_inputs="local")
    report = KitReport("approx", "mine", "cpu", [CaseResult(case, "fail", detail, 0.31, 0.1)])
    text = format_report(report)
    assert detail in text
    assert f"gradient budget (local inputs): FAIL: {detail} [case: " in text


def test_an_error_budget_verdict_is_still_printed_once() -> None:
    case = Case(feature="error budget (local inputs)", budget_inputs="local")
    detail = "rel. RMSE 0.01 <= error_budget 0.05 vs dense attention on local inputs"
    text = format_report(KitReport("approx", "mine", "cpu",
                                   [CaseResult(case, "pass", detail, 0.01, 0.05)]))
    assert text.count(f"error budget (local inputs): PASS: {detail}") == 1


# ---------------------------------------------------------------- locks from before aliases


def _h20_lock() -> tuple[dict, object, Registry]:
    policy, registry = load_policy("default"), Registry.load()
    spec = next(c.spec() for c in cells() if c.phase_label == "train" and c.mask == "causal")
    dev = simulate("h20")
    d = policy.resolve(spec, dev, registry)
    assert d.rule == "h20-dense"  # the H20 has a rule of its own on device_name
    return build_lock(policy, registry, [(dev, d)]), policy, registry


def test_an_h20_locked_as_its_arch_names_the_alias_to_regenerate_with() -> None:
    """A lock written before plan/lock named simulated models by alias recorded an H20 as
    ``sm90``; checked now it resolves as an H100 (drift, rightly: the lock cannot say which
    model it was), and the drift said nothing of why or of the fix."""
    lock, policy, registry = _h20_lock()
    assert lock["bindings"][0]["hardware"] == "h20"
    assert not check_lock(lock, policy, registry).drifted  # as written now: clean
    lock["bindings"][0]["hardware"] = "sm90"  # as the earlier attnhub wrote it
    drift = check_lock(lock, policy, registry)
    assert drift.drifted and len(drift.changed) == 1
    assert "rule 'h20-dense' -> " in drift.changed[0]
    assert "as locked on h20" in drift.changed[0]
    assert "attnhub lock --hardware h20" in drift.changed[0]


def test_a_real_drift_on_an_arch_gets_no_alias_hint() -> None:
    lock, policy, registry = _h20_lock()
    lock["bindings"][0]["hardware"] = "sm90"
    lock["bindings"][0]["rule"] = "some-other-rule"  # no model of sm90 resolves so
    drift = check_lock(lock, policy, registry)
    assert drift.drifted and "as locked on" not in drift.changed[0]
