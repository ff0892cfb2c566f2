"""Review round 11 of the ring, on 3 gloo ranks: a Ctrl-C on one rank drains the ring.

Before, a KeyboardInterrupt that landed in one rank's block work (the local kernel, the
merge, the block backward) left that rank at once, without passing the K/V blocks (and dK/dV
accumulators) on: the other ranks waited in a hop for it until the group's timeout (gloo's
default: 30 minutes), and a process that caught the interrupt (a notebook, a training loop's
handler) and called attention again hung with them. Now that rank drains the ring like any
failed rank; every other rank raises the usual ``RingError`` naming it (rank, pass, step,
block, ``KeyboardInterrupt``), the interrupted rank gets a ``KeyboardInterrupt`` (chained to
that RingError: never an Exception an ``except Exception`` would swallow), and the next call
of every rank is exact. This file is also the rank-side module ``run_on_ranks`` loads.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ring_ranks  # this folder's (conftest.py)

HERE = Path(__file__)
WORLD = 3
#: the group timeout: before the fix, the other ranks waited this long for the interrupted one
GROUP_TIMEOUT_S = 5.0


def _call(*a: Any, **kw: Any) -> None:
    return ring_ranks.sibling("test_review_10")._call(*a, **kw)


def _interrupted(rank: int, world: int, group: Any, bad: int, n: int, mode: str,
                 file: str, **kw: Any) -> str:
    """A call whose rank ``bad`` gets a Ctrl-C at the ``n``-th point of ``file``; that rank
    reports what reached it (the injector swallows the interrupt), the others raise."""
    from attnhub.testing import CtrlCAt

    if rank != bad:
        _call(rank, world, group, seed=3, **kw)
        return "returned"
    seen: list[str] = []

    def op() -> None:
        try:
            _call(rank, world, group, seed=3, **kw)
        except KeyboardInterrupt as exc:
            seen.append(f"KeyboardInterrupt: {exc}; cause {type(exc.__cause__).__name__}")
            raise

    injector = CtrlCAt(n, mode, (file,))
    injector.run(op)
    assert injector.fired, "the injection point was never reached"
    return seen[0] if seen else "no KeyboardInterrupt reached the caller"


def _then_exact(rank: int, world: int, group: Any) -> None:
    _call(rank, world, group, seed=4)


SCENARIOS: dict[str, Callable[..., Any]] = {
    # torch's CPU flash forward returns (c_return) on rank 1, its first block
    "forward_kernel": functools.partial(_interrupted, bad=1, n=3, mode="c",
                                        file="attnhub_ring/local_cpu.py"),
    "forward_kernel_after": _then_exact,
    # the merge of rank 1's first merged block (step 1)
    "merge": functools.partial(_interrupted, bad=1, n=3, mode="line",
                               file="attnhub_ring/merge.py"),
    "merge_after": _then_exact,
    # the math block backward on rank 2, mid-ring
    "backward": functools.partial(_interrupted, bad=2, n=40, mode="line",
                                  file="attnhub_ring/block_backward.py",
                                  block_backward="math"),
    "backward_after": _then_exact,
}


def main(rank: int, world: int) -> dict[str, tuple[Any, float]]:
    import torch.distributed as dist

    group = dist.new_group(list(range(world)),
                           timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    _then_exact(rank, world, group)  # warm-up: plugin loading
    return ring_ranks.outcomes({name: functools.partial(fn, rank, world, group)
                                for name, fn in SCENARIOS.items()})


@pytest.fixture(scope="module")
def results(run_on_ranks: Callable[..., list[Any]]) -> list[dict[str, tuple[Any, float]]]:
    return run_on_ranks(HERE, "main", WORLD, timeout=60)


EXPECT = {
    "forward_kernel": (1, "forward", "at step 0, on the K/V block of rank 1",
                       "Ctrl-C at point 3"),
    "merge": (1, "forward", "at step 1, on the K/V block of rank 0", "Ctrl-C at point 3"),
    "backward": (2, "backward", "at step 1, on the K/V block of rank 1", "Ctrl-C at point 40"),
}


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_a_ctrl_c_on_one_rank_drains_the_ring_and_every_rank_raises_at_once(
        results: list[dict[str, tuple[Any, float]]], name: str) -> None:
    bad, phase, where, point = EXPECT[name]
    words = ring_ranks.FAILED.format(rank=bad, phase=phase, where=where,
                                     error=f"KeyboardInterrupt: {point}")
    said = [r[name][0] for r in results]
    for rank, s in enumerate(said):
        if rank == bad:  # the user's Ctrl-C, not an Exception; it names the same failure
            assert s == ("ok", f"KeyboardInterrupt: {words[len('RingError: '):]}. Every rank "
                         "drained the ring and raises this; none returns a result of this "
                         f"{phase}; cause RingError"), (rank, s)
        else:
            assert isinstance(s, str) and s.startswith(words), (rank, said)
            assert "Every rank drained the ring and raises this" in s, s
    assert len({s for r, s in enumerate(said) if r != bad}) == 1, said
    seconds = [r[name][1] for r in results]
    assert max(seconds) < GROUP_TIMEOUT_S, f"a rank waited for the interrupted one: {seconds}"


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n.endswith("_after")])
def test_every_rank_is_in_step_after_a_ctrl_c(
        results: list[dict[str, tuple[Any, float]]], name: str) -> None:
    assert [r[name][0] for r in results] == [("ok", None)] * WORLD
