"""One-run sweep of paged decode variants (issue 16): split counts and tiles, bf16 cache, page 16.

Cells: 1 x 32k, 1 x 128k (the few-programs row), 64 x 32k and 32 x 4k (the paged row), 32
query / 8 KV heads, d=128, random page table (the table row, and the fastest variants of a
one-sequence cell, also on a sequential one). Per variant and split count: GPU time
(CUDA-graph replay, ``triton_decode.gpu_us``) and the FlashAttention-rule check against
fp32. A one-sequence cell tries, per tile config, the split counts that make one round of
1, 2, ... programs per SM (as many as its binary fits) and those that fill whole waves
(``programs = splits x 8`` a multiple of ``132 x programs per SM``), beside 64/128; a
many-sequence cell tries variants of the 4-stage paged row (its own row is timed first).
Then, per cell, eager time with host work included (``triton.testing.do_bench`` median, L2
flushed) through ``Hub.attention(layout="paged")`` and for the fastest variant's kernel
call, beside raw SDPA over a gathered contiguous copy of the same KV. Every compiled split
kernel's shared memory, registers and spills are recorded (``kernels``), so that programs
per SM follow from the binary rather than from arithmetic. Every result line is printed
and the JSON is rewritten after each cell (``--out``), so a run cut short still returns
what it measured. ``--fp8`` adds the e4m3-cache variants of the FP8 row (GPU time, relative
L2 error vs fp32) and its hub eager time.

    python benchmarks/decode_sweep.py --out $OUT [--budget 230] [--fp8] [--smoke]

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
from attnhub_triton_portable import decode
from attnhub_triton_portable.decode_configs import DecodeConfig, choose_splits, decode_config
from triton_decode import (
    ceilings,
    sweep_setup,
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

#: (batch, context, share of the time budget)
CELLS = ([(1, 256, 0.4), (1, 128, 0.3), (4, 64, 0.3)] if SMOKE else
         [(1, 32768, 0.33), (1, 131072, 0.33), (64, 32768, 0.17), (32, 4096, 0.17)])
#: One-sequence cells, on top of the few-programs row: (name, config changes, programs per
#: SM that its sm90 binary fits: shared memory and registers, sweep 3's ``kernels``).
FEW = [
    ("row", {}, 3),
    ("nopdl", {"pdl": False}, 3),
    ("s4", {"num_stages": 4}, 2),
    ("w2", {"num_warps": 2}, 3),
    ("mw8", {"merge_warps": 8}, 3),
    ("s2", {"num_stages": 2}, 4),
    ("n32_s3_w2", {"block_n": 32, "num_stages": 3, "num_warps": 2}, 6),
    ("n32_s4_w2", {"block_n": 32, "num_stages": 4, "num_warps": 2}, 4),
    ("n128_s2_w8", {"block_n": 128, "num_stages": 2, "num_warps": 8}, 2),
    ("n128_s3_w8", {"block_n": 128, "num_stages": 3, "num_warps": 8}, 1),
]
#: Many-sequence cells, on top of the 4-stage paged row: (name, changes, split counts;
#: None: the heuristic's).
MANY = [
    ("paged", {}, [None, 1, 2, 4]),
    ("nopdl", {"pdl": False}, [None]),
    ("s3", {"num_stages": 3}, [1, 2]),
    ("s5", {"num_stages": 5}, [1, 2]),
    ("no_prefetch", {"prefetch_pages": False}, [None]),
    ("w8", {"num_warps": 8}, [None]),
]
#: FP8 variants on top of the FP8 paged row (``--fp8``).
FP8 = [
    ("row", {}),
    ("q", {"fp8_dot": "q"}),
    ("ahead_n64", {"block_n": 64}),
    ("ahead_w8", {"num_warps": 8}),
]


def wave_splits(ctx: int, cfg: DecodeConfig, per_sm: int, sms: int) -> list[int]:
    """Split counts of a one-sequence cell (8 KV heads): one round of 1..``per_sm``
    programs per SM, whole waves of ``per_sm`` per SM, at least two key tiles a split; then
    64 and 128 (earlier rows)."""
    tiles = -(-ctx // cfg.block_n)
    if SMOKE:
        return sorted({2, 3, 4} & set(range(1, tiles + 1)))
    wave = sms * per_sm
    rounds = [sms * k // HKV for k in range(1, per_sm + 1)]
    whole = [p // HKV for p in range(wave, 264 * HKV + 1, wave) if p % HKV == 0]
    ss = sorted({s for s in rounds + whole if s * 2 <= tiles})
    return ss + [s for s in (64, 128) if s not in ss]


def kernel_info() -> list[dict[str, Any]]:
    """Shared memory, registers and spills of every split kernel compiled so far."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for shape in list(decode._shapes.values()):
        for launches in list(shape.by_splits.values()):
            tail = launches.split_tail
            consts = dict(zip(launches.split.fn.arg_names[-len(tail):], tail))
            for kern in launches.split._bins.values():  # device -> CompiledKernel
                md = kern.metadata
                key = (tuple(sorted(launches.split.options.items())), consts["BLOCK_N"],
                       consts["PREFETCH"], md.shared)
                seen[key] = {**launches.split.options, "block_n": consts["BLOCK_N"],
                             "prefetch": consts["PREFETCH"], "pdl": consts["GDC"],
                             "shared": md.shared,
                             "regs": getattr(kern, "n_regs", None),
                             "spills": getattr(kern, "n_spills", None)}
    return list(seen.values())


