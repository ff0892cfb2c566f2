"""Review 10: policy values that loaded as something else than what they say (a condition with
no value matched everything, ``before: ''`` placed nothing, a negative accuracy bound refused
every record, an escaped line separator in a name), target names matched by case unlike every
other name, simulated devices of one arch told apart in ``plan`` and ``lock``, and a hand-edited
lock refused where it is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnhub.cli import main
from attnhub.core.registry import Registry
from attnhub.errors import PolicyError
from attnhub.policy import load_policy
from attnhub.policy.lint import lint_policy
from attnhub.policy.loader import policies_dir

RULE = "rules:\n  - name: a\n    when: {WHEN}\n    use: [torch_sdpa]\n"


def _write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _problems(path: Path) -> list[str]:
    with pytest.raises(PolicyError) as exc:
        load_policy(str(path))
    return exc.value.problems


# -- 1. a condition written without a value ------------------------------------------------
@pytest.mark.parametrize("when,key,col", [
    ("{hardware: }", "hardware", 22), ("{phase: decode, hardware: ~}", "hardware", 37),
    ("{needs_grad: null}", "needs_grad", 24), ("{seqlen: }", "seqlen", 20),
    ("{seqlen: {ge: null, lt: 128}}", "seqlen.ge", 25), ("{seqlen: {in: }}", "seqlen.in", 25),
    ("{layer: {kind: }}", "layer.kind", 26), ("{device_name: }", "device_name", 25),
    ("{profile: {attention_share: }}", "profile.attention_share", 39)])
def test_a_condition_without_a_value_is_a_located_error(tmp_path: Path, when: str, key: str,
                                                        col: int) -> None:
    """``hardware:`` with nothing after it read as no condition: the rule matched every
    device (``{ge: null, lt: 128}`` dropped its lower bound the same way)."""
    (line,) = _problems(_write(tmp_path, "name: x\n" + RULE.replace("{WHEN}", when)))
    assert line.startswith(f"{tmp_path / 'p.yaml'}:4:{col} rules[0].when.{key}: got no value")
    assert "or remove the key: a condition left out matches everything" in line


def test_the_shipped_policies_write_every_condition() -> None:
    for path in sorted(policies_dir().glob("*.yaml")):
        assert load_policy(str(path)).rules, path


# -- 2. placements and removals name rules --------------------------------------------------
@pytest.mark.parametrize("key", ["before", "after"])
def test_an_empty_placement_is_a_located_error(tmp_path: Path, key: str) -> None:
    """``before: ''`` was falsy, so the rule went first as if unplaced, without a word."""
    text = (f"name: x\nextends: default\nrules:\n  - name: mine\n    {key}: ''\n"
            "    use: [torch_sdpa]\n")
    (line,) = _problems(_write(tmp_path, text))
    assert f"p.yaml:5:{len(key) + 7} rules[0].{key}: got '', expected a rule name" in line


@pytest.mark.parametrize("value", ['"sm90-dense\\n"', "' cpu'"])
def test_a_removal_that_is_no_rule_name_points_at_the_character(tmp_path: Path,
                                                                value: str) -> None:
    text = f"name: x\nextends: default\nremove: [{value}]\nrules: []\n"
    (line,) = _problems(_write(tmp_path, text))
    assert "p.yaml:3:10 remove[0]: got" in line and "not an ASCII letter or digit" in line


def test_placements_that_name_rules_still_work(tmp_path: Path) -> None:
    text = ("name: x\nextends: default\nremove: [rocm-other]\nrules:\n  - name: mine\n"
            "    after: sm90-dense\n    use: [torch_sdpa]\n")
    names = [lr.rule.name for lr in load_policy(str(_write(tmp_path, text))).rules]
    assert names[names.index("sm90-dense") + 1] == "mine" and "rocm-other" not in names


# -- 3. an accuracy bound no record can meet ------------------------------------------------
def test_a_negative_accuracy_bound_is_a_located_error(tmp_path: Path) -> None:
    text = ("name: x\nrules:\n  - name: a\n    use: [torch_sdpa]\n"
            "    requires: {accuracy: {max: {rel_error: -0.05}}}\n")
    (line,) = _problems(_write(tmp_path, text))
    assert "p.yaml:5:44 rules[0].requires.accuracy.max.rel_error: got -0.05, expected a " \
           "bound >= 0" in line


def test_a_zero_accuracy_bound_loads(tmp_path: Path) -> None:
    text = ("name: x\nrules:\n  - name: a\n    use: [torch_sdpa]\n"
            "    requires: {accuracy: {max: {rel_error: 0}}}\n")
    assert load_policy(str(_write(tmp_path, text))).rules[0].rule.requires is not None


# -- 4. line breaks and blanks no editor shows ----------------------------------------------
@pytest.mark.parametrize("escape,code", [("\\L", "2028"), ("\\P", "2029"), ("\\u2028", "2028")])
def test_an_escaped_line_separator_is_refused_like_a_raw_one(tmp_path: Path, escape: str,
                                                             code: str) -> None:
    (line,) = _problems(_write(tmp_path, f'name: "a{escape}b"\nrules: []\n'))
    assert f"p.yaml:1:7 name: character U+{code} (a line break no editor shows)" in line


@pytest.mark.parametrize("name", ['"\\u200b"', '"\\ufeff "', '"\\u2060"'])
def test_a_policy_name_of_invisible_characters_is_empty(tmp_path: Path, name: str) -> None:
    (line,) = _problems(_write(tmp_path, f"name: {name}\nrules: []\n"))
    assert "p.yaml:1:7 name: got an empty policy name" in line


# -- 5. target names and case ----------------------------------------------------------------
def test_a_target_in_another_case_is_a_lint_warning_naming_the_spelling(tmp_path: Path) -> None:
    """Targets are device names ``plan`` simulates, matched ignoring case as ``--hardware``
    is; every name a condition matches is exact. Kept loading, but said."""
    path = _write(tmp_path, "name: x\ntargets: [cpu, H200]\nrules:\n  - name: a\n"
                            "    use: [torch_sdpa]\n")
    policy = load_policy(str(path))
    assert policy.targets == ("cpu", "H200")
    found = [f for f in lint_policy(policy, Registry.load()) if f.path == "targets[1]"]
    assert [f.level for f in found] == ["warning"]
    assert found[0].where == f"{path}:2:16"
    assert "'H200' is read as 'h200'" in found[0].message
    assert "expected 'h200' as written" in found[0].message


def test_the_shipped_policies_spell_their_targets_exactly() -> None:
    registry = Registry.load()
    for path in sorted(policies_dir().glob("*.yaml")):
        policy = load_policy(str(path))
        assert not [f for f in lint_policy(policy, registry, ("cpu",))
                    if f.path.startswith("targets")], path


def test_a_hardware_condition_in_another_case_says_the_spelling(tmp_path: Path) -> None:
    (line,) = _problems(_write(tmp_path, "name: x\n" + RULE.replace("{WHEN}", "{hardware: SM90}")))
    assert line.endswith("; conditions match names exactly: write 'sm90'")


@pytest.mark.parametrize("model,arch,glob", [("h100", "sm90", "*H100*"),
                                              ("H200", "sm90", "*H200*"),
                                              ("mi300x", "gfx942", "*MI300X*")])
def test_a_hardware_condition_naming_a_device_model_says_its_arch_and_the_glob(
        tmp_path: Path, model: str, arch: str, glob: str) -> None:
    """Targets take models (h100); conditions take archs: the error says which, and how to
    match the model alone. The glob it proposes matches that model's device name."""
    import fnmatch

    from attnhub.core.device import simulate

    (line,) = _problems(_write(tmp_path, "name: x\n" + RULE.replace("{WHEN}",
                                                                      f"{{hardware: {model}}}")))
    assert line.endswith(f"; {model!r} is a device model: write {arch!r} (every {arch} device), "
                         f"or match the model with device_name: {glob!r}"), line
    assert fnmatch.fnmatchcase(simulate(model).name, glob)
    fixed = RULE.replace("{WHEN}", f"{{hardware: {arch}, device_name: {glob!r}}}")
    load_policy(str(_write(tmp_path, "name: x\n" + fixed, "fixed.yaml")))


