"""The profile store's writer under faults: a failed write (disk full, say) is an error that
names the store and the fix, keeps the store on disk as it was, and leaks neither the
temporary file nor its descriptor; the file gets ordinary permissions without touching the
process umask at write time (another thread may be creating files)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from attnhub.errors import PolicyError
from attnhub.policy import profile


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc")
def test_a_failed_write_names_the_store_and_keeps_it(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "store.json"
    profile.write_json_atomic(path, {"a": 1})
    before, fds = path.read_text(), _open_fds()

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(profile.os, "fsync", full)
    with pytest.raises(OSError):
        profile.write_json_atomic(path, {"a": 2})
    assert path.read_text() == before and _open_fds() == fds
    assert [p.name for p in tmp_path.iterdir()] == ["store.json"]  # no temporary left

    monkeypatch.setattr(profile.os, "fchmod", full)  # before anything is written
    with pytest.raises(OSError):
        profile.write_json_atomic(path, {"a": 3})
    assert _open_fds() == fds and json.loads(path.read_text()) == {"a": 1}


def test_the_store_reports_a_failed_write_with_its_path(tmp_path: Path, monkeypatch) -> None:
    store = profile.ProfileStore(tmp_path / "p.json")

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(profile, "write_json_atomic", full)
    with pytest.raises(PolicyError, match=r"p\.json: cannot write the profile store \(No space"):
        store._update(lambda data: None)


def test_the_umask_is_not_changed_while_writing(tmp_path: Path, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(profile.os, "umask", lambda m: calls.append(m) or 0o022)
    profile.write_json_atomic(tmp_path / "x.json", {})
    assert calls == []
    assert (tmp_path / "x.json").stat().st_mode & 0o777 == 0o666 & ~profile._UMASK
