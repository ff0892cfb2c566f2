"""Dropout and the hub's boundaries (found by a review of the dropout feature): checkpointing
that ends inside attention, a numpy probability and the binding cache, near-tie timing that
would draw, the linter, and the CLI's views of a dropout call."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import attnhub
from attnhub.cli import main
from attnhub.core.spec import AttentionSpec
from attnhub.core.registry import Registry
from attnhub.policy import load_policy
from attnhub.policy.lint import lint_policy
from attnhub.settle import blocker


def _inputs(layout: str, seed: int) -> tuple[tuple[torch.Tensor, ...], dict]:
    g = torch.Generator().manual_seed(seed)
    if layout == "thd":
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        return (tuple(torch.randn(8, 2, 16, generator=g).requires_grad_() for _ in range(3)),
                dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu))
    return tuple(torch.randn(1, 8, 2, 16, generator=g).requires_grad_() for _ in range(3)), {}


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_checkpointing_that_ends_in_attention_recomputes_it(layout: str, p: float) -> None:
    """Non-reentrant checkpointing stops its recomputation early by raising inside the last
    op it needs, here attention: the hub took that for a backend failure, tried every
    fallback and raised NoBackendError. The gradients are now the plain call's, draw
    included (the checkpoint restores the RNG state for the recomputation)."""
    hub = attnhub.Hub(hardware="cpu")
    (q, k, v), kw = _inputs(layout, 1)
    f = lambda q, k, v: hub.attention(q, k, v, causal=True, dropout_p=p, **kw)  # noqa: E731
    torch.manual_seed(3)
    out = checkpoint(f, q, k, v, use_reentrant=False)
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    torch.manual_seed(3)
    plain = f(q, k, v)
    want = torch.autograd.grad((plain * plain).sum(), (q, k, v))
    assert torch.equal(out, plain)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not hub.fallback_counts


def test_a_numpy_probability_does_not_leave_its_binding_to_later_calls() -> None:
    """np.float64(0.1) bound the dropout backend (the fp64 reference for thd) under the key
    of a call without dropout, so every later dropout_p=0.0 call of those shapes ran it."""
    hub = attnhub.Hub(hardware="cpu")
    (q, k, v), kw = _inputs("thd", 2)
    with torch.no_grad():
        hub.attention(q, k, v, dropout_p=np.float64(0.1), **kw)
        for _ in range(2):
            hub.attention(q, k, v, dropout_p=0.0, **kw)
    served = {r.decision.spec.dropout: r.decision.backend for r in hub.bound()}
    assert served == {True: "reference", False: "torch_sdpa"}
    fresh = attnhub.Hub(hardware="cpu")
    with torch.no_grad():
        fresh.attention(q, k, v, dropout_p=0.0, **kw)
    assert fresh.bound()[-1].decision.backend == served[False]


def test_near_ties_are_not_timed_on_a_dropout_call() -> None:
    """Timing runs each tied candidate many times on the caller's tensors: each run would
    draw from the caller's generator, so one seed would no longer repeat the call."""
    spec = AttentionSpec(phase="prefill", dtype="fp32", head_dim=16, num_q_heads=2,
                         num_kv_heads=2, max_seqlen_q=8, max_seqlen_k=8, dropout=True)
    why = blocker(torch.zeros(1), spec)
    assert why is not None and "dropout" in why
    assert blocker(torch.zeros(1), spec.with_(dropout=False)) is None


def test_lint_names_a_dropout_rule_whose_backends_draw_none(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("name: t\nrules:\n  - {name: drop, when: {dropout: true}, use: "
                    "[torch_flash_cpu, torch_sdpa, reference]}\n"
                    "  - {name: rest, use: [torch_sdpa, reference]}\n")
    found = lint_policy(load_policy(path), Registry.load(), ("cpu",))
    errors = [f for f in found if f.level == "error"]
    assert [f.path for f in errors] == ["rules[0].use[0] (drop)"], found
    assert "torch_flash_cpu, which declares no attention dropout" in errors[0].message


def test_explain_and_backends_show_dropout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--hardware", "sm90", "--phase", "train", "--mask",
                 "causal,softcap", "--dropout", "0.1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["decision"]["backend"] == "reference"
    assert "dropout" in doc["decision"]["spec"] and doc["decision"]["rule"] == "gpu-dropout"
    assert main(["explain", "--dropout", "1"]) == 1
    assert "--dropout 1: a probability below 1" in capsys.readouterr().err
    assert main(["backends", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["torch_sdpa"]["dropout"] and not rows["torch_flash_cpu"]["dropout"]


def test_the_planning_grid_has_dropout_cells(capsys: pytest.CaptureFixture[str]) -> None:
    """The training cells once more with dropout: lint, plan and lock see the rule that
    routes them (none did before), and each is served on a GPU."""
    assert main(["plan", "--hardware", "sm90", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["cells"] if r["dropout"]]
    assert rows and all(r["phase"] == "train" and "dropout" in r["spec"] for r in rows)
    assert {r["bindings"]["sm90"]["rule"] for r in rows} == {
        "gpu-dropout", "score-mod-variants", "mask-mod-variants"}
    assert all(r["bindings"]["sm90"]["backend"] for r in rows)
