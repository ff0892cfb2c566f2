"""The host calling plugin code: whatever a plugin's check()/available() raises, SystemExit
and unprintable exceptions included, becomes a reason naming it (a user's Ctrl-C on the main
thread still stops the host); the conformance kit judges it as a crash; a non-daemon thread
a plugin left running does not keep the ``attnhub`` process from exiting; a saved report
that is a FIFO is refused, not waited on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from attnhub.conformance.kit import run_case
from attnhub.conformance.cases import grid
from attnhub.core.backend import AttentionOutput, Backend, safe_available, safe_check
from attnhub.core.capabilities import Capabilities
from attnhub.core.device import DeviceInfo, probe
from attnhub.core.spec import AttentionSpec

REPO = Path(__file__).resolve().parents[1]


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no text")


def _raiser(exc: BaseException) -> Backend:
    class Raising(Backend):
        name, plugin = "raising", "adv_plugin"
        capabilities = Capabilities()

        def check(self, spec, device):  # type: ignore[no-untyped-def]
            raise exc

        def available(self, device):  # type: ignore[no-untyped-def]
            raise exc

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def]
            return AttentionOutput(q.clone())

    return Raising()


SPEC = AttentionSpec(dtype="float32", head_dim=8)


@pytest.fixture
def device() -> DeviceInfo:
    return probe("cpu")


@pytest.mark.parametrize("exc", [SystemExit(5), _Unprintable(), GeneratorExit(),
                                 KeyboardInterrupt()], ids=lambda e: type(e).__name__)
def test_whatever_check_raises_is_a_reason(exc: BaseException, device: DeviceInfo) -> None:
    backend = _raiser(exc)
    if isinstance(exc, KeyboardInterrupt):  # the user's Ctrl-C on the main thread stops us
        with pytest.raises(KeyboardInterrupt):
            safe_check(backend, SPEC, device)
        got: list[list[str]] = []  # off the main thread it is the plugin's own raise
        t = threading.Thread(target=lambda: got.append(safe_check(backend, SPEC, device)))
        t.start()
        t.join()
        (reasons,) = got
    else:
        reasons = safe_check(backend, SPEC, device)
        assert safe_available(backend, device) == [
            r.replace("check()", "available()") for r in reasons]
    (reason,) = reasons
    assert f"raised {type(exc).__name__}" in reason and "'adv_plugin'" in reason, reason


def test_the_kit_judges_a_check_that_exits_as_a_crash(device: DeviceInfo) -> None:
    case = grid(Capabilities(), True)[0]
    res = run_case(_raiser(SystemExit(3)), device, case)
    assert res.status == "crash" and "SystemExit" in res.detail, res


def test_the_process_exits_past_a_plugin_thread_left_running(tmp_path: Path) -> None:
    """Before, such a thread held ``attnhub plugins`` until it ended (120 s timeouts)."""
    code = textwrap.dedent("""
        import threading, time
        from attnhub.core import process_state
        import attnhub.cli as cli
        before = process_state.snapshot()
        threading.Thread(target=time.sleep, args=(120,), name="plugin-worker").start()
        process_state.stray_threads(before)
        cli.main = lambda: 4
        cli.run()
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 4, run.stderr[-2000:]
    assert "'plugin-worker'" in run.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_bench_from_json_refuses_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    run = subprocess.run([sys.executable, "-m", "attnhub", "bench", "--from-json", str(fifo)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode != 0 and "--from-json" in run.stderr and "Traceback" not in \
        run.stderr, run.stderr[-2000:]


def test_a_hanging_available_is_a_reason_in_listings(device: DeviceInfo) -> None:
    """``attnhub backends`` / ``doctor`` / ``check-plugin --all`` waited forever on one
    plugin's ``available()``; with a limit it is that backend's reason, the others listed."""
    release = threading.Event()

    class Hanging(Backend):
        name, plugin = "hanging", "adv_plugin"
        capabilities = Capabilities()

        def available(self, device):  # type: ignore[no-untyped-def]
            release.wait(30)
            return []

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def]
            return AttentionOutput(q.clone())

    try:
        (reason,) = safe_available(Hanging(), device, timeout=0.2)
    finally:
        release.set()
    assert "did not return within 0.2 s" in reason and "'adv_plugin'" in reason, reason
