"""The warp-specialised Hopper Gluon forward (``fwd_gluon_ws``) beside the shipped Gluon
forward and cuDNN SDPA, in one run: correctness of every variant first (each config in its own
process, under a time limit, so that a hang costs that config only), then forward TFLOP/s at
16k (b=1, d=128) full / causal / causal + window 4096, 16/16 heads and GQA 32/8.

    python3 benchmarks/gluon_ws.py --json OUT.json [--deadline 280] [--smoke]

``--smoke`` runs the orchestration on a CPU (interpreter, portable kernel, no checks).

Uses the helpers of ``triton_dense.py`` (do_bench median, the FLOP count). Window FLOPs count
the visible (query, key) pairs exactly.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "triton_portable"),
                str(ROOT / "plugins" / "triton_portable" / "tests"), str(ROOT / "benchmarks")]

SMOKE = "--smoke" in sys.argv  # CPU, Triton's interpreter, the portable kernel, tiny rows
if SMOKE:
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
S, D = (256, 32) if SMOKE else (16384, 128)
MASKS = {"full": {}, "causal": {"causal": True},
         "causal+window4096": {"causal": True, "window": (4096, 0)}}
#: (heads q/kv, mask): the cells of docs/benchmarks/triton_dense.md (16 heads full/causal,
#: 32/8 for the window), plus GQA 32/8 full and causal.
CELLS = [((16, 16), "full"), ((16, 16), "causal"), ((32, 8), "causal+window4096"),
         ((32, 8), "full"), ((32, 8), "causal")]


def _variants() -> dict[str, dict]:
    from attnhub_triton_portable import configs

    if SMOKE:
        return {n: configs.fwd_config("cpu", D, "bf16", False) for n in ("a", "b")}
    out = {}
    for c in configs.GLUON_WS_SM90:
        out[f"ws pp{c['PINGPONG']} kv{c['KV_STAGES']}"] = c
    out["gluon 128x128 P_SMEM (shipped)"] = configs.GLUON_SM90[0]
    out["gluon 128x128 P regs (shipped)"] = configs.GLUON_SM90[1]
    return out


def _check(name: str) -> dict:
    """Worker: every test case for one variant; then compile the timed specialisations."""
    try:
        from test_dense_gluon_ws_gpu import CASES, run_case

        cfg = _variants()[name]
        res = []
        for shape, kw in ([] if SMOKE else CASES):
            t = time.time()
            r = run_case(cfg, shape, kw, grads=False)
            res.append({"shape": shape, "kw": {k: str(v) for k, v in kw.items()}, **r,
                        "s": round(time.time() - t, 1)})
        _fill_cache(cfg)
        return {"ok": True, "cases": res}
    except Exception as exc:  # noqa: BLE001 - the report says what failed
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1500],
                "tb": traceback.format_exc()[-1500:]}


def _fill_cache(cfg: dict) -> None:
    """Run the timed specialisations once on short rows (Triton's disk cache keeps them)."""
    from attnhub_triton_portable.fwd import flash_fwd
    from attnhub_triton_portable.launch import DenseArgs

    from attnhub.plugin import AttnParams

    for (hq, hkv), mname in CELLS:
        kw = MASKS[mname]
        if True:
            n = 128 if SMOKE else 1024
            q = torch.randn(1, n, hq, D, device=DEV, dtype=torch.bfloat16)
            k, v = (torch.randn(1, n, hkv, D, device=DEV, dtype=torch.bfloat16)
                    for _ in range(2))
            args = DenseArgs.from_params(q, k, v, AttnParams(scale=D ** -0.5, **kw), "bshd")
            flash_fwd(args, cfg)
    if not SMOKE:
        torch.cuda.synchronize()


def flops(hq: int, kw: dict) -> float:
    i = torch.arange(S, dtype=torch.float64)
    if kw.get("causal"):
        left = kw.get("window", (S, 0))[0]
        pairs = float(torch.clamp(i + 1, max=left + 1).sum())
    else:
        pairs = float(S) * S
    return 4.0 * hq * pairs * D


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=280.0)
    ap.add_argument("--check-timeout", type=float, default=150.0)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    t0 = time.time()
    import triton
    import triton.testing

    def bench(fn) -> float:
        if SMOKE:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return float(triton.testing.do_bench(fn, return_mode="median"))

    gpu = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    data: dict = {"gpu": gpu, "torch": torch.__version__,
                  "triton": triton.__version__, "shape": f"b=1 S={S} d={D} bf16",
                  "correctness": {}, "tflops": {}, "notes": []}

    def save() -> None:
        a.json.write_text(json.dumps(data, indent=1, default=str))

    names = list(_variants())
    ctx = multiprocessing.get_context("spawn")
    pool = cf.ProcessPoolExecutor(max_workers=len(names), mp_context=ctx)
    futs = {n: pool.submit(_check, n) for n in names}
    ok = []
    for n, f in futs.items():
        try:
            r = f.result(timeout=max(1.0, a.check_timeout - (time.time() - t0)))
        except cf.TimeoutError:
            r = {"ok": False, "error": "timed out (hang?)"}
        data["correctness"][n] = r
        if r["ok"]:
            ok.append(n)
        worst = max((c["err"] / c["allowed"] for c in r.get("cases", [])), default=None)
        print(f"check {n}: {'PASS' if r['ok'] else 'FAIL ' + r['error'][:300]}"
              + (f" worst err/allowed {worst:.2f}" if worst is not None else ""), flush=True)
    save()
    for p in list(pool._processes.values()):  # a hung worker must not keep the GPU
        p.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    data["notes"].append(f"checks took {time.time() - t0:.0f}s")

    import torch.nn.functional as F
    from attnhub_triton_portable.fwd import flash_fwd
    from attnhub_triton_portable.launch import DenseArgs
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnhub.plugin import AttnParams

    variants = _variants()
    for (hq, hkv), mname in CELLS:
        kw = MASKS[mname]
        if True:
            col = f"{hq}/{hkv} {mname}"
            row = data["tflops"].setdefault(col, {})
            g = torch.Generator(device=DEV).manual_seed(hq + len(kw))
            q = torch.randn(1, S, hq, D, device=DEV, dtype=torch.bfloat16, generator=g)
            k, v = (torch.randn(1, S, hkv, D, device=DEV, dtype=torch.bfloat16, generator=g)
                    for _ in range(2))
            params = AttnParams(scale=D ** -0.5, **kw)
            args = DenseArgs.from_params(q, k, v, params, "bshd")
            fl = flops(hq, kw)
            for n in ok:
                if time.time() - t0 > a.deadline:
                    break
                ms = bench(lambda: flash_fwd(args, variants[n]))
                row[n] = round(fl / (ms * 1e-3) / 1e12, 1)
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            try:
                if "window" in kw:  # SDPA has no window argument: no cuDNN peer here
                    raise NotImplementedError("no sliding window in SDPA")
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    fn = lambda: F.scaled_dot_product_attention(  # noqa: E731
                        qt, kt, vt, is_causal=bool(kw), enable_gqa=hq != hkv)
                    fn()
                    ms = bench(fn)
                row["cuDNN SDPA"] = round(fl / (ms * 1e-3) / 1e12, 1)
            except Exception as exc:  # noqa: BLE001 - a peer that fails is a result
                row["cuDNN SDPA"] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
            print(col, row, flush=True)
            save()
    data["notes"].append(f"total {time.time() - t0:.0f}s")
    save()
    print("\n| variant | " + " | ".join(data["tflops"]) + " |")
    for n in ok + ["cuDNN SDPA"]:
        print(f"| {n} | " + " | ".join(str(r.get(n, "-")) for r in data["tflops"].values())
              + " |")


if __name__ == "__main__":
    main()
