"""Review round 8 of the ring, through the hub on 2 gloo ranks.

* A thd call whose ``max_seqlen_q`` is a legal upper bound on one rank: ring (and its CPU
  kernel, torch_flash_cpu) refused it at bind time on that rank, comparing length buckets,
  while the other rank waited in the handshake until the group's timeout. Now both answer;
  thd cross-attention is still refused on every rank (by the handshake), bshd at bind time.
* ``extra['process_group']`` that is not a live ProcessGroup (a mesh dimension's name, a
  destroyed group) failed as a backend with torch's raw AttributeError/ValueError; now a
  RingError names the argument, alike on every rank (and RingBackend.process_group likewise).

This file is also the rank-side module ``run_on_ranks`` loads in each gloo process.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


def _thd(rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """This rank's zigzag shard of two documents (5 and 7 tokens): q, k, v, cu_seqlens."""
    from attnhub_ring import zigzag_shard_varlen

    g = torch.Generator().manual_seed(9)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    (q, cu_local), (k, _), (v, _) = (zigzag_shard_varlen(torch.randn(12, h, 8, generator=g),
                                                         cu, rank, world) for h in (2, 1, 1))
    return q, k, v, cu_local


def _call(rank: int, world: int, group: Any, **kw: Any) -> torch.Tensor:
    """The thd self-attention call through the hub, ring over ``group``; ``kw`` overrides."""
    import attnhub

    q, k, v, cu = _thd(rank, world)
    args = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                context=attnhub.BindContext(world_size=world), extra={"process_group": group})
    return attnhub.Hub(hardware="cpu").attention(q, k, v, **{**args, **kw})


def _bound_on_rank_0(rank: int, world: int, group: Any) -> None:
    want = _call(rank, world, group)
    got = _call(rank, world, group, **({"max_seqlen_q": 32} if rank == 0 else {}))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _bound_on_every_rank(rank: int, world: int, group: Any) -> None:
    want = _call(rank, world, group)
    torch.testing.assert_close(_call(rank, world, group, max_seqlen_q=32, max_seqlen_k=16),
                               want, rtol=0, atol=0)


def _thd_cross_attention(rank: int, world: int, group: Any) -> None:
    other = _thd(rank, world)[3].clone()
    other[1] += 1  # same tokens, another cut: not self-attention
    _call(rank, world, group, cu_seqlens_k=other)


def _bshd_cross_attention(rank: int, world: int, group: Any) -> None:
    """Twice the keys of the queries on every rank: refused when binding, on every rank."""
    import attnhub

    q, k, v, _ = _thd(rank, world)
    attnhub.Hub(hardware="cpu").attention(
        q[None], torch.cat([k, k])[None], torch.cat([v, v])[None], causal=True,
        context=attnhub.BindContext(world_size=world), extra={"process_group": group})


def _group_is_a_name(rank: int, world: int, group: Any) -> None:
    _call(rank, world, "cp")


def _group_destroyed(rank: int, world: int, group: Any) -> None:
    import torch.distributed as dist

    gone = dist.new_group(list(range(world)))
    dist.destroy_process_group(gone)
    _call(rank, world, gone)


def _backend_group_is_a_name(rank: int, world: int, group: Any) -> None:
    """RingBackend.process_group set to a name, on a real (not simulated) device: refused
    when binding, alike on every rank."""
    import attnhub

    hub = attnhub.Hub()
    hub.registry.get("ring").process_group = "cp"
    q, k, v, cu = _thd(rank, world)
    hub.attention(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                  context=attnhub.BindContext(world_size=world))


SCENARIOS: dict[str, Callable[[int, int, Any], None]] = {
    "bound_on_rank_0": _bound_on_rank_0, "bound_on_every_rank": _bound_on_every_rank,
    "thd_cross_attention": _thd_cross_attention,
    "bshd_cross_attention": _bshd_cross_attention, "group_is_a_name": _group_is_a_name,
    "group_destroyed": _group_destroyed, "backend_group_is_a_name": _backend_group_is_a_name,
}

NOT_A_GROUP = ("is the str 'cp', not a torch.distributed ProcessGroup; pass the group object "
               "(torch.distributed.new_group(...); for a DeviceMesh dimension, "
               "mesh.get_group(dim)), or leave it unset for the default group")
#: what every rank must answer: "ok", or the start of the error it raises
EXPECT = {
    "bound_on_rank_0": "ok",
    "bound_on_every_rank": "ok",
    "thd_cross_attention": "RingError: ring: thd needs cu_seqlens_q == cu_seqlens_k",
    "bshd_cross_attention": "NoBackendError: no backend can serve this call",
    "group_is_a_name": "RingError: ring: extra['process_group'] " + NOT_A_GROUP,
    "group_destroyed": ("RingError: ring: extra['process_group'] is a ProcessGroup "
                        "torch.distributed no longer knows"),
    "backend_group_is_a_name": "NoBackendError: no backend can serve this call",
}
#: words the error must also hold (the reason a refusal at bind time gives)
ALSO = {"bshd_cross_attention": "shards self-attention only",
        "backend_group_is_a_name": "RingBackend.process_group " + NOT_A_GROUP}


def main(rank: int, world: int) -> dict[str, tuple[str, float]]:
    """Each scenario's outcome on this rank ("ok" or the error) and its seconds, after a
    warm-up call (plugin loading). The group's timeout is 10 s: a rank left waiting by a
    refusal on the other fails the scenario (too slow), not the suite."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=10))
    _call(rank, world, group)
    out = {}
    for name, fn in SCENARIOS.items():
        t0 = time.monotonic()
        try:
            fn(rank, world, group)
            res = "ok"
        except Exception as exc:  # noqa: BLE001 - the rank reports what it raised
            res = f"{type(exc).__name__}: {exc}"
        out[name] = (res, time.monotonic() - t0)
    return out


@pytest.fixture(scope="module")
def results(run_on_ranks: Callable[..., list[Any]]) -> list[dict[str, tuple[str, float]]]:
    return run_on_ranks(Path(__file__), "main", 2, timeout=150)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_rank_answers_or_raises_the_same_at_once(
        results: list[dict[str, tuple[str, float]]], name: str) -> None:
    said = [r[name][0] for r in results]
    assert all(s.startswith(EXPECT[name]) and ALSO.get(name, "") in s for s in said), said
    assert len(set(said)) == 1, said  # the same words on every rank
    assert max(r[name][1] for r in results) < 6, [r[name][1] for r in results]
