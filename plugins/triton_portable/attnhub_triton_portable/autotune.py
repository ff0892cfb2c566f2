"""Pick a tile config per shape bucket: the table's entry, or the fastest candidate on a GPU.

Tuning runs once per key (arch, head dim, dtype, mask switches, length and batch buckets) on
the first call, times each candidate with ``triton.testing.do_bench`` and keeps the fastest.
A candidate that fails to compile (too much shared memory, an option the installed Triton
lacks) is recorded in ``TUNING_LOG`` with its error and skipped; if every one fails, the
first error is raised. ``ATTNHUB_TRITON_AUTOTUNE=0`` turns tuning off (table entries only).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch

Config = dict[str, Any]

_CACHE: dict[tuple[Any, ...], Config] = {}
_LOCK = threading.Lock()
#: (key, config, median ms or None, error or None) for every candidate timed so far.
TUNING_LOG: list[tuple[tuple[Any, ...], Config, float | None, str | None]] = []


def tuning_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("ATTNHUB_TRITON_AUTOTUNE", "1") != "0"


def bucket(n: int) -> int:
    """Next power of two (0 stays 0): lengths within a factor of 2 share a config."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def pick(key: tuple[Any, ...], candidates: list[Config], device: torch.device,
         run: Callable[[Config], object]) -> Config:
    """The config to use for ``key``: the only candidate, a cached choice, or the fastest."""
    if len(candidates) == 1 or not tuning_enabled(device):
        return candidates[0]
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        from triton.testing import do_bench

        best: tuple[float, Config] | None = None
        first_error: Exception | None = None
        for cfg in candidates:
            try:
                ms = float(do_bench(lambda cfg=cfg: run(cfg), warmup=5, rep=20,
                                    return_mode="median"))
            except Exception as exc:  # noqa: BLE001 - one candidate's compile/resource failure
                TUNING_LOG.append((key, cfg, None, f"{type(exc).__name__}: {exc}"[:300]))
                first_error = first_error or exc
                continue
            TUNING_LOG.append((key, cfg, ms, None))
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best is None:
            assert first_error is not None
            raise first_error
        _CACHE[key] = best[1]
        return best[1]
