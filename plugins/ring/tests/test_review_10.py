"""Review round 10 of the ring, on 3 gloo ranks: one rank's failure is every rank's error.

Before, a rank whose part of a pass failed drained the ring and raised alone: the others
returned from the backward with NaN dK/dV (some blocks' dK/dV exact, some NaN, depending
on the step it failed at), returned from the forward as if nothing happened (and then waited
for it in their next call's collectives until the group's timeout), and a failure through the
hub was retried on the failed rank alone by the rule's next candidate (attention over its
shard only: silently wrong). Now each pass ends with a status exchange and every rank raises
the same ``RingError`` naming the rank, the step and block, and the reason:

* the block backward raising on one rank, at its last block (math kernel);
* the merge raising in the forward on one rank;
* a local kernel calling ``exit()`` (SystemExit) mid-ring: it left at once, the others hung;
* through the hub with a fallback candidate: no rank falls back;
* a rank whose last K/V hop fails: it raises at once, the others do not return an output
  (they fail at the group's timeout, in the status exchange).

After the drained failures every rank's next call is exact (the group is in step). This file
is also the rank-side module ``run_on_ranks`` loads in each gloo process.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ring_ranks  # this folder's (conftest.py)
import torch

HERE = Path(__file__)
WORLD = 3
#: the group timeout of the scenario whose hop fails: the other ranks wait this long for it
HOP_TIMEOUT_S = 4.0


def _round_4() -> Any:
    """test_adversarial_ring_4 (its helpers: shards, exact check, failing kernel)."""
    return ring_ranks.sibling("test_adversarial_ring_4")


FAILED = ring_ranks.FAILED


def _shards(rank: int, world: int, seed: int, dtype: torch.dtype = torch.float32) -> list[Any]:
    return _round_4()._sibling("test_ring_adversarial_3")._shards(
        rank, world, 4 * world + 1, "zigzag", seed=seed, dtype=dtype)


def _call(rank: int, world: int, group: Any, seed: int, local: Any = "torch_flash_cpu",
          backward: bool = True, dtype: torch.dtype = torch.float32, check: bool = True,
          **kw: Any) -> None:
    """A causal zigzag call (and its backward); fp32 ones checked against fp64."""
    from attnhub_ring import ring_attention

    q, k, v, dout, *full = _shards(rank, world, seed, dtype)
    lq, lk, lv = (x.detach().requires_grad_() for x in (q, k, v))
    out = ring_attention(lq, lk, lv, local_backend=local, causal=True, group=group, **kw)
    got = {0: out}
    if backward:
        got.update(enumerate(torch.autograd.grad((out * dout).sum(), (lq, lk, lv)), 1))
    if check:
        _round_4()._exact(rank, world, got, full, f"seed {seed}")


def _backward_fails_at_last_block(rank: int, world: int, group: Any) -> None:
    import attnhub_ring.ring as ring_mod

    real, calls = ring_mod._block_grads, [0]

    def failing(*a: Any) -> None:
        calls[0] += 1
        if rank == 2 and calls[0] == world:
            raise RuntimeError("injected math backward failure")
        real(*a)

    ring_mod._block_grads = failing
    try:
        _call(rank, world, group, seed=11, block_backward="math")
    finally:
        ring_mod._block_grads = real


def _merge_fails(rank: int, world: int, group: Any) -> None:
    import attnhub_ring.ring as ring_mod

    real = ring_mod.merge_into, ring_mod.merge_partial

    def failing(*a: Any) -> Any:
        raise RuntimeError("injected merge failure")

    if rank == 2:
        ring_mod.merge_into = ring_mod.merge_partial = failing
    try:
        _call(rank, world, group, seed=12, backward=False)
    finally:
        ring_mod.merge_into, ring_mod.merge_partial = real


def _kernel_exits(rank: int, world: int, group: Any) -> None:
    local = _round_4()._FailingKernel(
        1 if rank == 0 else None, SystemExit("a kernel library called exit()"))
    _call(rank, world, group, seed=13, local=local, backward=False)


def _after_failures(rank: int, world: int, group: Any) -> None:
    """The group is in step after the drained failures: exact, forward and backward."""
    _call(rank, world, group, seed=14)


class _RingWithFallback:
    """A policy stand-in: ``ring`` around the failing kernel, then ``reference`` as the
    rule's next candidate (``on_failure: next``)."""

    name = "test-ring-fallback"

    def resolve(self, spec: Any, device: Any, registry: Any, ctx: Any) -> Any:
        import attnhub

        inner = attnhub.Decision(spec=spec, device=device.describe(),
                                 backend="failing_on_one_rank", rule="local")
        return attnhub.Decision(spec=spec, device=device.describe(), backend="ring",
                                rule="ring", fallbacks=("reference",), on_failure="next",
                                inner=inner)


