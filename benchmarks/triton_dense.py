"""Dense attention speed of the ``triton`` kernels against every peer on the machine.

Shape grid of ``../shared/gpu/README.md``: bf16, head dim 128, 16 heads, batch = 16384 / seqlen,
seqlen 1k/4k/16k, causal and not. Forward TFLOP/s count 4·B·H·S²·D (half when causal);
backward TFLOP/s count 2.5x the forward FLOPs over the backward time (FlashAttention's
convention). Times are medians of ``triton.testing.do_bench``. Peers: SDPA's flash (FA2),
cuDNN and memory-efficient kernels, FlexAttention (torch.compile), FA3 forward (fa3-fwd) when
installed. Before timing, the run checks the kernels on the GPU (bf16 against an fp32
reference, FlashAttention rule) and compiles our candidate tile configs in parallel
processes (Triton's disk cache then serves the timed process).

    python benchmarks/triton_dense.py [--out docs/benchmarks] [--commit abc1234]
        [--deadline 420] [--smoke]

Writes ``triton_dense.json`` and ``triton_dense.md`` into ``--out`` after every measurement.
``--smoke`` runs the whole script on a CPU with Triton's interpreter and tiny shapes.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "triton_portable")]
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

DEV = "cpu" if SMOKE else "cuda"
HEADS, D = (2, 32) if SMOKE else (16, 128)
TOKENS = 128 if SMOKE else 16384
SEQLENS = [32, 64] if SMOKE else [1024, 4096, 16384]
DT = torch.bfloat16


# -- shared helpers (also run in the compile workers) ------------------------------------------
def _params(causal: bool, **kw: Any) -> Any:
    from attnhub.plugin import AttnParams

    return AttnParams(scale=D ** -0.5, causal=causal, **kw)


def _qkv(batch: int, seqlen: int, requires_grad: bool = False) -> tuple[Any, ...]:
    g = torch.Generator(device=DEV).manual_seed(seqlen)
    return tuple(torch.randn(batch, seqlen, HEADS, D, device=DEV, dtype=DT, generator=g)
                 .requires_grad_(requires_grad) for _ in range(3))


def _compile_task(task: tuple[str, bool, dict]) -> tuple[str, float, str | None]:
    """Worker: run one (kind, causal, config) once on a small shape of the same Triton
    specialisation as the grid (every length and stride a multiple of 16), filling the cache."""
    kind, causal, cfg = task
    t0 = time.time()
    os.environ["ATTNHUB_TRITON_AUTOTUNE"] = "0"  # compile this config only
    try:
        from attnhub_triton_portable.autograd import flash_attention
        from attnhub_triton_portable.bwd import flash_bwd
        from attnhub_triton_portable.launch import DenseArgs

        if kind == "case":
            _, layout, (q, k, v), params, _, kw = _cases()[cfg["index"]]
            out, _ = flash_attention(q, k, v, params, layout, **kw)
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
            return f"correctness case {cfg['index']}", time.time() - t0, None
        q, k, v = _qkv(1, 256)
        if kind == "fwd":
            flash_attention(q, k, v, _params(causal), fwd_cfg=cfg)
        else:
            args = DenseArgs.from_params(q, k, v, _params(causal), "bshd")
            out, lse = flash_attention(q, k, v, _params(causal))
            flash_bwd(args, out, lse, torch.randn_like(out), cfg)
        torch.cuda.synchronize() if DEV == "cuda" else None
        return f"{kind} causal={causal} {cfg}", time.time() - t0, None
    except Exception as exc:  # noqa: BLE001 - reported in the JSON; autotune skips it too
        return f"{kind} causal={causal} {cfg}", time.time() - t0, repr(exc)[:300]


# -- the run --------------------------------------------------------------------------------------
class Run:
    """Collects results and rewrites the JSON and markdown after every measurement."""

    def __init__(self, out: Path, commit: str, deadline: float):
        self.out, self.t0, self.deadline = out, time.time(), deadline
        gpu = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (interpreter smoke run)"
        import triton

        self.data: dict[str, Any] = {
            "date": datetime.date.today().isoformat(), "gpu": gpu, "commit": commit,
            "torch": torch.__version__, "triton": triton.__version__,
            "shape": f"bf16, head dim {D}, {HEADS} heads, batch = {TOKENS} / seqlen",
            "correctness": [], "compile": [], "fwd": {}, "bwd": {}, "tuning": [], "chosen": {},
            "notes": [],
        }

    def elapsed(self) -> float:
        return time.time() - self.t0

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in (("triton_dense.json", json.dumps(self.data, indent=1, default=str)),
                           ("triton_dense.md", self.markdown())):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.out / name)

    def record(self, table: str, impl: str, col: str, value: float | str) -> None:
        self.data[table].setdefault(impl, {})[col] = value
        print(f"{table:3s} {impl:22s} {col:12s} {value}", flush=True)
        self.save()

    def markdown(self) -> str:
        d = self.data
        cols = [f"{s // 1024 if s >= 1024 else s}{'k' if s >= 1024 else ''} {c}"
                for s in SEQLENS for c in ("full", "causal")]
        lines = [f"# Dense attention, `triton` backend vs peers ({d['gpu']})", "",
                 (f"Date {d['date']}, commit `{d['commit']}`, torch {d['torch']}, triton "
                 f"{d['triton']}. Shape: {d['shape']}. TFLOP/s (median of do_bench); "
                 "backward counts 2.5x the forward FLOPs."), ""]
        for table, title in (("fwd", "Forward"), ("bwd", "Backward")):
            lines += [f"## {title} TFLOP/s", "", "| impl | " + " | ".join(cols) + " |",
                      "|---" * (len(cols) + 1) + "|"]
            for impl, row in d[table].items():
                cells = [_cell(row.get(c)) for c in cols]
                lines.append(f"| {impl} | " + " | ".join(cells) + " |")
            lines.append("")
        lines += ["## Tile configs chosen by autotuning", ""]
        lines += [f"- {k}: `{v}`" for k, v in d["chosen"].items()]
        lines += ["", "## Correctness on the GPU (bf16 vs fp32 reference, FlashAttention rule)",
                  ""]
        lines += [f"- {c}" for c in d["correctness"]]
        if d["notes"]:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in d["notes"]]
        return "\n".join(lines) + "\n"


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if isinstance(v, (int, float)) else str(v)[:40]


def bench_ms(fn: Callable[[], Any]) -> float:
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median"))


def tflops(batch: int, seqlen: int, causal: bool, ms: float, bwd: bool = False) -> float:
    f = 4 * batch * HEADS * seqlen * seqlen * D * (0.5 if causal else 1.0) * (2.5 if bwd else 1)
    return f / (ms * 1e-3) / 1e12


# -- correctness ---------------------------------------------------------------------------------
def _cases() -> list[tuple[str, str, tuple[Any, ...], Any, Any, dict]]:
    """(name, layout, tensors q/k/v, params, params for the fp32 oracle, flash_attention
    keyword arguments) of the GPU checks: GQA, partial tiles, head-dim padding, varlen with an
    empty document, window + softcap + ALiBi, column-sparse ranges, top-left causal, and the
    atomic dq mode (TMA reduce-add)."""
    from attnhub_triton_portable.configs import bwd_config

    from attnhub.plugin import AttnParams

    torch.manual_seed(0)
    s1, s2 = (40, 24) if SMOKE else (1000, 777)
    cu_q = torch.tensor([0, s2 // 3, s2 // 3, s2], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, s2 // 2, s2 // 2, s2 + 5], dtype=torch.int32, device=DEV)
    cols = s1 // 2
    start = torch.randint(0, s1, (2, 1, cols), device=DEV, dtype=torch.int32)
    slopes = torch.rand(4, device=DEV) * 0.1

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=DEV, dtype=DT, requires_grad=True)

    return [
        (f"bshd GQA 8:2 causal S={s1} d=128", "bshd",
         (rand(2, s1, 8, 128), rand(2, s1, 2, 128), rand(2, s1, 2, 128)),
         AttnParams(scale=128 ** -0.5, causal=True, deterministic=True), None, {}),
        (f"thd docs [{s2 // 3},0,{s2 - s2 // 3}] window(256,0)+softcap 30+ALiBi d=96", "thd",
         (rand(s2, 4, 96), rand(s2 + 5, 2, 96), rand(s2 + 5, 2, 96)),
         AttnParams(scale=96 ** -0.5, window=(256, 0), softcap=30.0, alibi_slopes=slopes,
                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=s2 - s2 // 3,
                    max_seqlen_k=s2 + 5 - s2 // 2),
         # the oracle cannot take an empty key sequence; the empty document adds nothing
         AttnParams(scale=96 ** -0.5, window=(256, 0), softcap=30.0, alibi_slopes=slopes,
                    cu_seqlens_q=cu_q[[0, 1, 3]], cu_seqlens_k=cu_k[[0, 1, 3]]), {}),
        (f"bshd column-sparse + top-left causal Sq={s1} Sk={cols} d=64", "bshd",
         (rand(2, s1, 4, 64), rand(2, cols, 1, 64), rand(2, cols, 1, 64)),
         AttnParams(scale=0.125, causal=True, alignment="top_left", colmask_start=start), None,
         {}),
        (f"bshd GQA 8:2 causal S={s1} d=128, dq_mode atomic", "bshd",
         (rand(2, s1, 8, 128), rand(2, s1, 2, 128), rand(2, s1, 2, 128)),
         AttnParams(scale=128 ** -0.5, causal=True), None,
         {"bwd_cfg": {**bwd_config(_arch(), 128, "bf16", True), "dq_mode": "atomic"}}),
    ]


def _arch() -> str:
    return "cpu" if SMOKE else "sm{}{}".format(*torch.cuda.get_device_capability())


def correctness(run: Run) -> None:
    """Each case: out/LSE/grads of the bf16 kernels vs an fp32 reference (FlashAttention rule
    against the bf16 reference's own error), and grads bitwise equal over two runs."""
    from attnhub_triton_portable.autograd import flash_attention

    from attnhub.plugin import reference_attention
    from attnhub.testing import fa_rule_error

    for name, layout, (q, k, v), params, ref_params, kw in _cases():
        ref_params = ref_params or params
        try:
            out, lse = flash_attention(q, k, v, params, layout, **kw)
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            again = torch.autograd.grad(flash_attention(q, k, v, params, layout, **kw)[0],
                                        (q, k, v), dout)
            bitwise = all(torch.equal(a, b) for a, b in zip(grads, again))
            nrows = int(params.cu_seqlens_q[-1]) if layout == "thd" else out.shape[0]
            worst = []
            for dtype in (torch.float32, DT):
                leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
                ref, ref_lse = reference_attention(*leaves, ref_params, layout=layout,
                                                   compute_dtype=dtype)
                rg = torch.autograd.grad(ref, leaves, dout[:nrows].to(dtype))
                worst.append((ref, ref_lse, rg))
            (r32, l32, g32), (rbf, _, gbf) = worst
            checks = [("out", out[:nrows], r32, rbf, 2.0)] + [
                (nm, g, a, b, 3.0) for nm, g, a, b in zip(("dq", "dk", "dv"), grads, g32, gbf)]
            parts, ok = [], bitwise or not params.deterministic
            for nm, got, r, rs, mult in checks:
                err, allowed = fa_rule_error(got, r, rs, mult)
                ok &= err <= allowed and not bool(torch.isnan(got).any())
                parts.append(f"{nm} {err:.2e}<={allowed:.2e}")
            fin = torch.isfinite(l32)
            lse_n = lse[:, :nrows] if layout == "thd" else lse
            lse_err = float((lse_n[fin] - l32[fin]).abs().max()) if bool(fin.any()) else 0.0
            out = out.detach()
            ok &= lse_err < 2e-2 and torch.equal(torch.isinf(lse_n), torch.isinf(l32))
            run.data["correctness"].append(
                f"{'PASS' if ok else 'FAIL'} {name}: {', '.join(parts)}, lse {lse_err:.1e}, "
                f"grads bitwise equal over 2 runs: {bitwise}")
        except Exception as exc:  # noqa: BLE001 - a failing case is a result, not a stop
            run.data["correctness"].append(f"ERROR {name}: {exc!r}"[:400])
            traceback.print_exc()
        print(run.data["correctness"][-1], flush=True)
        run.save()


# -- our kernels ------------------------------------------------------------------------------------
def precompile(run: Run, workers: int) -> None:
    """Compile every candidate config in parallel processes (the disk cache serves the run)."""
    from attnhub_triton_portable.configs import bwd_candidates, fwd_candidates

    arch = _arch()
    tasks = [("fwd", c, cfg) for c in (False, True) for cfg in fwd_candidates(arch, D, "bf16", c)]
    tasks += [("bwd", c, cfg) for c in (False, True)
              for cfg in bwd_candidates(arch, D, "bf16", c, deterministic=False)]
    tasks += [("case", False, {"index": i}) for i in range(len(_cases()))]
    if SMOKE:
        tasks = tasks[:2]
    t = time.time()
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=ctx) as pool:
        for name, secs, err in pool.map(_compile_task, tasks):
            run.data["compile"].append(f"{name}: {secs:.1f}s" + (f" ERROR {err}" if err else ""))
    run.data["notes"].append(f"{len(tasks)} candidate configs compiled in {time.time() - t:.0f}s "
                             f"over {workers} processes")
    run.save()


