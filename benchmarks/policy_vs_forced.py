"""Why a cell's policy call and the same backend forced can time differently: for one regret
cell, the backend each call path runs (decision, runner chain, fallbacks), the CUDA kernels
each launches (torch.profiler), and their times sampled in turn.

    python benchmarks/policy_vs_forced.py [--cell "decode contiguous 16 x 4k"] [--backend torch_sdpa]
        [--profile N]

``--profile N`` adds torch.profiler's table of N back-to-back policy calls (host and CUDA
time per op): where a call's time goes when it is far above its kernels' time.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import attnhub
from attnhub import regret as rg
from attnhub.benchmark import make_inputs


def kernels(fn) -> list[str]:
    """Names of the CUDA kernels one call launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="decode contiguous 16 x 4k")
    ap.add_argument("--backend", default="torch_sdpa")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    args = ap.parse_args()
    cell = next(c for c in rg.standard_grid("bf16") if c.name == args.cell)
    dev = torch.device("cuda")
    inp = make_inputs(cell.spec, dev, softcap=cell.softcap)
    hub = attnhub.Hub()
    kw = inp.api_kwargs()
    calls = {"policy": lambda: hub.attention(inp.q, inp.k, inp.v, **kw),
             "forced": lambda: hub.attention(inp.q, inp.k, inp.v, backend=args.backend, **kw)}
    for name, fn in calls.items():
        fn()
        r = hub.bound()[-1]
        print(f"{name}: decision {r.decision.backend} rule {r.decision.rule} chain "
              f"{[b.name for b in r.chain]}; kernels {kernels(fn)}")
    print("fallbacks", dict(hub.fallback_counts))
    times: dict[str, list[float]] = {k: [] for k in calls}
    for i in range(args.repeats):
        for name in (calls if i % 2 == 0 else reversed(list(calls))):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            calls[name]()
            e.record()
            e.synchronize()
            times[name].append(s.elapsed_time(e) * 1e3)
    for name, t in times.items():
        print(f"{name}: median {statistics.median(t):.1f} us, p10 "
              f"{sorted(t)[len(t) // 10]:.1f} us over {len(t)} single calls")
    for name, fn in calls.items():
        host, batched = back_to_back(fn, 50)
        print(f"{name}: {batched:.1f} us per call over 50 back-to-back calls (CUDA events), "
              f"of which the host spent {host:.1f} us per call enqueueing")
    if args.profile:
        print(profile_table(calls["policy"], args.profile))


def back_to_back(fn, n: int) -> tuple[float, float]:
    """(host us, device us) per call over ``n`` back-to-back calls: the host's enqueue time
    (``perf_counter``, no sync inside) and the CUDA-event time to the last kernel's end.
    When the first is the larger, the call is bound by the host."""
    import time

    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    e.record()
    e.synchronize()
    return (t1 - t0) * 1e6 / n, s.elapsed_time(e) * 1e3 / n


def profile_table(fn, n: int) -> str:
    """torch.profiler over ``n`` back-to-back calls: ops by self CPU time, with CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


if __name__ == "__main__":
    main()
