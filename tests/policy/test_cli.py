"""The policy commands: policy check, explain (its --json schema is documented and stable),
plan and explain --run (run-time fallback counts)."""

from __future__ import annotations

import json

from attnhub.cli import main
from attnhub.policy import policies_dir
from attnhub.policy.cells import cells

DECISION_KEYS = {"spec", "device", "backend", "rule", "rule_location", "policy", "candidates",
                 "rejected", "fallbacks", "on_failure", "context", "notes", "inner", "missing",
                 "tied"}


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    rc = main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_policy_check_shipped_policies_pass(capsys):
    files = sorted(str(p) for p in policies_dir().glob("*.yaml"))
    assert main(["policy", "check", *files]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok (0 error(s)") == len(files) >= 6


def test_policy_check_fails_with_located_errors(write, capsys):
    good = write("good.yaml", "name: g\ntargets: [cpu]\nrules:\n"
                              "  - {name: all, use: [torch_sdpa, reference]}\n")
    bad = write("bad.yaml", "name: b\nrules:\n  - {name: r, use: [torch_sdpa], oops: 1}\n")
    assert main(["policy", "check", str(good), str(bad)]) == 1
    captured = capsys.readouterr()
    assert f"{bad}:3:34 rules[0].oops: unknown key 'oops'" in captured.err
    assert f"{good}: ok" in captured.out and f"{bad}: FAILED (1 error(s)" in captured.out
    rc, report = run_json(capsys, "policy", "check", str(good))
    assert rc == 0 and report[0]["ok"] and report[0]["findings"] == []


def test_explain_json_schema_is_stable(capsys):
    rc, doc = run_json(capsys, "explain", "--hardware", "sm90", "--phase", "decode",
                       "--heads", "32:8", "--seqlen", "32768", "--mask", "causal", "--trace")
    assert rc == 0
    assert set(doc) == {"schema", "policy", "device", "decision", "trace", "run"}
    assert doc["schema"] == "attnhub.explain/1" and doc["run"] is None
    assert set(doc["policy"]) == {"name", "files"}
    assert set(doc["device"]) == {"arch", "vendor", "name", "simulated"}
    d = doc["decision"]
    assert set(d) == DECISION_KEYS
    assert set(d["context"]) == {"model", "layer", "layer_kind", "world_size"}
    assert all(set(r) == {"backend", "reasons"} for r in d["rejected"])
    assert d["spec"].startswith("decode bf16 d=128 heads=32:8") and "sk<=32768" in d["spec"]
    assert doc["device"] == {"arch": "sm90", "vendor": "cuda", "name": "NVIDIA H100 80GB HBM3",
                             "simulated": True}
    assert doc["trace"][-1] == {"rule": d["rule"], "location": d["rule_location"],
                                "failed": None}
    assert all(t["failed"] for t in doc["trace"][:-1])
    text = (policies_dir().parent / "docs" / "policy.md").read_text()
    for key in DECISION_KEYS | {"trace", "run", "schema"}:
        assert f"`{key}`" in text, f"docs/policy.md does not document {key!r}"


def test_explain_exit_code_when_nothing_serves(write, capsys):
    p = write("p.yaml", "name: n\nrules:\n"
                        "  - {name: d, when: {phase: decode}, use: [torch_sdpa]}\n")
    assert main(["explain", "--policy", str(p), "--phase", "train"]) == 1
    assert "chosen:  NONE" in capsys.readouterr().out


def test_explain_run_reports_fallbacks(write, capsys):
    p = write("p.yaml", "name: r\nrules:\n  - {name: all, use: [nosuch, torch_sdpa]}\n")
    rc, doc = run_json(capsys, "explain", "--policy", str(p), "--phase", "decode",
                       "--heads", "4:2", "--head-dim", "16", "--seqlen", "33", "--mask",
                       "causal,sliding_window", "--window", "8", "--run")
    assert rc == 0 and doc["run"]["backend"] == "torch_sdpa"
    # the uninstalled backend the rule names is counted as a bind-time fallback and shown
    assert doc["run"]["fallbacks"] == [["nosuch", "torch_sdpa", 1]]
    assert doc["decision"]["rejected"][0]["backend"] == "nosuch"
    assert doc["decision"]["missing"] == ["nosuch"]
    assert any("names nosuch, which is not installed" in n for n in doc["decision"]["notes"])


def test_explain_run_reports_what_ran_not_the_policy_choice(write, capsys, monkeypatch,
                                                           make_registry, fake):
    """A run-time fallback and ATTNHUB_BACKEND both change what runs: --run says so."""
    import attnhub.cli._policy_common as common
    from attnhub.core.registry import Registry

    reg = make_registry(fake("boom", raises=RuntimeError("kernel fault")))
    monkeypatch.setattr(common.Registry, "load", classmethod(lambda cls, **kw: reg))
    p = write("p.yaml", "name: r\nrules:\n  - {name: all, use: [boom, torch_sdpa]}\n")
    args = ("explain", "--policy", str(p), "--dtype", "fp32", "--heads", "2:2", "--head-dim",
            "16", "--seqlen", "8", "--mask", "causal", "--run")
    rc, doc = run_json(capsys, *args)
    assert doc["decision"]["backend"] == "boom"
    assert doc["run"]["backend"] == "torch_sdpa" and doc["run"]["bound"] == "boom"
    assert "boom failed at run time" in doc["run"]["why"]
    monkeypatch.setenv("ATTNHUB_BACKEND", "reference")
    rc, doc = run_json(capsys, *args)
    assert doc["run"]["backend"] == "reference" and doc["run"]["forced"]
    assert "ATTNHUB_BACKEND=reference" in doc["run"]["why"] and "chose boom" in doc["run"]["why"]
    assert Registry is common.Registry


def test_plan_covers_every_cell_and_hardware(capsys):
    rc, doc = run_json(capsys, "plan", "--hardware", "cpu,gfx942")
    assert rc == 0 and doc["hardware"] == ["cpu", "gfx942"] and len(doc["cells"]) == len(cells())
    row = doc["cells"][0]
    assert set(row) == {"phase", "dtype", "mask", "dropout", "label", "spec", "bindings"}
    assert [r["label"] for r in doc["cells"]].count("train+dropout") == len(
        [c for c in cells() if c.phase == "train"]) // 2
    assert set(row["bindings"]["cpu"]) == {"backend", "rule", "fallbacks", "inner", "rejected",
                                             "notes"}
    assert all(c["bindings"]["cpu"]["backend"] in ("torch_sdpa", "reference")
               for c in doc["cells"])
    assert main(["plan", "--hardware", "sm90"]) == 0
    assert "| phase" in capsys.readouterr().out