def test_plan_shows_targets_by_the_name_that_plans(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "name: x\ntargets: [H200]\nrules:\n  - name: a\n"
                            "    use: [torch_sdpa]\n")
    assert main(["plan", "--policy", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"] == ["h200"]


# -- 6. simulated devices of one arch --------------------------------------------------------
def test_plan_keeps_a_column_per_device_of_one_arch(capsys: pytest.CaptureFixture[str]) -> None:
    """An H20 and an H100 are both sm90: the table printed the H20's bindings under both
    headers, and the JSON kept one of them."""
    assert main(["plan", "--policy", "default", "--hardware", "sm90,h20", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["hardware"] == ["sm90", "h20"]
    train = next(c for c in plan["cells"] if c["label"] == "train" and c["dtype"] == "bf16"
                 and c["mask"] == "causal")
    assert train["bindings"]["sm90"]["rule"] != "h20-dense"
    assert train["bindings"]["h20"]["rule"] == "h20-dense"


def test_a_lock_of_a_simulated_h20_checks_clean(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The lock recorded ``hardware: sm90`` and ``--check`` resolved it on an H100: every
    ``h20-dense`` binding was reported as drift right after locking."""
    out = tmp_path / "l.json"
    assert main(["lock", "--policy", "default", "--hardware", "h20,h100", "-o", str(out)]) == 0
    assert {b["hardware"] for b in json.loads(out.read_text())["bindings"]} == {"h20", "sm90"}
    capsys.readouterr()
    assert main(["lock", "--check", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["changed"] == []


# -- 7. a hand-edited lock -------------------------------------------------------------------
@pytest.fixture(scope="module")
def lock_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("lock") / "l.json"
    assert main(["lock", "--policy", "default", "--hardware", "cpu", "-o", str(out)]) == 0
    return out.read_text()


def test_an_empty_layer_kind_in_a_lock_is_located(tmp_path: Path, lock_text: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    lock = json.loads(lock_text)
    lock["bindings"][3]["context"]["layer_kind"] = ""
    path = tmp_path / "m.json"
    path.write_text(json.dumps(lock, indent=1))
    assert main(["lock", "--check", str(path)]) == 3
    err = capsys.readouterr().err
    assert f"{path}:" in err and "bindings[3].context: got layer_kind=''" in err
    assert "regenerate the lock" in err


def test_a_lock_whose_policy_is_gone_names_the_key_and_the_flag(
        tmp_path: Path, lock_text: str, capsys: pytest.CaptureFixture[str]) -> None:
    lock = json.loads(lock_text)
    lock["policy"]["files"] = ["gone.yaml"]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(lock))
    assert main(["lock", "--check", str(path)]) == 3
    err = capsys.readouterr().err
    assert "cannot read policy" in err
    assert f"{path}: policy.files[-1] names 'gone.yaml'" in err and "--policy FILE" in err


def test_a_lock_of_an_arch_still_checks(tmp_path: Path, lock_text: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "l.json"
    path.write_text(lock_text)
    assert main(["lock", "--check", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["drifted"] is False
