"""Policies and the CLI, seventh round: what a hostile or careless file, value or argument
did. A glob of 24,000 ``[`` stalled every match for tens of seconds; ``targets: [cuda]``
loaded and then broke ``policy check`` unlocated (no JSON, the other files unchecked); values
of megabytes were echoed whole into one error line; an empty ``--cells``/``--mask``/
``--backends``/``-k`` ran the whole default; a U+2028 in a comment broke the file at another
line; ``plan`` and ``policy check`` ignored ATTNHUB_HARDWARE."""

from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path

import pytest
import torch

import attnhub
from attnhub.cli import build_parser, main
from attnhub.core.decision import BindContext
from attnhub.core.device import simulate
from attnhub.core.registry import Registry
from attnhub.core.spec import AttentionSpec
from attnhub.errors import HardwareError, PolicyError
from attnhub.policy import load_policy

BIG = 1_000_000  # characters of a generated value
LINE = 1_000  # no problem line may be longer


@pytest.fixture(autouse=True)
def _no_hardware_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan and check would read it (see (F))."""
    monkeypatch.delenv("ATTNHUB_HARDWARE", raising=False)


def _write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text), encoding="utf-8")
    return p


def _targets(tmp_path: Path, targets: str, name: str = "p.yaml") -> Path:
    """A one-rule policy (torch_sdpa) with ``targets: [targets]``."""
    return _write(tmp_path, f"name: p\ntargets: [{targets}]\nrules:\n"
                            "  - name: r\n    use: [torch_sdpa]\n", name)


def _problems(path: Path) -> list[str]:
    with pytest.raises(PolicyError) as exc:
        load_policy(path)
    return exc.value.problems


def _at(line: str) -> str:
    """``line:col`` of a problem (its file is shown relative to the working directory when
    inside it, else as given)."""
    m = re.match(r"\S*?:(\d+:\d+) ", line)
    assert m, line
    return m.group(1)


# (A) globs -----------------------------------------------------------------------------------

def _glob_rule(tmp_path: Path, key: str, glob: str, more: str = "") -> Path:
    """A policy whose first rule matches ``key`` against ``glob``; ``more``: rules after it."""
    return _write(tmp_path, f"name: p\nrules:\n  - name: r\n    when: {{{key}: ['{glob}']}}\n"
                            f"    use: [torch_sdpa]\n{more}")


@pytest.mark.parametrize("key", ["device_name", "model"])
def test_a_glob_of_thousands_of_characters_is_refused_located(tmp_path: Path, key: str) -> None:
    """24,000 ``[`` loaded, and every match through the rule took tens of seconds; one at the
    limit loads and matches at once."""
    p = _glob_rule(tmp_path, key, "[" * 24000)
    (line,) = _problems(p)
    assert _at(line).startswith("4:"), line
    assert f"rules[0].when.{key}[0]: got 24000 characters" in line and "at most 256" in line
    assert len(line) < LINE
    rest = "  - name: rest\n    use: [reference]\n"
    policy = load_policy(_glob_rule(tmp_path, key, "*[" * 128, rest))
    spec = AttentionSpec(phase="prefill", dtype="fp32", head_dim=64, num_q_heads=2,
                         num_kv_heads=2, max_seqlen_q=16, max_seqlen_k=16)
    t = time.perf_counter()
    d = policy.resolve(spec, simulate("cpu"), Registry.load(), BindContext(model="llama"))
    assert d.rule == "rest" and time.perf_counter() - t < 1.0


# (B) targets ---------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["cuda", "sm999", "gfxabc", "rocm"])
def test_targets_name_devices_plan_can_simulate(tmp_path: Path, target: str) -> None:
    """``targets: [cuda]`` loaded; ``policy check`` then died with "unknown hardware 'cuda'"
    and no file, line or key."""
    p = _targets(tmp_path, f"sm90, {target}")
    q = torch.randn(1, 4, 2, 8)  # the call path never reads targets (review 8): served
    assert attnhub.Hub(policy=p, hardware="cpu").attention(q, q, q).shape == q.shape
    with pytest.raises(PolicyError) as exc:
        load_policy(p).check_targets()  # what plan and policy check ask
    (line,) = exc.value.problems
    assert _at(line).startswith("2:") and f" targets[1]: got {target!r}, " in line, line
    assert "expected a device to plan for" in line and "h100" in line and "sm90" in line


def test_targets_take_archs_and_aliases(tmp_path: Path) -> None:
    p = _targets(tmp_path, "sm90, h100, gfx942, cpu, H200")
    assert load_policy(p).targets == ("sm90", "h100", "gfx942", "cpu", "H200")


def test_policy_check_reports_a_bad_file_and_checks_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """One file's error ended the command: the other files unchecked, no JSON printed."""
    bad = _targets(tmp_path, "cuda")
    monkeypatch.chdir(tmp_path)
    assert main(["policy", "check", "portable", bad.name, "portable", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [r["file"] for r in report] == ["portable", "p.yaml", "portable"]
    assert [r["ok"] for r in report] == [True, False, True]
    assert "p.yaml:2:11 targets[0]" in report[1]["findings"][0]["message"]


def test_policy_check_catches_any_attnhub_error_per_file(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Not only PolicyError: a HardwareError from one file's lint is that file's finding."""
    import attnhub.cli.policy as cli_policy

    real = cli_policy.lint_policy

    def lint(policy, registry, hardware):  # type: ignore[no-untyped-def]
        if policy.name == "portable":
            raise HardwareError("unknown hardware 'x'")
        return real(policy, registry, hardware)

    monkeypatch.setattr(cli_policy, "lint_policy", lint)
    assert main(["policy", "check", "portable", "default", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [r["ok"] for r in report] == [False, True]
    assert report[0]["findings"][0]["message"] == "portable: unknown hardware 'x'"


def test_plan_names_the_bad_target_located(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    p = _write(tmp_path, """\
        name: p
        targets: sm999
        rules:
          - name: r
            use: [torch_sdpa]
        """)
    assert main(["plan", "--policy", str(p)]) == 1
    err = capsys.readouterr().err
    assert "p.yaml:2:10 targets: got 'sm999', expected a device to plan for" in err, err


# (C) long values -----------------------------------------------------------------------------

def _base(tmp_path: Path, rules: int = 30) -> None:
    _write(tmp_path, "name: base\nrules:\n" + "".join(
        f"  - name: r{i}\n    use: [torch_sdpa]\n" for i in range(rules)), "base.yaml")


@pytest.mark.parametrize("body", [
    "rules:\n  - name: r\n    use: [torch_sdpa]\n    when: {hardware: X}\n",
    "extends: base.yaml\nrules:\n  - name: r\n    use: [torch_sdpa]\n    before: X\n",
    "extends: base.yaml\nrules:\n  - name: r\n    use: [torch_sdpa]\n    after: X\n",
    "extends: base.yaml\nremove: [X]\n",
    "extends: base.yaml\nremove: [r1, X, X]\n",
    "extends: X\n",
    "extends: X.yaml\n",
    "rules:\n  - name: r\n    use: [torch_sdpa]\n    when: {seqlen: '1X'}\n",
    "rules:\n  - name: r\n    use: [torch_sdpa]\n    when: {seqlen: '0X1e5'}\n",
    "rules:\n  - name: r\n    use: [torch_sdpa]\n    when: {variant: X}\n",
    "targets: [X]\nrules: []\n",
])
def test_long_values_are_cut_in_every_problem(tmp_path: Path, body: str) -> None:
    """A 3 MB value in ``when.hardware``, ``before:``, ``remove:`` or ``extends:`` made one
    error line of 3 million characters."""
    _base(tmp_path)
    fill = ("0" if "'0X" in body else "1" if "'1X'" in body else "x") * BIG
    p = _write(tmp_path, "name: p\n" + body.replace("X", fill))
    problems = _problems(p)
    assert problems and all(len(x) < LINE for x in problems), [len(x) for x in problems]


def test_a_long_policy_name_is_refused(tmp_path: Path) -> None:
    """Every decision record and lint message carried it: 5 MB lines from ``policy check``."""
    p = _write(tmp_path, f"name: {'n' * BIG}\nrules: []\n")
    (line,) = _problems(p)
    assert _at(line) == "1:7" and " name: got 1000000 characters" in line, line
    assert "at most 128" in line


def test_expected_rule_names_are_listed_up_to_twenty(tmp_path: Path) -> None:
    _base(tmp_path, rules=30)
    p = _write(tmp_path, "name: p\nextends: base.yaml\nremove: [nope]\n")
    (line,) = _problems(p)
    assert line.endswith("expected one of: " + ", ".join(f"r{i}" for i in range(20))
                         + " and 10 more (`attnhub policy show` lists them)"), line


# (D) empty CLI values ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag, good", [
    (["bench", "--regret", "--cells", ""], "--cells", "decode,"),
    (["bench", "--regret", "--cells", " , "], "--cells", "decode tiny"),
    (["bench", "--backends", ""], "--backends", "torch_sdpa"),
    (["bench", "--backends", ","], "--backends", "torch_sdpa,reference"),
    (["bench", "--regret", "--exclude", ""], "--exclude", "fa2"),
    (["bench", "--from-json", ""], "--from-json", "a.json"),
    (["explain", "--mask", ""], "--mask", "causal"),
    (["explain", "--mask", ","], "--mask", "causal,softcap"),
    (["explain", "--model", ""], "--model", "llama"),
    (["explain", "--layer-kind", " "], "--layer-kind", "sliding"),
    (["lock", "-o", "x.json", "--model", ""], "--model", "llama"),
    (["check-plugin", "torch_sdpa", "-k", ""], "-k/--feature", "causal"),
    (["check-plugin", "torch_sdpa", "-k", "causal", "-k", " "], "-k/--feature", "window"),
    (["fp8-check", "--backend", ""], "--backend", "fa3_fp8"),
    (["fp8-check", "--recipe", ""], "--recipe", "smooth_k"),
    (["fp8-check", "--inputs", ""], "--inputs", "captured.pt"),
])
def test_an_empty_list_or_filter_is_a_usage_error(argv: list[str], flag: str, good: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """An unset shell variable (``--cells "$CELLS"``) was read as no filter: the whole grid
    ran, every backend was timed, every feature checked, explain planned for mask none. A
    value that names something still parses."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err.splitlines()[-1]
    assert exc.value.code == 2 and f"argument {flag}: " in err and "names no " in err, err
    assert "leave the flag out" in err
    args = build_parser().parse_args([*argv[:-1], good])
    dest = flag.split("/")[-1].lstrip("-").replace("-", "_")
    got = getattr(args, dest)
    assert (got[-1] if isinstance(got, list) else got) == good


# (E) line breaks YAML sees and editors do not -------------------------------------------------

@pytest.mark.parametrize("char, name", [("\u2028", "LINE SEPARATOR"),
                                        ("\u2029", "PARAGRAPH SEPARATOR"),
                                        ("\x85", "NEXT LINE (NEL)")])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_a_hidden_line_break_is_located_where_an_editor_shows_it(
        tmp_path: Path, char: str, name: str, newline: str) -> None:
    """PyYAML ends a comment at U+2028, so the rest of the line was YAML and the syntax error
    pointed at line 4 (``rules:`` is line 3)."""
    text = ("name: p\n# see https://example.com/" + char + "notes (pasted)\nrules:\n"
            "  - name: r\n    use: [torch_sdpa]\n").replace("\n", newline)
    p = tmp_path / "p.yaml"
    p.write_bytes(text.encode("utf-8"))
    (line,) = _problems(p)
    assert _at(line) == "2:27" and f" (yaml): character U+{ord(char):04X} {name} " in line
    assert "(replace it)" in line


def test_every_hidden_line_break_is_counted(tmp_path: Path) -> None:
    p = tmp_path / "p.yaml"
    p.write_text("\ufeffname: 'a\u2028b'\nrules: []  # x\u2029y\u2028\n", encoding="utf-8")
    (line,) = _problems(p)
    assert _at(line) == "1:9" and " (yaml): character U+2028 " in line  # BOM: no column
    assert "(2 more in this file" in line


# (F) ATTNHUB_HARDWARE ------------------------------------------------------------------------

def test_plan_honours_attnhub_hardware(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The README says planning commands honour it; plan planned for the targets."""
    monkeypatch.setenv("ATTNHUB_HARDWARE", "sm80")
    assert main(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"] == ["sm80"]
    assert main(["plan", "--json", "--hardware", "sm90"]) == 0  # the flag wins
    assert json.loads(capsys.readouterr().out)["hardware"] == ["sm90"]


def test_policy_check_honours_attnhub_hardware(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    p = _write(tmp_path, """\
        name: p
        targets: [cpu]
        rules:
          - name: r
            when: {hardware: cpu}
            use: [reference]
        """)
    assert main(["policy", "check", str(p), "--json"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("ATTNHUB_HARDWARE", "sm80")
    assert main(["policy", "check", str(p), "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert any("on sm80" in f["message"] for f in report["findings"]), report


@pytest.mark.parametrize("command", [["plan"], ["policy", "check", "default"]])
def test_an_unknown_attnhub_hardware_is_refused(command: list[str],
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """As ``explain`` refuses it: ``cuda`` names no device to plan for."""
    monkeypatch.setenv("ATTNHUB_HARDWARE", "cuda")
    assert main(command) == 1
    err = capsys.readouterr().err
    assert "ATTNHUB_HARDWARE: unknown hardware 'cuda'" in err and "or unset it" in err
