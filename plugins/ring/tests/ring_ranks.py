"""Run a function on N gloo ranks in fresh processes, torchrun style (tests of the ring only).

The parent starts one ``python ring_ranks.py`` per rank with the environment torchrun would set
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port); each child joins a
gloo group, calls ``function(rank, world_size, *args)`` from the given file and pickles the
result or the traceback. Subprocesses rather than ``mp.spawn`` so a hung ring is killed by a
timeout instead of hanging the suite, and so the target needs no importable module name.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


#: What every rank raises when rank ``rank`` of 3 fails mid-ring (the review-10 suites).
FAILED = "RingError: ring: rank {rank} of 3 failed in the ring's {phase} {where}: {error}"


def outcomes(scenarios: dict[str, Callable[[], Any]],
             before: Callable[[], Any] | None = None) -> dict[str, tuple[Any, float]]:
    """Each scenario's outcome on this rank, ("ok", its value) or its error's words
    (SystemExit included), with its seconds; ``before`` runs ahead of each (a barrier)."""
    out = {}
    for name, fn in scenarios.items():
        if before is not None:
            before()
        t0 = time.monotonic()
        try:
            res: Any = ("ok", fn())
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - judged by the test
            res = f"{type(exc).__name__}: {exc}"
        out[name] = (res, time.monotonic() - t0)
    return out


def sibling(name: str) -> Any:
    """Another module of this folder, loaded by path once (tests import no package here:
    pytest runs in importlib mode, and the ranks load their target by path)."""
    import importlib.util

    full = f"_ring_tests_{name}"
    if full not in sys.modules:
        spec = importlib.util.spec_from_file_location(full, Path(__file__).parent / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[full]


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_on_ranks(file: str | Path, function: str, world_size: int, *args: Any,
                 timeout: float = 60.0) -> list[Any]:
    """``function(rank, world_size, *args)`` from ``file`` on every rank; results by rank.

    Raises ``RuntimeError`` with every failing rank's traceback (or a timeout, after which
    the processes it started are killed)."""
    with tempfile.TemporaryDirectory(prefix="ring-ranks-") as tmp:
        work = Path(tmp)
        (work / "args.pkl").write_bytes(pickle.dumps(args))
        port = str(free_port())
        procs = []
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       OMP_NUM_THREADS="1")
            with open(work / f"{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, str(file), function, str(work)], env=env,
                    stdout=log, stderr=subprocess.STDOUT))
        timed_out = _wait_all(procs, timeout)
        logs = [(work / f"{r}.log").read_text(errors="replace") for r in range(world_size)]
        errors = [f"rank {r}:\n{(work / f'{r}.err').read_text()}" for r in range(world_size)
                  if (work / f"{r}.err").exists()]
        missing = [r for r in range(world_size) if not (work / f"{r}.pkl").exists()]
        if timed_out or errors or missing:
            head = f"timed out after {timeout:.0f} s\n" if timed_out else ""
            tails = "\n".join(f"--- rank {r} output ---\n{log[-2000:]}"
                              for r, log in enumerate(logs))
            raise RuntimeError(f"{function} on {world_size} ranks failed\n{head}"
                               + "\n".join(errors) + f"\n{tails}")
        return [pickle.loads((work / f"{r}.pkl").read_bytes()) for r in range(world_size)]


def _wait_all(procs: list[subprocess.Popen], timeout: float, grace: float = 3.0) -> bool:
    """Wait for every process; once one fails, give the others ``grace`` seconds (they are
    likely blocked on it in a collective), then kill what is left. True on a timeout."""
    deadline = time.monotonic() + timeout
    failed = False
    while any(p.poll() is None for p in procs):
        if not failed and any(p.returncode not in (None, 0) for p in procs):
            failed = True
            deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            return not failed
        time.sleep(0.05)
    return False


def _child(file: str, function: str, work: Path) -> None:
    import importlib.util

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        spec = importlib.util.spec_from_file_location(f"_ring_target_{rank}", file)
        assert spec is not None and spec.loader is not None, file
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        args = pickle.loads((work / "args.pkl").read_bytes())
        result = getattr(module, function)(rank, world, *args)
        (work / f"{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        (work / f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.modules.setdefault("ring_ranks", sys.modules[__name__])  # ``import ring_ranks``
    _child(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
