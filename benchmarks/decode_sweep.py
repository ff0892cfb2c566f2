"""One-run sweep of paged decode variants (issue 16): bf16 and FP8 (e4m3) caches, page 16.

Cells: 1 x 32k, 1 x 128k, 64 x 32k (32 query / 8 KV heads, d=128), random page table (the
table config also on a sequential one). Per variant and split count: GPU time (CUDA-graph
replay, ``triton_decode.gpu_us``) and the output check (FlashAttention rule for bf16,
relative L2 error vs fp32 for FP8). Then, per cell, eager time with host work included
(``triton.testing.do_bench`` median, L2 flushed) through ``Hub.attention(layout="paged")``
for the table config and for the fastest variant of the cell, beside raw SDPA over a
gathered contiguous copy of the same KV. Every result line is printed and the JSON is
rewritten after each cell (``--out``), so a run cut short still returns what it measured.

    python benchmarks/decode_sweep.py --out $OUT [--budget 200] [--smoke]

``--smoke``: tiny shapes under Triton's CPU interpreter (checks the script, times nothing
meaningful). FlashInfer is not timed here: its first paged decode call compiles ~90 s.
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
if "--smoke" in sys.argv:  # before anything imports Triton (as triton_decode does)
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from attnhub_triton_portable import decode, decode_configs
from attnhub_triton_portable.decode_configs import choose_splits, decode_config
from triton_decode import (
    HKV,
    ROOT,
    SMOKE,
    PagedCase,
    eager_us,
    est,
    fa_rule,
    gpu_us,
    kv_bytes,
    source_commit,
)

CELLS = [(1, 64), (2, 32)] if SMOKE else [(64, 32768), (1, 32768), (1, 131072)]
#: bf16 variants on top of the paged table row the cell gets: (name, config changes).
BF16 = [
    ("row", {}),
    ("s4", {"num_stages": 4}),
    ("s3", {"num_stages": 3}),
    ("merge2", {"merge_chunks": 2}),
    ("merge4", {"merge_chunks": 4}),
    ("merge8", {"merge_chunks": 8}),
    ("no_prefetch", {"prefetch_pages": False}),
    ("fused", {"fused_merge": True}),
]
#: FP8 variants on top of the FP8 paged row.
FP8 = [
    ("row", {}),
    ("q", {"fp8_dot": "q"}),
    ("ahead", {"fp8_v_ahead": True}),
    ("ahead_n64", {"fp8_v_ahead": True, "block_n": 64}),
    ("ahead_s3", {"fp8_v_ahead": True, "num_stages": 3}),
    ("ahead_w8", {"fp8_v_ahead": True, "num_warps": 8}),
    ("ahead_n256_w8", {"fp8_v_ahead": True, "block_n": 256, "num_warps": 8,
                       "num_stages": 3}),
    ("ahead_n64_merge4", {"fp8_v_ahead": True, "block_n": 64, "merge_chunks": 4}),
]


def splits_for(batch: int, ctx: int, sms: int, cfg: decode_configs.DecodeConfig) -> list[int]:
    """The heuristic's split count, plus alternatives at batch 1 (where splits matter)."""
    s0 = choose_splits(batch, HKV, ctx, sms, cfg)
    if batch > 1:
        return [s0]
    alts = {2, 4} if SMOKE else {64, 128}
    return sorted(alts | {s0})


_ROWS = (decode_configs._PAGED, decode_configs._PAGED_FEW, decode_configs._FP8_PAGED)
_SAVED = [dict(r) for r in _ROWS]


def patch_rows(bf16: decode_configs.DecodeConfig | None,
               fp8: decode_configs.DecodeConfig | None) -> None:
    """Make the arch's paged rows ``bf16``/``fp8`` for the hub's own calls; (None, None):
    back to the table's."""
    fam = "cpu" if SMOKE else "sm90"
    if bf16 is None and fp8 is None:
        for row, saved in zip(_ROWS, _SAVED):
            row.clear()
            row.update(saved)
    if bf16 is not None:
        decode_configs._PAGED[fam] = decode_configs._PAGED_FEW[fam] = bf16
    if fp8 is not None:
        decode_configs._FP8_PAGED[fam] = fp8
    decode._plan.cache_clear()
    decode._shapes.clear()


def hub_times(hub: Any, c: PagedCase, ev: dict[str, Any], tag: str) -> None:
    """Eager us through ``Hub.attention(layout="paged")`` (random table): bf16 as the policy
    binds it and forced to ``triton_decode``, and the e4m3 cache on ``triton_decode_fp8``."""
    kw = {"layout": "paged", "block_table": c.tables["random"], "seqlens_k": c.seqlens}
    f8 = {"k_descale": c.kd, "v_descale": c.vd}
    bf16 = lambda: hub.attention(c.q, c.kc, c.vc, **kw)
    forced = lambda: hub.attention(c.q, c.kc, c.vc, backend="triton_decode", **kw)
    fp8 = lambda: hub.attention(c.q, c.k8, c.v8, backend="triton_decode_fp8", extra=f8, **kw)
    for name, fn in (("", bf16), ("forced_", forced), ("fp8_", fp8)):
        fn()  # first call binds and compiles
        ev[f"hub_{name}{tag}_us"] = eager_us(fn)


