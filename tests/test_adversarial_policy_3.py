"""Hostile policy files, third round: values YAML 1.1 or pydantic's lax mode silently
re-read as other numbers, and references the loader could not even resolve (a traceback
instead of a located problem)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from attnhub.errors import PolicyError
from attnhub.policy import load_policy

RULE = "name: p\nrules:\n  - name: r\n    use: [torch_sdpa]\n"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # files are shown relative to the working directory
    monkeypatch.delenv("ATTNHUB_POLICY", raising=False)


def _problems(text: str, name: str = "p.yaml") -> list[str]:
    Path(name).write_text(text, encoding="utf-8")
    t0 = time.perf_counter()
    with pytest.raises(PolicyError) as exc:
        load_policy(name)
    assert time.perf_counter() - t0 < 5
    return exc.value.problems


def _when(cond: str) -> str:
    return RULE + f"    when: {{{cond}}}\n"


TEXT_NUMBERS = [  # (where, YAML, located problem): each was read as the number, silently
    ("bound", _when("seqlen: {ge: '4096'}"),
     "p.yaml:5:25 rules[0].when.seqlen.ge: got the text '4096', expected a number (write it "
     "unquoted as 4096)"),
    ("exponent", _when("seqlen: {ge: 1e3}"),
     "p.yaml:5:25 rules[0].when.seqlen.ge: got the text '1e3', expected a number (YAML 1.1 "
     "reads an exponent without a dot and a sign as text: write 1000 or 1.0e+3)"),
    ("shorthand", _when("head_dim: '128'"),
     "p.yaml:5:22 rules[0].when.head_dim: got the text '128', expected a number (write it "
     "unquoted as 128)"),
    ("list item", _when("head_dim: [64, '128']"),
     "p.yaml:5:27 rules[0].when.head_dim[1]: got the text '128', expected a number (write it "
     "unquoted as 128)"),
    ("count", _when("layer: {every: '4'}"),
     "p.yaml:5:27 rules[0].when.layer.every: got the text '4', expected a number (write it "
     "unquoted as 4)"),
    ("offset", _when("layer: {every: 4, offset: ['1']}"),
     "p.yaml:5:39 rules[0].when.layer.offset[0]: got the text '1', expected a number (write it "
     "unquoted as 1)"),
    ("capability", _when("capability: {ge: '8.0'}"),
     "p.yaml:5:29 rules[0].when.capability.ge: got the text '8.0', expected a number (write it "
     "unquoted as 8)"),
    ("non-finite", _when("seqlen: {ge: 'inf'}"),
     "p.yaml:5:25 rules[0].when.seqlen.ge: got the text 'inf', expected a finite number"),
    ("version", "version: '2'\n" + RULE,
     "p.yaml:1:10 version: got the text '2', expected a number (write it unquoted as 2)"),
    ("accuracy bound", RULE + "    requires: {accuracy: {max: {rel_error: '0.05'}}}\n",
     "p.yaml:5:44 rules[0].requires.accuracy.max.rel_error: got the text '0.05', expected a "
     "number (write it unquoted as 0.05)"),
]


@pytest.mark.parametrize("text, problem", [c[1:] for c in TEXT_NUMBERS],
                         ids=[c[0] for c in TEXT_NUMBERS])
def test_a_number_written_as_text_is_not_read_as_a_number(text: str, problem: str) -> None:
    """Pydantic's lax mode turned ``'4096'`` (quoted: text) into 4096.0 in bounds, counts and
    ``version``, while the shorthand ``head_dim: '128'`` was refused: the same value meant a
    number in one place and an error in another. ``1e3`` is text in YAML 1.1."""
    assert _problems(text) == [problem]


LEGACY = [  # YAML 1.1 integers that do not say what they read as
    ("octal", _when("head_dim: 0100"), "p.yaml:5:22 rules[0].when.head_dim: '0100' is an octal "
     "number in YAML 1.1 (it reads as 64), expected a decimal number without a leading 0 or "
     "colons (quote it for a string)"),
    ("octal in a list", _when("seqlen: [0, 010]"), "p.yaml:5:24 rules[0].when.seqlen[1]: '010' "
     "is an octal number in YAML 1.1 (it reads as 8), expected a decimal number without a "
     "leading 0 or colons (quote it for a string)"),
    ("signed octal", _when("batch: {le: +020}"), "p.yaml:5:24 rules[0].when.batch.le: '+020' "
     "is an octal number in YAML 1.1 (it reads as 16), expected a decimal number without a "
     "leading 0 or colons (quote it for a string)"),
    ("base 60", _when("capability: 9:0"), "p.yaml:5:24 rules[0].when.capability: '9:0' is a "
     "base-60 number in YAML 1.1 (it reads as 540), expected a decimal number without a "
     "leading 0 or colons (quote it for a string)"),
    ("base 60 float", _when("head_dim: 1:30.5"), "p.yaml:5:22 rules[0].when.head_dim: '1:30.5' "
     "is a base-60 number in YAML 1.1 (it reads as 90.5), expected a decimal number without a "
     "leading 0 or colons (quote it for a string)"),
    ("tagged", _when("head_dim: !!int 0100"), "p.yaml:5:22 rules[0].when.head_dim: '0100' is "
     "an octal number in YAML 1.1 (it reads as 64), expected a decimal number without a "
     "leading 0 or colons (quote it for a string)"),
]


@pytest.mark.parametrize("text, problem", [c[1:] for c in LEGACY], ids=[c[0] for c in LEGACY])
def test_yaml_1_1_octal_and_base_60_numbers_are_refused(text: str, problem: str) -> None:
    """``head_dim: 0100`` bound head dim 64 and ``capability: 9:0`` meant 540, silently."""
    assert _problems(text) == [problem]
    # the decimal forms next to them still read as written
    rule = load_policy(_write(_when("head_dim: [0x40, 100, 1_024], capability: 9.0"))).data
    when = rule.rules[0].rule.when
    assert when.head_dim.in_ == [64, 100, 1024] and when.capability.in_ == [9.0]


def _write(text: str) -> str:
    Path("ok.yaml").write_text(text, encoding="utf-8")
    return "ok.yaml"


@pytest.mark.parametrize("ref", ["~attnhub_no_such_user/x.yaml", "a" * 5000],
                         ids=["no user", "long name"])
def test_an_unresolvable_reference_is_a_located_problem(ref: str) -> None:
    """``extends: ~nosuchuser/x.yaml`` raised RuntimeError (no home directory) and a name
    longer than the file system allows raised OSError (ENAMETOOLONG) out of the loader,
    from ``extends:`` and from ``load_policy`` alike."""
    (line,) = _problems(f"name: p\nextends: {ref}\nrules: []\n")
    assert line.startswith("p.yaml:2:10 extends: cannot read policy "), line
    assert "), expected a readable YAML file (or a packaged name such as `default`)" in line
    with pytest.raises(PolicyError, match="^cannot read policy "):
        load_policy(ref)


def test_a_deleted_working_directory_is_a_located_problem(tmp_path: Path,
                                                          monkeypatch) -> None:
    """With the working directory deleted, ``getcwd`` fails: a relative policy path raised
    FileNotFoundError from path resolution instead of saying which file cannot be read."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(PolicyError) as exc:
        load_policy("mine.yaml")
    assert exc.value.problems == ["cannot read policy mine.yaml (No such file or directory), "
                                  "expected a readable YAML file (or a packaged name such as "
                                  "`default`)"]
    assert load_policy("default").name == "default"  # packaged names still resolve
    assert os.path.isabs(str(load_policy("portable").data.paths[-1]))


