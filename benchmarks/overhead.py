"""Host cost of ``attnhub.attention`` over the bound backend called directly.

Two shapes where the kernel is short, so the difference is attnhub's per-call work:
- tiny decode: 1 query token, 32/8 heads, d128, 1k keys, causal=True (bshd, the HF
  DynamicCache decode step);
- paged decode step: batch 8, 1k-token contexts in a paged cache (page 16), 32/8 heads, d128.

``--walks`` adds the calls whose length changes every call, as the regret grid's walking
cells make them (a new shape each call: the hub's length-bucket table, not its exact one):
- growing cache: 8 x 2k+ keys, 32/8 heads, d64, one key more per call (HF DynamicCache);
- new-length prefill: causal 1 x 4k+, 8/2 heads, d64, a new prompt length per call;
- the same prefill at one fixed length (4k);
each beside SDPA called directly (its cuDNN kernel off, as torch_sdpa runs it) and, where the
fa3 backend serves, FA3's own ``flash_attn_func``.

For each: raw torch SDPA (tiny decode only), the backend the policy binds called directly
(``backend.forward`` with a prepared spec and params: no attnhub call path at all), and
``attnhub.attention`` through the policy and with that backend forced. Each figure is the
median host time per call (``perf_counter`` around the call; the GPU queue absorbs the
kernels and is drained between chunks, outside the timing), the cases interleaved in chunks
of 100 calls in a random order (see ``measure``), in ``--rounds`` passes spread over the run
(pass 1 of every case, then pass 2...), each figure the minimum of its passes' medians (the
JSON keeps every pass), as the GPU timings take the minimum over rounds.

Decoding runs without autograd (HF ``generate`` under ``torch.no_grad``, vLLM and SGLang
under ``torch.inference_mode``), so the headline figures are taken under
``torch.inference_mode()``; the same cases with autograd on (a decode step called from
ordinary code) follow as ``*_grad_enabled``. Target (issue 15): policy - direct <= 5 us.

    python benchmarks/overhead.py [--device cuda] [--calls 20000] [--json] [--profile]
                                  [--walks] [--kernels]

``--profile`` adds, per case, a cProfile of the policy call and of the direct call (the
functions with the most own time): where the added microseconds go. ``--kernels`` lists,
per case, the device kernels one policy call and one direct call launch (torch.profiler):
attnhub must launch exactly the kernels of the backend it binds.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import math
import pstats
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import attnhub
from attnhub.core.kvcache import PagedKVCache
from attnhub.core.spec import AttnParams

BOUND_US = 5.0
#: Seconds each case runs before the timed calls (see ``measure``).
WARM_S = 0.5


def measure(cases: dict[str, Callable[[], object]], calls: int, rounds: int,
            sync: Callable[[], None], chunk: int = 100, seed: int = 0,
            warm_s: float = WARM_S) -> dict[str, float]:
    """Median host microseconds per call of each case (``perf_counter`` around each call,
    no synchronisation inside a chunk: the GPU queue absorbs its kernels), over ``rounds``
    x ``calls`` calls taken in chunks of ``chunk`` calls, the cases in a fresh random order
    per chunk step. Every case samples every stretch of the run, so a drift of the host
    (clock, neighbours) hits all cases alike instead of whichever case ran in a bad second.
    The queue is drained after every chunk (untimed): a chunk never waits on the kernels of
    the chunks before it, which would time the GPU, not the host."""
    order = list(cases)
    rng = random.Random(seed)
    # warm-up: caches, allocator, compiled kernels, and the host's clock: on the H200 host
    # the first case measured after other work once ran 1.5x slower than a minute later
    # (triton_decode direct 29.1 vs 19.9 us), so each case runs for at least ``warm_s`` first
    for fn in cases.values():
        end = time.perf_counter() + warm_s
        n = 0
        while n < min(200, calls) or (time.perf_counter() < end and n < calls):
            fn()
            n += 1
            if n % 100 == 0:
                sync()
    sync()
    times: dict[str, list[int]] = {name: [] for name in cases}
    clock = time.perf_counter_ns
    for _ in range(max(1, rounds * calls // chunk)):
        rng.shuffle(order)
        for name in order:
            fn, out = cases[name], times[name]
            for _ in range(chunk):
                t0 = clock()
                fn()
                out.append(clock() - t0)
            sync()
    return {name: statistics.median(t) / 1e3 for name, t in times.items()}


def profile_calls(fn: Callable[[], object], calls: int, top: int = 18) -> str:
    """cProfile of ``calls`` calls of ``fn``: the ``top`` functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def direct_call(hub: attnhub.Hub, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                params: AttnParams) -> tuple[str, Callable[[], object]]:
    """The backend the hub bound for the last call, called directly with its spec."""
    runner = hub.bound()[-1]
    backend, spec = runner.chain[0], runner.decision.spec
    backend.load()
    return backend.name, lambda: backend.forward(q, k, v, spec, params)


