"""``attnhub policy check``: shadowed rules, contradictions, gates, unserved cells."""

from __future__ import annotations

import json

import pytest

from attnhub.core.capabilities import Capabilities
from attnhub.policy import load_policy
from attnhub.policy.cells import cells
from attnhub.policy.lint import covers, lint_policy
from attnhub.policy.schema import When


def findings(policy, registry, hardware=("cpu",)):
    return [(f.level, f.path, f.message) for f in lint_policy(policy, registry, hardware)]


def test_covers_is_conservative():
    w = When.model_validate
    assert covers(w({}), w({"phase": "train"}))
    assert covers(w({"hardware": "cuda"}), w({"hardware": ["sm80", "sm90"], "dtype": "bf16"}))
    assert covers(w({"seqlen": {"ge": 1024}}), w({"seqlen": {"ge": 4096, "lt": 8192}}))
    assert covers(w({"mask": ["none", "causal"]}), w({"mask": "causal"}))
    assert not covers(w({"hardware": "sm90"}), w({"hardware": "cuda"}))
    assert not covers(w({"phase": "train"}), w({}))
    assert not covers(w({"seqlen": {"gt": 1024}}), w({"seqlen": {"ge": 1024}}))
    assert not covers(w({"profile": {"attention_share": {"lt": 0.2}}}), w({"phase": "decode"}))


def test_shadowed_thresholds_and_clean(write, make_registry):
    p = load_policy(write("p.yaml", """
        name: t
        targets: [cpu]
        rules:
          - {name: any-cpu, when: {hardware: cpu}, use: [torch_sdpa, reference]}
          - {name: cpu-decode, when: {hardware: cpu, phase: decode}, use: [reference]}
          - {name: long, when: {seqlen: {ge: 5000}}, use: [torch_sdpa]}
        """))
    got = findings(p, make_registry())
    assert got == [
        ("warning", "rules[1] (cpu-decode)",
         f"can never match: earlier rule 'any-cpu' ({p.rules[0].location}) matches every call "
         "this one does; expected it before that rule or narrower conditions there"),
        ("warning", "rules[2].when.seqlen (long)",
         "bound 5000 is not a power of two, but seqlen is compared after bucketing to the next "
         "power of two; expected a power of two (e.g. 4096, 8192)")]


def test_contradictions_and_gates(write, make_registry, fake):
    reg = make_registry(
        fake("nodet", caps=Capabilities(deterministic_forward=False)),
        fake("f8", caps=Capabilities(dtypes=frozenset({"bf16"}),
                                     kv_dtypes=frozenset({"fp8_e4m3"}))),
        fake("approx", "approximate", Capabilities(exact=False, error_budget=0.1)))
    p = load_policy(write("p.yaml", """
        name: t
        targets: [cpu]
        rules:
          - {name: det, when: {deterministic: true}, use: [nodet, torch_sdpa]}
          - {name: fp8, when: {dtype: fp8_e4m3}, use: [torch_sdpa]}
          - name: kv8
            when: {kv_dtype: fp8_e4m3}
            use: [f8]
            requires: {accuracy: {backends: [f9]}}
          - {name: approx, use: [approx, torch_sdpa, reference]}
        """))
    got = findings(p, reg)
    errors = [(path, msg.split(";")[0]) for level, path, msg in got if level == "error"]
    assert errors == [
        ("rules[0].use[0] (det)", "rule routes deterministic requests to nodet, whose forward "
                                  "is not deterministic"),
        ("rules[1].use[0] (fp8)", "rule routes FP8 (fp8_e4m3) to torch_sdpa, which supports "
                                  "bf16, fp16, fp32"),
        ("rules[2].requires.accuracy.backends[0] (kv8)", "'f9' is not a candidate of this rule, "
                                                         "expected one of: f8"),
        ("rules[3].use[0] (approx)", "approx is approximate (error budget 0.1), expected it only "
                                     "in a rule with a layer selector (when.layer) or with "
                                     "`requires: {accuracy: ...}` for it")]
    warnings = [path for level, path, _ in got if level == "warning"]
    assert warnings == ["rules[2].use[0] (kv8)"]  # FP8 without a gate for it


def test_unserved_cells_and_missing_plugins(write, make_registry):
    p = load_policy(write("p.yaml", """
        name: t
        rules:
          - {name: gpu-only, when: {hardware: cuda}, use: [fa3]}
          - {name: sdpa, use: [torch_sdpa]}
        """))
    got = lint_policy(p, make_registry(), ("cpu", "sm90"))
    by_level = {(f.level, f.path) for f in got}
    # fa3 is first-party but not installed in this registry: a warning, not an error
    assert ("warning", "rules[0].use[0] (gpu-only)") in by_level
    missing = [f for f in got if "have no installed backend" in f.message]
    n_dropout = len([c for c in cells() if c.dropout])
    assert sorted(f.message.split(" cell(s)")[0] for f in missing) == sorted(
        [f"on sm90, {len(cells()) - n_dropout}", f"on sm90, {n_dropout}"])
    # torch_sdpa cannot do softcap/score_mod: those cpu cells are unserved -> error
    (unserved,) = [f for f in got if f.level == "error"]
    assert unserved.path == "rules[1] (sdpa)" and unserved.message.startswith("on cpu, 18 cell(s)")
    # with dropout also packed documents; a policy for models trained without attention
    # dropout may leave those cells: a warning naming the fix, not an error
    (dropped,) = [f for f in got if "with attention dropout" in f.message]
    assert dropped.level == "warning" and dropped.message.startswith("on cpu, 9 training")
    assert "torch_sdpa: mask softcap not supported" in unserved.message


@pytest.mark.parametrize("seed", [7, 11, 23])
def test_shadow_index_finds_the_same_first_cover_as_pairwise_comparison(write, seed):
    """The indexed search for shadowing rules agrees with comparing every earlier rule."""
    import random

    from attnhub.policy.lint import _ShadowIndex, covers

    rng = random.Random(seed)
    keys = {
        "phase": lambda: rng.sample(["train", "prefill", "decode"], rng.randint(1, 3)),
        "hardware": lambda: rng.sample(["cpu", "cuda", "sm90"], rng.randint(1, 2)),
        "head_dim": lambda: rng.choice([64, [64, 128], {"ge": 64}, {"le": 128},
                                        {"ge": 32, "lt": 256}]),
        "seqlen": lambda: rng.choice([{"ge": 1024}, {"ge": 4096}, {"lt": 4096}, [512, 1024]]),
        "needs_grad": lambda: rng.choice([True, False]),
    }
    lines = ["name: p", "rules:"]
    for i in range(300):
        when = {k: f() for k, f in keys.items() if rng.random() < 0.4}
        lines.append(f"  - {{name: r{i}, when: {json.dumps(when)}, use: [torch_sdpa]}}")
    rules = load_policy(write("p.yaml", "\n".join(lines) + "\n")).rules
    index = _ShadowIndex()
    for i, lr in enumerate(rules):
        found = index.add(lr)
        naive = next((e for e in rules[:i] if covers(e.rule.when, lr.rule.when)), None)
        assert bool(found) == (naive is not None), lr.rule.name
        if naive is not None:
            assert f"earlier rule {naive.rule.name!r}" in found[0].message
