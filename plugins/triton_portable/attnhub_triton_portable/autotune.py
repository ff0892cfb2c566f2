"""Pick a tile config per shape bucket: the table's entry, or the fastest candidate on a GPU.

Tuning runs once per key (arch, head dim, dtype, mask switches, length and batch buckets) on
the first call, times each candidate with ``triton.testing.do_bench`` and keeps the fastest.
A candidate that fails to compile (too much shared memory, an option the installed Triton
lacks) is recorded in ``TUNING_LOG`` with its error and skipped; if every one fails, the
first error is raised. ``ATTNHUB_TRITON_AUTOTUNE=0`` turns tuning off (table entries only).

Timing says nothing of whether a candidate is right, and some candidates (the Hopper Gluon
kernels) can only be tested on a GPU of their kind, with the Triton installed there. So a
winner other than the table's entry is kept only when its outputs on the tuning call agree
with the entry's (:func:`disagreement`); one that disagrees is logged, warned about and
passed over for the next fastest.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from attnhub.plugin import env_flag

Config = dict[str, Any]

_CACHE: dict[tuple[Any, ...], Config] = {}
_LOCK = threading.Lock()
#: (key, config, median ms or None, error or None) for every candidate timed so far.
TUNING_LOG: list[tuple[tuple[Any, ...], Config, float | None, str | None]] = []


def tuning_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and env_flag("ATTNHUB_TRITON_AUTOTUNE", True)


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

        timed: list[tuple[float, int]] = []
        first_error: Exception | None = None
        for i, cfg in enumerate(candidates):
            try:
                ms = float(do_bench(lambda cfg=cfg: run(cfg), warmup=5, rep=20,
                                    return_mode="median"))
            except Exception as exc:  # noqa: BLE001 - one candidate's compile/resource failure
                TUNING_LOG.append((key, cfg, None, f"{type(exc).__name__}: {exc}"[:300]))
                first_error = first_error or exc
                continue
            TUNING_LOG.append((key, cfg, ms, None))
            timed.append((ms, i))
        if not timed:
            assert first_error is not None
            raise first_error
        base = candidates[min(i for _, i in timed)]  # the table's entry, or the next that ran
        best = _first_agreeing(key, [candidates[i] for _, i in sorted(timed)], base, run)
        _CACHE[key] = best
        return best


def _first_agreeing(key: tuple[Any, ...], ranked: list[Config], base: Config,
                    run: Callable[[Config], object]) -> Config:
    """The fastest of ``ranked`` whose outputs on the tuning call agree with ``base``'s."""
    expected = None
    for cfg in ranked:
        if cfg is base:
            return cfg
        if expected is None:
            expected = run(base)
        why = disagreement(expected, run(cfg))
        if why is None:
            return cfg
        TUNING_LOG.append((key, cfg, None, f"not used: its outputs disagree with {base}: {why}"))
        warnings.warn(f"attnhub_triton_portable autotune: the config {cfg} was the fastest for "
                      f"{key} but its outputs disagree with the table entry {base} ({why}); "
                      "it is not used. Report it with your GPU and Triton version.",
                      RuntimeWarning, stacklevel=4)
    return base


def disagreement(expected: object, got: object, rtol: float = 2e-2) -> str | None:
    """Why ``got`` (a tensor or a tuple of them: a kernel's outputs) is not ``expected`` up to
    summation order, or None. Non-finite entries must sit in the same places with the same
    values (-inf LSE of a fully masked row); the finite rest must be within ``rtol`` in
    relative L2 (two correct bf16 kernels differ by ~1e-3; a wrong tile, by O(1))."""
    exp = expected if isinstance(expected, (tuple, list)) else (expected,)
    out = got if isinstance(got, (tuple, list)) else (got,)
    for i, (a, b) in enumerate(zip(exp, out)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            continue
        if a.shape != b.shape:
            return f"output {i}: shape {tuple(b.shape)}, expected {tuple(a.shape)}"
        a, b = a.float(), b.float()
        fin = torch.isfinite(a)
        if not torch.equal(fin, torch.isfinite(b)):
            return f"output {i}: non-finite entries in other places"
        if not torch.equal(a[~fin].nan_to_num(0.0), b[~fin].nan_to_num(0.0)):
            return f"output {i}: other infinities"
        err = float((a[fin] - b[fin]).norm() / a[fin].norm().clamp_min(1e-12))
        if err > rtol:
            return f"output {i}: relative L2 difference {err:.3g} > {rtol}"
    return None
