"""Host time of one ``triton_decode`` call, measured on the CPU with the GPU launch stubbed.

Eager decode at small contexts is bound by the host: on the H200 one call cost ~150 us of
host work against 38 us for SDPA (docs/benchmarks/triton_decode.md). This script measures
that work on a machine without a GPU (``attnhub_triton_portable.launch_stub``): the decode
kernels are ordinary (compiled, not interpreted) Triton kernels, Triton's driver reports an
sm90 GPU, compiling yields a stub binary whose C launcher only counts (behind Triton's own
Python launcher wrapper, ``CudaLauncher.__call__``, which a launch through Triton's dispatch
runs as on a GPU), and the plugin's device queries answer "sm90, 132 SMs". Everything else
runs for real: the backend's forward, the plan and split choice, the allocations, Triton's
per-launch Python where it runs (binding, specialization, cache key, launch metadata, the
wrapper), so the figure is a call's host time minus the C launcher's work (reading the
arguments, ``cuLaunchKernel``) and minus the CUDA calls that torch makes (stream, device,
capture status): the part Python code can cut. Cases: the kernel entry
``decode_attention``, the backend's ``forward``, and ``Hub.attention`` with the backend
forced (1 sequence, 32/8 heads, d=128, bf16; contiguous and 16-key pages).

Per case it prints microseconds per call (median of ``--repeats`` runs of ``--calls``
calls; by default this thread's CPU time, which the other work of a shared machine inflates
far less than wall time: ``--clock wall`` for elapsed time), torch allocations and
host-sync calls per call (``.item()``, ``.tolist()``, ``int(t)``..., counted with a
TorchFunctionMode) and kernel launches per call. ``--check`` also has every stub launch
verify that Triton would specialize its arguments exactly as the binary it launches
(slower; a correctness check of the direct launch path).

    python benchmarks/decode_host_overhead.py [--calls 2000] [--check] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels (stubbed), not the interpreter

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "triton_portable")]

import triton
from attnhub_triton_portable.launch_stub import StubKernel, stub_triton
from triton.runtime.jit import JITFunction

#: 32 query / 8 KV heads, d=128, bf16: the shape of docs/benchmarks/triton_decode.md.
HQ, HKV, D, PAGE = 32, 8, 128, 16
SM90_SMS = 132


def load_decode() -> Any:
    """The decode module with compiled (not interpreted) kernels and sm90 device answers."""
    from attnhub_triton_portable import decode

    for name in ("_split_kernel", "_merge_kernel"):
        if not isinstance(getattr(decode, name), JITFunction):
            raise SystemExit(f"decode.{name} is not a JITFunction: unset TRITON_INTERPRET")
    decode._check_interpreter = lambda device: None  # CPU tensors, compiled kernels: stubbed
    decode.device_arch = lambda device: "sm90"
    decode._sm_count = lambda index: SM90_SMS
    return decode


_SYNCS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu",
          "numpy", "nonzero", "equal", "allclose", "any", "all"}
_ALLOCS = {"empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like",
           "full_like", "new_empty", "new_zeros", "new_full", "new_ones", "clone",
           "contiguous", "to", "tensor", "as_tensor", "arange", "cat", "stack"}


class _Count(TorchFunctionMode):
    """Counts torch calls by name: allocations and host syncs are what we look for."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def counts(fn: Callable[[], Any], stubs: dict[str, list[StubKernel]],
           calls: int = 10) -> dict[str, Any]:
    """Allocating and syncing torch calls, and kernel launches, per call of ``fn``."""
    fn()
    launched = lambda: sum(k.launches for made in stubs.values() for k in made)
    before = launched()
    with _Count() as c:
        for _ in range(calls):
            fn()
    per = {k: v / calls for k, v in c.calls.items()}
    return {"allocs": sum(v for k, v in per.items() if k in _ALLOCS),
            "syncs": sum(v for k, v in per.items() if k in _SYNCS),
            "launches": (launched() - before) / calls,
            "torch_calls": dict(sorted(per.items()))}