def decode_cases(hub: attnhub.Hub, dev: torch.device, dtype: torch.dtype
                 ) -> dict[str, tuple[str, str, dict[str, Callable[[], object]]]]:
    """Per case: (bound backend, shape, the calls to time: direct, policy, forced, and raw
    SDPA for the tiny decode). Each call is made once here, which binds it."""
    scale = 1 / math.sqrt(128)
    # tiny decode, contiguous KV
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=dtype)
    k = torch.randn(1, 1024, 8, 128, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    hub.attention(q, k, v, causal=True)
    params = AttnParams(scale=scale, causal=True, max_seqlen_q=1, max_seqlen_k=1024)
    name, direct = direct_call(hub, q, k, v, params)
    tiny = {"raw_sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
            "direct": direct,
            "policy": lambda: hub.attention(q, k, v, causal=True),
            "forced": lambda: hub.attention(q, k, v, causal=True, backend=name)}

    # paged decode step
    b, ctx, page = 8, 1024, 16
    cache = PagedKVCache(num_layers=1, num_pages=b * ctx // page, page_size=page,
                         num_kv_heads=8, head_dim=128, dtype=dtype, device=dev)
    seqs = [cache.allocate() for _ in range(b)]
    kv = torch.randn(b * ctx, 8, 128, device=dev, dtype=dtype)
    cache.write(0, cache.reserve(seqs, ctx), kv, kv.clone())
    table, lens = cache.block_table(seqs), cache.seqlens(seqs)
    kc, vc = cache.k_cache(0), cache.v_cache(0)
    qp = torch.randn(b, 1, 32, 128, device=dev, dtype=dtype)
    hub.attention(qp, kc, vc, layout="paged", block_table=table, seqlens_k=lens, causal=True)
    pparams = AttnParams(scale=scale, causal=True, block_table=table, seqlens_k=lens,
                         max_seqlen_q=1, max_seqlen_k=ctx)
    pname, pdirect = direct_call(hub, qp, kc, vc, pparams)
    step = {"direct": pdirect,
            # written out as a caller writes it (no ** of a dict per call)
            "policy": lambda: hub.attention(qp, kc, vc, layout="paged", block_table=table,
                                            seqlens_k=lens, causal=True),
            "forced": lambda: hub.attention(qp, kc, vc, layout="paged", block_table=table,
                                            seqlens_k=lens, causal=True, backend=pname)}
    return {"tiny_decode": (name, "1 query, 1k keys, causal, bshd", tiny),
            "paged_decode_step": (pname, f"b={b} ctx={ctx} page={page}", step)}


def cycling(items: list[tuple[Any, ...]], fn: Callable[..., object]) -> Callable[[], object]:
    """A call of ``fn`` on the next of ``items`` each time (every case pays this alike)."""
    nxt = itertools.cycle(items).__next__
    return lambda: fn(*nxt())


def walk_cases(hub: attnhub.Hub, dev: torch.device, dtype: torch.dtype, scale: int = 1
               ) -> dict[str, tuple[str, str, dict[str, Callable[[], object]]]]:
    """The walking cells (a new length per call) and a fixed-length prefill beside them:
    direct (the bound backend's ``forward`` with each length's params, made beforehand),
    policy, forced, raw SDPA without cuDNN, and raw FA3 where the fa3 backend serves.
    ``scale`` divides every length (CPU dry runs)."""
    from attnhub.core.builtin import sdpa

    out: dict[str, tuple[str, str, dict[str, Callable[[], object]]]] = {}
    shapes = (("growing_cache_decode", "8 x 2k+ keys, 32/8 heads, d64, one key more per call",
               8, 32, 8, 64, 1, range(2048 // scale + 1, 4096 // scale + 1)),
              ("new_length_prefill", "causal 1 x 4k+, 8/2 heads, d64, a new length per call",
               1, 8, 2, 64, 0, range(4096 // scale + 1, 8192 // scale + 1, 7)),
              ("fixed_prefill", "causal 1 x 4k, 8/2 heads, d64", 1, 8, 2, 64, 0,
               range(4096 // scale, 4096 // scale + 1)))
    fa = None
    try:
        from attnhub_sm90_fa3.build import fa3_build, import_interface
        build = fa3_build()
        fa = import_interface(build) if build.module is not None else None
    except ImportError:
        pass
    for case, shape, b, hq, hkv, d, sq, lengths in shapes:
        top = lengths[-1]
        bufs = [torch.randn(b * h * top * d, device=dev, dtype=dtype) for h in (hq, hkv, hkv)]
        views = []
        for s in lengths:
            n = sq or s
            if sq:  # decode: a (B, Hkv, S, D) cache seen as bshd, as transformers passes it
                kv = [buf[:b * hkv * s * d].view(b, hkv, s, d).transpose(1, 2)
                      for buf in bufs[1:]]
                q = bufs[0][:b * n * hq * d].view(b, n, hq, d)
            else:
                q, *kv = (buf[:b * s * h * d].view(b, s, h, d)
                          for buf, h in zip(bufs, (hq, hkv, hkv)))
            views.append((q, *kv))
        for qkv in views[:8]:  # a backend with a per-shape budget has met it (then moved)
            hub.attention(*qkv, causal=True)
        runner = hub.bound()[-1]
        backend, spec = runner.chain[0], runner.decision.spec
        backend.load()
        name = backend.name
        with_params = [(*qkv, AttnParams(scale=d ** -0.5, causal=True,
                                         max_seqlen_q=qkv[0].shape[1],
                                         max_seqlen_k=qkv[1].shape[1])) for qkv in views]
        # (every lambda binds this case's values: a loop variable read later is the last's)
        cases: dict[str, Callable[[], object]] = {
            "direct": cycling(with_params, lambda q, k, v, p, f=backend.forward, s=spec:
                              f(q, k, v, s, p)),
            "policy": cycling(views, lambda q, k, v: hub.attention(q, k, v, causal=True)),
            "forced": cycling(views, lambda q, k, v, n=name: hub.attention(
                q, k, v, causal=True, backend=n)),
            "raw_sdpa": cycling(views, lambda q, k, v, c=sq == 0, s=d ** -0.5: sdpa(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=c,
                scale=s, enable_gqa=True))}
        if fa is not None and not sq:
            cases["raw_fa3"] = cycling(views, lambda q, k, v: fa.flash_attn_func(
                q, k, v, causal=True))
            if name != "fa3":
                cases["fa3_forced"] = cycling(views, lambda q, k, v: hub.attention(
                    q, k, v, causal=True, backend="fa3"))
        for fn in cases.values():  # every length bucket met once before timing
            fn()
        out[case] = (name, shape, cases)
    return out


def kernels_of(fn: Callable[[], object]) -> list[str]:
    """The device kernels one call of ``fn`` launches, in order, each with its device time
    (torch.profiler): the policy call must launch the direct call's kernels, no more."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [f"{e.name[:70]} ({e.device_time:.1f} us)" for e in prof.events()
            if e.device_type.name == "CUDA"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also print a cProfile of the policy and direct calls per case")
    ap.add_argument("--walks", action="store_true",
                    help="also the cases of a new length per call (growing cache, prompts)")
    ap.add_argument("--scale", type=int, default=1,
                    help="divide the walking cases' lengths by this (CPU dry runs)")
    ap.add_argument("--kernels", action="store_true",
                    help="list the device kernels of one policy and one direct call per case")
    args = ap.parse_args()
    dev = torch.device(args.device)  # "cuda" is fine: the KV cache canonicalises it
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    hub = attnhub.Hub()
    res: dict[str, Any] = {"device": hub.device.describe(), "bound_us": BOUND_US}
    cases = decode_cases(hub, dev, dtype)
    if args.walks:
        cases.update(walk_cases(hub, dev, dtype, args.scale))
    modes = (("", torch.inference_mode), ("_grad_enabled", torch.enable_grad))
    # passes spread over the whole run: pass r of every case, then pass r + 1 of every case,
    # so that a slow stretch of the host (once 1.7x for the ~7 s of one case, direct call
    # included, on the H200 host) lands in one pass of each case, not in all of one case's
    passes: dict[str, list[dict[str, float]]] = {}
    for r in range(max(1, args.rounds)):
        for suffix, mode in modes:
            for case, (name, shape, calls) in cases.items():
                with mode():
                    passes.setdefault(case + suffix, []).append(
                        measure(calls, args.calls, 1, sync, seed=r,
                                warm_s=WARM_S if r == 0 else 0.05))
    for suffix, mode in modes:
        for case, (name, shape, calls) in cases.items():
            runs = passes[case + suffix]
            t = {k: min(run[k] for run in runs) for k in runs[0]}  # each at the host's best
            if args.profile and not suffix:
                with mode():
                    res[f"{case}_profile"] = {
                        which: profile_calls(calls[which], min(args.calls, 5000))
                        for which in ("policy", "direct")}
            res[case + suffix] = {"backend": name, "shape": shape,
                                  **{f"{k}_us": x for k, x in t.items()},
                                  "added_us": t["policy"] - t["direct"],
                                  "passes": [{k: round(x, 3) for k, x in run.items()}
                                             for run in runs]}
            if args.kernels and not suffix and dev.type == "cuda":
                with mode():
                    res[case]["kernels"] = {which: kernels_of(calls[which]) for which in
                                            ("policy", "direct", "forced", "raw_fa3",
                                             "fa3_forced") if which in calls}
    if args.json:
        print(json.dumps(res, indent=2))
        return
    for case in cases:
        for which, text in dict(res.get(f"{case}_profile", {})).items():
            print(f"--- {case}: cProfile of the {which} call ---\n{text}")
    for case in (c + suffix for suffix in ("", "_grad_enabled") for c in cases):
        r = res[case]
        print(f"{case} (bound backend {r['backend']}, {r['shape']}):")
        for k, x in r.items():
            if k.endswith("_us"):
                print(f"  {k[:-3]:<10} {x:8.2f} us")
        for which, names in r.get("kernels", {}).items():
            print(f"  kernels of one {which} call: {names}")
        print(f"  -> attnhub adds {r['added_us']:.2f} us over the backend called directly "
              f"({'within' if r['added_us'] <= BOUND_US else 'OVER'} the {BOUND_US} us bound)")


if __name__ == "__main__":
    main()
