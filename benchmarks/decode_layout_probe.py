"""Where paged decode's last percent goes (issue 16, 1 x 128k): layout, paging, splits, merge.

One sequence, 32 query / 8 KV heads, d128, bf16, page 16. Per cell, GPU time (CUDA-graph
replay, ``triton_decode.gpu_us``) and the FlashAttention-rule check of:

* ``row``: the shipped call (no config), random and sequential page tables;
* ``hnd``: the same pages stored head-major (each (page, head) 4 KB contiguous; NHD, the
  usual serving layout, interleaves the 8 heads' 256-byte rows), same config and splits;
* ``contig_bshd`` / ``contig_bhsd``: no pages at all, the same config and splits, the cache
  token-major (the NHD of one sequence) and head-major (SDPA's layout);
* split counts and tile configs around the row's;
* the CUDA profiler's per-kernel device time of ``row`` and of SDPA on a gathered
  contiguous copy (what splits, merges and gaps cost).

    python benchmarks/decode_layout_probe.py --json $OUT/dprobe.json [--smoke]
    python benchmarks/decode_layout_probe.py --replot dprobe.json   # its chart again

The chart (``--json``'s path with ``.png``) puts each variant's TB/s beside the card's copy
ceiling, one panel per cell.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from attnhub_triton_portable.decode_configs import choose_splits, decode_config
from triton_decode import (
    D, HKV, PAGE, SCALE, SMOKE, PagedCase, ceilings, decode_attention, est, fa_rule,
    gpu_us, kv_bytes, source_commit, sweep_setup,
)

CELLS = [(1, 256)] if SMOKE else [(1, 131072), (1, 32768)]
#: tile variants on the row: (name, config changes, split counts; None = the row's)
TILES = [
    ("row", {}, [None, 32, 31, 34]),
    ("w8", {"num_warps": 8}, [None]),
    ("n128_w8_s2", {"block_n": 128, "num_warps": 8, "num_stages": 2}, [None]),
    ("s2", {"num_stages": 2}, [None, 49]),
]


def head_major(x: torch.Tensor) -> torch.Tensor:
    """The same values stored (N, heads, S, d), viewed as (N, S, heads, d)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def profile(fn: Callable[[], Any], calls: int = 10) -> dict[str, float]:
    """Mean device time per call of each kernel ``fn`` launches (us), from the profiler."""
    if SMOKE:
        return {}
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in p.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t > 0 and e.count >= calls:
            out[e.key[:90]] = t / calls
    return out


def run(name: str, fn: Callable[[], Any], ref: torch.Tensor, base: torch.Tensor,
        nbytes: int, e: float) -> dict[str, Any]:
    r: dict[str, Any] = {"name": name}
    try:
        o = fn()
        r.update(fa_rule(o[0] if isinstance(o, tuple) else o, ref, base))
        r["gpu_us"] = gpu_us([fn], e)
        r["TBps"] = nbytes / r["gpu_us"] / 1e6
    except Exception as exc:  # noqa: BLE001  (a variant that fails is a result)
        r["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(json.dumps(r), flush=True)
    return r


def cell(batch: int, ctx: int, sms: int, arch: str) -> dict[str, Any]:
    c = PagedCase(batch, ctx, fp8=False)
    e, nbytes = est(batch, ctx), kv_bytes(batch, ctx)
    ref = c.reference("random")
    sdpa = c.sdpa_contiguous("random")
    base = sdpa()
    row = decode_config(arch, paged=True, programs=(batch * HKV, sms))
    splits = choose_splits(batch, HKV, ctx, sms, row)
    res: dict[str, Any] = {"batch": batch, "ctx": ctx, "row": repr(row), "row_splits": splits,
                           "runs": []}
    add = res["runs"].append
    add(run("sdpa_contiguous", sdpa, ref, base, nbytes, e))
    add(run("row/random", c.ours("random"), ref, base, nbytes, e))
    add(run("row/sequential", c.ours("sequential"), ref, base, nbytes, e))
    kw = {"config": row, "num_splits": splits}

    def cache(name: str, k: torch.Tensor, v: torch.Tensor, **paging: Any) -> None:
        add(run(name, lambda: decode_attention(c.q, k, v, scale=SCALE, **paging, **kw), ref,
                base, nbytes, e))

    t = c.tables["random"]
    cache("hnd/random", head_major(c.kc), head_major(c.vc), block_table=t,
          seqlens_k=c.seqlens, max_seqlen_k=ctx)
    pages = t.long()
    k_tok, v_tok = c.kc[pages].flatten(1, 2), c.vc[pages].flatten(1, 2)  # (B, S, Hkv, D)
    cache("contig_bshd", k_tok, v_tok)
    cache("contig_bhsd", head_major(k_tok), head_major(v_tok))
    del k_tok, v_tok
    for name, changes, counts in TILES:
        cfg = row.with_(**changes)
        for s in counts:
            s = s or choose_splits(batch, HKV, ctx, sms, cfg)
            if name == "row" and s == splits:
                continue
            add(run(f"{name}@{s}/random", c.ours("random", config=cfg, num_splits=s), ref,
                    base, nbytes, e))
    res["profile_row"] = profile(c.ours("random"))
    res["profile_sdpa"] = profile(sdpa)
    print(json.dumps({k: res[k] for k in ("profile_row", "profile_sdpa")}), flush=True)
    return res


def plot(doc: dict[str, Any], path: Path) -> None:
    """Each variant's TB/s, one panel per cell, the copy ceiling as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = doc["cells"]
    fig, axes = plt.subplots(1, len(cells), figsize=(6 * len(cells), 4.5), squeeze=False)
    for ax, c in zip(axes[0], cells):
        runs = [r for r in c["runs"] if "TBps" in r]
        ax.barh([r["name"] for r in runs], [r["TBps"] for r in runs],
                color=["tab:gray" if r["name"].startswith("sdpa") else "tab:blue" for r in runs])
        ax.axvline(doc["ceilings"]["copy_rw_TBps"], color="tab:red", ls="--")
        ax.invert_yaxis()
        ax.set_xlabel("TB/s (KV bytes / GPU time); red: the card's copy ceiling")
        ax.set_title(f"{c['batch']} x {c['ctx'] // 1024}k, page {doc['page']}")
    fig.suptitle(f"paged decode variants, {doc['gpu']}, {doc['commit']}, {doc['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--replot", help="draw the chart of this JSON again, measure nothing")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.replot:
        plot(json.loads(Path(a.replot).read_text()), Path(a.replot).with_suffix(".png"))
        return
    if not a.json:
        ap.error("--json PATH (where the results go) or --replot JSON")
    out, gpu, sms, arch = sweep_setup(str(Path(a.json).parent))
    doc: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="minutes"), "gpu": gpu, "sm_count": sms, "commit": source_commit(),
        "torch": torch.__version__, "heads": [32, HKV], "d": D, "page": PAGE,
        "ceilings": ceilings(), "cells": []}
    print(json.dumps(doc["ceilings"]), flush=True)
    for batch, ctx in CELLS:
        doc["cells"].append(cell(batch, ctx, sms, arch))
        Path(a.json).write_text(json.dumps(doc, indent=1))
    plot(doc, Path(a.json).with_suffix(".png"))


if __name__ == "__main__":
    main()
