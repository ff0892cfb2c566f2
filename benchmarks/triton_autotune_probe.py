"""Which forward config the triton backend's autotuning picks for a cell, and the cell's time
through ``attnhub.attention`` (backend forced), on the GPU: the candidates' own timings from
``autotune.TUNING_LOG`` beside the public-API figure (CUDA events, median of 20).

    python3 benchmarks/triton_autotune_probe.py [--cells window full causal]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import attnhub

CELLS = {"window": {"causal": True, "window": (4096, 0)}, "full": {}, "causal": {"causal": True}}


def visible_pairs(s: int, kw: dict) -> int:
    if not kw.get("causal"):
        return s * s
    left = kw.get("window", (-1, 0))[0]
    return sum(min(i + 1, left + 1) if left >= 0 else i + 1 for i in range(s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    ap.add_argument("--seqlen", type=int, default=16384)
    a = ap.parse_args()
    from attnhub_triton_portable import autotune

    hub = attnhub.Hub()
    s, hq, hkv, d = a.seqlen, 32, 8, 128
    q = torch.randn(1, s, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, s, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for name in a.cells:
        kw = CELLS[name]
        n0 = len(autotune.TUNING_LOG)
        hub.attention(q, k, v, backend="triton", **kw)
        for _key, cfg, ms, err in autotune.TUNING_LOG[n0:]:
            tag = {x: cfg[x] for x in ("BLOCK_M", "BLOCK_N", "GLUON", "WS", "PINGPONG",
                                       "KV_STAGES", "P_SMEM", "num_warps") if x in cfg}
            print(f"  {name} candidate {tag}: {ms if ms is None else round(ms, 3)} ms {err or ''}",
                  flush=True)
        ts = []
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            hub.attention(q, k, v, backend="triton", **kw)
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        ms = statistics.median(ts)
        tf = 4 * visible_pairs(s, kw) * hq * d / (ms * 1e-3) / 1e12
        print(f"{name}: attnhub.attention(backend='triton') {ms:.3f} ms = {tf:.0f} TFLOP/s",
              flush=True)


if __name__ == "__main__":
    main()
