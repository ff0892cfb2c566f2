"""Run-time failure of a backend follows its rule: ``next`` falls back (counted, warned
once per backend and reason), ``error`` raises with the decision record."""

from __future__ import annotations

import logging

import pytest
import torch

import attnhub
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.errors import NoBackendError

POLICY = """
    name: flaky
    rules:
      - name: strict
        when: {phase: train}
        use: [boom, torch_sdpa]
        on_failure: error
      - name: lenient
        use: [boom, torch_sdpa]
    """


@pytest.fixture
def hub(write, make_registry, fake):
    boom = fake("boom", raises=RuntimeError("kernel launch failed: out of shared memory"))
    return attnhub.Hub(policy=str(write("flaky.yaml", POLICY)), hardware="cpu",
                       registry=make_registry(boom))


def test_next_falls_back_counts_and_warns_once(hub, caplog):
    q, k, v = (torch.randn(2, 37, 4, 16) for _ in range(3))
    with caplog.at_level(logging.WARNING, logger="attnhub"):
        outs = [hub.attention(q, k, v, causal=True) for _ in range(3)]
    ref, _ = reference_attention(q, k, v, AttnParams(scale=16 ** -0.5, causal=True))
    for out in outs:
        torch.testing.assert_close(out, ref.to(q.dtype), atol=2e-5, rtol=2e-5)
    assert hub.fallback_counts == {("boom", "torch_sdpa"): 3}
    warnings = [r for r in caplog.records if "boom failed" in r.getMessage()]
    assert len(warnings) == 1 and "out of shared memory" in warnings[0].getMessage()
    (runner,) = hub.bound()
    assert runner.decision.rule == "lenient" and runner.decision.fallbacks == ("torch_sdpa",)
    assert hub.registry.get("boom").calls == 3


def test_error_raises_with_the_decision_record(hub):
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    with pytest.raises(NoBackendError) as info:
        hub.attention(q, k, v)
    d = info.value.decision
    assert d.rule == "strict" and d.backend == "boom" and d.fallbacks == ()
    assert "on_failure=error" in str(info.value) and "rule:    strict" in str(info.value)
    assert any("torch_sdpa will not be tried" in n for n in d.notes)
    assert not hub.fallback_counts


def test_a_failure_on_a_later_call_follows_the_rule_too(write, make_registry, fake):
    """The hot path runs the bound backend itself once its binding is cached: a failure
    there (a kernel that worked before) must follow the rule as on the first call, and an
    InputError (the caller's data) is raised, never retried elsewhere."""
    from attnhub.errors import InputError

    flaky = fake("boom")  # works at first
    hub = attnhub.Hub(policy=str(write("flaky.yaml", POLICY)), hardware="cpu",
                      registry=make_registry(flaky))
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    hub.attention(q, k, v)
    flaky.raises = RuntimeError("device lost")
    out = hub.attention(q, k, v)  # lenient: next candidate
    ref, _ = reference_attention(q, k, v, AttnParams(scale=16 ** -0.5))
    torch.testing.assert_close(out, ref.to(q.dtype), atol=2e-5, rtol=2e-5)
    assert hub.fallback_counts == {("boom", "torch_sdpa"): 1}
    flaky.raises = InputError("boom: this call's data is refused")
    with pytest.raises(InputError, match="refused"):
        hub.attention(q, k, v)
    assert hub.fallback_counts == {("boom", "torch_sdpa"): 1}

    flaky.raises = None
    qg, kg, vg = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    hub.attention(qg, kg, vg)  # strict (training): bound and cached
    flaky.raises = RuntimeError("device lost")
    with pytest.raises(NoBackendError, match="device lost") as info:
        hub.attention(qg, kg, vg)
    assert info.value.decision.rule == "strict"
