"""The capability data of the six backends, and what a resolver makes of it: approximate
backends never serve an exact request; a layer binding is what puts them in a model."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from attnhub_hybrid_linear.plugin import BACKENDS

import attnhub
from attnhub import AttentionSpec, BindContext, MaskSpec

APPROXIMATE = {"gla", "linear", "retention", "longformer", "lsh"}
CPU = attnhub.probe("cpu")


def test_exactness_tiers_and_budgets_are_declared() -> None:
    for cls in BACKENDS:
        caps = cls.capabilities
        if cls.name in APPROXIMATE:
            assert not caps.exact and cls.tier == "approximate", cls.name
            assert caps.error_budget is not None and caps.error_budget > 0, cls.name
        else:
            assert cls.name == "sliding_window" and caps.exact and caps.error_budget is None
    budgets = {c.name: c.capabilities.error_budget for c in BACKENDS}
    # a linear layer is another operator, not an approximation: no finite promise
    assert all(math.isinf(budgets[n]) for n in ("gla", "linear", "retention"))
    assert budgets["longformer"] < 1 and budgets["lsh"] < 1


def _spec(phase: str = "prefill", **mask: object) -> AttentionSpec:
    return AttentionSpec(phase=phase, dtype="bf16", head_dim=64, num_q_heads=8, num_kv_heads=2,
                         mask=MaskSpec(**mask), max_seqlen_q=1 if phase == "decode" else 512,
                         max_seqlen_k=512, needs_grad=phase == "train").bucketed()


@pytest.mark.parametrize("name,spec,ok", [
    ("gla", _spec("train", causal=True), True),
    ("gla", _spec("decode"), True),  # one query at the end of its context: causal is moot
    ("gla", _spec("prefill"), False),  # bidirectional: not a recurrence
    ("gla", _spec("prefill", causal=True, window=(64, 0)), False),
    ("retention", _spec("prefill", causal=True).with_(return_lse=True), False),
    ("sliding_window", _spec("train", causal=True, window=(64, 0)), True),
    ("sliding_window", _spec("prefill", causal=True), False),  # no window: nothing to skip
    ("sliding_window", _spec("prefill", causal=True, window=(-1, 0)), False),
    ("longformer", _spec("prefill", window=(32, 32)), True),
    ("lsh", _spec("train", causal=True), True),
    ("lsh", _spec("prefill", causal=True, softcap=True), False),
])
def test_check_reasons(name: str, spec: AttentionSpec, ok: bool) -> None:
    backend = next(cls() for cls in BACKENDS if cls.name == name)
    reasons = backend.check(spec, CPU)
    assert (reasons == []) == ok, reasons
    assert all(isinstance(r, str) and r for r in reasons)


def _policy(tmp_path: Path) -> Path:
    """Approximate backends first in a catch-all rule, then an exact one; and a layer rule."""
    path = tmp_path / "hybrid.yaml"
    path.write_text(
        "name: hybrid-test\nversion: 1\nrules:\n"
        "  - name: gla-layers\n    when: {layer: {kind: gla}}\n    use: [gla]\n"
        "  - name: everything\n"
        "    use: [gla, linear, retention, longformer, lsh, sliding_window, torch_sdpa]\n")
    return path


def test_resolver_never_binds_an_approximate_backend_to_an_exact_request(
        tmp_path: Path) -> None:
    hub = attnhub.Hub(policy=_policy(tmp_path), hardware="cpu")
    masks = [dict(causal=True), dict(), dict(causal=True, window=(64, 0)),
             dict(window=(32, 32))]
    for phase, mask in itertools.product(("train", "prefill", "decode"), masks):
        d = hub.decide(_spec(phase, **mask), BindContext(layer=0))
        assert d.backend is not None and d.backend not in APPROXIMATE, d.explain()
        assert {r.backend for r in d.rejected} >= APPROXIMATE - {d.backend}, d.explain()
    bound = hub.decide(_spec("prefill", causal=True), BindContext(layer=3, layer_kind="gla"))
    assert bound.backend == "gla", bound.explain()