def check(c: PagedCase, fn: Any, ref: torch.Tensor, sdpa_out: torch.Tensor | None,
          e: float) -> dict[str, Any]:
    o = fn()[0]
    chk: dict[str, Any]
    if sdpa_out is None:
        chk = {"rel_err": float((o.float() - ref).norm() / ref.norm())}
    else:
        chk = {"ok": fa_rule(o, ref, sdpa_out)["ok"]}
    return {"gpu_us": gpu_us([fn], e), **chk}


def run_variant(c: PagedCase, table: str, cfg: DecodeConfig, splits: int, ref: torch.Tensor,
                sdpa_out: torch.Tensor | None, e: float, nbytes: int, fp8: bool = False
                ) -> dict[str, Any]:
    """GPU time and check of one (config, split count); a failure is a result."""
    r: dict[str, Any] = {"splits": splits, "table": table}
    try:
        r.update(check(c, c.ours(table, fp8=fp8, config=cfg, num_splits=splits), ref,
                       sdpa_out, e / 2 if fp8 else e))
        r["TBps"] = nbytes / r["gpu_us"] / 1e6
    except Exception as exc:  # noqa: BLE001  (a variant that fails to compile is a result)
        r["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return r


def eager_times(hub: Any, c: PagedCase, row: DecodeConfig, row_splits: int,
                best: tuple[str, DecodeConfig, int] | None, fp8: bool) -> dict[str, Any]:
    """Eager us, host included (random table): SDPA on the contiguous copy, the hub (policy
    and forced ``triton_decode``; ``triton_decode_fp8`` with ``fp8``), the row's kernel
    call and the fastest variant's."""
    kw = {"layout": "paged", "block_table": c.tables["random"], "seqlens_k": c.seqlens}
    calls = {"sdpa_contiguous": c.sdpa_contiguous("random"),
             "hub": lambda: hub.attention(c.q, c.kc, c.vc, **kw),
             "hub_forced": lambda: hub.attention(c.q, c.kc, c.vc, backend="triton_decode",
                                                 **kw),
             "kernel_row": c.ours("random", config=row, num_splits=row_splits),
             "kernel_row_nopdl": c.ours("random", config=row.with_(pdl=False),
                                        num_splits=row_splits)}
    if fp8:
        calls["hub_fp8"] = lambda: hub.attention(
            c.q, c.k8, c.v8, backend="triton_decode_fp8",
            extra={"k_descale": c.kd, "v_descale": c.vd}, **kw)
    if best is not None:
        name, cfg, s = best
        calls[f"kernel_best_{name}_{s}"] = c.ours("random", config=cfg, num_splits=s)
    ev: dict[str, Any] = {}
    for key, fn in calls.items():
        fn()  # first call binds and compiles
        ev[f"{key}_us"] = eager_us(fn)
    return ev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/decode_sweep")
    ap.add_argument("--budget", type=float, default=230.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="also the e4m3 cache's variants")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--cells", nargs="+", default=None, metavar="BxCTX",
                    help="only these cells, e.g. 1x131072 (default: all four)")
    ap.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                    help="only these variants of FEW / MANY, e.g. row nopdl paged")
    args = ap.parse_args()
    cells = [c for c in CELLS if args.cells is None or f"{c[0]}x{c[1]}" in args.cells]
    if not cells:
        ap.error(f"--cells {args.cells}: none of {[f'{b}x{n}' for b, n, _ in CELLS]}")
    t0 = time.time()
    out, gpu, sms, arch = sweep_setup(args.out)
    import triton

    from attnhub import Hub

    base8 = decode_config(arch, paged=True, kv_fp8=True)
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "gpu": gpu, "sm_count": sms, "commit": args.commit or source_commit(ROOT),
        "torch": torch.__version__, "triton": triton.__version__,
        "row_paged": repr(decode_config(arch, paged=True)),
        "row_few": repr(decode_config(arch, paged=True, programs=(HKV, sms))),
        "row_fp8": repr(base8), "cells": []}
    res["ceilings"] = ceilings()  # this card's copy and read bandwidth, in the same run
    print(json.dumps({k: v for k, v in res.items() if k != "cells"}), flush=True)
    hub = Hub()
    for i, (batch, ctx, share) in enumerate(cells):
        # this cell's share of what is left of the budget
        left = sum(sh for *_, sh in cells[i:])
        deadline = time.time() + (t0 + args.budget - time.time()) * share / left
        c = PagedCase(batch, ctx, fp8=args.fp8)
        base = decode_config(arch, paged=True, programs=(batch * HKV, sms))
        e, nbytes = est(batch, ctx), kv_bytes(batch, ctx)
        row_splits = choose_splits(batch, HKV, ctx, sms, base)
        cell: dict[str, Any] = {"batch": batch, "ctx": ctx, "row": repr(base),
                                "row_splits": row_splits, "bf16": [], "fp8": []}
        refs = {t: c.reference(t) for t in ("random", "sequential")}
        sdpa_outs = {}
        for table in ("sequential", "random"):
            sd = c.sdpa_contiguous(table)
            sdpa_outs[table] = sd().transpose(1, 2)
            cell[f"sdpa_{table}_gpu_us"] = gpu_us([sd], e)
            cell[f"row_{table}"] = run_variant(c, table, base, row_splits, refs[table],
                                               sdpa_outs[table], e, nbytes)
        print(json.dumps({k: v for k, v in cell.items() if k not in ("bf16", "fp8")}),
              flush=True)
        few = batch == 1
        if few:
            cfgs = {name: base.with_(**ch) for name, ch, _ in FEW}
            plan = [(name, wave_splits(ctx, cfgs[name], per_sm, sms))
                    for name, _, per_sm in FEW]
        else:
            paged = decode_config(arch, paged=True)
            cfgs = {name: paged.with_(**ch) for name, ch, _ in MANY}
            paged_splits = choose_splits(batch, HKV, ctx, sms, paged)
            plan = [(name, list(dict.fromkeys(paged_splits if s is None else s for s in ss)))
                    for name, _, ss in MANY]
        if args.variants is not None:
            plan = [(name, ss) for name, ss in plan if name in args.variants]
        for name, split_list in plan:
            cfg = cfgs[name]
            for s in split_list:
                if time.time() > deadline:
                    break
                r = {"name": name, **run_variant(c, "random", cfg, s, refs["random"],
                                                 sdpa_outs["random"], e, nbytes)}
                cell["bf16"].append(r)
                print("bf16", batch, ctx, json.dumps(r), flush=True)
        ok = sorted((r for r in cell["bf16"] if r.get("ok")), key=lambda r: r["gpu_us"])
        # the three fastest again (noise) and on the sequential table
        top = []
        for r in ok:
            if (r["name"], r["splits"]) not in top:
                top.append((r["name"], r["splits"]))
        for name, s in top[:3] if few else top[:1]:
            cfg = cfgs[name]
            for table in ("random", "sequential"):
                r = {"name": name, "repeat": True, **run_variant(
                    c, table, cfg, s, refs[table], sdpa_outs[table], e, nbytes)}
                cell["bf16"].append(r)
                print("bf16", batch, ctx, json.dumps(r), flush=True)
        if args.fp8:
            for name, changes in FP8:
                if time.time() > deadline:
                    break
                cfg = base8.with_(**changes)
                r = {"name": name, **run_variant(
                    c, "random", cfg, choose_splits(batch, HKV, ctx, sms, cfg),
                    refs["random"], None, e, nbytes, fp8=True)}
                cell["fp8"].append(r)
                print("fp8", batch, ctx, json.dumps(r), flush=True)
        best = None
        if top:
            name, s = top[0]
            best = (name, cfgs[name], s)
        ev = eager_times(hub, c, base, row_splits, best, args.fp8)
        cell["eager"] = ev
        print("eager", batch, ctx, json.dumps(ev), flush=True)
        res["cells"].append(cell)
        try:
            res["kernels"] = [] if SMOKE else kernel_info()
        except Exception as exc:  # noqa: BLE001  (bookkeeping only: never lose the cell)
            res["kernels"] = [f"{type(exc).__name__}: {exc}"]
        res["seconds"] = time.time() - t0
        (out / "decode_sweep.json").write_text(json.dumps(res, indent=1))
        del c
        if not SMOKE:
            torch.cuda.empty_cache()
    print("kernels", json.dumps(res["kernels"]), flush=True)
    print("done", time.time() - t0, flush=True)


if __name__ == "__main__":
    main()
