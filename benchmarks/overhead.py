"""Host-side cost of ``attnhub.attention`` over a direct torch SDPA call.

Tiny decode shape (1 query token, 32/8 heads, 128 keys, d=128): the kernel is negligible, so
the difference is attnhub's per-call work (checks, key, dict lookup). Prints medians of many
calls and the added microseconds, for a forced backend and through a bound policy.

    python benchmarks/overhead.py [--device cuda] [--calls 20000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import attnhub


def median_us(fn, calls: int, sync) -> float:
    for _ in range(200):
        fn()
    sync()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    sync()
    return statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=dtype)
    k = torch.randn(1, 128, 8, 128, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    hub = attnhub.Hub()
    direct = median_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
                       args.calls, sync)
    forced = median_us(lambda: hub.attention(q, k, v, backend="torch_sdpa"), args.calls, sync)
    policy = median_us(lambda: hub.attention(q, k, v), args.calls, sync)
    chosen = hub.bound()[-1].decision.backend
    res = {"device": str(dev), "direct_sdpa_us": direct, "forced_torch_sdpa_us": forced,
           "policy_us": policy, "policy_backend": chosen,
           "added_forced_us": forced - direct, "added_policy_us": policy - direct}
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"direct SDPA                 {direct:8.2f} us")
    print(f"attnhub, backend forced     {forced:8.2f} us  (+{forced - direct:.2f} us, "
          f"x{forced / direct:.2f})")
    print(f"attnhub, via policy ({chosen}) {policy:8.2f} us  (+{policy - direct:.2f} us)"
          + ("" if chosen == "torch_sdpa" else "  [different backend: not comparable]"))


if __name__ == "__main__":
    main()
