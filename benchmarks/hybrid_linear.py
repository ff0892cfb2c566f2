"""GLA (hybrid_linear plugin) against fla and dense attention, on one GPU.

    python benchmarks/hybrid_linear.py --out docs/benchmarks          # on the H200
    python benchmarks/hybrid_linear.py --smoke --out /tmp/hl          # CPU check of the script

Measures, in bf16 with 16 heads of dim 128 (the dense-attention figures' shapes):
  1. correctness on the GPU: our chunked kernels against fla's chunk_gla and a torch fp32
     reference (outputs and gradients, relative RMSE);
  2. training/prefill throughput of the chunked form, forward and forward+backward, at 4k
     (batch 4) and 16k (batch 1) tokens, against fla's chunk_gla and dense causal attention
     (SDPA flash and cuDNN; FA3 forward when fa3-fwd is installed);
  3. decode: one recurrent step (state read, update, output) against a dense decode over a
     4k / 16k / 64k context, at batch 1 and 16; plus the whole backend call with its state
     cache;
  4. which implementation the backend's run-time probe picks (ours or fla).
Results go to ``<out>/hybrid_linear.json`` and ``.md`` after every section, so a run cut
short still reports what it measured. fla's autotuning is limited to its num_warps=4 configs
(at most 4 per kernel) to fit the GPU time: its fully tuned speed may be higher, and the
report says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from attnhub.timing import source_commit

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "hybrid_linear")]

T0 = time.perf_counter()


def _elapsed() -> float:
    return time.perf_counter() - T0


class Report:
    """Results plus where they are written; ``save`` rewrites JSON and markdown."""

    def __init__(self, out: Path, meta: dict[str, Any]):
        self.out = out
        self.data: dict[str, Any] = {"meta": meta, "correctness": [], "train": [],
                                     "decode": [], "probe": {}, "notes": []}

    def note(self, text: str) -> None:
        print("note:", text, flush=True)
        self.data["notes"].append(text)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.data["meta"]["elapsed_s"] = round(_elapsed(), 1)
        for name, text in (("hybrid_linear.json", json.dumps(self.data, indent=2)),
                           ("hybrid_linear.md", render(self.data))):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.out / name)


def render(d: dict[str, Any]) -> str:
    m = d["meta"]
    lines = [f"# GLA vs fla and dense attention ({m.get('gpu', '?')})", "",
             f"date {m['date']}, commit {m['commit']}, torch {m.get('torch')}, triton "
             f"{m.get('triton')}, fla {m.get('fla')}, dtype bf16, heads {m['heads']} x "
             f"dim {m['dim']}", ""]
    if d["correctness"]:
        lines += ["## Correctness on the GPU (relative RMSE)", "", "| check | value |", "|---|---|"]
        lines += [f"| {c['what']} | {c['value']:.2e} |" for c in d["correctness"]]
        lines.append("")
    if d["train"]:
        lines += ["## Chunked form (train/prefill): ms per call, tokens/s", "",
                  "| tokens | batch | impl | fwd ms | fwd Mtok/s | fwd+bwd ms | fwd+bwd Mtok/s |",
                  "|---|---|---|---|---|---|---|"]
        for r in d["train"]:
            lines.append(f"| {r['seqlen']} | {r['batch']} | {r['impl']} | {_f(r.get('fwd_ms'))} "
                         f"| {_f(r.get('fwd_mtok_s'))} | {_f(r.get('fwdbwd_ms'))} | "
                         f"{_f(r.get('fwdbwd_mtok_s'))} |")
        lines.append("")
    if d["decode"]:
        lines += ["## Decode: one step, microseconds", "",
                  "| batch | context | impl | us/step |", "|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r.get('context', '-')} | {r['impl']} | {_f(r.get('us'))} |"
                  for r in d["decode"]]
        lines.append("")
    if d["probe"]:
        lines += ["## Run-time probe (backend's choice)", "", "```",
                  json.dumps(d["probe"], indent=1), "```", ""]
    if d["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in d["notes"]] + [""]
    return "\n".join(lines)


def _f(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (script check)")
    ap.add_argument("--budget-s", type=float, default=165.0,
                    help="stop starting new sections after this many seconds (default 165)")
    ap.add_argument("--commit", default=None, help="commit id to record (default: git)")
    args = ap.parse_args()
    import torch

    if args.smoke and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    fla_version = _limit_fla_autotune()
    meta = {"date": datetime.date.today().isoformat(),
            "commit": args.commit or source_commit(ROOT),
            "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (smoke)",
            "torch": torch.__version__, "triton": triton.__version__, "fla": fla_version,
            "heads": 2 if args.smoke else 16, "dim": 16 if args.smoke else 128}
    rep = Report(Path(args.out), meta)
    if fla_version:
        rep.note("fla autotuning limited to its num_warps=4 configs (<= 4 per kernel) to fit "
                 "the GPU time; fully tuned fla may be faster than shown")
    sections: list[tuple[str, Callable[[], None]]] = [
        ("correctness", lambda: correctness(rep, dev, args.smoke)),
        ("train", lambda: train(rep, dev, args.smoke)),
        ("decode", lambda: decode(rep, dev, args.smoke)),
        ("probe", lambda: probe(rep, dev, args.smoke)),
    ]
    for name, fn in sections:
        if _elapsed() > args.budget_s:
            rep.note(f"section {name} skipped: time budget ({args.budget_s:.0f} s) used")
            continue
        t = _elapsed()
        try:
            fn()
        except Exception as exc:  # record and go on: one run must report all it can
            rep.note(f"section {name} failed: {type(exc).__name__}: {str(exc)[:300]}")
        print(f"section {name}: {_elapsed() - t:.1f} s", flush=True)
        rep.save()
    rep.save()
    print(render(rep.data))
    return 0


# -- helpers ---------------------------------------------------------------------------------
def _limit_fla_autotune() -> str | None:
    """Import fla (if installed) and keep at most 4 num_warps=4 configs per autotuner."""
    try:
        import fla
        import fla.ops.gla  # noqa: F401  (loads the GLA kernels whose autotuners we limit)
    except Exception:
        return None
    from triton.runtime.autotuner import Autotuner

    limited = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.ops"):
            continue
        for obj in vars(mod).values():
            for _ in range(4):  # heuristics/autotune wrappers nest through .fn
                if isinstance(obj, Autotuner) and len(obj.configs) > 1:
                    keep = [c for c in obj.configs if c.num_warps == 4][:4]
                    obj.configs = keep or obj.configs[:2]
                    limited += 1
                obj = getattr(obj, "fn", None)
    print(f"fla: limited {limited} autotuners", flush=True)
    return getattr(sys.modules["fla"], "__version__", "installed")


def _bench_ms(fn: Callable[[], Any], dev: str) -> float:
    import torch

    if dev == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()
    t = time.perf_counter()
    for _ in range(2):
        fn()
    torch.cuda.synchronize() if dev == "cuda" else None
    return (time.perf_counter() - t) / 2 * 1e3


def _inputs(b: int, t: int, h: int, d: int, dev: str, grad: bool = False):
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(b, t, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    g = F.logsigmoid(torch.randn(b, t, h, d, device=dev)) / 16
    if grad:
        for x in (q, k, v, g):
            x.requires_grad_()
    return q, k, v, g


def _impls(dev: str) -> dict[str, Callable]:
    """name -> chunked(q, k, v, g, scale) returning the output."""
    from attnhub_hybrid_linear import linear_torch

    out: dict[str, Callable] = {}
    if dev == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        from attnhub_hybrid_linear import linear_triton

        out["ours (triton)"] = lambda q, k, v, g, s: linear_triton.chunked(q, k, v, g, s)[0]
    try:
        from fla.ops.gla import chunk_gla

        out["fla chunk_gla"] = lambda q, k, v, g, s: chunk_gla(q, k, v, g, scale=s)[0]
    except Exception:
        pass
    if dev == "cpu":
        out["torch chunked"] = lambda q, k, v, g, s: linear_torch.chunked(q, k, v, g, s)[0]
    return out


# -- sections ----------------------------------------------------------------------------------
def correctness(rep: Report, dev: str, smoke: bool) -> None:
    import torch
    from attnhub_hybrid_linear import linear_torch
    from attnhub_hybrid_linear.metrics import rel_rmse

    b, t, h, d = (1, 100, 2, 16) if smoke else (1, 1024, 4, 128)
    q, k, v, g = _inputs(b, t, h, d, dev)
    scale = d ** -0.5
    do = torch.randn_like(v)
    ref_x = [x.detach().double().requires_grad_() for x in (q, k, v, g)]
    o_ref, _ = linear_torch.recurrent(*ref_x, scale)
    (o_ref * do.double()).sum().backward()
    for name, fn in _impls(dev).items():
        try:
            xs = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
            o = fn(*xs, scale)
            (o.double() * do.double()).sum().backward()
            rep.data["correctness"].append({"what": f"{name} o vs torch fp64 recurrent",
                                            "value": rel_rmse(o, o_ref)})
            for n, a, r in zip(("dq", "dk", "dv", "dg"), xs, ref_x):
                rep.data["correctness"].append({"what": f"{name} {n} vs torch fp64 recurrent",
                                                "value": rel_rmse(a.grad, r.grad)})
        except Exception as exc:
            rep.note(f"correctness {name}: {type(exc).__name__}: {str(exc)[:300]}")
        rep.save()
    from attnhub_hybrid_linear import linear_ops

    o_rec, _ = linear_ops.recurrent(q[:, :64], k[:, :64], v[:, :64], g[:, :64], scale)
    o_chk, _ = linear_torch.recurrent(q[:, :64].double(), k[:, :64].double(),
                                      v[:, :64].double(), g[:, :64].double(), scale)
    rep.data["correctness"].append({"what": "recurrent step (backend's choice) vs torch fp64",
                                    "value": rel_rmse(o_rec, o_chk)})


def train(rep: Report, dev: str, smoke: bool) -> None:
    import torch

    h, d = (2, 16) if smoke else (16, 128)
    shapes = [(64, 2), (128, 1)] if smoke else [(4096, 4), (16384, 1)]
    for t, b in shapes:
        impls = dict(_impls(dev))
        impls.update(_dense(dev))
        for name, fn in impls.items():
            if _elapsed() > 150:
                rep.note(f"train {t}: {name} skipped (time)")
                continue
            row: dict[str, Any] = {"seqlen": t, "batch": b, "impl": name}
            try:
                dense = name.startswith("dense")
                q, k, v, g = _inputs(b, t, h, d, dev)
                with torch.no_grad():
                    row["fwd_ms"] = _bench_ms(lambda: fn(q, k, v, g, d ** -0.5), dev)
                if "fwd only" not in name:
                    xs = [x.detach().requires_grad_() for x in (q, k, v, g)]
                    do = torch.randn_like(v)

                    def step() -> None:
                        fn(*xs, d ** -0.5).backward(do)
                        for x in xs:
                            x.grad = None

                    row["fwdbwd_ms"] = _bench_ms(step, dev)
                for key in ("fwd", "fwdbwd"):
                    if key + "_ms" in row:
                        row[key + "_mtok_s"] = b * t / row[key + "_ms"] / 1e3
                if dense:
                    flops = 4 * b * h * t * t * d / 2  # causal forward
                    row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rep.note(f"train {t} {name}: {row['error']}")
            rep.data["train"].append(row)
            rep.save()
            torch.cuda.empty_cache() if dev == "cuda" else None


def _dense(dev: str) -> dict[str, Callable]:
    """Dense causal attention on the same (B, T, H, D) tensors (g unused)."""
    import torch.nn.functional as F

    def sdpa(backend: Any) -> Callable:
        def run(q, k, v, g, s):  # type: ignore[no-untyped-def]
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                   v.transpose(1, 2), is_causal=True, scale=s)
            return o.transpose(1, 2)
        return run

    from torch.nn.attention import SDPBackend

    out = {"dense SDPA math" if dev == "cpu" else "dense SDPA flash (FA2)":
           sdpa(SDPBackend.MATH if dev == "cpu" else SDPBackend.FLASH_ATTENTION)}
    if dev == "cuda":
        out["dense SDPA cuDNN"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        fa3 = _fa3()
        if fa3 is not None:  # fa3-fwd is built without backward
            out["dense FA3 (fwd only)"] = lambda q, k, v, g, s: fa3.flash_attn_func(
                q, k, v, softmax_scale=s, causal=True)
    return out


def _fa3() -> Any:
    try:
        import fa3_fwd_config

        sys.modules.setdefault("flash_attn_config", fa3_fwd_config)
        import fa3_fwd_interface

        return fa3_fwd_interface
    except Exception:
        return None


def decode(rep: Report, dev: str, smoke: bool) -> None:
    import torch
    from attnhub_hybrid_linear import RecurrentStateCache
    from attnhub_hybrid_linear.linear_backends import GLABackend

    from attnhub.plugin import AttentionSpec, AttnParams, MaskSpec

    h, d = (2, 16) if smoke else (16, 128)
    batches = (1, 2) if smoke else (1, 16)
    contexts = (64, 256) if smoke else (4096, 16384, 65536)
    fa3 = _fa3() if dev == "cuda" else None
    for b in batches:
        q, k, v, g = _inputs(b, 1, h, d, dev)
        h0 = torch.randn(b, h, d, d, device=dev)
        for name, fn in _recurrent_impls().items():
            _timed(rep, {"batch": b, "context": "any", "impl": name},
                   lambda: fn(q, k, v, g, d ** -0.5, h0), dev)
        cache = RecurrentStateCache(layers=1, num_heads=h, key_dim=d, max_seqs=b, device=dev)
        for s in range(b):
            cache.allocate(s)
        backend = GLABackend()
        spec = AttentionSpec(phase="decode", dtype="bf16", head_dim=d, num_q_heads=h,
                             num_kv_heads=h, mask=MaskSpec(causal=True), max_seqlen_q=1,
                             max_seqlen_k=1, batch=b)

        def step() -> None:
            p = AttnParams(scale=d ** -0.5, causal=True,
                           extra={"recurrent_state": cache, "seq_ids": list(range(b)),
                                  "layer": 0})
            # the state has consumed everything before this token: context = position + 1
            ctx = cache.position(0, 0) + 1
            kk = k.expand(b, ctx, h, d) if ctx > 1 else k
            backend.forward(q, kk, v.expand(b, ctx, h, d) if ctx > 1 else v, spec, p)

        _timed(rep, {"batch": b, "context": "any",
                     "impl": "gla backend call (state cache read+write)"}, step, dev)
        for n in contexts:
            kc, vc = (torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
            _timed(rep, {"batch": b, "context": n, "impl": "dense SDPA"},
                   lambda: _sdpa_decode(q, kc, vc), dev)
            if fa3 is not None:
                _timed(rep, {"batch": b, "context": n, "impl": "dense FA3 kvcache"},
                       lambda: fa3.flash_attn_with_kvcache(q, kc, vc, causal=True), dev)
            rep.save()


def _timed(rep: Report, row: dict[str, Any], fn: Callable[[], Any], dev: str) -> None:
    """Time one decode variant into the report; a failure is noted, not fatal."""
    try:
        row["us"] = _bench_ms(fn, dev) * 1e3
    except Exception as exc:
        row["us"] = None
        rep.note(f"decode {row['impl']} b={row['batch']}: {type(exc).__name__}: "
                 f"{str(exc)[:200]}")
    rep.data["decode"].append(row)


def _recurrent_impls() -> dict[str, Callable]:
    """name -> one recurrent step (q, k, v, g, scale, state) for the installed kernels."""
    out: dict[str, Callable] = {}
    if os.environ.get("TRITON_INTERPRET") == "1" or _cuda():
        from attnhub_hybrid_linear import linear_triton

        out["ours recurrent step"] = linear_triton.recurrent
    try:
        from fla.ops.gla import fused_recurrent_gla

        out["fla fused_recurrent_gla"] = lambda q, k, v, g, s, h0: fused_recurrent_gla(
            q, k, v, gk=g, scale=s, initial_state=h0, output_final_state=True)
    except Exception:
        pass
    return out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _sdpa_decode(q, kc, vc):  # type: ignore[no-untyped-def]
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2),
                                          vc.transpose(1, 2))


def probe(rep: Report, dev: str, smoke: bool) -> None:
    from attnhub_hybrid_linear import linear_ops

    h, d = (2, 16) if smoke else (16, 128)
    for t, b in ((64, 1),) if smoke else ((4096, 4), (1, 16)):
        q, k, v, g = _inputs(b, t, h, d, dev)
        if t == 1:
            linear_ops.recurrent(q, k, v, g, d ** -0.5)
        else:
            linear_ops.chunked(q, k, v, g, d ** -0.5)
    rep.data["probe"] = {" ".join(map(str, key)): val for key, val in linear_ops.CHOICES.items()}
    if not linear_ops.CHOICES:
        rep.note("no probe ran (fla not installed or not on a GPU): ours is used")


if __name__ == "__main__":
    raise SystemExit(main())
