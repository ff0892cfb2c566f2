"""Policy engine semantics, eleventh round: what ``explain`` and ``decide`` report must be what
``Hub.attention`` runs, and lint must say when a rule can never match.

- ``explain`` kept a sliding window the call's check drops (an edge past every key of the
  length bucket): it showed a sliding-window rule while the hub ran another one.
- ``explain --run`` ran the call without ``--return-lse``, so it bound another rule than the
  decision it printed.
- A ``bhsd`` spec given to ``Policy.resolve``/``Hub.decide`` missed ``layout: bshd`` rules,
  although the hub runs that call as ``bshd``.
- Lint said nothing of bucketed values no call has (``batch: 3``, ``seqlen: 3000``, ``seqlen:
  {gt: 4096, lt: 8192}``) and warned about the bound 0, which bucketed values reach.
- A pack's near-tie was timed across a ``fastest`` rule's accuracy opt-in: the hub could
  bind the faster un-gated candidate over the one a passing record opted in.
"""

from __future__ import annotations

import json
import random
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import attnhub
from attnhub.cli import main
from attnhub.core.device import probe
from attnhub.core.registry import Registry
from attnhub.core.spec import AttentionSpec
from attnhub.hookspecs import hookimpl
from attnhub.policy import ProfileStore, load_policy
from attnhub.policy.lint import lint_policy
from tests.test_settle_ties import _Counted


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("ATTNHUB_HARDWARE", "ATTNHUB_BACKEND", "ATTNHUB_POLICY", "ATTNHUB_PROVIDERS",
                "ATTNHUB_SETTLE_TIES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ATTNHUB_PROFILE", str(tmp_path / "store.json"))
    monkeypatch.setenv("ATTNHUB_PROFILE_PACKS", "off")


def _policy_file(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


SMALL = ["--heads", "2:2", "--head-dim", "16"]


def _explain(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    main(["explain", *argv, *SMALL, "--json"])
    return json.loads(capsys.readouterr().out)


WINDOWED = """
    name: windowed
    rules:
      - {name: windowed, when: {mask_any: [sliding_window]}, use: [reference]}
      - {name: rest, use: [torch_sdpa, reference]}
    """


@pytest.mark.parametrize("mask,window,seqlen,rule", [
    ("causal,sliding_window", 1024, 256, "rest"),      # past every key: no window at all
    ("causal,sliding_window", 256, 256, "rest"),       # the edge at the bucket: the same
    ("causal,sliding_window", 100, 256, "windowed"),   # a window that bounds
    ("sliding_window", 1024, 256, "windowed"),         # not causal: right edge 0 still bounds
])
def test_explain_normalises_the_window_as_the_call_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], mask: str, window: int,
        seqlen: int, rule: str) -> None:
    """The decision explain prints, the one its --run binds and the hub's own, alike."""
    path = _policy_file(tmp_path, WINDOWED)
    got = _explain(capsys, "--policy", str(path), "--mask", mask, "--window", str(window),
                   "--seqlen", str(seqlen), "--run")
    assert got["decision"]["rule"] == rule
    assert got["run"]["bound"] == got["run"]["policy_choice"] == got["decision"]["backend"]
    hub = attnhub.Hub(policy=load_policy(path))
    q = torch.randn(1, seqlen, 2, 16)
    hub.attention(q, q, q, causal="causal" in mask, window=(window, 0))
    assert hub.bound()[-1].decision.rule == rule


