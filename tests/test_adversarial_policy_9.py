"""Policies and the CLI, ninth round: ``$`` in the name patterns took a trailing newline
(``hardware: "cpu\\n"`` loaded and never matched, a rule name split every message) and
``\\d`` took non-ASCII digits (``sm٩٠``); a policy name could hold a line break or be blank;
``extends: "default\\n"`` gave a two-line error; ``--policy ''`` ran the default policy
(``run``) or read the working directory (``explain``); ``load_policy('')`` read ``.``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from attnhub.cli import main
from attnhub.errors import PolicyError
from attnhub.policy import load_policy
from attnhub.policy.loader import load_data


@pytest.fixture(autouse=True)
def _core_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNHUB_PLUGINS", "")
    for var in ("ATTNHUB_HARDWARE", "ATTNHUB_BACKEND", "ATTNHUB_POLICY", "ATTNHUB_PROVIDERS"):
        monkeypatch.delenv(var, raising=False)


def _problems(tmp_path: Path, text: str) -> list[str]:
    p = tmp_path / "p.yaml"
    p.write_text(textwrap.dedent(text), encoding="utf-8")
    with pytest.raises(PolicyError) as exc:
        load_data(p)
    return exc.value.problems


RULE = "name: p\nrules:\n  - name: {name}\n    when: {when}\n    use: [{use}]\n"


@pytest.mark.parametrize("name,when,use,where", [
    ("a", '{hardware: "cpu\\n"}', "torch_sdpa", "when.hardware"),
    ("a", "{hardware: 'sm\u0669\u0660'}", "torch_sdpa", "when.hardware"),
    ("a", '{layer: {kind: "gla\\n"}}', "torch_sdpa", "when.layer.kind"),
    ("a", "{}", '"torch_sdpa\\n"', "use[0]"),
    ('"a\\n"', "{}", "torch_sdpa", "rules[0].name"),
])
def test_a_trailing_newline_or_foreign_digit_is_not_a_name(
        tmp_path: Path, name: str, when: str, use: str, where: str) -> None:
    """Each loaded, and the condition never held (or the name split every message)."""
    (line,) = _problems(tmp_path, RULE.format(name=name, when=when, use=use))
    assert where in line and "\n" not in line, line


@pytest.mark.parametrize("value", ['"a\\nb"', "'   '", '"a\\tb"'])
def test_a_policy_name_is_one_line(tmp_path: Path, value: str) -> None:
    (line,) = _problems(tmp_path, f"name: {value}\nrules: []\n")
    assert ":1:7 name: got" in line, line
    assert "one line" in line and "\n" not in line, line


def test_an_extends_with_a_line_break_is_one_problem_on_one_line(tmp_path: Path) -> None:
    """The file was followed too: "cannot read policy default\\n (No such file...)" printed
    over two lines, after the schema's own problem."""
    problems = _problems(tmp_path, 'name: p\nextends: "default\\n"\nrules: []\n')
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert ":2:10 extends: got a tab or line break" in problems[0]


def test_load_policy_of_an_empty_path_says_so() -> None:
    with pytest.raises(PolicyError, match="policy path '' is empty"):
        load_policy("")


@pytest.mark.parametrize("argv", [["explain", "--policy", ""], ["plan", "--policy", " "],
                                  ["run", "--policy", "", "--layers", "1"],
                                  ["lock", "--policy", "", "--check", "x.lock"]])
def test_an_empty_policy_flag_is_a_usage_error(argv: list[str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``run --policy ''`` ran the default policy; ``explain --policy ''`` said "cannot read
    policy . (Is a directory)"."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "--policy" in capsys.readouterr().err


# lint ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", sorted(p.name for p in (
    Path(__file__).resolve().parents[1] / "policies").glob("*.yaml")))
def test_a_packaged_policy_lints_without_errors_when_plugins_are_absent(
        policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``triton_decode_fp8`` (triton_portable) and ``torch_flash_cpu`` (ring) were missing from
    the first-party table: ``attnhub policy check policies/default.yaml`` failed with
    "unknown backend" on a machine without those plugins, instead of "not installed here"."""
    rc = main(["policy", "check", str(Path(__file__).resolve().parents[1] / "policies" / policy),
               "--json"])
    import json
    (report,) = json.loads(capsys.readouterr().out)
    errors = [f["message"] for f in report["findings"] if f["level"] == "error"]
    assert rc == 0 and not errors, errors


SHADOWED = "name: p\nrules:\n  - name: r1\n    when: {a}\n    use: [torch_sdpa]\n" \
           "  - name: r2\n    when: {b}\n    use: [reference]\n" \
           "  - name: rest\n    use: [torch_sdpa, reference]\n"


@pytest.mark.parametrize("first,second,shadowed", [
    ("{model: '*'}", "{model: llama}", True),
    ("{model: 'llama-*'}", "{model: llama-8b}", True),
    ("{device_name: '*'}", "{device_name: 'NVIDIA H100'}", True),
    ("{layer: {kind: [gla, linear]}}", "{layer: {kind: gla}}", True),
    ("{layer: {every: 2}}", "{layer: {every: 4, offset: [0, 2]}}", True),
    ("{layer: {index: {lt: 12}}}", "{layer: {index: {lt: 6}, kind: gla}}", True),
    ("{profile: {attention_share: {lt: 0.5}}}", "{profile: {attention_share: {lt: 0.2}}}", True),
    # reachable: no false alarm
    ("{model: 'llama-*'}", "{model: 'mistral'}", False),
    ("{model: 'llama'}", "{model: 'llama*'}", False),
    ("{layer: {every: 4}}", "{layer: {every: 2}}", False),
    ("{layer: {every: 2, offset: [1]}}", "{layer: {every: 4}}", False),
    ("{layer: {index: {lt: 12}}}", "{layer: {kind: gla}}", False),
    ("{layer: {kind: gla}}", "{layer: {index: {lt: 3}}}", False),
    ("{profile: {attention_share: {lt: 0.2}}}", "{profile: {attention_share: {lt: 0.5}}}",
     False),
])
def test_lint_says_a_rule_shadowed_by_a_glob_layer_or_profile_condition(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], first: str, second: str,
        shadowed: bool) -> None:
    p = tmp_path / "p.yaml"
    p.write_text(SHADOWED.replace("{a}", first).replace("{b}", second))
    main(["policy", "check", str(p), "--hardware", "cpu"])
    out = capsys.readouterr()
    said = "rules[1] (r2): warning: can never match: earlier rule 'r1'" in out.out + out.err
    assert said == shadowed, out.out + out.err
    assert shadowed or "can never match" not in out.out + out.err


@pytest.mark.parametrize("kind", ["x y", "gla\n", "gl\u0430"])
def test_explain_refuses_a_layer_kind_no_policy_can_name(
        kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """It was explained as a kind no rule selects (bound like softmax, exit 0)."""
    with pytest.raises(SystemExit) as exc:
        main(["explain", "--layer-kind", kind])
    assert exc.value.code == 2
    assert "--layer-kind" in capsys.readouterr().err
