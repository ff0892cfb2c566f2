"""FP8 (e4m3) paged KV decode against the bf16 cache through the public API (issue 16):
``attnhub.attention(layout="paged")`` forced to ``triton_decode`` (bf16 pool) and to
``triton_decode_fp8`` (the same pool in e4m3, per-(page, KV head) descales), host time
included, timed interleaved (``attnhub.timing.interleaved_ms``, CUDA events), random page
table. Per cell: ms per call, as one call from an idle GPU (latency: the host's work before
the first launch counts) and back to back (a step's layers: throughput, tokens/s), the
tokens/s ratio of each (bf16 ms / e4m3 ms), relative L2 error of each
against fp32 attention over the bf16 pool, and which pass 1 the e4m3 call took (the Gluon
kernel on sm90 where it serves, else the portable one).

    python benchmarks/decode_fp8_api.py [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
from triton_decode import ROOT, SMOKE, PagedCase, source_commit  # noqa: E402

import attnhub  # noqa: E402
from attnhub.timing import interleaved_ms  # noqa: E402

CELLS = [(2, 64)] if SMOKE else [(64, 32768), (1, 131072), (32, 4096), (1, 32768)]


def pass1(decode: Any) -> str:
    """The pass 1 the last e4m3 shape planned: the Gluon row or the portable table."""
    shape = list(decode._shapes.values())[-1]
    cfg = shape.plan_opts[2]
    if cfg is None or not cfg.gluon:
        return "portable"
    return (f"gluon block_n={cfg.block_n} prefetch={cfg.prefetch_pages} "
            f"ring={cfg.fp8_ring or '-'} maxnreg={cfg.maxnreg or '-'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    from attnhub_triton_portable import decode

    hub = attnhub.Hub()
    device = "cpu" if SMOKE else "cuda"
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "commit": source_commit(ROOT), "cells": []}
    for batch, ctx in CELLS:
        c = PagedCase(batch, ctx, fp8=True)
        t = c.tables["random"]
        kw = {"layout": "paged", "block_table": t, "seqlens_k": c.seqlens}
        fns = {
            "bf16": lambda: hub.attention(c.q, c.kc, c.vc, backend="triton_decode", **kw),
            "e4m3": lambda: hub.attention(c.q, c.k8, c.v8, backend="triton_decode_fp8",
                                          extra={"k_descale": c.kd, "v_descale": c.vd}, **kw)}
        ref = c.reference("random")
        err = {n: float((fn().float() - ref).norm() / ref.norm()) for n, fn in fns.items()}
        kernel = pass1(decode)
        ms = interleaved_ms(fns, device, warmup=3, repeats=20, rounds=2).ms
        # throughput: the calls of a decode step's layers back to back (host work under the
        # GPU's), ~20 ms a sample; the figure above is one call from an idle GPU (latency)
        b2b = interleaved_ms(fns, device, warmup=1, repeats=5, rounds=2,
                             batch_below_ms=float("inf"), batch_ms=20.0).ms
        row = {"batch": batch, "ctx": ctx, "bf16_ms": ms["bf16"], "e4m3_ms": ms["e4m3"],
               "speedup": ms["bf16"] / ms["e4m3"], "bf16_ms_back_to_back": b2b["bf16"],
               "e4m3_ms_back_to_back": b2b["e4m3"],
               "speedup_back_to_back": b2b["bf16"] / b2b["e4m3"], "rel_err_bf16": err["bf16"],
               "rel_err_e4m3": err["e4m3"], "e4m3_pass1": kernel}
        res["cells"].append(row)
        print(f"{batch} x {ctx}: one call bf16 {ms['bf16']:.4f} ms, e4m3 {ms['e4m3']:.4f} ms "
              f"({row['speedup']:.2f}x); back to back {b2b['bf16']:.4f} / "
              f"{b2b['e4m3']:.4f} ms ({row['speedup_back_to_back']:.2f}x); {kernel}; rel err "
              f"bf16 {err['bf16']:.4f}, e4m3 {err['e4m3']:.4f}", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        del c, fns, ref


if __name__ == "__main__":
    main()
