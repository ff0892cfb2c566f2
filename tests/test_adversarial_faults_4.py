"""Stores and the CLI under faults, fourth round: a profile store (or a shipped pack) that is
a FIFO, ``/dev/zero`` or JSON nested past the recursion limit; a lockfile written over the
policy it locks; ``doctor`` with a policy that does not load. Readers hung, a RecursionError
escaped as a traceback, a policy was replaced by JSON, and doctor said all was well."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Callable

import pytest

from attnhub.cli import main
from attnhub.core.bounded import Stalled, bounded
from attnhub.core.device import simulate
from attnhub.errors import PolicyError
from attnhub.policy.profile import ProfileStore, shipped_pack

DEVICE = simulate("sm90")


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _zero(p: Path) -> None:
    p.symlink_to("/dev/zero")


def _deep(p: Path) -> None:
    n = random.randrange(20_000, 200_000)
    p.write_text('{"schema": "attnhub.profile/1", "devices": ' + "[" * n + "]" * n + "}")


SPOILED: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (_fifo, "(not a regular file)"), "dev zero": (_zero, "(not a regular file)"),
    "deep json": (_deep, "(maximum recursion depth exceeded"),
}


def _quick(fn: Callable[[], object]) -> object:
    """``fn()`` or its exception; a call still running after 20 s fails the test (the
    FIFO cases waited for a writer forever)."""
    try:
        return bounded(fn, 20.0)
    except Stalled:
        pytest.fail("the store read did not return within 20 s")


@pytest.mark.parametrize("case", list(SPOILED))
@pytest.mark.parametrize("op", ["read", "write"])
def test_a_store_that_cannot_be_json_is_refused_quickly_and_kept(tmp_path: Path, case: str,
                                                                 op: str) -> None:
    """A FIFO (or ``/dev/zero``) where the profile store goes hung every hub that read it;
    JSON nested deeper than the recursion limit raised RecursionError out of the store."""
    path = tmp_path / f"store{random.randrange(10**6)}.json"
    SPOILED[case][0](path)
    before = os.lstat(path)
    store = ProfileStore(path, packs="off")
    call = (lambda: store.accuracy(DEVICE, "*", "x")) if op == "read" else (
        lambda: store.record_accuracy(DEVICE, "*", "x", True, {"e": random.random() + 0.1}))
    with pytest.raises(PolicyError) as exc:
        _quick(call)
    (line,) = exc.value.problems
    assert line.startswith(f"{path}: the profile store cannot be read {SPOILED[case][1]}"), line
    assert line.endswith("point ATTNHUB_PROFILE elsewhere"), line
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode, after.st_size) == (before.st_ino, before.st_mode,
                                                            before.st_size)


def test_a_fifo_among_the_shipped_packs_names_the_packs_variable(tmp_path: Path) -> None:
    """A FIFO in ``ATTNHUB_PROFILE_PACKS`` hung every ``fastest`` rule's ranking."""
    folder = tmp_path / f"packs{random.randrange(10**6)}"
    folder.mkdir()
    os.mkfifo(folder / "pack.json")
    with pytest.raises(PolicyError) as exc:
        _quick(lambda: shipped_pack(DEVICE, folder))
    (line,) = exc.value.problems
    assert line.startswith(f"{folder / 'pack.json'}: the profile store cannot be read (not a "
                           "regular file)") and line.endswith("point ATTNHUB_PROFILE_PACKS "
                                                              "elsewhere"), line


def test_a_lock_written_over_its_own_policy_is_refused(tmp_path: Path, monkeypatch,
                                                       capsys) -> None:
    """``attnhub lock --policy p.yaml -o p.yaml`` replaced the policy with the lock's JSON:
    the policy was lost and ``lock --check`` could not load it any more."""
    monkeypatch.chdir(tmp_path)
    name = f"p{random.randrange(10**6)}"
    text = (f"name: {name}\nrules:\n  - name: r\n    use: [torch_sdpa]\n")
    Path("base.yaml").write_text(text)
    Path("top.yaml").write_text(f"name: top\nextends: base.yaml\nrules: []\n")
    os.symlink("base.yaml", "alias.yaml")
    for out in ("top.yaml", "./base.yaml", "alias.yaml"):
        assert main(["lock", "--policy", "top.yaml", "-o", out, "--hardware", "cpu"]) == 1
        assert "is a file of the policy being locked" in capsys.readouterr().err
    assert Path("base.yaml").read_text() == text and Path("top.yaml").read_text().startswith(
        "name: top")
    assert main(["lock", "--policy", "top.yaml", "-o", "lock.json", "--hardware", "cpu"]) == 0


def test_doctor_fails_when_the_policy_does_not_load(tmp_path: Path, monkeypatch,
                                                    capsys) -> None:
    """``attnhub doctor --policy missing.yaml`` printed the problem and exited 0: a CI step
    that checks the deployment's policy with doctor passed."""
    monkeypatch.chdir(tmp_path)
    missing = f"gone{random.randrange(10**6)}.yaml"
    assert main(["doctor", "--policy", missing]) == 1
    assert f"policy: policy does not load: cannot read policy {missing}" in capsys.readouterr().out
    Path("ok.yaml").write_text("name: ok\nrules:\n  - name: r\n    use: [torch_sdpa]\n")
    assert main(["doctor", "--policy", "ok.yaml", "--json"]) == 0
