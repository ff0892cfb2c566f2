"""The ring on 2 and 4 gloo processes against the single-process reference (FA rule).

One process group per world size runs every case of ring_cases.py (forward, LSE and the three
gradients on each rank's shard), so the suite pays the process start-up twice, not per case.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CASES_FILE = Path(__file__).parent / "ring_cases.py"


@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_single_process_reference(
        run_on_ranks: Callable[..., list[Any]], ring_cases: Any, world: int) -> None:
    case_names = list(ring_cases.CASES)
    per_rank = run_on_ranks(CASES_FILE, "check_cases", world, case_names, timeout=120)
    assert len(per_rank) == world
    for rank, results in enumerate(per_rank):
        assert set(results) == set(case_names), f"rank {rank} ran {sorted(results)}"
    failures = [msg for results in per_rank for msg in results.values() if msg is not None]
    assert not failures, "\n".join(failures)