def test_an_empty_policy_name_is_refused() -> None:
    """``name: ''`` loaded: decision records, ``explain`` and lockfiles named no policy."""
    assert _problems(RULE.replace("name: p", "name: ''", 1)) == [
        "p.yaml:1:7 name: got an empty policy name '', expected one line of printable text"]


NEVER = [  # (rule condition or use, the warning): each linted clean and never matched
    ("when: {head_dim: [64.5, 96.25]}", "5:22 rules[0].when.head_dim (r): warning: head_dim is "
     "a whole number and head_dim: [64.5, 96.25] lists none, so this rule can never match"),
    ("when: {profile: {attention_share: {gt: 1.5}}}", "5:21 rules[0].when.profile (r): "
     "warning: attention_share is between 0 and 1, and the condition admits no value there, "
     "so this rule can never match"),
    ("when: {layer: {every: 4, offset: [4, 6]}}", "5:19 rules[0].when.layer (r): warning: "
     "offset [4, 6] is never reached (layer % 4 is at most 3), so this rule can never match"),
    ("when: {device_name: ''}", "5:25 rules[0].when.device_name (r): warning: a device name "
     "is never empty, and `device_name` is '', so this rule can never match"),
]


@pytest.mark.parametrize("extra, warning", NEVER, ids=[w.split(" (")[0] for _, w in NEVER])
def test_a_condition_no_call_can_meet_is_warned(extra: str, warning: str) -> None:
    """Ranges that are satisfiable as numbers but not by any call (a fractional head dim, a
    share above 1, an offset the remainder never reaches) passed ``policy check`` clean."""
    from attnhub.core.registry import Registry
    from attnhub.policy.lint import lint_policy

    reg = Registry.load(modules=[], entry_points=False)
    found = lint_policy(load_policy(_write(RULE + f"    {extra}\n")), reg, ("cpu",))
    warnings = [str(f) for f in found if f.level == "warning"
                and "with attention dropout" not in f.message]  # the rule serves no dropout
    assert [w.split(";")[0] for w in warnings] == [f"ok.yaml:{warning}"], warnings


