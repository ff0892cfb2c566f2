"""A call bound for one world size over a process group of another (a 2-D mesh whose
context-parallel group was not given): the ring mixed the ranks' shards and answered 0.8 off
the reference with no error (review round 7). Now every rank raises, naming both sizes.

This file is also the rank-side module ``run_on_ranks`` loads in each gloo process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def main(rank: int, world: int) -> str:
    import attnhub

    g = torch.Generator().manual_seed(1)
    full = [torch.randn(1, 12, h, 8, generator=g) for h in (2, 1, 1)]
    chunks = torch.tensor_split(torch.arange(12), 6)  # zigzag shards for 3 ranks
    idx = torch.cat([chunks[rank], chunks[5 - rank]])
    q, k, v = (x.index_select(1, idx) for x in full)
    try:
        attnhub.Hub().attention(q, k, v, causal=True,
                                context=attnhub.BindContext(world_size=3))
    except Exception as exc:  # noqa: BLE001 - the rank reports what it raised
        return f"{type(exc).__name__}: {exc}"
    return "answered"


def test_a_call_bound_for_another_world_size_raises_on_every_rank(
        run_on_ranks: Callable[..., list[Any]]) -> None:
    got = run_on_ranks(Path(__file__), "main", 2, timeout=90)
    assert all("world_size=3" in r and "2 ranks" in r for r in got), got