def bench_ours(run: Run, batch: int, seqlen: int, causal: bool, col: str) -> None:
    from attnhub_triton_portable import autotune
    from attnhub_triton_portable.autograd import flash_attention

    params = _params(causal)
    q, k, v = _qkv(batch, seqlen)
    n_log = len(autotune.TUNING_LOG)
    flash_attention(q, k, v, params)  # tunes on first call
    ms = bench_ms(lambda: flash_attention(q, k, v, params))
    run.record("fwd", "triton (ours)", col, tflops(batch, seqlen, causal, ms))
    q, k, v = _qkv(batch, seqlen, requires_grad=True)
    out, _ = flash_attention(q, k, v, params)
    dout = torch.randn_like(out)
    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # tunes on first call
    ms = bench_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    run.record("bwd", "triton (ours)", col, tflops(batch, seqlen, causal, ms, bwd=True))
    for key, cfg, t, err in autotune.TUNING_LOG[n_log:]:
        what = f"{key[0]} {col}"
        run.data["tuning"].append({"what": what, "config": cfg, "ms": t, "error": err})
    for kind in ("fwd", "bwd"):
        tried = [e for e in autotune.TUNING_LOG[n_log:] if e[0][0] == kind and e[2] is not None]
        if tried:
            run.data["chosen"][f"{kind} {col}"] = min(tried, key=lambda e: e[2])[1]
    run.save()


