"""Stores, eleventh round: a Ctrl-C as ``tempfile.mkstemp`` returned in ``atomic_path`` (the
writer of ``bench --md``/``--plot``), before its ``try``, left a temporary file beside the
target each time (and its file descriptor open). Swept with the project's fault injector:
after every interrupted write the target is whole (old or new) and nothing else is left in
its folder; the profile store's writer is swept the same way."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Callable

import pytest

from attnhub.cli._common import write_text_atomic
from attnhub.core.device import simulate
from attnhub.policy.profile import ProfileStore, write_json_atomic
from attnhub.testing import CtrlCAt

#: The store's and the writers' own code, and the standard library calls they make (not
#: ``tempfile``'s: the old writer used ``mkstemp``, whose first call takes a module lock that a
#: Ctrl-C just after it was taken never gives back, and every later ``mkstemp`` hung).
_FILES = ("cli/_common.py", "policy/profile.py", "json/encoder.py", "json/__init__.py",
          "pathlib.py", "contextlib.py")


def _sweep(folder: Path, write: Callable[[int], None], whole: Callable[[], None],
           keep: set[str]) -> int:
    """Interrupt ``write(n)`` at each point n in turn until it runs to its end; after each
    run ``whole()`` holds and ``folder`` holds only ``keep``. The number of points."""
    n = 1
    while True:
        inj = CtrlCAt(n, "c", _FILES)
        inj.run(lambda: write(n))
        whole()
        assert {p.name for p in folder.iterdir()} <= keep, (n, sorted(os.listdir(folder)))
        if not inj.fired:
            return n
        n += 1


def test_an_interrupted_text_write_leaves_the_old_or_new_file_and_nothing_else(
        tmp_path: Path) -> None:
    target = tmp_path / "report.md"
    target.write_text("old")
    points = _sweep(tmp_path, lambda n: write_text_atomic(target, f"new {n}"),
                    lambda: target.read_text().startswith(("old", "new")) or pytest.fail(),
                    {"report.md"})
    assert points > 5 and target.read_text().startswith("new")


def test_an_interrupted_store_record_leaves_a_readable_store_and_nothing_else(
        tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    dev = simulate("sm90")
    ProfileStore(path).record_attention_share(dev, "m", 0.5)

    def share() -> None:
        assert ProfileStore(path).attention_share(dev, "m", "*") in (0.5, 0.25)

    _sweep(tmp_path, lambda n: ProfileStore(path).record_attention_share(dev, "m", 0.25),
           share, {"profile.json", ".profile.json.lock"})
    assert json.loads(path.read_text())["schema"] == "attnhub.profile/1"


@pytest.mark.parametrize("write", [
    lambda p: write_text_atomic(p, "x"),
    lambda p: write_json_atomic(p, {"a": 1}),
], ids=["text", "json"])
def test_a_written_file_has_an_ordinary_new_files_mode(tmp_path: Path,
                                                       write: Callable[[Path], None]) -> None:
    """Made by ``os.open`` now (not ``mkstemp``'s 0600): 0666 less the umask, as ``open``."""
    umask = os.umask(0o022)
    try:
        write(tmp_path / "f.out")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "f.out").stat().st_mode) == 0o644
