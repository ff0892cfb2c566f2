"""Where the dense backward's time goes: each kernel of ``flash_bwd`` timed on its own.

Issue 16's backward target is 480 TFLOP/s at 16k full (bf16, d128, 16/16 heads, batch 1);
the shipped backward measured 392. This probe times, per tile config and dq mode, the delta,
dK/dV and dQ kernels separately (CUDA profiler, device time), with each kernel's registers and
spills as compiled, so a rewrite goes to the kernel that needs it. cuDNN's backward (SDPA),
the backward through ``attnhub.attention`` (the autotuned config a user gets) and, when given
``--gluon``, the Hopper Gluon backward (ring depths and a no-dq probe) are timed in the same
run.

    python benchmarks/bwd_probe.py [--json out.json] [--png out.png] [--masks full causal]
    python benchmarks/bwd_probe.py --plot out.json --png out.png   # re-draw a saved run

TFLOP/s count 2.5x the forward's FLOPs (FlashAttention's convention), half when causal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "triton_portable")]
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

DEV = "cpu" if SMOKE else "cuda"
B, S, H, D = (1, 64, 2, 32) if SMOKE else (1, 16384, 16, 128)


def _c(bm: int, bn: int, w: int, st: int) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}


#: (name, config) tried; the first is the shipped sm90 d128 entry.
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("shipped", {"dkdv": _c(64, 128, 8, 3), "dq": _c(128, 128, 8, 2), "dq_mode": "separate"}),
    ("dq 128x64", {"dkdv": _c(64, 128, 8, 3), "dq": _c(128, 64, 8, 2), "dq_mode": "separate"}),
    ("dq 64x128/4w", {"dkdv": _c(64, 128, 8, 3), "dq": _c(64, 128, 4, 2), "dq_mode": "separate"}),
    ("dkdv 64x64/4w", {"dkdv": _c(64, 64, 4, 3), "dq": _c(128, 128, 8, 2), "dq_mode": "separate"}),
    ("dkdv 32x128", {"dkdv": _c(32, 128, 8, 3), "dq": _c(128, 128, 8, 2), "dq_mode": "separate"}),
    ("atomic 64x128", {"dkdv": _c(64, 128, 8, 2), "dq": _c(128, 128, 8, 2), "dq_mode": "atomic"}),
    ("atomic 64x64/4w", {"dkdv": _c(64, 64, 4, 2), "dq": _c(128, 128, 8, 2), "dq_mode": "atomic"}),
]
if SMOKE:
    CONFIGS = [("smoke", {"dkdv": _c(16, 16, 1, 1), "dq": _c(16, 16, 1, 1),
                          "dq_mode": "separate"})]


def _flops(causal: bool) -> float:
    return 2.5 * 4 * B * H * S * S * D * (0.5 if causal else 1.0)


def _kernel_stats() -> dict[str, dict[str, int]]:
    """Registers and spills of every compiled backward kernel (Triton's JIT caches)."""
    from attnhub_triton_portable import bwd

    kernels = {"_dkdv_kernel": bwd._dkdv_kernel, "_dq_kernel": bwd._dq_kernel}
    try:
        from attnhub_triton_portable import bwd_gluon

        kernels["gluon _bwd_kernel"] = bwd_gluon._bwd_kernel
    except ImportError:  # a Triton without Gluon
        pass
    out: dict[str, dict[str, int]] = {}
    for name, fn in kernels.items():
        for caches in getattr(fn, "device_caches", {}).values():
            for i, k in enumerate(caches[0].values()):
                regs, spills = getattr(k, "n_regs", None), getattr(k, "n_spills", None)
                if regs is not None:
                    out[f"{name}#{i}"] = {"regs": int(regs), "spills": int(spills or 0)}
    return out


def per_kernel_ms(fn, reps: int) -> dict[str, float]:
    """Device ms per call of each kernel ``fn`` launches (profiler, ``reps`` calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    acc: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            acc[e.name[:60]] += e.device_time_total / 1e3 / reps
    return dict(acc)


def wall_ms(fn) -> float:
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def _api_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """Row ``api``: the backward as a user gets it, ``attnhub.attention(...,
    backend="triton")`` with grads and its autotuned config; one forward, then the gradients
    timed."""
    import attnhub

    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = attnhub.attention(qq, kk, vv, causal=causal, backend="triton")
    go = torch.randn_like(o)
    return lambda: torch.autograd.grad(o, (qq, kk, vv), go, retain_graph=True)


def plot(data: dict[str, Any], path: str) -> None:
    """Bars of TFLOP/s per implementation, one panel per mask, cuDNN's as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    masks = list(dict.fromkeys(r["mask"] for r in data["rows"]))
    fig, axes = plt.subplots(1, len(masks), figsize=(6 * len(masks), 4.5), squeeze=False)
    for ax, mask in zip(axes[0], masks):
        rows = [r for r in data["rows"] if r["mask"] == mask and "tflops" in r]
        peer = [r["tflops"] for r in rows if r["impl"].startswith("SDPA")]
        ours = [r for r in rows if not r["impl"].startswith("SDPA")]
        colors = ["tab:gray" if "probe" in r["impl"] else
                  "tab:orange" if r["impl"].startswith(("gluon", "api")) else "tab:blue"
                  for r in ours]
        ax.barh([r["impl"] for r in ours], [r["tflops"] for r in ours], color=colors)
        for p in peer:
            ax.axvline(p, color="tab:red", ls="--", label=f"cuDNN {p:.0f}")
        ax.invert_yaxis()
        ax.set_xlabel("TFLOP/s (2.5x forward FLOPs)")
        ax.set_title(f"backward, {mask}, shape {data['shape']}")
        if peer:
            ax.legend(loc="best")
    fig.suptitle(data.get("title", ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--masks", nargs="+", default=["full", "causal"])
    ap.add_argument("--gluon", action="store_true", help="also the Hopper Gluon backward")
    ap.add_argument("--only", nargs="*", default=None, help="config names to time (default all)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--png", default=None, help="draw the rows (TFLOP/s per impl and mask)")
    ap.add_argument("--plot", default=None, help="only draw this saved JSON into --png")
    a = ap.parse_args()
    if a.plot:
        plot(json.loads(Path(a.plot).read_text()), a.png or a.plot.replace(".json", ".png"))
        return

    from attnhub.plugin import AttnParams
    from attnhub_triton_portable.autograd import flash_attention
    from attnhub_triton_portable.bwd import flash_bwd
    from attnhub_triton_portable.launch import DenseArgs

    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device=DEV, dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    data: dict[str, Any] = {"shape": [B, S, H, D], "rows": []}
    for mask in a.masks:
        causal = mask == "causal"
        params = AttnParams(scale=D ** -0.5, causal=causal)
        args = DenseArgs.from_params(q, k, v, params, "bshd")
        out, lse = flash_attention(q, k, v, params)
        dout = torch.randn_like(out)
        impls = [(n, (lambda c=c: flash_bwd(args, out, lse, dout, c))) for n, c in CONFIGS]
        if a.gluon:
            from attnhub_triton_portable.bwd import gluon_bwd_unsupported
            from attnhub_triton_portable.configs import GLUON_BWD_SM90

            why = gluon_bwd_unsupported(args)
            if why is None:
                impls.insert(0, ("gluon", lambda: flash_bwd(args, out, lse, dout, GLUON_BWD_SM90)))
                from attnhub_triton_portable import bwd_gluon

                delta = torch.empty_like(lse)
                # another ring depth (one dq buffer), and a timing probe without dq (wrong
                # gradients: four of the five GEMMs)
                other = "gluon-pipe" if not bwd_gluon.PIPE else "gluon-step"
                for nm, kw in (("gluon-s2-dq1", {"_stages": 2, "_dq_bufs": 1}),
                               ("gluon-s3-dq1", {"_stages": 3, "_dq_bufs": 1}),
                               (other, {"_pipe": not bwd_gluon.PIPE}),
                               (other + "-dq1", {"_pipe": not bwd_gluon.PIPE, "_dq_bufs": 1}),
                               ("gluon-hoist" if bwd_gluon.NO_HOIST else "gluon-nohoist",
                                {"_no_hoist": not bwd_gluon.NO_HOIST}),
                               ("gluon-no-dq-probe", {"_probe": 2}),
                               # the last wave's walks whole, or in 4 / 8 parts (bwd_tail)
                               ("gluon-whole", {"_tail_parts": 1}),
                               ("gluon-parts4", {"_tail_parts": 4}),
                               ("gluon-parts8", {"_tail_parts": 8}),
                               # key tiles first to last (causal: longest walks first)
                               ("gluon-asc", {"_key_desc": False}),
                               ("gluon-asc-whole", {"_key_desc": False, "_tail_parts": 1})):
                    impls.insert(1, (nm, lambda kw=kw: bwd_gluon.flash_bwd(
                        args, out, lse, dout, delta, **kw)))
            else:
                print("gluon skipped:", why)
        impls.append(("api", _api_backward(q, k, v, causal)))
        for name, fn in impls:
            if a.only is not None and name not in a.only:
                continue
            row: dict[str, Any] = {"mask": mask, "impl": name}
            try:
                ms = wall_ms(fn)
                row["ms"] = round(ms, 3)
                row["tflops"] = round(_flops(causal) / (ms * 1e-3) / 1e12, 1)
                if not SMOKE:
                    row["kernels_ms"] = {kk: round(vv, 3)
                                         for kk, vv in per_kernel_ms(fn, 5).items()}
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(row), flush=True)
            data["rows"].append(row)
        if not SMOKE:
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel

            qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                go = torch.randn_like(o)
                ms = wall_ms(lambda: torch.autograd.grad(o, (qt, kt, vt), go, retain_graph=True))
            row = {"mask": mask, "impl": "SDPA cuDNN", "ms": round(ms, 3),
                   "tflops": round(_flops(causal) / (ms * 1e-3) / 1e12, 1)}
            print(json.dumps(row), flush=True)
            data["rows"].append(row)
    data["kernel_stats"] = _kernel_stats()
    print(json.dumps(data["kernel_stats"]))
    if a.json:
        Path(a.json).write_text(json.dumps(data, indent=1))
    if a.png:
        try:
            plot(data, a.png)
        except ImportError as exc:  # the H200 image has no matplotlib: draw it here later
            print(f"no plot ({exc}); draw it with: bwd_probe.py --plot {a.json} --png {a.png}")


if __name__ == "__main__":
    main()