# -- peers -----------------------------------------------------------------------------------------
def bench_sdpa(run: Run, batch: int, seqlen: int, causal: bool, col: str) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"SDPA flash (FA2)": SDPBackend.FLASH_ATTENTION,
             "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION,
             "SDPA mem-efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, backend in names.items():
        try:
            q, k, v = (t.transpose(1, 2) for t in _qkv(batch, seqlen, requires_grad=True))
            with sdpa_kernel(backend):
                fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa
                out = fwd()
                run.record("fwd", name, col, tflops(batch, seqlen, causal, bench_ms(fwd)))
                dout = torch.randn_like(out)
                bwd = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa
                bwd()
                run.record("bwd", name, col, tflops(batch, seqlen, causal, bench_ms(bwd), True))
        except Exception as exc:  # noqa: BLE001 - a peer that fails is a result
            run.record("fwd", name, col, f"error: {type(exc).__name__}")
            print(repr(exc)[:300], flush=True)


def bench_fa3(run: Run, batch: int, seqlen: int, causal: bool, col: str) -> None:
    try:
        import fa3_fwd_config

        sys.modules.setdefault("flash_attn_config", fa3_fwd_config)
        from fa3_fwd_interface import flash_attn_func
    except ImportError:
        run.record("fwd", "FA3 (fa3-fwd)", col, "not installed")
        return
    q, k, v = _qkv(batch, seqlen)
    fwd = lambda: flash_attn_func(q, k, v, causal=causal)
    fwd()
    run.record("fwd", "FA3 (fa3-fwd)", col, tflops(batch, seqlen, causal, bench_ms(fwd)))


