"""Hostile policy files the loader must refuse quickly, located, as a ``PolicyError``: never a
traceback, a hang or a silently coerced value."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attnhub.cli import main
from attnhub.errors import PolicyError
from attnhub.policy import load_policy
from attnhub.policy.loader import MAX_PROBLEMS

HEAD = "name: p\nrules:\n"
RULE = "  - {name: r, use: [torch_sdpa]}\n"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # files are shown relative to the working directory


def _problems(path: Path) -> list[str]:
    t0 = time.perf_counter()
    with pytest.raises(PolicyError) as exc:
        load_policy(path)
    assert time.perf_counter() - t0 < 5, "the loader must refuse, not work through it"
    return exc.value.problems


def _write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("where", ["version: 1{}\n", "rules:\n  - {{name: r, use: [torch_sdpa], "
                                                    "when: {{head_dim: 1{}}}}}\n"])
def test_an_integer_of_thousands_of_digits_is_located(tmp_path: Path, where: str) -> None:
    """Python refuses int('1' + 5000 digits) with a ValueError, which escaped the loader."""
    path = _write(tmp_path, "name: p\n" + where.format("0" * 5000))
    (line,) = _problems(path)
    assert re.match(r"p\.yaml:\d+:\d+ \S+: cannot read '1000+\.\.\. as a plain value, expected "
                    r"a string, number", line), line


@pytest.mark.parametrize("escape, code", [(r"\ud800", "D800"), (r"\x1b[2J", "001B"),
                                          (r"\x01", "0001")])
def test_control_characters_and_lone_surrogates_are_refused(tmp_path: Path, capsys,
                                                            escape: str, code: str) -> None:
    """A lone surrogate crashed ``policy show`` (UnicodeEncodeError); terminal escapes would
    reach every report that prints the name."""
    path = _write(tmp_path, f'name: "p{escape}"\n' + "rules:\n" + RULE)
    assert _problems(path) == [f"p.yaml:1:7 name: character U+{code} (a control character or "
                               "lone surrogate) is not allowed in policy files, expected "
                               "printable text (remove the escape)"]
    assert main(["policy", "show", str(path)]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_a_raw_control_character_is_located(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"name: p\nrules:\n  - {name: r\x01, use: [torch_sdpa]}\n")
    assert _problems(path) == ["p.yaml:3:13 (yaml): character U+0001 is not allowed in YAML, "
                               "expected printable text (remove it)"]


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    done: list[list[str]] = []
    t = threading.Thread(target=lambda: done.append(_problems(fifo)), daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # unblock the reader so the test process can end
        with open(fifo, "w"):
            pass
        pytest.fail("loading a FIFO blocked waiting for a writer")
    assert done == [["policy p.yaml is not a regular file, expected a regular YAML file of at "
                     "most 16 MiB (split it with `extends:`)"]]


def test_extends_dev_zero_is_refused(tmp_path: Path) -> None:
    """Reading /dev/zero to its end never finishes (and fills memory): in a subprocess, so
    that a loader which still tries is killed."""
    _write(tmp_path, "name: p\nextends: /dev/zero\n")
    code = ("from attnhub.policy import load_policy\nfrom attnhub.errors import PolicyError\n"
            "try:\n    load_policy('p.yaml')\nexcept PolicyError as e:\n    print(e.problems)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert run.stdout.strip() == str(["p.yaml:2:10 extends: policy /dev/zero is not a regular "
                                      "file, expected a regular YAML file of at most 16 MiB "
                                      "(split it with `extends:`)"]), run.stderr[-2000:]


def test_a_symlink_loop_is_a_located_read_error(tmp_path: Path) -> None:
    """``Path.resolve`` raised RuntimeError on a symlink loop, before any read."""
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    path = _write(tmp_path, "name: p\nextends: loop.yaml\n")
    (line,) = _problems(path)
    assert re.fullmatch(r"p\.yaml:2:10 extends: cannot read policy \S*loop\.yaml \(Too many "
                        r"levels of symbolic links\), expected a readable YAML file.*", line)


def test_a_long_extends_chain_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    for i in range(1100):
        _write(tmp_path, f"name: p{i}\nextends: p{i + 1}.yaml\n", f"p{i}.yaml")
    _write(tmp_path, HEAD + RULE, "p1100.yaml")
    (line,) = _problems(tmp_path / "p0.yaml")
    assert re.fullmatch(r"\S*p31\.yaml:2:10 extends: extends chain longer than 32 files, "
                        r"expected a short chain \(merge some of the files\)", line)


def test_thousands_of_problems_are_capped_and_quick(tmp_path: Path) -> None:
    """One problem per value gave a listing of half a million lines (46 MB) after ~15 s."""
    path = _write(tmp_path, "name: p\nrules: [" + ", ".join(["1"] * 60_000) + "]\n"
                  + "".join(f"k{i}: 1\n" for i in range(20_000)))
    problems = _problems(path)
    assert len(problems) == MAX_PROBLEMS + 1
    assert problems[0].startswith("p.yaml:2:9 rules[0]: got 1, expected")
    assert problems[-1] == (f"p.yaml: {80_000 - MAX_PROBLEMS} more problem(s) not listed, "
                            "expected the ones above fixed first (then check again)")


@pytest.mark.parametrize("when, message", [
    ("{needs_grad: 'no'}", "rules[0].when.needs_grad: got 'no', expected true or false"),
    ("{deterministic: 1}", "rules[0].when.deterministic: got 1, expected true or false"),
    ("{return_lse: 'false'}", "rules[0].when.return_lse: got 'false', expected true or false"),
    ("{layer: {every: true}}", "rules[0].when.layer.every: got True, expected a number"),
    ("{layer: {every: 2, offset: [true]}}", "rules[0].when.layer.offset[0]: got True, expected "
                                            "a number"),
    ("{head_dim: {in: [true]}}", "rules[0].when.head_dim.in[0]: got True, expected a number"),
    ("{seqlen: {ge: false}}", "rules[0].when.seqlen.ge: got False, expected a number"),
])
def test_no_value_is_silently_coerced_to_a_flag_or_number(tmp_path: Path, when: str,
                                                          message: str) -> None:
    """pydantic's lax mode read ``needs_grad: 'no'`` as True, ``every: true`` as 1."""
    path = _write(tmp_path, HEAD + f"  - {{name: r, when: {when}, use: [torch_sdpa]}}\n")
    (line,) = _problems(path)
    assert line.split(" ", 1)[1].startswith(message), line


def test_version_true_is_not_version_1(tmp_path: Path) -> None:
    (line,) = _problems(_write(tmp_path, "name: p\nversion: true\n" + "rules:\n" + RULE))
    assert line == "p.yaml:2:10 version: got True, expected a number"


@pytest.mark.parametrize("bound", [".nan", "true"])
def test_accuracy_bound_must_be_a_finite_number(tmp_path: Path, bound: str) -> None:
    """``max: {rel_error: .nan}`` made every record pass (x > nan is False)."""
    path = _write(tmp_path, HEAD + "  - {name: r, use: [torch_sdpa], requires: {accuracy: "
                  f"{{max: {{rel_error: {bound}}}}}}}}}\n")
    (line,) = _problems(path)
    assert re.match(r"p\.yaml:3:\d+ rules\[0\]\.requires\.accuracy\.max\.rel_error: got "
                    r"(nan, expected a finite number|True, expected a number)$", line), line
