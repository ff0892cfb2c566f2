"""Whether FlashInfer's decode should use its tensor-core kernel, chosen from measurements.

FlashInfer's docs suggest tensor cores for large GQA groups, but on the H200 with 0.6.3 the
tensor-core decode ran at 0.30 TB/s against 2.21 TB/s for the CUDA-core one at 1 x 32k with
32/8 heads. So the choice is looked up in measured timings (``data/decode_tensor_cores.json``,
refreshed by ``benchmarks/nvidia_backends.py``): the nearest measured shape decides, and the
reason names the measurement. ``ATTNHUB_FLASHINFER_TENSOR_CORES=0|1`` forces it.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from importlib import resources
from typing import Any

ENV_FORCE = "ATTNHUB_FLASHINFER_TENSOR_CORES"


@dataclass(frozen=True)
class DecodeTiming:
    """One measured decode shape: microseconds with and without tensor cores."""

    gqa: int
    batch: int
    seqlen_k: int
    tensor_cores_us: float
    cuda_cores_us: float
    page_size: int = 16

    def distance(self, gqa: int, batch: int, seqlen_k: int) -> float:
        """GQA ratio first (it decides the kernel's work per KV byte), then log-shape."""
        return (4.0 * abs(math.log2(max(gqa, 1)) - math.log2(max(self.gqa, 1)))
                + abs(math.log2(max(batch, 1)) - math.log2(max(self.batch, 1)))
                + abs(math.log2(max(seqlen_k, 1)) - math.log2(max(self.seqlen_k, 1))))


@dataclass(frozen=True)
class Measurements:
    source: str
    rows: tuple[DecodeTiming, ...]


def parse_measurements(data: dict[str, Any]) -> Measurements:
    rows = tuple(DecodeTiming(**{k: r[k] for k in DecodeTiming.__dataclass_fields__ if k in r})
                 for r in data.get("rows", []))
    return Measurements(str(data.get("source", "?")), rows)


@functools.lru_cache(maxsize=1)
def packaged_measurements() -> Measurements:
    text = resources.files(__package__).joinpath("data/decode_tensor_cores.json").read_text()
    return parse_measurements(json.loads(text))


def choose_tensor_cores(gqa: int, batch: int, seqlen_k: int,
                        measured: Measurements | None = None) -> tuple[bool, str]:
    """(use_tensor_cores, why) for a decode of this GQA ratio and shape."""
    forced = os.environ.get(ENV_FORCE)
    if forced in ("0", "1"):
        return forced == "1", f"forced by {ENV_FORCE}={forced}"
    m = measured if measured is not None else packaged_measurements()
    if not m.rows:
        return False, "no decode measurements: CUDA-core kernel (the measured default)"
    row = min(m.rows, key=lambda r: r.distance(gqa, batch, seqlen_k))
    use = row.tensor_cores_us < row.cuda_cores_us
    return use, (f"{'tensor' if use else 'CUDA'} cores: nearest measured decode gqa={row.gqa} "
                 f"batch={row.batch} k={row.seqlen_k}: tensor cores {row.tensor_cores_us:.1f} us "
                 f"vs CUDA cores {row.cuda_cores_us:.1f} us ({m.source})")
