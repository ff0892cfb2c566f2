"""Tile sweep of the dense ``triton`` kernels and the Hopper Gluon forward, beside FA3/cuDNN.

One GPU run answers issue 16's dense questions: is the Gluon forward (``fwd_gluon``) correct
by the FlashAttention rule (fp64 reference, bf16 reference's own error as the yardstick;
LSE and its -inf pattern), and which config of each kernel is fastest at 1k/4k/16k full and
causal, causal + window 4096 at 16k (32/8 heads), and the backward at 16k full. Every config
is compiled first in parallel processes (Triton's disk cache then serves the timed process).

    python benchmarks/triton_dense_sweep.py [--out DIR] [--part all|check|time] [--smoke]

Writes ``triton_dense_sweep.json`` into ``--out`` after every measurement; ``--smoke`` runs
the portable half on a CPU with Triton's interpreter and tiny shapes (Gluon needs a GPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import triton_dense as td

SMOKE, DEV = td.SMOKE, td.DEV

# The sweep of 2026-12-01 (docs/benchmarks/triton_dense.md) timed seven portable configs:
# (64,64,4,3/4), (64,128,4,2), (128,128,8,3/2), (128,64,8,3), (64,32,4,3); the two kept
# here were the fastest in every cell. Gluon: (BLOCK_M, BLOCK_N, warps, P through smem).
PORTABLE = [(64, 64, 4, 3), (128, 128, 8, 3)]
GLUON = [(128, 128, 8, 1), (64, 64, 4, 1), (128, 128, 8, 0), (64, 64, 4, 0)]
BWD = [((64, 128, 8, 3), (128, 128, 8, 2)), ((64, 128, 8, 2), (128, 128, 8, 2)),
       ((64, 128, 8, 3), (128, 64, 8, 3)), ((64, 64, 4, 3), (64, 128, 4, 3)),
       ((128, 128, 8, 2), (128, 128, 8, 2))]
WINDOW = 4096
PUBLIC = "--no-public" not in sys.argv


def _cfg(t: tuple[int, ...], gluon: bool = False) -> dict[str, Any]:
    c = {"BLOCK_M": t[0], "BLOCK_N": t[1], "num_warps": t[2], "num_stages": 1 if gluon else t[3]}
    return {**c, "GLUON": True, "P_SMEM": bool(t[3])} if gluon else c


def _bwd_cfg(pair: tuple[tuple[int, ...], tuple[int, ...]]) -> dict[str, Any]:
    return {"dkdv": _cfg(pair[0]), "dq": _cfg(pair[1]), "dq_mode": "separate"}


def _params(mask: str, **kw: Any) -> Any:
    from attnhub.plugin import AttnParams

    d = kw.pop("d", td.D)
    window = (WINDOW, 0) if mask == "window" else kw.pop("window", None)
    return AttnParams(scale=d ** -0.5, causal=mask in ("causal", "window"), window=window, **kw)


def _rand(b: int, s: int, h: int, d: int = td.D, grad: bool = False) -> torch.Tensor:
    return torch.randn(b, s, h, d, device=DEV, dtype=td.DT, requires_grad=grad)


# -- compile in parallel ------------------------------------------------------------------------
def _warm(task: tuple[str, str, Any]) -> str:
    """Worker: run one (kind, mask, config) on a small shape of the same specialisation."""
    kind, mask, cfg = task
    t0 = time.time()
    try:
        from attnhub_triton_portable.autograd import flash_attention
        from attnhub_triton_portable.bwd import flash_bwd
        from attnhub_triton_portable.launch import DenseArgs

        q, k, v = _rand(1, 256, 4), _rand(1, 256, 2), _rand(1, 256, 2)
        p = _params(mask) if mask != "window" else _params("causal", window=(64, 0))
        if kind == "fwd":
            flash_attention(q, k, v, p, fwd_cfg=cfg)
        else:
            args = DenseArgs.from_params(q, k, v, p, "bshd")
            out, lse = flash_attention(q, k, v, p, fwd_cfg=_cfg(PORTABLE[0]))
            flash_bwd(args, out, lse, torch.randn_like(out), cfg)
        torch.cuda.synchronize()
        return f"{kind} {mask} {cfg}: {time.time() - t0:.1f}s"
    except Exception as exc:  # noqa: BLE001 - recorded; the timing loop skips it too
        return f"{kind} {mask} {cfg}: ERROR {exc!r}"[:400]


def warm_all(data: dict[str, Any], workers: int) -> None:
    tasks = [("fwd", m, _cfg(c)) for m in ("full", "causal", "window") for c in PORTABLE]
    tasks += [("fwd", m, _cfg(c, True)) for m in ("full", "causal", "window") for c in GLUON]
    tasks += [("bwd", "full", _bwd_cfg(p)) for p in BWD]
    t = time.time()
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=ctx) as pool:
        data["compile"] = list(pool.map(_warm, tasks))
    data["notes"].append(f"{len(tasks)} configs compiled in {time.time() - t:.0f}s")


# -- Gluon correctness -------------------------------------------------------------------------------
def _gluon_cases() -> list[tuple[str, tuple[int, ...], dict[str, Any]]]:
    """(name, (B, Sq, Sk, Hq, Hkv, d), params kwargs): GQA, Sq != Sk both ways, fully masked
    rows (bottom-right causal with Sq > Sk), both alignments, windows, d = 64."""
    return [
        ("full GQA 8:2 S=1024 d128", (2, 1024, 1024, 8, 2, 128), {}),
        ("causal bottom-right Sq=512 Sk=1024 d128", (2, 512, 1024, 8, 2, 128),
         {"causal": True}),
        ("causal bottom-right Sq=1024 Sk=512 (empty rows) d128", (1, 1024, 512, 4, 4, 128),
         {"causal": True}),
        ("causal + window (256, 0) GQA 4:1 S=1024 d128", (2, 1024, 1024, 4, 1, 128),
         {"causal": True, "window": (256, 0)}),
        ("window (100, 37) top-left S=768 d64", (1, 768, 768, 4, 2, 64),
         {"window": (100, 37), "alignment": "top_left"}),
        ("causal top-left Sq=1024 Sk=512 d64", (1, 1024, 512, 4, 2, 64),
         {"causal": True, "alignment": "top_left"}),
    ]


def gluon_correctness(data: dict[str, Any]) -> bool:
    from attnhub_triton_portable.fwd import flash_fwd, gluon_unsupported
    from attnhub_triton_portable.launch import DenseArgs

    from attnhub.plugin import AttnParams
    from attnhub.testing import fa_references, fa_rule_error

    all_ok = True
    torch.manual_seed(0)
    for name, (b, sq, sk, hq, hkv, d), kw in _gluon_cases():
        q, k, v = _rand(b, sq, hq, d), _rand(b, sk, hkv, d), _rand(b, sk, hkv, d)
        params = AttnParams(scale=d ** -0.5, **kw)
        ref64, ref_lse, ref_bf = fa_references(q, k, v, params)
        for c in GLUON:
            cfg = _cfg(c, True)
            args = DenseArgs.from_params(q, k, v, params, "bshd")
            why = gluon_unsupported(args, cfg)
            if why:
                data["correctness"].append(f"SKIP {name} {c}: {why}")
                continue
            try:
                out, lse = flash_fwd(args, cfg)
                torch.cuda.synchronize()
                err, allowed = fa_rule_error(out, ref64, ref_bf, 2.0)
                fin = torch.isfinite(ref_lse)
                lse_err = float((lse[fin] - ref_lse[fin]).abs().max()) if bool(fin.any()) else 0.0
                pattern = torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
                ok = (err <= allowed and not bool(torch.isnan(out).any()) and lse_err < 2e-3
                      and pattern)
                line = (f"{'PASS' if ok else 'FAIL'} {name} cfg {c}: out {err:.2e}<={allowed:.2e}"
                        f", lse {lse_err:.1e}, -inf pattern {pattern}")
            except Exception as exc:  # noqa: BLE001 - a failure is a result
                ok, line = False, f"ERROR {name} cfg {c}: {exc!r}"[:400]
                traceback.print_exc()
            all_ok &= ok
            data["correctness"].append(line)
            print(line, flush=True)
    return all_ok


# -- timing ------------------------------------------------------------------------------------------
def _flops(b: int, h: int, s: int, mask: str) -> float:
    """Forward FLOPs over the visible pairs (4 * d per pair)."""
    if mask == "full":
        pairs = s * s
    elif mask == "causal":
        pairs = s * (s + 1) // 2
    else:  # causal + window (WINDOW, 0): row i sees min(i, WINDOW) + 1 keys
        w = min(WINDOW, s - 1)
        pairs = (w + 1) * (w + 2) // 2 + (s - w - 1) * (w + 1)
    return 4.0 * b * h * pairs * td.D


def cells() -> list[tuple[str, int, int, int, int, str]]:
    """(column, B, S, Hq, Hkv, mask)."""
    out = []
    for s in td.SEQLENS:
        for mask in ("full", "causal"):
            col = f"{s // 1024}k {mask}" if s >= 1024 else f"{s} {mask}"
            out.append((col, max(1, td.TOKENS // s), s, td.HEADS, td.HEADS, mask))
    s = td.SEQLENS[-1]
    out.append((f"{s // 1024}k causal+window {WINDOW} (32/8 heads)", 1, s, 32, 8, "window"))
    return out


def time_fwd(data: dict[str, Any], ok_gluon: bool) -> None:
    from attnhub_triton_portable import configs
    from attnhub_triton_portable.autograd import flash_attention
    from attnhub_triton_portable.fwd import flash_fwd, gluon_unsupported
    from attnhub_triton_portable.launch import DenseArgs

    if not ok_gluon:  # never let the autotuner pick a kernel that failed (or skipped) the gate
        configs.GLUON_SM90.clear()
    for col, b, s, hq, hkv, mask in cells():
        q, k, v = _rand(b, s, hq), _rand(b, s, hkv), _rand(b, s, hkv)
        params = _params(mask)
        args = DenseArgs.from_params(q, k, v, params, "bshd")
        flops = _flops(b, hq, s, mask)
        row = data["fwd"].setdefault(col, {})
        cfgs = [(f"portable {c}", _cfg(c)) for c in PORTABLE]
        if ok_gluon:
            cfgs += [(f"gluon {c}", _cfg(c, True)) for c in GLUON
                     if gluon_unsupported(args, _cfg(c, True)) is None]
        for name, cfg in cfgs:
            try:
                ms = td.bench_ms(lambda cfg=cfg, args=args: flash_fwd(args, cfg))
                row[name] = round(flops / (ms * 1e-3) / 1e12, 1)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                row[name] = f"error {type(exc).__name__}"
            print(col, name, row[name], flush=True)
        if PUBLIC:  # the public function, autotuned over the shipped candidates (host time in)
            flash_attention(q, k, v, params)
            ms = td.bench_ms(lambda q=q, k=k, v=v, p=params: flash_attention(q, k, v, p))
            row["flash_attention (autotuned)"] = round(flops / (ms * 1e-3) / 1e12, 1)
        if mask != "window" and not SMOKE:
            _peers(row, q, k, v, mask == "causal", flops)
        save(data)


def _peers(row: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           causal: bool, flops: float) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms = td.bench_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    row["SDPA cuDNN"] = round(flops / (ms * 1e-3) / 1e12, 1)
    try:
        import fa3_fwd_config

        sys.modules.setdefault("flash_attn_config", fa3_fwd_config)
        from fa3_fwd_interface import flash_attn_func

        ms = td.bench_ms(lambda: flash_attn_func(q, k, v, causal=causal))
        row["FA3 (fa3-fwd)"] = round(flops / (ms * 1e-3) / 1e12, 1)
    except ImportError:
        row["FA3 (fa3-fwd)"] = "not installed"


def time_bwd(data: dict[str, Any]) -> None:
    from attnhub_triton_portable.autograd import flash_attention
    from attnhub_triton_portable.bwd import flash_bwd
    from attnhub_triton_portable.launch import DenseArgs

    s = td.SEQLENS[-1]
    b = max(1, td.TOKENS // s)
    q, k, v = _rand(b, s, td.HEADS), _rand(b, s, td.HEADS), _rand(b, s, td.HEADS)
    params = _params("full")
    args = DenseArgs.from_params(q, k, v, params, "bshd")
    out, lse = flash_attention(q, k, v, params)
    dout = torch.randn_like(out)
    flops = 2.5 * _flops(b, td.HEADS, s, "full")
    row = data["bwd"].setdefault(f"{s // 1024 if s >= 1024 else s} full", {})
    for pair in BWD:
        try:
            ms = td.bench_ms(lambda pair=pair: flash_bwd(args, out, lse, dout, _bwd_cfg(pair)))
            row[str(pair)] = round(flops / (ms * 1e-3) / 1e12, 1)
        except Exception as exc:  # noqa: BLE001
            row[str(pair)] = f"error {type(exc).__name__}"
        print("bwd", pair, row[str(pair)], flush=True)
    if not SMOKE:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qt, kt, vt)
            g = torch.randn_like(o)
            ms = td.bench_ms(lambda: torch.autograd.grad(o, (qt, kt, vt), g, retain_graph=True))
        row["SDPA cuDNN"] = round(flops / (ms * 1e-3) / 1e12, 1)
    save(data)


OUT: list[Path] = []


def save(data: dict[str, Any]) -> None:
    path = OUT[0] / "triton_dense_sweep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=td.ROOT / "docs" / "benchmarks")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-public", action="store_true",
                    help="skip the autotuned flash_attention row (its candidates' compiles)")
    ap.add_argument("--part", choices=("all", "check", "time"), default="all",
                    help="check: compile + Gluon correctness; time: the timings (reads check's "
                         "JSON for whether the Gluon kernel passed)")
    a = ap.parse_args()
    OUT.append(a.out)
    import triton

    t0 = time.time()
    data: dict[str, Any] = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                            "commit": os.environ.get("COMMIT", "?"), "torch": torch.__version__,
                            "triton": triton.__version__, "correctness": [], "fwd": {},
                            "bwd": {}, "notes": []}
    os.environ["ATTNHUB_TRITON_AUTOTUNE"] = "1"
    if SMOKE:
        global PORTABLE, BWD
        PORTABLE, BWD = [(16, 16, 1, 1)], [((16, 16, 1, 1), (16, 16, 1, 1))]
        time_fwd(data, False)
        time_bwd(data)
        return
    path = a.out / "triton_dense_sweep.json"
    if a.part in ("all", "check"):  # compile everything, then the Gluon correctness gate
        warm_all(data, a.workers)
        save(data)
        ok = gluon_correctness(data)
        data["notes"].append(f"gluon correctness all pass: {ok}")
        data["gluon_ok"] = ok
        save(data)
    else:  # a separate process, so that a kernel that hangs in "check" costs only that part
        if path.exists():
            data = json.loads(path.read_text())
        data.setdefault("notes", []).append("timing process")
    if a.part in ("all", "time"):
        time_fwd(data, bool(data.get("gluon_ok")))
        time_bwd(data)
    data["notes"].append(f"{a.part}: {time.time() - t0:.0f}s")
    save(data)


if __name__ == "__main__":
    main()
