"""The Gluon paged FP8 decode pass (``GLUON_FP8_PAGED``, issue 16) beside the bf16 paged row
and the portable FP8 row, on the random table: GPU time (CUDA-graph replay) and eager time
(``do_bench``), relative L2 error vs fp32 over the bf16 pool, speedup vs the bf16 row of
the same run. Cells: 64 x 32k, 1 x 128k, 32 x 4k (32 query / 8 KV heads, d128, page 16).
The Gluon rows: the software-pipelined
pass (``prefetch_pages``: the next tile's K and V in registers before this tile is used)
as built and capped at 168 registers (what ``gluon_fp8_row`` bound before), and the cp.async ring
(``fp8_ring``: K and V tiles through shared memory, ring - 1 tiles in flight) of 2, 4 and 8
slots, with 32-key tiles, and at twice the splits, each planned for the programs per SM its
registers and shared memory allow (``resident``); a variant that fails or is refused is
recorded as a result. The JSON is rewritten after every row, so a run cut short keeps what it
measured.

    python benchmarks/decode_fp8_gluon.py --out $OUT [--smoke]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from attnhub_triton_portable.decode_configs import GLUON_FP8_PAGED, choose_splits, decode_config
from triton_decode import (HKV, ROOT, SMOKE, PagedCase, eager_us, est, gpu_us, kv_bytes,
                           source_commit, sweep_setup)

CELLS = [(2, 64), (1, 128)] if SMOKE else [(64, 32768), (1, 131072), (32, 4096)]


def resident(regs: int) -> int:
    """One-warp programs an SM holds at ``regs`` registers per thread: registers are given to
    warps in units of 256 within one of the SM's 4 sub-partitions (16384 each), so 4 x
    floor(16384 / (32 x regs rounded up to 8)) (cuda_occupancy.h), not 65536 / (32 x regs):
    12 up to 168 registers, 8 up to 255. Register counts: the Triton 3.6 sm90 build
    (benchmarks/gluon_decode_sm90_offline.py, page 16, several splits)."""
    return 4 * (16384 // (32 * (-(-regs // 8) * 8)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/fp8_gluon")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", nargs="*", default=[], help="only these rows (default: all)")
    args = ap.parse_args()
    t0 = time.time()
    out, gpu, sms, arch = sweep_setup(args.out)
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "gpu": gpu, "sm_count": sms, "commit": source_commit(ROOT),
        "gluon": repr(GLUON_FP8_PAGED), "cells": []}
    path = out / "fp8_gluon.json"

    def save() -> None:
        res["seconds"] = time.time() - t0
        path.write_text(json.dumps(res, indent=1))

    for batch, ctx in CELLS:
        c = PagedCase(batch, ctx, fp8=True)
        e, nbytes = est(batch, ctx), kv_bytes(batch, ctx)
        ref = c.reference("random")
        cell: dict[str, Any] = {"batch": batch, "ctx": ctx, "rows": []}
        res["cells"].append(cell)
        bf16 = decode_config(arch, paged=True, programs=(batch * HKV, sms))
        row8 = decode_config(arch, paged=True, kv_fp8=True)
        pre = GLUON_FP8_PAGED.with_(prefetch_pages=True)
        ring = GLUON_FP8_PAGED.with_(ctas_per_sm=resident(163))
        rows = [("bf16", False, bf16, None), ("fp8_row", True, row8, None),
                # software-pipelined: the next tile's K / V in flight (203 registers), the
                # same capped at 168 (12 per SM): the rows gluon_fp8_row bound before the ring
                ("gluon_pre", True, pre.with_(ctas_per_sm=resident(203)), None),
                ("gluon_pre_r168", True, pre.with_(maxnreg=168, ctas_per_sm=resident(168)),
                 None),
                # the cp.async ring (155-163 registers: 12 per SM by registers; 8 KB of
                # shared memory per 2 slots of 16-key tiles: 8 slots fit 7 per SM), 32-key
                # tiles in a 4-slot ring (170-172 registers, 32 KB: 7 per SM), and the
                # 4-slot ring at twice the splits
                ("gluon_ring2", True, ring.with_(fp8_ring=2), None),
                ("gluon_ring4", True, ring.with_(fp8_ring=4), None),
                ("gluon_ring8", True, ring.with_(fp8_ring=8, ctas_per_sm=7), None),
                ("gluon_ring4_n32", True, ring.with_(fp8_ring=4, block_n=32, ctas_per_sm=7),
                 None),
                ("gluon_ring4_twice_splits", True, ring.with_(fp8_ring=4),
                 2 * choose_splits(batch, HKV, ctx, sms, ring)),
                # two slots capped at 128 registers: 16 programs per SM, 29 spill loads and
                # stores per tile in the sm90 build
                ("gluon_ring2_r128", True, ring.with_(fp8_ring=2, maxnreg=128,
                                                      ctas_per_sm=resident(128)), None)]
        rows = [r for r in rows if not args.rows or r[0] in args.rows]
        for name, fp8, cfg, splits in rows:
            splits = splits or choose_splits(batch, HKV, ctx, sms, cfg)
            r: dict[str, Any] = {"name": name, "splits": splits, "config": repr(cfg)}
            try:
                fn = c.ours("random", fp8=fp8, config=cfg, num_splits=splits)
                o = fn()[0]
                r["rel_err"] = float((o.float() - ref).norm() / ref.norm())
                r["gpu_us"] = gpu_us([fn], e)
                r["eager_us"] = eager_us(fn)
                r["TBps_bf16_equiv"] = nbytes / r["gpu_us"] / 1e6
                if cell["rows"] and "gpu_us" in cell["rows"][0]:
                    r["speedup_vs_bf16"] = cell["rows"][0]["gpu_us"] / r["gpu_us"]
            except Exception as exc:  # noqa: BLE001  (a variant that fails is a result)
                r["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            cell["rows"].append(r)
            print(batch, ctx, json.dumps(r), flush=True)
            save()
        del c, ref
        if not SMOKE:
            torch.cuda.empty_cache()
    print("done", time.time() - t0, flush=True)


if __name__ == "__main__":
    main()
