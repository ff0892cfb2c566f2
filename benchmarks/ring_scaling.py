"""Ring attention scaling on several GPUs: tokens/s and efficiency against one GPU.

For each world size W in ``--worlds`` (sub-groups of the launched ranks) and each global
sequence length S, times the ring on W GPUs (zigzag shards, local kernel ``--local``) and the
same local kernel on the whole sequence on one GPU, and reports

    tokens/s   = batch * S / t_ring
    efficiency = t_one_gpu / (W * t_ring)      (1.0 = perfect strong scaling)

Forward, or forward + backward with ``--backward``. Run with torchrun, one process per GPU:

    torchrun --nproc-per-node 8 benchmarks/ring_scaling.py --seqlens 32768 131072 \\
        --worlds 2 4 8 --local torch_sdpa --backward --json docs/benchmarks/ring_scaling.json

``--print-model`` prints the paper model of docs/ring-attention.md instead (no GPU, no
torchrun). Not run yet on several GPUs: no multi-GPU machine was available.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from attnhub_ring import ZigzagLayout, ring_attention
from attnhub_ring.cost import INFINIBAND, LLAMA3_8B, LLAMA3_70B, NVLINK, hop, min_tokens_per_gpu

import attnhub

SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}


def timed(fn: Callable[[], Any], args: argparse.Namespace, group: Any = None) -> float:
    """Median seconds of ``fn``. With a ``group``, each repetition starts together on its
    ranks and ends when the slowest finishes (a ring step is as slow as its slowest rank)."""
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.reps):
        if group is not None:
            dist.barrier(group=group)
        _sync(args)
        t0 = time.perf_counter()
        fn()
        _sync(args)
        t = torch.tensor([time.perf_counter() - t0], device=args.device)
        if group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times.append(float(t))
    return statistics.median(times)


def _sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool,
                   run: Callable[..., torch.Tensor]) -> Callable[[], None]:
    """One timed unit: forward, or forward and backward with a random output gradient."""
    grad = torch.randn_like(q) if backward else None

    def step() -> None:
        if backward:
            for x in (q, k, v):
                x.grad = None
            run(q, k, v).backward(grad)
        else:
            with torch.no_grad():
                run(q, k, v)
    return step


def leaves(shape: tuple[int, ...], kv_heads: int, args: argparse.Namespace
           ) -> list[torch.Tensor]:
    b, s, hq, d = shape
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return [torch.randn(b, s, h, d, device=args.device, dtype=dtype)
            .requires_grad_(args.backward) for h in (hq, kv_heads, kv_heads)]


def measure(args: argparse.Namespace, world: int, seqlen: int, group: Any) -> dict[str, Any]:
    """Ring time on ``world`` ranks (this rank is in ``group``) and, on rank 0 of the group,
    the single-GPU time of the local kernel on the whole sequence."""
    shape = SHAPES[args.model]
    rank = dist.get_rank(group)
    local_len = ZigzagLayout(world, (seqlen,)).local_lens(rank)[0]
    q, k, v = leaves((args.batch, local_len, shape.q_heads, shape.head_dim), shape.kv_heads,
                     args)

    def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, local_backend=args.local, causal=args.causal,
                              group=group, global_seqlens=[seqlen])

    t_ring = timed(attention_step(q, k, v, args.backward, ring), args, group)
    t_one = float("nan")
    if rank == 0 and not args.skip_single:
        hub = attnhub.Hub()
        qf, kf, vf = leaves((args.batch, seqlen, shape.q_heads, shape.head_dim),
                            shape.kv_heads, args)

        def one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return hub.attention(q, k, v, causal=args.causal, backend=args.local)

        t_one = timed(attention_step(qf, kf, vf, args.backward, one), args)
    tokens = args.batch * seqlen
    return {"world": world, "seqlen": seqlen, "tokens_per_gpu": seqlen // world,
            "t_ring_ms": t_ring * 1e3, "t_one_gpu_ms": t_one * 1e3,
            "tokens_per_s": tokens / t_ring, "efficiency": t_one / (world * t_ring)}


def run_benchmark(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # before NCCL p2p
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    me, size = dist.get_rank(), dist.get_world_size()
    rows = []
    for world in args.worlds:
        if world > size:
            raise SystemExit(f"--worlds {world} exceeds the {size} launched ranks")
        group = dist.new_group(list(range(world)))  # every rank must join every new_group
        for seqlen in args.seqlens:
            if me < world:
                row = measure(args, world, seqlen, group)
                if me == 0:
                    rows.append(row)
                    print(f"W={world:3d} S={seqlen:8d} ring {row['t_ring_ms']:9.2f} ms  "
                          f"one GPU {row['t_one_gpu_ms']:9.2f} ms  "
                          f"{row['tokens_per_s']:12.0f} tok/s  eff {row['efficiency']:.2f}",
                          flush=True)
            dist.barrier()
    if me == 0 and args.json:
        gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        report = {"date": datetime.date.today().isoformat(), "gpu": gpu,
                  "ranks": size, "commit": _commit(), "args": vars(args), "rows": rows}
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=2)
        os.replace(tmp, args.json)
    dist.destroy_process_group()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_model() -> None:
    """The tables of docs/ring-attention.md, from attnhub_ring.cost."""
    print("minimum tokens per GPU for the hop to hide (forward / backward):")
    for shape in SHAPES.values():
        for name, bw in (("NVLink 450 GB/s", NVLINK), ("IB 50 GB/s", INFINIBAND)):
            cells = [f"{min_tokens_per_gpu(shape, bw, c, b):6.0f}" for c in (True, False)
                     for b in (False, True)]
            print(f"  {shape.name:12s} {name:16s} causal {cells[0]} / {cells[1]}   "
                  f"full {cells[2]} / {cells[3]}")
    print("per layer and hop, causal (tokens per GPU s = S / W):")
    for shape in SHAPES.values():
        for s in (1024, 2048, 4096, 8192, 16384, 32768):
            nv, ib = hop(shape, s, NVLINK), hop(shape, s, INFINIBAND)
            print(f"  {shape.name:12s} s={s:6d} KV/hop {nv.kv_bytes / 2**20:6.1f} MiB  "
                  f"fwd {nv.fwd_flops / 1e12:6.3f} TFLOP {nv.fwd_compute_s * 1e6:8.0f} us  "
                  f"wire NVLink {nv.fwd_comm_s * 1e6:6.0f} us IB {ib.fwd_comm_s * 1e6:6.0f} us  "
                  f"| bwd {nv.bwd_compute_s * 1e6:8.0f} us wire NVLink "
                  f"{nv.bwd_comm_s * 1e6:6.0f} us IB {ib.bwd_comm_s * 1e6:6.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b",
                    help="attention shape (heads, head dim)")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--worlds", type=int, nargs="+", default=None,
                    help="ring sizes to measure (default: 2, 4, ... up to the ranks launched)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu (gloo, fp32) only to try the script on tiny shapes")
    ap.add_argument("--local", default="torch_sdpa", help="local backend for the blocks")
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--backward", action="store_true", help="time forward + backward")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-single", action="store_true",
                    help="do not time one GPU on the whole sequence (too long for it)")
    ap.add_argument("--json", default=None, help="write the results here (rank 0)")
    ap.add_argument("--print-model", action="store_true",
                    help="print the paper model instead of measuring")
    args = ap.parse_args()
    if args.print_model:
        print_model()
        return
    if args.worlds is None:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        args.worlds = [w for w in (2, 4, 8, 16, 32, 64) if w <= size]
    run_benchmark(args)


if __name__ == "__main__":
    main()
