"""Which forward config the triton backend's autotuning picks for the cells of
``gluon_ws.py`` (16k, d128, bf16, 32/8 heads), and each cell's time through
``attnhub.attention`` (backend forced) on the GPU: the candidates' own timings from
``autotune.TUNING_LOG`` beside the public-API figure (CUDA events, median of 20, host
included). The regret grid measured 477 TFLOP/s for the window cell through the API against
the kernel's 582 called directly: this says whether the choice or the call path differs.

    python3 benchmarks/triton_autotune_probe.py [--masks full causal causal+window4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gluon_ws import MASKS, S, D, flops  # noqa: E402

import attnhub  # noqa: E402

KEYS = ("BLOCK_M", "BLOCK_N", "GLUON", "WS", "PINGPONG", "KV_STAGES", "P_SMEM", "num_warps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    ap.add_argument("--profile", action="store_true",
                    help="also where the host time of a call goes (cProfile, 200 calls)")
    a = ap.parse_args()
    from attnhub_triton_portable import autotune
    from attnhub_triton_portable.fwd import flash_fwd
    from attnhub_triton_portable.launch import DenseArgs

    from attnhub.plugin import AttnParams

    hub = attnhub.Hub()
    hq, hkv = 32, 8
    q = torch.randn(1, S, hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, S, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for name in a.masks:
        kw = MASKS[name]
        n0 = len(autotune.TUNING_LOG)
        hub.attention(q, k, v, backend="triton", **kw)
        for _key, cfg, ms, err in autotune.TUNING_LOG[n0:]:
            tag = {x: cfg[x] for x in KEYS if x in cfg}
            print(f"  {name} candidate {tag}: {'-' if ms is None else f'{ms:.3f}'} ms "
                  f"{err or ''}", flush=True)
        ts = []
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            hub.attention(q, k, v, backend="triton", **kw)
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        ms = statistics.median(ts)
        print(f"{name}: attnhub.attention(backend='triton') {ms:.3f} ms = "
              f"{flops(hq, kw) / (ms * 1e-3) / 1e12:.0f} TFLOP/s (one call from an idle GPU)",
              flush=True)
        # the same call back to back (the layers of a prefill: host work overlaps the kernel
        # before): GPU time per call; and the host time per call alone (no sync)
        def call() -> None:
            hub.attention(q, k, v, backend="triton", **kw)

        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            call()
        e1.record()
        e1.synchronize()
        b2b = e0.elapsed_time(e1) / 20
        host = []
        for _ in range(20):
            t0 = time.perf_counter()
            call()
            host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        print(f"{name}: back to back {b2b:.3f} ms = {flops(hq, kw) / (b2b * 1e-3) / 1e12:.0f} "
              f"TFLOP/s; host {statistics.median(host):.0f} us per call", flush=True)
        # the autotuner's timings are short bursts (do_bench rep=20 ms): the picked kernel
        # called directly and the API call, each by the same longer do_bench, interleaved
        picked = autotune._CACHE.get(autotune.TUNING_LOG[n0][0]) if len(
            autotune.TUNING_LOG) > n0 else None
        if picked is not None:
            from triton.testing import do_bench

            args = DenseArgs.from_params(q, k, v, AttnParams(scale=D ** -0.5, **kw), "bshd")
            rows: dict[str, list[float]] = {"kernel": [], "api": []}
            for _ in range(3):
                rows["kernel"].append(do_bench(lambda: flash_fwd(args, picked), rep=300,
                                               return_mode="median"))
                rows["api"].append(do_bench(call, rep=300, return_mode="median"))
            tag = {x: picked[x] for x in KEYS if x in picked}
            from bwd_probe import per_kernel_ms  # every kernel one API call launches

            print(f"{name}: api kernels (ms per call) {per_kernel_ms(call, 5)}", flush=True)
            for what, t in rows.items():
                m = statistics.median(t)
                print(f"{name}: {what} do_bench(rep=300) x3 {[round(x, 3) for x in t]} ms, "
                      f"median {m:.3f} = {flops(hq, kw) / (m * 1e-3) / 1e12:.0f} TFLOP/s "
                      f"(picked {tag})", flush=True)
        if a.profile:
            host_profile(name, call)


def host_profile(name: str, call: Any) -> None:
    """The host's share of one call, by function (cProfile over 200 back-to-back calls,
    top 25 by own time): what the launch path costs before the kernel can start."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        call()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(f"{name}: host profile of 200 calls\n{buf.getvalue()}", flush=True)


if __name__ == "__main__":
    main()