def measure(c: PagedCase, fn: Any, ref: torch.Tensor, sdpa_out: torch.Tensor | None,
            e: float) -> dict[str, Any]:
    o = fn()[0]
    chk: dict[str, Any]
    if sdpa_out is None:
        chk = {"rel_err": float((o.float() - ref).norm() / ref.norm())}
    else:
        chk = {"ok": fa_rule(o, ref, sdpa_out)["ok"]}
    return {"gpu_us": gpu_us([fn], e), **chk}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/decode_sweep")
    ap.add_argument("--budget", type=float, default=200.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows-only", action="store_true",
                    help="only the table rows (a confirming run): no variants")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if SMOKE:
        gpu, sms, arch = "CPU interpreter", 4, "cpu"
    else:
        props = torch.cuda.get_device_properties(0)
        gpu, sms, arch = props.name, props.multi_processor_count, f"sm{props.major}{props.minor}"
    import triton

    from attnhub import Hub

    base = decode_config(arch, paged=True)  # per cell below: the row the table gives it
    base8 = decode_config(arch, paged=True, kv_fp8=True)
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "gpu": gpu, "sm_count": sms, "commit": args.commit or source_commit(ROOT), "torch": torch.__version__,
        "triton": triton.__version__, "row": repr(base), "row_fp8": repr(base8),
        "cells": []}
    print(json.dumps({k: v for k, v in res.items() if k != "cells"}), flush=True)
    hub = Hub()
    for i, (batch, ctx) in enumerate(CELLS):
        # each cell gets an equal share of what is left of the budget for its variants
        deadline = time.time() + (t0 + args.budget - time.time()) / (len(CELLS) - i)
        c = PagedCase(batch, ctx)
        base = decode_config(arch, paged=True, programs=(batch * HKV, sms))
        e, nbytes = est(batch, ctx), kv_bytes(batch, ctx)
        cell: dict[str, Any] = {"batch": batch, "ctx": ctx, "row": repr(base), "bf16": [],
                                "fp8": []}
        refs = {t: c.reference(t) for t in ("random", "sequential")}
        for table in ("sequential", "random"):
            sd = c.sdpa_contiguous(table)
            cell[f"sdpa_{table}_gpu_us"] = gpu_us([sd], e)
            cell[f"row_{table}"] = measure(c, c.ours(table), refs[table],
                                           sd().transpose(1, 2), e)
        sdpa_out = c.sdpa_contiguous("random")().transpose(1, 2)
        print(json.dumps({k: v for k, v in cell.items() if k not in ("bf16", "fp8")}),
              flush=True)
        for name, changes in BF16 if not args.rows_only else BF16[:1]:
            cfg = base.with_(**changes)
            for s in splits_for(batch, ctx, sms, cfg):
                if time.time() > deadline:
                    break
                r = {"name": name, "splits": s}
                try:
                    r.update(measure(c, c.ours("random", config=cfg, num_splits=s),
                                     refs["random"], sdpa_out, e))
                    r["TBps"] = nbytes / r["gpu_us"] / 1e6
                except Exception as exc:  # noqa: BLE001  (a variant that fails to compile is a result)
                    r["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                cell["bf16"].append(r)
                print("bf16", batch, ctx, json.dumps(r), flush=True)
        for name, changes in FP8 if not args.rows_only else FP8[:1]:
            cfg = base8.with_(**changes)
            for s in splits_for(batch, ctx, sms, cfg)[:1] if batch > 1 else [
                    choose_splits(batch, HKV, ctx, sms, cfg)]:
                if time.time() > deadline:
                    break
                r = {"name": name, "splits": s}
                try:
                    r.update(measure(c, c.ours("random", fp8=True, config=cfg, num_splits=s),
                                     refs["random"], None, e / 2))
                    r["bf16_equiv_TBps"] = nbytes / r["gpu_us"] / 1e6
                except Exception as exc:  # noqa: BLE001
                    r["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                cell["fp8"].append(r)
                print("fp8", batch, ctx, json.dumps(r), flush=True)
        # eager, host included, through the hub: table rows, then the cell's best variants
        ev: dict[str, Any] = {"sdpa_contiguous_us": eager_us(c.sdpa_contiguous("random"))}

        hub_times(hub, c, ev, "row")
        best = {k: min((r for r in cell[k] if "gpu_us" in r and r.get("ok", True)
                        and r.get("rel_err", 0) < 0.08), key=lambda r: r["gpu_us"],
                       default=None)
                for k in ("bf16", "fp8")}
        ev["best"] = best
        if best["bf16"] and best["fp8"] and time.time() < deadline + 30 and not args.rows_only:
            cfg = base.with_(**dict(BF16)[best["bf16"]["name"]])
            cfg8 = base8.with_(**dict(FP8)[best["fp8"]["name"]])
            ev["kernel_best_forced_splits_us"] = eager_us(
                c.ours("random", config=cfg, num_splits=best["bf16"]["splits"]))
            ev["kernel_fp8_best_forced_splits_us"] = eager_us(
                c.ours("random", fp8=True, config=cfg8, num_splits=best["fp8"]["splits"]))
            patch_rows(cfg, cfg8)
            ev["best_rows_splits"] = [choose_splits(batch, HKV, ctx, sms, cfg),
                                      choose_splits(batch, HKV, ctx, sms, cfg8)]
            hub_times(hub, c, ev, "best_rows")
            patch_rows(None, None)
        cell["eager"] = ev
        print("eager", batch, ctx, json.dumps(ev), flush=True)
        res["cells"].append(cell)
        res["seconds"] = time.time() - t0
        (out / "decode_sweep.json").write_text(json.dumps(res, indent=1))
        del c
        if not SMOKE:
            torch.cuda.empty_cache()
    print("done", time.time() - t0, flush=True)


if __name__ == "__main__":
    main()