def test_explain_run_asks_for_the_lse_it_explains(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = _policy_file(tmp_path, """
        name: lse
        rules:
          - {name: lse, when: {return_lse: true}, use: [reference]}
          - {name: rest, use: [torch_sdpa]}
        """)
    got = _explain(capsys, "--policy", str(path), "--return-lse", "--seqlen", "64", "--run")
    assert got["decision"]["backend"] == "reference"
    assert got["run"]["bound"] == "reference" and got["run"]["why"] == ""


def test_a_bhsd_spec_is_decided_as_the_bshd_call_the_hub_makes(tmp_path: Path) -> None:
    path = _policy_file(tmp_path, """
        name: layouts
        rules:
          - {name: dense, when: {layout: bshd}, use: [reference]}
          - {name: rest, use: [torch_sdpa]}
        """)
    hub = attnhub.Hub(policy=load_policy(path))
    q = torch.randn(1, 2, 8, 16)  # B, H, S, D
    hub.attention(q, q, q, layout="bhsd")
    ran = hub.bound()[-1].decision
    spec = AttentionSpec(phase="prefill", dtype="fp32", head_dim=16, num_q_heads=2,
                         num_kv_heads=2, layout="bhsd", max_seqlen_q=8, max_seqlen_k=8)
    decided = hub.decide(spec)
    assert ran.rule == decided.rule == "dense" and decided.backend == "reference"
    assert [t for t, failed in hub.resolver.trace(spec, hub.device) if failed is None]


BUCKETED = """
    name: buckets
    targets: [cpu]
    rules:
      - {name: odd-seqlen, when: {seqlen: 3000}, use: [reference]}
      - {name: odd-batch, when: {batch: [3, 4]}, use: [reference]}
      - {name: gap, when: {seqlen: {gt: 4096, lt: 8192}}, use: [reference]}
      - {name: gap-k, when: {seqlen_k: {ge: 4097, le: 8000}}, use: [reference]}
      - {name: zero, when: {batch: {gt: 0}, seqlen_q: {ge: 0, le: 4096}}, use: [reference]}
      - {name: rest, use: [reference]}
    """


def test_lint_says_which_bucketed_conditions_no_call_meets(tmp_path: Path) -> None:
    policy = load_policy(_policy_file(tmp_path, BUCKETED))
    found = {(f.path, f.message.split(":")[0].split(",")[0])
             for f in lint_policy(policy, Registry.load()) if f.level == "warning"}
    assert found == {
        ("rules[0].when.seqlen (odd-seqlen)",
         "seqlen is compared after bucketing to the next power of two"),
        ("rules[1].when.batch (odd-batch)", "value 3 never holds"),
        ("rules[2].when.seqlen (gap)",
         "seqlen is compared after bucketing to the next power of two"),
        ("rules[3].when.seqlen_k (gap-k)",
         "seqlen_k is compared after bucketing to the next power of two"),
    }


def test_what_lint_calls_unreachable_no_call_reaches(tmp_path: Path) -> None:
    """The property behind the warnings: across lengths and batches, the flagged rules (and
    the listed value 3) never decide, and the unflagged ones do."""
    policy = load_policy(_policy_file(tmp_path, BUCKETED))
    registry, device, rng = Registry.load(), probe(), random.Random(11)
    seen = set()
    for _ in range(300):
        sq, sk = rng.randint(1, 9000), rng.randint(1, 9000)
        spec = AttentionSpec(phase="prefill", dtype="fp32", head_dim=16, num_q_heads=2,
                             num_kv_heads=2, max_seqlen_q=sq, max_seqlen_k=sk,
                             batch=rng.choice([1, 2, 3, 5, 8]))
        d = policy.resolve(spec, device, registry)
        seen.add(d.rule)
        assert d.rule != "odd-batch" or d.spec.batch == 4
    assert seen.isdisjoint({"odd-seqlen", "gap", "gap-k"})
    assert {"odd-batch", "zero", "rest"} <= seen


# -- a pack's near-tie and an accuracy opt-in ---------------------------------------------

_Timed = _Counted  # the reference kernel on the virtual clock


class OptedIn(_Timed):
    name = "opted_in"
    cost = 1.0e-3


class Quicker(_Timed):
    name = "quicker"
    cost = 0.5e-3


GATED = """
    name: gated
    rules:
      - name: gated
        use: {fastest: [quicker, opted_in]}
        requires: {accuracy: {backends: [opted_in]}}
    """


def test_a_pack_near_tie_never_unseats_an_accuracy_opt_in(tmp_path: Path,
                                                          virtual_clock: Any) -> None:
    """``fastest`` puts a candidate its accuracy record opted in first "whatever the
    timings"; timing a pack's near-tie at the first call bound the quicker one instead."""
    backends = (OptedIn(virtual_clock), Quicker(virtual_clock))

    @hookimpl
    def attnhub_register_backends(register):  # type: ignore[no-untyped-def]
        for b in backends:
            register(b)

    registry = Registry.load()
    registry.add_plugin(types.SimpleNamespace(
        attnhub_register_backends=attnhub_register_backends), "review11_plugin")
    hub = attnhub.Hub(load_policy(_policy_file(tmp_path, GATED)), registry=registry)
    q = torch.randn(1, 8, 2, 16)
    spec = AttentionSpec(phase="prefill", dtype="fp32", head_dim=16, num_q_heads=2,
                         num_kv_heads=2, max_seqlen_q=8, max_seqlen_k=8)
    src = ProfileStore(tmp_path / "src.json", packs="off")
    src.record_speed(hub.device, spec, "quicker", 1.00e-4)
    src.record_speed(hub.device, spec, "opted_in", 1.02e-4)
    data = src.data()
    data["pack"] = {"measured": "2026-12-02", "command": "test"}
    (tmp_path / "packs").mkdir()
    (tmp_path / "packs" / "pack.json").write_text(json.dumps(data))
    store = ProfileStore(tmp_path / "user.json", packs=tmp_path / "packs")
    store.record_accuracy(hub.device, spec, "opted_in", passed=True,
                          metrics={"rel_error": 0.001}, reference="fp32")
    hub.resolver.profile = store
    assert hub.decide(spec).tied == ()
    hub.attention(q, q, q)
    d = hub.bound()[-1].decision
    assert d.backend == "opted_in" and d.fallbacks == ("quicker",)
    assert any("opted in by a passing accuracy record" in n for n in d.notes)
