"""Decode on a contiguous KV cache that grows by one key per step, as transformers'
DynamicCache hands it over, timed on the GPU through the public API: the policy's call, each
decode backend forced, and raw SDPA, per call with host time included.

Per shape and method: ``--steps`` steps, each over a cache one key longer than the last
(transformers' layout: a contiguous (B, Hkv, S, D) tensor seen as bshd), ``--layers`` calls
per step with one ``BindContext`` per layer (the first layer of a step meets a new length,
the others reuse it, as in a model). Methods take turns by step and each walks its own
lengths (method m of M gets L + M*s + m), so no method meets a length another has warmed.
It prints host enqueue and device time per call over the whole walk (back to back, CUDA
events), checks every method's first output against raw SDPA in fp32, and writes JSON. Then one
prefill, and one training step, per new prompt length per backend: whether a backend pays a
build per shape (run it again with ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` to see torch's
ragged cuDNN path).

    python benchmarks/decode_growing_gpu.py [--steps 150] [--layers 4] [--json out.json] [--new-lengths-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnhub
from attnhub.core.decision import BindContext
from attnhub.timing import source_commit

#: (name, batch, context, query heads, KV heads, head dim): Llama-3-8B's tiny decode and
#: the two cells of benchmarks/hf_generate.py (a 1.1B model, d64)
SHAPES = [("llama8b 1 x 1k d128", 1, 1024, 32, 8, 128),
          ("hf 8 x 2k d64", 8, 2048, 32, 8, 64),
          ("hf 1 x 16k d64", 1, 16384, 32, 8, 64)]


def views(buf: torch.Tensor, b: int, hkv: int, s: int, d: int) -> torch.Tensor:
    """A contiguous (b, hkv, s, d) tensor over ``buf``'s storage, seen as bshd."""
    return buf.as_strided((b, hkv, s, d), (hkv * s * d, s * d, d, 1)).transpose(1, 2)


def raw_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), enable_gqa=True).transpose(1, 2)


def run_shape(name: str, b: int, ctx: int, hq: int, hkv: int, d: int, steps: int,
              layers: int, backends: list[str]) -> dict:
    dev = torch.device("cuda")
    methods = ["policy", *backends, "raw SDPA"]
    m = len(methods)
    top = ctx + m * steps + m
    kbuf = torch.randn(b * hkv * top * d, device=dev, dtype=torch.bfloat16)
    vbuf = torch.randn_like(kbuf)
    q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.bfloat16)
    ctxs = [BindContext(model="growing", layer=i) for i in range(layers)]
    hub = attnhub.Hub()
    calls = {}
    for meth in methods:
        if meth == "raw SDPA":
            calls[meth] = lambda k, v, c: raw_sdpa(q, k, v)
        else:
            forced = None if meth == "policy" else meth
            calls[meth] = (lambda f: lambda k, v, c: hub.attention(
                q, k, v, context=c, backend=f))(forced)
    walks = {meth: [(views(kbuf, b, hkv, ctx + m * s + i, d), views(vbuf, b, hkv, ctx + m * s + i, d))
                    for s in range(steps)] for i, meth in enumerate(methods)}
    row: dict = {"shape": name, "batch": b, "ctx": ctx, "heads": f"{hq}:{hkv}", "d": d,
                 "steps": steps, "layers": layers, "methods": {}}
    k0, v0 = views(kbuf, b, hkv, ctx - 1, d), views(vbuf, b, hkv, ctx - 1, d)
    want = raw_sdpa(q.float(), k0.float(), v0.float())
    for meth in methods:  # warm-up on a length no walk uses, and the check
        try:
            got = calls[meth](k0, v0, ctxs[0]).float()
            err = (got - want).abs().max().item()
            row["methods"][meth] = {"max_err_vs_fp32": err}
            if meth == "policy":
                row["policy_binds"] = hub.bound()[-1].decision.backend
        except Exception as e:  # noqa: BLE001 - a method that cannot serve is reported
            row["methods"][meth] = {"error": f"{type(e).__name__}: {e}"[:200]}
    live = [x for x in methods if "error" not in row["methods"][x]]
    host = {x: 0.0 for x in live}
    dev_t = {x: 0.0 for x in live}
    per_step: dict[str, list[float]] = {x: [] for x in live}
    for s in range(steps):  # methods take turns by step; each step timed as a block
        for x in (live if s % 2 == 0 else live[::-1]):
            k, v = walks[x][s]
            fn = calls[x]
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            for c in ctxs:
                fn(k, v, c)
            host[x] += time.perf_counter() - t0
            e1.record()
            e1.synchronize()
            dev_t[x] += e0.elapsed_time(e1) * 1e-3
            per_step[x].append(e0.elapsed_time(e1) * 1e3 / layers)
    n = steps * layers
    for x in live:
        row["methods"][x].update(host_us=host[x] / n * 1e6, call_us=dev_t[x] / n * 1e6,
                                 median_step_call_us=statistics.median(per_step[x]),
                                 max_step_call_us=max(per_step[x]))
    print(f"\n{name} (batch {b}, {ctx}+ keys, {hq}:{hkv} heads, d{d}; {steps} steps x "
          f"{layers} layers; policy binds {row.get('policy_binds')})")
    for x in methods:
        r = row["methods"][x]
        if "error" in r:
            print(f"  {x:16s} cannot serve: {r['error']}")
        else:
            print(f"  {x:16s} mean {r['call_us']:8.1f} us/call (host {r['host_us']:7.1f})  "
                  f"median step {r['median_step_call_us']:7.1f} us/call  worst step "
                  f"{r['max_step_call_us']:9.1f}  err {r['max_err_vs_fp32']:.1e}")
    return row


