"""A backend's lasting refusal (``BackendUnavailableError(lasting=True)``: a per-shape build
budget spent) moves it behind its binding's other candidates, once, with a note in the
decision and a warning; later calls go to the next candidate directly. A refusal that is not
lasting (this call's shape only) leaves the order alone."""

from __future__ import annotations

import logging
import textwrap

import pytest
import torch

import attnhub
from attnhub.core.backend import AttentionOutput, Backend
from attnhub.core.capabilities import ALL_MASKS, Capabilities
from attnhub.core.reference import reference_attention
from attnhub.core.registry import Registry
from attnhub.errors import BackendUnavailableError, NoBackendError
from attnhub.testing import assert_fa_rule, fa_references
from attnhub.core.spec import AttnParams


class Budgeted(Backend):
    """Exact attention for its first ``budget`` distinct shapes, then refuses new ones."""

    name = "budgeted"
    capabilities = Capabilities(dtypes=frozenset({"fp32"}), masks=ALL_MASKS, gqa=True,
                                max_head_dim=256)

    def __init__(self, budget: int, lasting: bool):
        super().__init__()
        self.budget, self.lasting = budget, lasting
        self.shapes: set[tuple] = set()
        self.calls = 0

    def forward(self, q, k, v, spec, params):  # type: ignore[override]
        self.calls += 1
        key = (q.shape, k.shape)
        if key not in self.shapes:
            if len(self.shapes) >= self.budget:
                raise BackendUnavailableError(self.name, ["shape budget spent"],
                                              lasting=self.lasting)
            self.shapes.add(key)
        out, _ = reference_attention(q, k, v, params)
        return AttentionOutput(out.to(q.dtype), None)


def _hub(tmp_path, budget: int, lasting: bool, on_failure: str = "next") -> attnhub.Hub:
    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent(f"""
        name: lasting
        rules:
          - name: prompts
            use: [budgeted, torch_sdpa]
            on_failure: {on_failure}
        """).lstrip(), encoding="utf-8")
    reg = Registry.of(Budgeted(budget, lasting), plugin="budgeted")
    return attnhub.Hub(policy=str(path), hardware="cpu", registry=reg)


def _prompts(n: int, start: int = 17):
    g = torch.Generator().manual_seed(n)
    for s in range(start, start + n):  # a new length per call, one length bucket
        yield tuple(torch.randn(1, s, h, 16, generator=g) for h in (4, 2, 2))


def _exact(out, q, k, v):
    ref64, _, same = fa_references(q, k, v, AttnParams(scale=0.25, causal=True))
    assert_fa_rule(out, ref64, same)


def test_lasting_refusal_moves_the_backend_back_once(tmp_path, caplog):
    hub = _hub(tmp_path, budget=3, lasting=True)
    budgeted = hub.registry.get("budgeted")
    with caplog.at_level(logging.WARNING, logger="attnhub"):
        for q, k, v in _prompts(10):
            _exact(hub.attention(q, k, v, causal=True), q, k, v)
    assert budgeted.calls == 4  # 3 served, the 4th refused; none after it
    assert hub.fallback_counts == {("budgeted", "torch_sdpa"): 1}
    run = hub.bound()[-1]
    assert [b.name for b in run.chain] == ["torch_sdpa", "budgeted"]
    d = run.decision
    assert d.backend == "torch_sdpa" and d.fallbacks == ("budgeted",)
    assert "moved behind torch_sdpa" in d.explain() and "shape budget spent" in d.explain()
    assert hub.decide(d.spec, d.context) is d  # what explain() reports from then on
    assert sum("moved behind" in r.message for r in caplog.records) == 1


def test_refusal_of_one_call_keeps_the_order(tmp_path):
    hub = _hub(tmp_path, budget=3, lasting=False)
    budgeted = hub.registry.get("budgeted")
    for q, k, v in _prompts(8):
        _exact(hub.attention(q, k, v, causal=True), q, k, v)
    assert budgeted.calls == 8  # tried first on every call
    assert hub.fallback_counts == {("budgeted", "torch_sdpa"): 5}
    assert hub.bound()[-1].decision.backend == "budgeted"


def test_lasting_refusal_under_on_failure_error_raises(tmp_path):
    hub = _hub(tmp_path, budget=2, lasting=True, on_failure="error")
    calls = list(_prompts(3))
    for q, k, v in calls[:2]:
        hub.attention(q, k, v, causal=True)
    with pytest.raises(NoBackendError, match="shape budget spent"):
        hub.attention(*calls[2], causal=True)
    assert hub.bound()[-1].decision.backend == "budgeted"  # nothing moved: the rule says stop