_FLEX: dict[str, Any] = {}


def bench_flex(run: Run, batch: int, seqlen: int, causal: bool, col: str) -> None:
    if run.elapsed() > run.deadline:
        run.record("fwd", "FlexAttention", col, "skipped (run deadline)")
        return
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # The timing loop calls backward with retain_graph=True, which donated buffers forbid.
        torch._functorch.config.donated_buffer = False
        fn = _FLEX.setdefault("fn", torch.compile(flex_attention))
        mask = (create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seqlen, seqlen,
                                  device=DEV) if causal else None)
        q, k, v = (t.transpose(1, 2) for t in _qkv(batch, seqlen, requires_grad=True))
        fwd = lambda: fn(q, k, v, block_mask=mask)
        with torch.no_grad():
            fwd()
            run.record("fwd", "FlexAttention", col, tflops(batch, seqlen, causal, bench_ms(fwd)))
        out = fwd()
        dout = torch.randn_like(out)
        bwd = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        bwd()
        run.record("bwd", "FlexAttention", col, tflops(batch, seqlen, causal, bench_ms(bwd), True))
    except Exception as exc:  # noqa: BLE001 - a peer that fails is a result
        run.record("fwd", "FlexAttention", col, f"error: {type(exc).__name__}")
        print(repr(exc)[:300], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("--commit", default=os.environ.get("ATTNHUB_COMMIT", "unknown"))
    ap.add_argument("--deadline", type=float, default=420.0,
                    help="seconds after which the slow Flex compiles are skipped")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    args = ap.parse_args()
    run = Run(args.out, args.commit, args.deadline)
    if not SMOKE:
        precompile(run, args.workers)
        os.environ["ATTNHUB_TRITON_AUTOTUNE"] = "0"  # correctness uses the table configs
    correctness(run)
    os.environ["ATTNHUB_TRITON_AUTOTUNE"] = "1"
    grid = [(s, c) for s in SEQLENS for c in (False, True)]
    for seqlen, causal in grid:
        col = f"{seqlen // 1024 if seqlen >= 1024 else seqlen}{'k' if seqlen >= 1024 else ''} " \
              f"{'causal' if causal else 'full'}"
        batch = max(1, TOKENS // seqlen)
        bench_ours(run, batch, seqlen, causal, col)
        if not SMOKE:
            bench_sdpa(run, batch, seqlen, causal, col)
            bench_fa3(run, batch, seqlen, causal, col)
    if not SMOKE:
        for seqlen, causal in sorted(grid, key=lambda sc: -sc[0]):  # 16k first: the headline
            col = f"{seqlen // 1024}k {'causal' if causal else 'full'}"
            bench_flex(run, TOKENS // seqlen, seqlen, causal, col)
    run.data["notes"].append(f"total run time {run.elapsed():.0f}s")
    run.save()
    print(run.markdown())


if __name__ == "__main__":
    main()
