"""Host time of ``decode_attention`` on a contiguous KV cache that grows by one key per call
(a transformers DynamicCache decode loop), against a cache of fixed length, on the CPU with
the GPU launch stubbed (``benchmarks/decode_host_overhead.py``'s set-up: compiled kernels,
sm90 answers). A new length is a new shape key; the kernel entry rebases it from the shape
of an earlier length (``decode._Shape.rebased``) instead of building it and launching
through Triton's dispatch. ``--check`` has the stub verify every launch's specialization.

    python benchmarks/decode_growing_cache.py [--calls 300] [--check]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels (stubbed), not the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from attnhub_triton_portable.launch_stub import stub_triton
from decode_host_overhead import HKV, HQ, D, load_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    decode = load_decode()
    n, ctx = args.calls, args.ctx
    q = torch.randn(1, 1, HQ, D).to(torch.bfloat16)
    big = torch.randn(1, ctx + n + 1, HKV, D).to(torch.bfloat16)
    cases = {
        "fixed length": [big[:, :ctx].contiguous()] * n,
        "growing, bshd": [big[:, :ctx + i].contiguous() for i in range(1, n + 1)],
        "growing, bhsd cache as a view (transformers)": [
            big[:, :ctx + i].transpose(1, 2).contiguous().transpose(1, 2)
            for i in range(1, n + 1)],
    }
    with stub_triton([decode._split_kernel, decode._merge_kernel], check=args.check):
        for _ in range(50):
            decode.decode_attention(q, cases["fixed length"][0], cases["fixed length"][0],
                                    scale=0.1)
        for name, ks in cases.items():
            t0 = time.perf_counter()
            for k in ks:
                decode.decode_attention(q, k, k, scale=0.1)
            print(f"{name:46s} {(time.perf_counter() - t0) / n * 1e6:7.1f} us/call")


if __name__ == "__main__":
    main()