def per_call_us(fn: Callable[[], Any], calls: int, repeats: int,
                sync: Callable[[], None] = lambda: None,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Median over ``repeats`` of the mean time of ``calls`` back-to-back calls (and one
    ``sync`` at the end, so that on a GPU a call's time is max(host, GPU) per call).
    ``clock``: wall time by default; ``time.thread_time`` counts only this thread's CPU
    time, which other work on a shared machine inflates far less."""
    for _ in range(min(calls, 200)):
        fn()
    sync()
    runs = []
    for _ in range(repeats):
        t = clock()
        for _ in range(calls):
            fn()
        sync()
        runs.append((clock() - t) / calls * 1e6)
    return statistics.median(runs)


def cases(decode: Any, ctx: int, dev: str = "cpu") -> dict[str, Callable[[], Any]]:
    """Contiguous and paged calls: the kernel entry, the backend's forward (and the FP8
    backend's over an e4m3 paged cache), and the hub."""
    from attnhub_triton_portable.backend_decode import TritonDecodeBackend, TritonDecodeFp8Backend

    from attnhub import AttentionSpec, Hub
    from attnhub.plugin import AttnParams

    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to(dev, torch.bfloat16)
    q, k, v = mk(1, 1, HQ, D), mk(1, ctx, HKV, D), mk(1, ctx, HKV, D)
    pages = ctx // PAGE
    kc, vc = k.view(pages, PAGE, HKV, D), v.view(pages, PAGE, HKV, D)
    table = torch.randperm(pages, generator=g).view(1, pages).to(dev, torch.int32)
    lens = torch.full((1,), ctx, dtype=torch.int32, device=dev)
    scale = D ** -0.5
    backend, fp8 = TritonDecodeBackend(), TritonDecodeFp8Backend()
    backend.load()
    fp8.load()
    # an e4m3 cache with per-(page, KV head) descales, as core.kvquant keeps it
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    descales = {"k_descale": torch.rand(pages, HKV, generator=g).to(dev) + 0.5,
                "v_descale": torch.rand(pages, HKV, generator=g).to(dev) + 0.5}
    spec = AttentionSpec(phase="decode", dtype="bf16", head_dim=D, num_q_heads=HQ,
                         num_kv_heads=HKV, layout="bshd", max_seqlen_q=1, max_seqlen_k=ctx,
                         batch=1).bucketed()
    pspec = AttentionSpec(phase="decode", dtype="bf16", head_dim=D, num_q_heads=HQ,
                          num_kv_heads=HKV, layout="paged", max_seqlen_q=1,
                          max_seqlen_k=ctx, batch=1, page_size=PAGE).bucketed()
    pspec8 = AttentionSpec(phase="decode", dtype="bf16", kv_dtype="fp8_e4m3", head_dim=D,
                           num_q_heads=HQ, num_kv_heads=HKV, layout="paged", max_seqlen_q=1,
                           max_seqlen_k=ctx, batch=1, page_size=PAGE).bucketed()
    # on the CPU a simulated sm90, so that the backend's checks pass for CPU tensors
    hub = Hub(hardware="sm90" if dev == "cpu" else None)
    return {
        "decode_attention contiguous": lambda: decode.decode_attention(q, k, v, scale=scale),
        "backend.forward contiguous": lambda: backend.forward(
            q, k, v, spec, AttnParams(scale=scale, max_seqlen_q=1, max_seqlen_k=ctx)),
        "backend.forward paged16": lambda: backend.forward(
            q, kc, vc, pspec, AttnParams(scale=scale, block_table=table, seqlens_k=lens,
                                         max_seqlen_q=1, max_seqlen_k=ctx)),
        "backend.forward paged16 fp8": lambda: fp8.forward(
            q, kc8, vc8, pspec8, AttnParams(scale=scale, block_table=table, seqlens_k=lens,
                                            max_seqlen_q=1, max_seqlen_k=ctx, extra=descales)),
        "hub.attention contiguous": lambda: hub.attention(q, k, v, backend="triton_decode"),
        "hub.attention paged16": lambda: hub.attention(
            q, kc, vc, layout="paged", block_table=table, seqlens_k=lens,
            backend="triton_decode"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: launches stubbed (above); cuda: real kernels, see gpu_main")
    ap.add_argument("--ctx", type=int, default=1024, help="context length (1 sequence)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu (stubbed runs): this thread's CPU time, steadier on a shared "
                         "machine; wall: elapsed time")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--profile", default=None, help="cProfile this case name, print top 25")
    ap.add_argument("--check", action="store_true",
                    help="verify each launch's specialization against its binary's")
    args = ap.parse_args()
    results: dict[str, Any] = {"triton": triton.__version__, "torch": torch.__version__,
                               "device": args.device, "ctx": args.ctx, "cases": {},
                               "clock": "wall" if args.device == "cuda" else args.clock}
    if args.device == "cuda":
        gpu_main(args, results)
    else:
        decode = load_decode()
        from attnhub_triton_portable import decode_gluon  # the e4m3 pages' pass 1 on sm90

        with stub_triton([decode._split_kernel, decode._merge_kernel,
                          decode_gluon._fp8_paged_split_kernel], check=args.check) as stubs:
            for name, fn in cases(decode, args.ctx).items():
                results["cases"][name] = measure(name, fn, stubs.made, args)
                stubs.log.clear()
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, args.json)


def gpu_main(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """On a GPU, real kernels, each case with the direct launch on and off (Triton's
    dispatch on every launch, as before the direct path existed):

    * host-bound time per call at 1 x ``--ctx`` (1k: ~6 us of GPU work per call), no sync
      between calls, the same cases as on the CPU, plus SDPA for reference;
    * eager time per call at 1 x 32k, ``triton.testing.do_bench`` (L2 flushed, no CUDA
      graphs), the figure that was 124 us (1.08 TB/s) in docs/benchmarks/triton_decode.md,
      against SDPA; outputs checked: direct == dispatch bit for bit, and the FlashAttention
      rule against an fp32 reference (2x SDPA's bf16 error plus rounding).

        ATTNHUB_PLUGIN_MODULES=attnhub_triton_portable.plugin \\
            python benchmarks/decode_host_overhead.py --device cuda --json out.json
    """
    import torch.nn.functional as F
    from attnhub_triton_portable import decode, fastlaunch

    os.environ.setdefault("ATTNHUB_PLUGIN_MODULES", "attnhub_triton_portable.plugin")
    sync = torch.cuda.synchronize
    results["gpu"] = torch.cuda.get_device_name()
    for direct in (True, False):
        fastlaunch.DIRECT = direct
        tag = "direct" if direct else "triton_dispatch"
        for name, fn in cases(decode, args.ctx, "cuda").items():
            us = per_call_us(fn, args.calls, args.repeats, sync)
            results["cases"][f"{name} [{tag}]"] = {"us_per_call": us}
            print(f"{name:30s} [{tag:15s}] {us:7.2f} us/call (1 x {args.ctx})", flush=True)
    fastlaunch.DIRECT = True
    results["cases"]["sdpa contiguous"] = sdpa_case(args, sync, F)
    results["eager_32k"] = eager_32k(decode, fastlaunch, F)


def _qkv_cuda(ctx: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g,
                                dtype=torch.bfloat16)
    return mk(1, 1, HQ, D), mk(1, ctx, HKV, D), mk(1, ctx, HKV, D)


def sdpa_case(args: argparse.Namespace, sync: Callable[[], None], F: Any) -> dict[str, float]:
    q, k, v = (t.transpose(1, 2) for t in _qkv_cuda(args.ctx))
    us = per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                     args.calls, args.repeats, sync)
    print(f"{'sdpa contiguous':30s} [{'':15s}] {us:7.2f} us/call (1 x {args.ctx})")
    return {"us_per_call": us}


def eager_32k(decode: Any, fastlaunch: Any, F: Any) -> dict[str, Any]:
    """do_bench at 1 x 32k, contiguous and 16-key pages, direct and Triton dispatch, SDPA."""
    ctx = 32768
    q, k, v = _qkv_cuda(ctx)
    pages = ctx // PAGE
    perm = torch.randperm(pages, device="cuda")
    kc = torch.empty(pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    kc[perm], vc[perm] = k.view(pages, PAGE, HKV, D), v.view(pages, PAGE, HKV, D)
    table = perm.view(1, pages).to(torch.int32)
    lens = torch.full((1,), ctx, device="cuda", dtype=torch.int32)
    scale = D ** -0.5
    ours = {"contiguous": lambda: decode.decode_attention(q, k, v, scale=scale),
            "paged16": lambda: decode.decode_attention(q, kc, vc, scale=scale,
                                                      block_table=table, seqlens_k=lens,
                                                      max_seqlen_k=ctx)}
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, scale=scale,
                                                  enable_gqa=True)
    ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), scale=scale,
                                         enable_gqa=True).transpose(1, 2)
    base = float((sdpa().transpose(1, 2).float() - ref).abs().max())
    floor = float((ref.bfloat16().float() - ref).abs().max())
    nbytes = 2 * ctx * HKV * D * 2
    bench = lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=100,
                                                     return_mode="median")) * 1e3
    res: dict[str, Any] = {"sdpa": {"us": bench(sdpa), "max_err": base}}
    for name, fn in ours.items():
        fastlaunch.DIRECT = False
        slow_out = fn()[0]
        slow_us = bench(fn)
        fastlaunch.DIRECT = True
        out = fn()[0]
        err = float((out.float() - ref).abs().max())
        res[name] = {"direct_us": bench(fn), "triton_dispatch_us": slow_us,
                     "direct_equals_dispatch": bool(torch.equal(out, slow_out)),
                     "max_err": err, "fa_rule_ok": err <= 2 * base + floor + 1e-5}
    for name, r in res.items():
        for key in [k for k in r if k.endswith("us")]:
            r[key.replace("us", "TBps")] = nbytes / r[key] / 1e6
        print(f"1 x 32k eager {name:10s} {json.dumps(r)}", flush=True)
    return res


def measure(name: str, fn: Callable[[], Any], stubs: dict[str, list[StubKernel]],
            args: argparse.Namespace) -> dict[str, Any]:
    """Time, count and optionally profile one case; prints one line."""
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    res = {"us_per_call": per_call_us(fn, args.calls, args.repeats, clock=clock),
           **counts(fn, stubs)}
    print(f"{name:30s} {res['us_per_call']:7.2f} us/call  allocs {res['allocs']:.0f}  "
          f"syncs {res['syncs']:.0f}  launches {res['launches']:.0f}", flush=True)
    if args.profile == name:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(lambda: [fn() for _ in range(args.calls)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return res


if __name__ == "__main__":
    main()