def _hub_does_not_fall_back(rank: int, world: int, group: Any) -> None:
    import attnhub
    from attnhub_ring import RingBackend

    from attnhub.core.registry import Registry

    local = _round_4()._FailingKernel(0 if rank == 1 else None)
    hub = attnhub.Hub(_RingWithFallback(), registry=Registry.of(RingBackend(), local))
    q, k, v, *_ = _round_4()._sibling("test_ring_adversarial_3")._shards(
        rank, world, 4 * world + 1, "zigzag", seed=15)
    hub.attention(q, k, v, causal=True, extra={"process_group": group})


def _last_hop_fails(rank: int, world: int, group: Any) -> None:
    """Rank 1's last K/V hop of the forward completes, then its wait raises."""
    from attnhub_ring import RingError
    from attnhub_ring.comm import Ring

    real, hops = Ring.hop, [0]

    class Broken:
        def __init__(self, pending: Any):
            self.pending = pending

        def wait(self) -> torch.Tensor:
            self.pending.wait()
            raise RingError("ring: injected hop failure")

    def hop(self: Ring, *a: Any, **kw: Any) -> Any:
        pending = real(self, *a, **kw)
        hops[0] += 1
        return Broken(pending) if rank == 1 and hops[0] == world - 1 else pending

    Ring.hop = hop  # type: ignore[method-assign]
    try:
        _call(rank, world, group, seed=16, backward=False)
    finally:
        Ring.hop = real  # type: ignore[method-assign]


#: name -> (scenario, group timeout in s); run in this order (the broken hop last: it
#: leaves its group broken)
SCENARIOS: dict[str, tuple[Callable[[int, int, Any], None], float]] = {
    "backward_fails_at_last_block": (_backward_fails_at_last_block, 20.0),
    "merge_fails": (_merge_fails, 20.0),
    "kernel_exits": (_kernel_exits, 20.0),
    "hub_does_not_fall_back": (_hub_does_not_fall_back, 20.0),
    "after_failures": (_after_failures, 20.0),
    "last_hop_fails": (_last_hop_fails, HOP_TIMEOUT_S),
}


def main(rank: int, world: int) -> dict[str, tuple[str, float]]:
    """Each scenario's outcome on this rank ("ok" or the error, SystemExit included) and
    its seconds, after a warm-up call (plugin loading) on the first scenario's group."""
    import torch.distributed as dist

    groups = {name: dist.new_group(list(range(world)),
                                   timeout=datetime.timedelta(seconds=seconds))
              for name, (_, seconds) in SCENARIOS.items()}
    _after_failures(rank, world, groups["after_failures"])
    return ring_ranks.outcomes({name: functools.partial(fn, rank, world, groups[name])
                                for name, (fn, _) in SCENARIOS.items()})


@pytest.fixture(scope="module")
def results(run_on_ranks: Callable[..., list[Any]]) -> list[dict[str, tuple[str, float]]]:
    return run_on_ranks(HERE, "main", WORLD, timeout=150)


#: per drained scenario: the words every rank must raise, alike
EXPECT = {
    "backward_fails_at_last_block": FAILED.format(
        rank=2, phase="backward", where="at step 2, on the K/V block of rank 0",
        error="RuntimeError: injected math backward failure"),
    "merge_fails": FAILED.format(rank=2, phase="forward", where="at step 1, on the K/V block "
                                 "of rank 1", error="RuntimeError: injected merge failure"),
    "kernel_exits": FAILED.format(rank=0, phase="forward", where="at step 1, on the K/V "
                                  "block of rank 2",
                                  error="SystemExit: a kernel library called exit()"),
    "hub_does_not_fall_back": FAILED.format(
        rank=1, phase="forward", where="at step 0, on the K/V block of rank 1",
        error="RuntimeError: injected kernel failure"),
}


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_one_rank_failing_raises_the_same_error_on_every_rank_at_once(
        results: list[dict[str, tuple[str, float]]], name: str) -> None:
    said = [r[name][0] for r in results]
    assert all(s.startswith(EXPECT[name]) for s in said), said
    assert "Every rank drained the ring and raises this" in said[0], said[0]
    assert len(set(said)) == 1, said  # the same words on every rank
    seconds = [r[name][1] for r in results]
    assert max(seconds) < 10, f"a rank waited for the failed one: {seconds}"


def test_the_group_is_in_step_after_the_failures(
        results: list[dict[str, tuple[str, float]]]) -> None:
    assert [r["after_failures"][0] for r in results] == [("ok", None)] * WORLD


def test_a_failed_hop_leaves_no_rank_with_an_output(
        results: list[dict[str, tuple[str, float]]]) -> None:
    said = [r["last_hop_fails"][0] for r in results]
    assert said[1] == "RingError: ring: injected hop failure", said
    for rank in (0, 2):
        assert said[rank].startswith(f"RingError: ring: rank {rank} of 3 got no answer from "
                                     "the other ranks in the status check closing the "
                                     "ring's forward"), said
    seconds = [r["last_hop_fails"][1] for r in results]
    assert max(seconds) < HOP_TIMEOUT_S + 10, seconds
