"""Review round 9 of the ring, on 2 gloo ranks.

* ``block_backward="flash"`` (forced) where only rank 0's loss uses the returned LSE: rank 0
  refused the kernel before its first backward hop and raised alone, while rank 1 (whose loss
  does not use the LSE, so its kernel serves) waited in its hops until the group's timeout.
  Rank 0 must drain the ring like a rank whose block kernel fails, and (review 10) every
  rank raises its refusal at once, naming rank 0 (before: rank 1 got NaN dK/dV).
* The simulated ring (``SimulatedRing``: every rank played on one device) and the gloo ring
  run the same code: on random calls (bshd and thd with empty documents, zigzag and
  contiguous shards, GQA, causal or not, fp32/bf16, flash or math block backward) each rank's
  out, LSE and dQ are bitwise equal on both.

This file is also the rank-side module ``run_on_ranks`` loads in each gloo process.
"""

from __future__ import annotations

import datetime
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__)


def _lse_loss_on_rank_0(rank: int, world: int) -> dict[str, Any]:
    """Rank 0's loss uses the LSE; the block backward is forced to ``flash``."""
    import torch.distributed as dist
    from attnhub_ring import ring_attention, zigzag_shard

    ring = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=6))
    after = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4 * world + 1, 2, 8, generator=g) for _ in range(3))
    ql, kl, vl = (zigzag_shard(x, rank, world).requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(ql, kl, vl, local_backend="torch_flash_cpu", causal=True,
                              return_lse=True, block_backward="flash", group=ring)
    loss = out.sum() + (lse.sum() if rank == 0 else 0)
    t0 = time.monotonic()
    try:
        loss.backward()
        said = "ok"
    except Exception as exc:  # noqa: BLE001 - reported to the test, which judges it
        said = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    dist.barrier(group=after)  # rank 0 stays alive (a training job would) until rank 1 is out
    grads = [x.grad for x in (ql, kl, vl)]
    return {"said": said, "seconds": seconds, "grads": grads}


def _random_calls(rank: int, world: int, n: int = 6) -> list[str]:
    """Each call on the gloo ring and on a simulated ring: what differs (empty: nothing)."""
    from attnhub_ring import ZigzagLayout, ring_attention
    from attnhub_ring.simulate import SimulatedRing, pack_kv

    rng, bad = random.Random(909), []
    for i in range(n):
        thd = i % 2 == 0
        lens = (tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3))) if thd
                else (rng.randint(1, 11),))
        causal, sharding = rng.random() < 0.6, ("zigzag", "contiguous")[i // 2 % 2]
        hkv = rng.choice([1, 2])
        hq, bwd = hkv * rng.choice([1, 2]), rng.choice(["auto", "math"])
        dtype = rng.choice([torch.float32, torch.bfloat16])
        g = torch.Generator().manual_seed(i)
        shape = (sum(lens),) if thd else (2, sum(lens))

        def make(h: int) -> torch.Tensor:
            return torch.randn(*shape, h, 8, generator=g).to(dtype)  # noqa: B023

        q, k, v, do = make(hq), make(hkv), make(hkv), make(hq)
        layout = ZigzagLayout(world, lens, sharding)

        def shard(x: torch.Tensor, r: int) -> torch.Tensor:
            return x.index_select(0 if thd else 1, layout.global_indices(r))  # noqa: B023

        cu = torch.tensor([0, *torch.tensor(layout.local_lens(rank)).cumsum(0).tolist()],
                          dtype=torch.int32)
        got = {}
        for path in ("gloo", "simulated"):
            ql, kl, vl = (shard(x, rank).clone().requires_grad_() for x in (q, k, v))
            kw: dict[str, Any] = dict(local_backend="torch_flash_cpu", causal=causal,
                                      return_lse=True, sharding=sharding, block_backward=bwd,
                                      cu_seqlens=cu if thd else None)
            if path == "simulated":
                blocks = [pack_kv(shard(k, r), shard(v, r)) for r in range(world)]
                kw.update(transport=SimulatedRing(rank, blocks), global_seqlens=list(lens))
            out, lse = ring_attention(ql, kl, vl, **kw)
            (out.float() * shard(do, rank).float()).sum().backward()
            got[path] = (out.detach(), lse.detach(), ql.grad)
        for name, a, b in zip(("out", "lse", "dq"), got["gloo"], got["simulated"]):
            if not torch.equal(a, b):
                bad.append(f"call {i} (thd={thd}, lens={lens}, causal={causal}, {sharding}, "
                           f"heads {hq}:{hkv}, {bwd}, {dtype}) rank {rank}: {name} differs")
    return bad


def main(rank: int, world: int) -> dict[str, Any]:
    return {"lse_loss": _lse_loss_on_rank_0(rank, world),
            "simulated": _random_calls(rank, world)}


@pytest.fixture(scope="module")
def results(run_on_ranks: Callable[..., list[Any]]) -> list[dict[str, Any]]:
    return run_on_ranks(HERE, "main", 2, timeout=120)


def test_a_forced_block_backward_refused_on_one_rank_drains_the_ring(
        results: list[dict[str, Any]]) -> None:
    said = [r["lse_loss"]["said"] for r in results]
    assert said[0].startswith("RingError: ring: rank 0 of 2 failed in the ring's backward "
                              "before its first block: InputError: ring: block_backward="
                              "'flash' cannot serve"), said[0]
    assert said[1] == said[0], said  # the same words on every rank
    second = results[1]["lse_loss"]
    assert second["seconds"] < 3, f"rank 1 waited {second['seconds']:.1f} s in its hops"
    assert all(g is None for g in second["grads"]), "rank 1 must not keep gradients"


def test_the_simulated_ring_equals_the_gloo_ring_bitwise(
        results: list[dict[str, Any]]) -> None:
    bad = [m for r in results for m in r["simulated"]]
    assert not bad, "\n".join(bad)
