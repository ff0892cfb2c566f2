"""Tampered lockfiles: ``attnhub lock --check`` exits 3 with a located problem and the fix, never
a traceback or a silently accepted edit; writing a lock fails with a clear message."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnhub.cli import main
from attnhub.policy.lock import EXIT_BAD_LOCK, LockfileError, read_lock, write_lock


@pytest.fixture(scope="module")
def lock_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("lock") / "good.lock"
    assert main(["lock", "--hardware", "cpu", "-o", str(path)]) == 0
    return path.read_text()


def _check(tmp_path: Path, text: str, capsys) -> list[str]:
    path = tmp_path / "x.lock"
    path.write_text(text)
    assert main(["lock", "--check", str(path)]) == EXIT_BAD_LOCK
    err = capsys.readouterr().err
    assert "Traceback" not in err
    with pytest.raises(LockfileError) as exc:
        read_lock(path)
    return exc.value.problems


def _edited(text: str, edit) -> str:  # type: ignore[no-untyped-def]
    data = json.loads(text)
    edit(data)
    return json.dumps(data, indent=2)


def test_unknown_simulated_hardware_is_located(tmp_path: Path, lock_text: str, capsys) -> None:
    """``simulate('sm9999x')`` raised ValueError out of ``lock --check``."""
    text = _edited(lock_text, lambda d: d["bindings"][0].update(hardware="sm9999x"))
    (line,) = _check(tmp_path, text, capsys)
    assert re.match(r"\S+x\.lock:\d+:\d+ bindings\[0\]\.hardware: got 'sm9999x', expected a "
                    r"known hardware name \(unknown hardware .*regenerate the lock", line), line


def test_an_unknown_context_key_is_ignored_like_an_unknown_spec_key(tmp_path: Path,
                                                                    lock_text: str) -> None:
    """A key added by a later version (or by hand) raised TypeError in BindContext(**...)."""
    path = tmp_path / "x.lock"
    path.write_text(_edited(lock_text, lambda d: d["bindings"][0]["context"].update(extra=1)))
    assert main(["lock", "--check", str(path)]) == 0


def test_a_duplicate_key_is_not_silently_resolved(tmp_path: Path, lock_text: str,
                                                  capsys) -> None:
    """json keeps the last of two equal keys: a hand edit could change a binding unseen."""
    text = lock_text.replace('"backend": "torch_sdpa",', '"backend": "reference",\n'
                             '      "backend": "torch_sdpa",', 1)
    (line,) = _check(tmp_path, text, capsys)
    assert re.match(r"\S+x\.lock:\d+:7 bindings\[0\]\.backend: duplicate key 'backend' \(first "
                    r"at line \d+\), expected each key once; regenerate it", line), line


@pytest.mark.parametrize("text, what", [
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),
    ('{"schema": "attnhub.lock/2", "n": 1' + "0" * 5000 + "}", "ValueError: Exceeds the limit"),
], ids=["deep-nesting", "int-of-5000-digits"])
def test_hostile_json_is_a_lockfile_error(tmp_path: Path, capsys, text: str, what: str) -> None:
    (line,) = _check(tmp_path, text, capsys)
    assert re.match(rf"\S+x\.lock: not a lockfile \({what}.*\); expected the JSON `attnhub "
                    r"lock` writes; regenerate it", line), line


def test_a_lockfile_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    """``--check /dev/zero`` read forever: in a subprocess, killed if it still does."""
    code = ("from attnhub.policy.lock import read_lock, LockfileError\ntry:\n"
            "    read_lock('/dev/zero')\nexcept LockfileError as e:\n    print(e.problems)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert "/dev/zero: the lockfile is not a regular file; expected a file written by" in \
        run.stdout, run.stderr[-2000:]


def test_writing_over_a_folder_is_a_clear_error(tmp_path: Path, capsys) -> None:
    assert main(["lock", "--hardware", "cpu", "-o", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"attnhub lock: error: {tmp_path}: cannot write the lockfile (Is a directory); " \
           "expected a writable file path" in err, err


def test_a_lock_is_flushed_to_disk_before_it_replaces_the_old_one(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """Renamed without fsync, a crash can leave an empty file where the lock was."""
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"),
                                                     real_replace(a, b))[1])
    write_lock(tmp_path / "x.lock", {"schema": "attnhub.lock/2"})
    assert calls == ["fsync", "replace"]
    assert json.loads((tmp_path / "x.lock").read_text()) == {"schema": "attnhub.lock/2"}


def test_the_policy_a_lock_names_may_not_be_dev_zero(tmp_path: Path, lock_text: str,
                                                     capsys) -> None:
    path = tmp_path / "x.lock"
    path.write_text(_edited(lock_text, lambda d: d["policy"].update(files=["/dev/zero"])))
    code = ("import sys\nfrom attnhub.cli import main\n"
            f"sys.exit(main(['lock', '--check', {str(path)!r}]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    # 3: the check could not run (1 is drift)
    assert run.returncode == 3 and "policy /dev/zero is not a regular file" in run.stderr, \
        run.stderr[-2000:]