def test_a_backend_named_twice_in_one_rule_is_warned() -> None:
    """``use: [torch_sdpa, torch_sdpa]`` linted clean; the run-time fallback retried the
    backend that had just failed."""
    from attnhub.core.registry import Registry
    from attnhub.policy.lint import lint_policy

    text = RULE.replace("[torch_sdpa]", "[torch_sdpa, reference, torch_sdpa]")
    found = lint_policy(load_policy(_write(text)), Registry.load(modules=[], entry_points=False),
                        ("cpu",))
    assert [str(f) for f in found if f.level == "warning"] == [
        "ok.yaml:4:34 rules[0].use[2] (r): warning: torch_sdpa is named twice in this rule's "
        "candidates; expected each backend once"]


@pytest.mark.parametrize("target", ["folder", "fifo", "missing", "dev_zero"])
def test_a_bad_attnhub_policy_is_named_in_the_error(tmp_path: Path, monkeypatch,
                                                     target: str) -> None:
    """``ATTNHUB_POLICY`` pointing at a folder, a FIFO, /dev/zero or nothing said "cannot
    read policy ." (the working directory, shown relative) without naming the variable the
    path came from, so the fix (unset or correct it) was not said."""
    import threading

    import torch

    from attnhub import Hub

    path = {"folder": tmp_path, "fifo": tmp_path / "p.fifo", "missing": tmp_path / "nope.yaml",
            "dev_zero": Path("/dev/zero")}[target]
    if target == "fifo":
        os.mkfifo(path)
    monkeypatch.setenv("ATTNHUB_POLICY", str(path))
    got: list[list[str]] = []

    def load() -> None:
        for attempt in (lambda: load_policy(),
                        lambda: Hub(hardware="cpu").attention(*[torch.ones(1, 2, 1, 4)] * 3)):
            with pytest.raises(PolicyError) as exc:
                attempt()
            got.append(exc.value.problems)

    t = threading.Thread(target=load, daemon=True)  # a FIFO read would wait for a writer
    t.start()
    t.join(30)
    assert len(got) == 2, "loading the policy is still waiting"
    for problems in got:
        (line,) = problems
        assert line.startswith(f"ATTNHUB_POLICY={path}: "), line


def test_finding_shadowed_rules_is_not_quadratic() -> None:
    """The shadow index intersected sets of every earlier rule with the same keys for each
    new rule: 20,000 rules `{phase: decode, head_dim: N}` (none shadowed) took 6.5 s, 40,000
    did not finish in 5 minutes. Bounded in a thread: a regression fails, it does not hang."""
    import threading

    from attnhub.policy.lint import _ShadowIndex
    from attnhub.policy.loader import LoadedRule
    from attnhub.policy.schema import Rule

    rules = [LoadedRule(Rule.model_validate({"name": f"r{i}", "use": ["torch_sdpa"], "when": {
        "phase": "decode", "head_dim": i + 1}}), None, ("rules", i))  # type: ignore[arg-type]
        for i in range(40_000)]
    done: list[bool] = []

    def index() -> None:
        shadows = _ShadowIndex()
        done.append(all(shadows.add(r) == [] for r in rules))

    t = threading.Thread(target=index, daemon=True)
    t0 = time.perf_counter()
    t.start()
    t.join(15)
    assert done == [True], f"not done after {time.perf_counter() - t0:.1f} s"


def test_a_rule_removed_twice_is_named_as_a_repeat() -> None:
    """``remove: [cpu, cpu]`` said "no rule named 'cpu' in the policy it extends" (listing
    the rules without it), sending the reader to look for a typo that is not there."""
    text = "name: o\nextends: default\nremove: [cpu, portable, cpu]\nrules: []\n"
    assert _problems(text) == ["p.yaml:3:25 remove[2]: 'cpu' is listed twice (first at "
                               "remove[0]), expected each name once"]