def prefill_new_lengths(backends: list[str], n: int = 4, train: bool = False) -> dict:
    """Causal prefill (or, with ``train``, forward + backward) of a prompt of a new length per
    call (1 x 4096+7i+1, 32/8 heads, d128): whether a backend pays a per-shape build (cuDNN
    builds a graph per shape). Each backend's first output is checked against fp32 SDPA."""
    dev = torch.device("cuda")
    hub = attnhub.Hub()
    res: dict = {}
    what = "train fwd+bwd" if train else "prefill"
    print(f"\n{what}, causal, a new prompt length per call (1 x 4096+i, 32:8 heads, d128)")
    for j, name in enumerate(backends):
        times, err = [], None
        try:
            for i in range(n + 1):
                sq = 4096 + 7 * (i * len(backends) + j) + 1  # no backend meets another's
                q = torch.randn(1, sq, 32, 128, device=dev, dtype=torch.bfloat16,
                                requires_grad=train)
                k, v = (torch.randn(1, sq, 8, 128, device=dev, dtype=torch.bfloat16,
                                    requires_grad=train) for _ in range(2))

                def call() -> torch.Tensor:
                    out = hub.attention(q, k, v, causal=True, backend=name)
                    if train:
                        out.sum().backward()
                    return out

                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = call()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e6)
                if i == 0:
                    ref = F.scaled_dot_product_attention(
                        *(x.detach().float().transpose(1, 2) for x in (q, k, v)),
                        is_causal=True, enable_gqa=True).transpose(1, 2)
                    err = (out.detach().float() - ref).abs().max().item()
            torch.cuda.synchronize()
            again = time.perf_counter()
            call()
            torch.cuda.synchronize()
            res[name] = {"new_length_us": times[1:], "max_err_vs_fp32": err,
                         "repeat_us": (time.perf_counter() - again) * 1e6}
            print(f"  {name:14s} new lengths {', '.join(f'{t:.0f}' for t in times[1:])} us; "
                  f"same length again {res[name]['repeat_us']:.0f} us; err {err:.1e}")
        except Exception as e:  # noqa: BLE001 - reported
            res[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            print(f"  {name:14s} cannot serve: {res[name]['error']}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--backends", nargs="*", default=["torch_sdpa", "triton_decode"])
    ap.add_argument("--prefill-backends", nargs="*",
                    default=["torch_sdpa", "cudnn", "fa3", "triton"])
    ap.add_argument("--train-backends", nargs="*", default=["torch_sdpa", "cudnn", "triton"])
    ap.add_argument("--new-lengths-only", action="store_true",
                    help="only the prefill / training calls at new lengths")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_growing_gpu.py needs a CUDA GPU (benchmarks/decode_growing_cache.py "
                 "measures the host path on the CPU)")
    rows = [] if args.new_lengths_only else [
        run_shape(*s, args.steps, args.layers, args.backends) for s in SHAPES]
    prefill = prefill_new_lengths(args.prefill_backends)
    train = prefill_new_lengths(args.train_backends, train=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "gpu": torch.cuda.get_device_name(), "commit": source_commit(),
           "torch": torch.__version__, "rows": rows, "prefill_new_lengths": prefill,
           "train_new_lengths": train,
           "TORCH_CUDNN_SDPA_AVOID_RECOMPILE": os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
