"""Timing that means the same thing on a CPU and a GPU.

GPU work is asynchronous: a wall clock around a launch measures the launch. ``Stopwatch``
synchronises before reading the clock; ``median_ms`` times each repeat with CUDA events on a
GPU (``perf_counter`` on the CPU) after warm-up runs, and reports the median, which one slow
repeat (a compile, a clock change) does not move. ``interleaved_ms`` times several callables
so that their figures compare: in turn within every repeat, and short calls in batches.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import subprocess
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work on ``device`` (no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """``with Stopwatch(device) as sw: ...`` then ``sw.seconds`` (GPU work included)."""

    def __init__(self, device: torch.device | str):
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        synchronize(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0


def median_ms(fn: Callable[[], object], device: torch.device | str, *, warmup: int = 3,
              repeats: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs, each
    from an idle device (``sample_ms``)."""
    for _ in range(warmup):
        fn()
    return statistics.median(sample_ms(fn, device) for _ in range(repeats))


def sample_ms(fn: Callable[[], object], device: torch.device | str, calls: int = 1) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls of ``fn``, from an idle device
    (synchronised first) to the end of the last one: CUDA events on a GPU (host time counts
    wherever the GPU waits for it), ``perf_counter`` on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3 / calls


@dataclass
class Interleaved:
    """``ms``: per callable, the median ms per call (the minimum over rounds); ``batch``:
    the calls per timed sample (the same for every callable of one measurement)."""

    ms: dict[Hashable, float]
    batch: int


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``range(n)`` in which every index follows every other equally often (a
    Williams design: n rows for even n, 2n for odd n): over a cycle of rows no callable
    gets a favoured predecessor, which a random draw can give it by chance, the same in
    every run of a seeded draw."""
    if n <= 1:
        return [list(range(n))]
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in base] for i in range(n)]
    return rows + [r[::-1] for r in rows] if n % 2 else rows


def interleaved_ms(fns: Mapping[Hashable, Callable[[], object]], device: torch.device | str, *,
                   warmup: int = 3, repeats: int = 20, rounds: int = 2,
                   batch_below_ms: float = 0.1, batch_ms: float = 0.5,
                   max_batch: int = 64, drop_above: float | None = None,
                   skip_above: float | None = None, paired: bool = False) -> Interleaved:
    """Time several callables so that two of them running the same kernel get the same
    figure: each repeat takes one sample of every callable in turn, in the next order of a
    :func:`balanced_orders` cycle (callables shuffled onto its indices each round), so a
    clock, thermal or co-tenant change hits all alike and every callable follows every other
    equally often. (A rotating order keeps every callable's predecessor fixed: on the H200
    the backend forced right after the policy's call of the same kernel timed 5-14% faster
    than that call, from the caches it left warm.) When the fastest
    single call is under ``batch_below_ms``, a sample is a batch of back-to-back calls
    lasting about ``batch_ms`` (the same count for all), so launch jitter of a few
    microseconds averages out instead of deciding a ratio.
    No cache flush between calls, for every callable alike (inputs stay where the previous
    call left them, as in a model's step). Median of ``repeats`` samples, min over
    ``rounds``. ``drop_above``: after a round, a callable slower than that many times the
    fastest keeps its figure and is not timed again: a call 50x slower than the rest takes
    most of a round's time, and whatever clock or heat change it causes lands on the calls
    that follow it. ``skip_above``: a callable whose calibration calls (three single calls,
    the fastest kept) took over that many times the fastest callable's keeps that figure
    and sits out every round (a 50 ms call per new shape leaves the GPU idle and its clocks
    low for whatever is timed next).

    ``paired``: each repeat's samples are read against that repeat's reference, the median
    of its samples over the callables, and a callable's figure is the median of its ratios
    to the reference times the median reference. The callables of one repeat run back to
    back, so whatever moves them all alike (the lengths of a walk that grows call by call,
    a clock change) cancels in the ratios instead of in the ranks of a wide distribution,
    where a few slow samples move the median by a few percent."""
    names = list(fns)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    batch = 1
    best: dict[Hashable, float] = {}
    if names:
        single = {n: min(sample_ms(fns[n], device) for _ in range(3)) for n in names}
        one = min(single.values())
        if skip_above is not None:
            best = {n: t for n, t in single.items() if t > skip_above * one}
            names = [n for n in names if n not in best]
        if one < batch_below_ms:
            batch = max(1, min(max_batch, math.ceil(batch_ms / max(one, 1e-6))))
    rng = random.Random(0)
    for i in range(rounds):
        if drop_above is not None and i:
            fastest = min(best.values())
            names = [n for n in names if best[n] <= drop_above * fastest]
        samples: dict[Hashable, list[float]] = {n: [] for n in names}
        labels = names[:]
        rng.shuffle(labels)
        orders = balanced_orders(len(labels))
        for r in range(max(1, repeats)):
            for i in orders[r % len(orders)]:
                n = labels[i]
                samples[n].append(sample_ms(fns[n], device, batch))
        figures = _paired(samples) if paired else {
            n: statistics.median(samples[n]) for n in names}
        for n in names:
            best[n] = min(best.get(n, math.inf), figures[n])
    return Interleaved(best, batch)


def _paired(samples: Mapping[Hashable, list[float]]) -> dict[Hashable, float]:
    """Per callable: the median of its ratios to each repeat's reference (the median
    sample of that repeat), times the median reference (see ``interleaved_ms``)."""
    names = list(samples)
    refs = [statistics.median(samples[n][r] for n in names)
            for r in range(len(samples[names[0]]))] if names else []
    scale = statistics.median(refs) if refs else 0.0
    return {n: scale * statistics.median(s / max(ref, 1e-12)
                                         for s, ref in zip(samples[n], refs))
            for n in names}


class CallClock:
    """Accumulates the time of the calls it wraps (``clock(fn)``): CUDA events on a GPU, so
    timing adds no synchronisation to the step it sits in; ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.reset()

    def reset(self) -> None:
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._cpu = 0.0

    def __call__(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self._events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = fn()
        self._cpu += time.perf_counter() - t0
        return out

    def seconds(self) -> float:
        """Total time of the wrapped calls so far (waits for the GPU)."""
        synchronize(self.device)
        return self._cpu + sum(s.elapsed_time(e) for s, e in self._events) / 1e3


def source_commit(root: str | os.PathLike[str] | None = None) -> str:
    """The commit a measurement ran: ``$COMMIT`` when set (``benchmarks/gpu_session.sh`` sets
    it: a device's copy of the tree may carry stale git metadata), else ``git rev-parse`` in
    ``root``, else ``"unknown"``."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                             capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"
