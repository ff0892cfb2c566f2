"""The CLI, fifth round: Ctrl-C, output paths that are devices or each other, on/off
switches in the environment, and fp8-check's inputs. Each printed a traceback, replaced a
device file or the profile store, or silently did the opposite of what was asked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import attnhub
from attnhub.cli import main
from attnhub.errors import ArgumentError

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _exits(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


def test_ctrl_c_ends_a_run_with_one_line(tmp_path: Path) -> None:
    """Ctrl-C printed a full traceback (run, bench, profile, fp8-check) and made
    check-plugin abort (SIGABRT) with a kit case still running in its thread."""
    proc = subprocess.Popen([sys.executable, "-m", "attnhub", "check-plugin",
                             "--all-available"], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(6)  # past start-up, inside the cases
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err[-1500:])
    assert b"Traceback" not in err and b"interrupted" in err, err[-1500:]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_bench_refuses_outputs_that_are_devices_or_the_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--md`` over the store destroyed every earlier record; over a FIFO or a device the
    report replaced it; ``--plot x.txt`` crashed after the whole run."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    store = tmp_path / "s.json"
    for extra, words in ((["--md", str(fifo)], "not a regular file"),
                         (["--md", str(store), "--store", str(store)], "is also --store"),
                         (["--md", str(tmp_path / "a"), "--plot", str(tmp_path / "a")],
                          "is also --md"),
                         (["--plot", str(tmp_path / "t.txt")], "names no image format"),
                         (["--plot", str(tmp_path / "noext")], "names no image format")):
        code, err = _exits(["bench", "--seqlens", "16", *extra], capsys)
        assert code and words in str(code) + err, (extra, code, err)
    assert fifo.exists() and not fifo.is_file() and not store.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_lock_does_not_replace_a_device_or_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "out.lock"
    os.mkfifo(fifo)
    run = subprocess.run([sys.executable, "-m", "attnhub", "lock", "--hardware", "cpu", "-o",
                          str(fifo)], cwd=tmp_path, env=ENV, capture_output=True, timeout=120)
    assert run.returncode != 0 and b"not a regular file" in run.stderr, run.stderr[-800:]
    assert b"Traceback" not in run.stderr and not fifo.is_file()


@pytest.mark.parametrize("word, on", [("false", False), ("off", False), ("no", False),
                                      ("0", False), ("", False), ("1", True), ("true", True),
                                      ("ON", True), ("yes", True)])
def test_switches_in_the_environment_read_false_as_off(word: str, on: bool,
                                                       monkeypatch) -> None:
    """``ATTNHUB_SETTLE_TIES=false`` meant on (only 0 was off); so did ATTNHUB_DEBUG."""
    monkeypatch.setenv("ATTNHUB_SETTLE_TIES", word)
    monkeypatch.setenv("ATTNHUB_DEBUG", word)
    hub = attnhub.Hub(hardware="cpu")
    assert hub.settle_ties is on and hub.debug is on


def test_a_switch_with_another_word_is_named(monkeypatch) -> None:
    monkeypatch.setenv("ATTNHUB_DEBUG", "maybe")
    with pytest.raises(ArgumentError, match="ATTNHUB_DEBUG='maybe'; set it to 1"):
        attnhub.Hub(hardware="cpu")


def test_fp8_check_names_what_it_cannot_check(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A non-FP8 backend crashed with TypeError; an empty list checked nothing and passed;
    ``causal: "no"`` counted as causal; integer tensors were cast."""
    code, _ = _exits(["fp8-check", "--backend", "torch_sdpa", "--emulate", "--no-record"],
                     capsys)
    assert "computes in no FP8 dtype" in str(code), code
    for data, words in (([], "checks nothing"),
                        ({"q": torch.randn(1, 4, 2, 8), "k": torch.randn(1, 4, 2, 8),
                          "v": torch.randn(1, 4, 2, 8), "causal": "no"}, "causal='no'"),
                        ({"q": torch.ones(1, 4, 2, 8, dtype=torch.int32),
                          "k": torch.randn(1, 4, 2, 8), "v": torch.randn(1, 4, 2, 8)},
                         "floating tensors")):
        path = tmp_path / "in.pt"
        torch.save(data, path)
        code, _ = _exits(["fp8-check", "--inputs", str(path), "--emulate", "--no-record",
                          "--shape", "1,12,2,1,8", "--magnitudes", "5"], capsys)
        assert words in str(code), (words, code)


def test_run_check_fails_a_backend_far_from_the_reference(monkeypatch) -> None:
    """Forced onto linear attention, the run's logits were 5.1 off the reference with tokens
    differing, and the check said "ok": its near-tie allowance grew with the error itself."""
    tiny = ["run", "--layers", "1", "--heads", "4:2", "--head-dim", "8", "--vocab", "32",
            "--batch", "1", "--prompt-len", "6", "--new-tokens", "3", "--page-size", "4"]
    assert main(tiny) == 0
    monkeypatch.setenv("ATTNHUB_BACKEND", "linear")
    assert main(tiny) != 0


@pytest.mark.parametrize("flags", [["--out-json", "r.json"], ["--pack", "p.json"],
                                   ["--cells", "decode"], ["--rounds", "3"]])
def test_regret_flags_without_regret_are_named(flags: list[str], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Without --regret, bench ignored them: --out-json and --pack wrote nothing, exit 0."""
    code, _ = _exits(["bench", "--seqlens", "16", *flags], capsys)
    assert f"{flags[0]} belong to the regret report" in str(code), code
