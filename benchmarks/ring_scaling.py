"""Ring attention scaling: ring vs the same local kernel on one GPU vs PyTorch's context
parallelism, forward and forward + backward, in one run, on the same shapes.

For each world size W in ``--worlds`` (sub-groups of the launched ranks), each global length S
and each mode (``fwd``, ``fwdbwd``), times

- the ring on W GPUs (zigzag shards; local kernel from the policy, or ``--local-backend``),
- the same local kernel on the whole sequence on one GPU (through the public API),
- ``torch.distributed.tensor.experimental.context_parallel`` around SDPA on W GPUs (shard
  copies included; GQA heads through ``enable_gqa`` when it accepts them, else MHA with the
  K/V heads repeated, and the row says so),

and reports ``efficiency = t_one_gpu / (W * t)`` (1.0 = perfect strong scaling). Run with
torchrun, one process per GPU (multicast off, as the device notes ask):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 2 benchmarks/ring_scaling.py --seqlens 32768 131072 \\
        --json docs/benchmarks/ring_scaling.json --markdown docs/benchmarks/ring_scaling.md

``--simulate W`` runs W virtual ranks in one process on one GPU (attnhub_ring.simulate): the
compute side of the ring (local kernels, merges, copies, host work), without the links.
``--print-model`` prints the paper model of docs/ring-attention.md (no GPU, no torchrun).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from attnhub_ring import ZigzagLayout, ring_attention, zigzag_shard
from attnhub_ring.block_kernels import block_backward_fn, block_backward_kernel
from attnhub_ring.cost import (
    INFINIBAND,
    LLAMA3_8B,
    LLAMA3_70B,
    NVLINK,
    hop,
    min_tokens_per_gpu,
    predict,
)
from attnhub_ring.simulate import SimulatedRing, pack_kv

import attnhub
from attnhub.timing import source_commit

SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}
MODES = ("fwd", "fwdbwd")


# -- timing --------------------------------------------------------------------------------
def timed(fn: Callable[[], Any], args: argparse.Namespace, group: Any = None) -> float:
    """Median seconds of ``fn`` (host time included: synchronised wall clock). With a
    ``group``, each repetition starts together on its ranks and counts the slowest rank."""
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


def leaves(shape: tuple[int, ...], kv_heads: int, args: argparse.Namespace, grad: bool,
           seed: int = 0) -> list[torch.Tensor]:
    b, s, hq, d = shape
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    g = torch.Generator(device=args.device).manual_seed(seed)
    return [torch.randn(b, s, h, d, device=args.device, dtype=dtype, generator=g)
            .requires_grad_(grad) for h in (hq, kv_heads, kv_heads)]


# -- which local kernel ----------------------------------------------------------------------
def local_kernel(args: argparse.Namespace, seqlen: int, world: int, mode: str
                 ) -> tuple[str, str]:
    """(backend name, explain text): ``--local-backend`` as given, or what the policy binds
    inside ring for this call (a kernel that returns its LSE natively)."""
    if args.local_backend != "policy":
        return args.local_backend, f"--local-backend {args.local_backend} (given by hand)"
    shape = SHAPES[args.model]
    spec = attnhub.AttentionSpec(
        phase="train" if mode == "fwdbwd" else "prefill",
        dtype="bf16" if args.device == "cuda" else "fp32", head_dim=shape.head_dim,
        num_q_heads=shape.q_heads, num_kv_heads=shape.kv_heads,
        mask=attnhub.MaskSpec(causal=args.causal), max_seqlen_q=seqlen // world,
        max_seqlen_k=seqlen // world, batch=args.batch, needs_grad=mode == "fwdbwd")
    hub = attnhub.Hub()
    if args.simulate:  # no process group to satisfy ring's check: resolve the inner level
        # itself, as the resolver does for ring (world size 1, LSE required, local=True)
        inner = hub.resolver._resolve(spec.bucketed().with_(return_lse=True), hub.device,
                                      hub.registry, attnhub.BindContext(world_size=1),
                                      local=True)
        if inner.backend is None:
            raise SystemExit("no local kernel for ring here:\n" + inner.explain())
        return inner.backend, inner.explain()
    d = hub.resolver.resolve(spec.bucketed(), hub.device, hub.registry,
                             attnhub.BindContext(world_size=world))
    if d.backend != "ring" or d.inner is None or d.inner.backend is None:
        raise SystemExit("the policy does not bind ring with a local kernel here:\n"
                         + d.explain())
    return d.inner.backend, d.explain()


# -- the three contenders --------------------------------------------------------------------
def time_ring(args: argparse.Namespace, world: int, seqlen: int, group: Any, mode: str,
              local: str) -> float:
    shape = SHAPES[args.model]
    rank = dist.get_rank(group)
    n = ZigzagLayout(world, (seqlen,)).local_lens(rank)[0]
    q, k, v = leaves((args.batch, n, shape.q_heads, shape.head_dim), shape.kv_heads, args,
                     mode == "fwdbwd", seed=rank)

    def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, local_backend=local, causal=args.causal, group=group,
                              global_seqlens=[seqlen], block_backward=args.ring_backward)

    return timed(attention_step(q, k, v, mode == "fwdbwd", ring), args, group)


def time_one(args: argparse.Namespace, seqlen: int, mode: str, local: str) -> float:
    shape = SHAPES[args.model]
    hub = attnhub.Hub()
    q, k, v = leaves((args.batch, seqlen, shape.q_heads, shape.head_dim), shape.kv_heads,
                     args, mode == "fwdbwd")

    def one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return hub.attention(q, k, v, causal=args.causal, backend=local)

    return timed(attention_step(q, k, v, mode == "fwdbwd", one), args)


def one_gpu_time(args: argparse.Namespace, seqlen: int, mode: str,
                 local: str) -> tuple[float, int]:
    """(seconds, length timed): the whole sequence on one GPU, or, past ``--single-max``
    (a length one GPU cannot hold or time), the largest that it can, scaled by
    ``(S / S_max)^2`` (attention FLOPs are quadratic in S; the row records S_max)."""
    n = min(seqlen, args.single_max) if args.single_max else seqlen
    return time_one(args, n, mode, local) * (seqlen / n) ** 2, n


def time_cp(args: argparse.Namespace, world: int, seqlen: int, mesh: Any, group: Any,
            mode: str) -> tuple[float, str]:
    """PyTorch's context parallelism around SDPA: every rank holds the full (B,H,S,D)
    tensors; each repetition copies them (the copies are the shard buffers CP reshards in
    place, so they count) and runs SDPA inside ``context_parallel``. Returns (seconds, the
    K/V heads used)."""
    from torch.distributed.tensor.experimental import context_parallel

    shape = SHAPES[args.model]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    backward = mode == "fwdbwd"

    def run_with(kv_heads: int) -> float:
        g = torch.Generator(device=args.device).manual_seed(0)
        full = [torch.randn(args.batch, h, seqlen, shape.head_dim, device=args.device,
                            dtype=dtype, generator=g)
                for h in (shape.q_heads, kv_heads, kv_heads)]
        gqa = kv_heads != shape.q_heads

        def step() -> None:
            q, k, v = (x.clone() for x in full)
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                                  no_restore_buffers={q, k, v}):
                if backward:
                    for x in (q, k, v):
                        x.requires_grad_()
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal,
                                                         enable_gqa=gqa)
                    out.backward(torch.ones_like(out))
                else:
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, is_causal=args.causal,
                                                       enable_gqa=gqa)

        return timed(step, args, group)

    try:
        return run_with(shape.kv_heads), f"{shape.q_heads}/{shape.kv_heads} (enable_gqa)"
    except Exception as exc:  # noqa: BLE001 - recorded in the row, then MHA-equal shapes
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return run_with(shape.q_heads), (f"{shape.q_heads}/{shape.q_heads} (K/V heads repeated; "
                                     f"GQA raised {why})")


# -- the distributed run ---------------------------------------------------------------------
def run_benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    me, size = dist.get_rank(), dist.get_world_size()
    rows: list[dict[str, Any]] = []
    for world in args.worlds:
        if world > size:
            raise SystemExit(f"--worlds {world} exceeds the {size} launched ranks")
        group = dist.new_group(list(range(world)))  # every rank must join every new_group
        mesh = _mesh(args, world) if not args.no_cp else None
        for seqlen in args.seqlens:
            for mode in args.modes:
                if me < world:
                    row = measure(args, world, seqlen, mode, group, mesh)
                    if me == 0:
                        rows.append(row)
                        print(_line(row), flush=True)
                dist.barrier()
    if me == 0:
        write_report(args, rows, size)
    dist.destroy_process_group()
    return rows


def _mesh(args: argparse.Namespace, world: int) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(args.device, list(range(world)))


def measure(args: argparse.Namespace, world: int, seqlen: int, mode: str, group: Any,
            mesh: Any) -> dict[str, Any]:
    local, why = local_kernel(args, seqlen, world, mode)
    row: dict[str, Any] = {"world": world, "seqlen": seqlen, "mode": mode, "local": local,
                           "tokens_per_gpu": seqlen // world, "explain": why,
                           "block_backward": _bwd_name(args, mode)}
    t_ring = time_ring(args, world, seqlen, group, mode, local)
    row["t_ring_ms"] = t_ring * 1e3
    t_one = float("nan")
    if dist.get_rank(group) == 0 and not args.skip_single:
        t_one, row["one_gpu_from"] = one_gpu_time(args, seqlen, mode, local)
    row["t_one_gpu_ms"] = t_one * 1e3
    row["efficiency"] = t_one / (world * t_ring)
    row["tokens_per_s"] = args.batch * seqlen / t_ring
    if mesh is not None:
        try:
            t_cp, heads = time_cp(args, world, seqlen, mesh, group, mode)
            row.update(t_cp_ms=t_cp * 1e3, cp_heads=heads,
                       cp_efficiency=t_one / (world * t_cp))
        except Exception as exc:  # noqa: BLE001 - a peer that fails is a result, not a crash
            row["cp_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    row["predicted_efficiency"] = predict(SHAPES[args.model], seqlen, world, NVLINK,
                                          args.causal, mode == "fwdbwd").efficiency
    return row


def _bwd_name(args: argparse.Namespace, mode: str) -> str:
    """The ring's block backward for bf16 (fp32 on the CPU) at the model's head dim."""
    if mode != "fwdbwd":
        return "-"
    shape = SHAPES[args.model]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    probe = torch.empty(1, 1, 1, shape.head_dim, device=args.device, dtype=dtype)
    name, passed = block_backward_kernel(probe, probe, None, False, False, args.ring_backward)
    return name + (f" ({'; '.join(passed)})" if passed else "")


def _line(row: dict[str, Any]) -> str:
    cp = (f"CP {row['t_cp_ms']:9.2f} ms eff {row['cp_efficiency']:.2f}" if "t_cp_ms" in row
          else f"CP {row.get('cp_error', 'not run')}")
    return (f"W={row['world']} S={row['seqlen']:7d} {row['mode']:6s} local={row['local']:10s} "
            f"ring {row['t_ring_ms']:9.2f} ms  one GPU {row['t_one_gpu_ms']:9.2f} ms  "
            f"eff {row['efficiency']:.2f} (model {row['predicted_efficiency']:.2f})  {cp}")


# -- one GPU: a simulated ring ---------------------------------------------------------------
def run_simulated(args: argparse.Namespace) -> list[dict[str, Any]]:
    """W virtual ranks on one device, each timed alone; see attnhub_ring.simulate."""
    world = args.simulate
    rows = []
    for seqlen in args.seqlens:
        for mode in args.modes:
            try:
                row = measure_simulated(args, world, seqlen, mode)
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                row = {"world": world, "seqlen": seqlen, "mode": mode, "simulated": True,
                       "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "explain"}), flush=True)
    if args.check_seqlen:
        rows += check_simulated(args, world, args.check_seqlen)
    write_report(args, rows, 1)
    return rows


def measure_simulated(args: argparse.Namespace, world: int, seqlen: int,
                      mode: str) -> dict[str, Any]:
    from attnhub_ring.plan import block_plans

    shape = SHAPES[args.model]
    backward = mode == "fwdbwd"
    local, why = local_kernel(args, seqlen, world, mode)
    hub = attnhub.Hub()
    backend = hub.registry.get(local)
    backend.load()
    q, k, v = leaves((args.batch, seqlen, shape.q_heads, shape.head_dim), shape.kv_heads,
                     args, backward)
    t_one = time_one(args, seqlen, mode, local)
    layout = ZigzagLayout(world, (seqlen,))
    shards = [[zigzag_shard(x.detach(), r, world).requires_grad_(backward) for x in (q, k, v)]
              for r in range(world)]
    blocks = [pack_kv(s[1], s[2]) for s in shards]
    t_ranks, t_kernels = [], []
    for r, (ql, kl, vl) in enumerate(shards):
        transport = SimulatedRing(r, blocks)

        def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 transport: SimulatedRing = transport) -> torch.Tensor:
            return ring_attention(q, k, v, local_backend=backend, causal=args.causal,
                                  global_seqlens=[seqlen], transport=transport,
                                  block_backward=args.ring_backward)

        step_fn = attention_step(ql, kl, vl, backward, ring)
        t_ranks.append(timed(step_fn, args))
        if args.profile and r == 0:
            _profile(args, step_fn, f"{args.profile}.{seqlen}.{mode}.txt")
        plans = block_plans(layout, r, args.causal)
        t_kernels.append(_time_block_kernels(args, backend, plans, ql, shards, backward))
    compute_eff = t_one / sum(t_ranks)
    steps = world * world  # W ranks x W steps
    return {"world": world, "seqlen": seqlen, "mode": mode, "local": local, "simulated": True,
            "explain": why, "block_backward": _bwd_name(args, mode), "t_one_gpu_ms": t_one * 1e3,
            "t_rank_ms": [t * 1e3 for t in t_ranks],
            "t_block_kernels_ms": [t * 1e3 for t in t_kernels],
            "compute_efficiency": compute_eff,
            "kernel_efficiency": t_one / sum(t_kernels),
            "ring_overhead_per_step_us": (sum(t_ranks) - sum(t_kernels)) / steps * 1e6,
            "predicted_efficiency": predict(SHAPES[args.model], seqlen, world, NVLINK,
                                            args.causal, backward).efficiency}


def _time_block_kernels(args: argparse.Namespace, backend: Any, plans: Any, q: torch.Tensor,
                        shards: list[list[torch.Tensor]], backward: bool) -> float:
    """The local kernel alone on each block of one rank (and, with ``backward``, the ring's
    block backward on it): what the ring step costs without merges, copies and host work."""
    from attnhub.plugin import AttnParams

    scale = q.shape[-1] ** -0.5
    bwd = block_backward_fn(block_backward_kernel(q, q, None, False, False,
                                                  args.ring_backward)[0])
    work = []
    for plan in plans:
        if plan.empty:
            continue
        kb, vb = (x.detach()[:, plan.k_rows(q.device)] for x in shards[plan.source][1:])
        qb = q.detach()[:, plan.q_rows(q.device)]
        p = AttnParams(scale=scale, causal=plan.causal, return_lse=True)
        spec = attnhub.AttentionSpec(
            phase="prefill", dtype="bf16" if q.dtype == torch.bfloat16 else "fp32",
            head_dim=q.shape[-1], num_q_heads=q.shape[2], num_kv_heads=kb.shape[2],
            mask=attnhub.MaskSpec(causal=plan.causal), max_seqlen_q=qb.shape[1],
            max_seqlen_k=kb.shape[1], return_lse=True)
        work.append((qb, kb, vb, spec, p))

    def run() -> None:
        with torch.no_grad():
            for qb, kb, vb, spec, p in work:
                out, lse = backend.forward(qb, kb, vb, spec, p)
                if backward:
                    bwd(torch.ones_like(out), qb, kb, vb, out, lse, p.causal, scale)

    return timed(run, args)


def _profile(args: argparse.Namespace, fn: Callable[[], None], path: str) -> None:
    """torch.profiler table of one ring step of one rank: where the time beyond the local
    kernels goes (merges, copies, launches)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        _sync(args)
    key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60)
    _atomic_write(path, table)


def check_simulated(args: argparse.Namespace, world: int, seqlen: int) -> list[dict[str, Any]]:
    """Ring (simulated) vs one device on this GPU, by the FlashAttention rule: out, LSE, dQ
    of every rank, causal and full, GQA heads of the model (fp64 and bf16 references)."""
    from attnhub.plugin import AttnParams, reference_attention
    from attnhub.testing import fa_rule_error

    shape = SHAPES[args.model]
    rows = []
    for causal in (True, False):
        g = torch.Generator(device=args.device).manual_seed(seqlen + causal)
        q, k, v, dout = (torch.randn(1, seqlen, h, shape.head_dim, device=args.device,
                                     generator=g).bfloat16()
                         for h in (shape.q_heads, shape.kv_heads, shape.kv_heads,
                                   shape.q_heads))
        params = AttnParams(scale=shape.head_dim ** -0.5, causal=causal)
        refs = {}
        for name, dt in (("64", torch.float64), ("same", torch.bfloat16)):
            lv = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
            o, l = reference_attention(*lv, params, compute_dtype=dt)
            (o * dout.to(dt)).sum().backward()
            refs[name] = (o.detach(), l.detach(), lv[0].grad)
        local, _ = local_kernel(args, seqlen, world, "fwdbwd")
        blocks = [pack_kv(zigzag_shard(k, r, world), zigzag_shard(v, r, world))
                  for r in range(world)]
        worst = {"out": 0.0, "dq": 0.0, "lse": 0.0}
        ok = True
        for r in range(world):
            idx = ZigzagLayout(world, (seqlen,)).global_indices(r).to(args.device)
            ql = zigzag_shard(q, r, world).requires_grad_()
            out, lse = ring_attention(ql, zigzag_shard(k, r, world), zigzag_shard(v, r, world),
                                      local_backend=local, causal=causal,
                                      global_seqlens=[seqlen], return_lse=True,
                                      transport=SimulatedRing(r, blocks),
                                      block_backward=args.ring_backward)
            (out * dout.index_select(1, idx)).sum().backward()
            for name, got, i, mult in (("out", out, 0, 2), ("dq", ql.grad, 2, 3)):
                err, allowed = fa_rule_error(got, refs["64"][i].index_select(1, idx),
                                             refs["same"][i].index_select(1, idx), mult)
                worst[name] = max(worst[name], err / allowed)
                ok &= err <= allowed
            d_lse = float((lse - refs["64"][1].index_select(2, idx)).abs().max())
            worst["lse"] = max(worst["lse"], d_lse)
            ok &= d_lse <= 1e-2
        rows.append({"check": True, "world": world, "seqlen": seqlen, "causal": causal,
                     "local": local, "passed": ok,
                     "error_over_allowed_out": worst["out"],
                     "error_over_allowed_dq": worst["dq"], "max_lse_error": worst["lse"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# -- reports ---------------------------------------------------------------------------------
def write_report(args: argparse.Namespace, rows: list[dict[str, Any]], ranks: int) -> None:
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": gpu, "ranks": ranks, "commit": source_commit(), "torch": torch.__version__,
              "args": vars(args), "rows": rows}
    if args.json:
        _atomic_write(args.json, json.dumps(report, indent=2, default=str))
    if args.markdown:
        _atomic_write(args.markdown, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    """The table of docs/ring-attention.md from a report."""
    a = report["args"]
    head = (f"{report['date']}, {report['gpu']} x {report['ranks']}, commit {report['commit']},"
            f" torch {report['torch']}, {a['model']}, batch {a['batch']}, "
            f"{'causal' if a['causal'] else 'full'}, "
            f"{'bf16' if a['device'] == 'cuda' else 'fp32'}\n\n")
    timing = [r for r in report["rows"] if not r.get("check")]
    if any(r.get("simulated") for r in timing):
        lines = ["| W (virtual) | S | mode | local kernel | one GPU ms | ring ranks ms (sum) "
                 "| block kernels ms (sum) | compute efficiency | kernels only | overhead/step "
                 "µs | model (NVLink) |", "|" + "---|" * 11]
        for r in timing:
            if "error" in r:
                lines.append(f"| {r['world']} | {r['seqlen']} | {r['mode']} | error: "
                             f"{r['error']} |" + " |" * 7)
                continue
            lines.append(
                f"| {r['world']} | {r['seqlen']} | {r['mode']} | {r['local']} | "
                f"{r['t_one_gpu_ms']:.1f} | {sum(r['t_rank_ms']):.1f} | "
                f"{sum(r['t_block_kernels_ms']):.1f} | {r['compute_efficiency']:.2f} | "
                f"{r['kernel_efficiency']:.2f} | {r['ring_overhead_per_step_us']:.0f} | "
                f"{r['predicted_efficiency']:.2f} |")
    else:
        lines = ["| W | S | mode | local kernel | ring ms | one GPU ms | efficiency | "
                 "model | PyTorch CP ms | CP efficiency | CP heads |", "|" + "---|" * 11]
        if any(r.get("one_gpu_from", r["seqlen"]) != r["seqlen"] for r in timing):
            lines.insert(0, "One GPU marked * : timed at the largest length it holds and "
                            "scaled by (S / that length)^2.\n")
        for r in timing:
            cp = (f"{r['t_cp_ms']:.1f} | {r['cp_efficiency']:.2f} | {r['cp_heads']}"
                  if "t_cp_ms" in r else f"- | - | {r.get('cp_error', 'not run')}")
            star = "*" if r.get("one_gpu_from", r["seqlen"]) != r["seqlen"] else ""
            lines.append(f"| {r['world']} | {r['seqlen']} | {r['mode']} | {r['local']} | "
                         f"{r['t_ring_ms']:.1f} | {r['t_one_gpu_ms']:.1f}{star} | "
                         f"{r['efficiency']:.2f} | {r['predicted_efficiency']:.2f} | {cp} |")
    checks = [r for r in report["rows"] if r.get("check")]
    if checks:
        lines += ["", "| check | W | S | local | passed | out err/allowed | dQ err/allowed | "
                  "max LSE err |", "|" + "---|" * 8]
        lines += [f"| {'causal' if c['causal'] else 'full'} | {c['world']} | {c['seqlen']} | "
                  f"{c['local']} | {c['passed']} | {c['error_over_allowed_out']:.2f} | "
                  f"{c['error_over_allowed_dq']:.2f} | {c['max_lse_error']:.1e} |"
                  for c in checks]
    return head + "\n".join(lines) + "\n"


def _atomic_write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


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
    print("predicted efficiency, causal, NVLink (fwd / fwd+bwd):")
    for shape in SHAPES.values():
        for seqlen in (32768, 131072, 524288, 1048576):
            cells = [f"W={w}: {predict(shape, seqlen, w, NVLINK).efficiency:.2f} / "
                     f"{predict(shape, seqlen, w, NVLINK, backward=True).efficiency:.2f}"
                     for w in (2, 4, 8)]
            print(f"  {shape.name:12s} S={seqlen:8d}  " + "   ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b",
                    help="attention shape (heads, head dim)")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--worlds", type=int, nargs="+", default=None,
                    help="ring sizes to measure (default: 2, 4, ... up to the ranks launched)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                    help="fwd, fwdbwd (forward + backward), or both")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu (gloo, fp32) only to try the script on tiny shapes")
    ap.add_argument("--local-backend", default="policy",
                    help="local kernel for the blocks: 'policy' (what the policy binds inside "
                         "ring) or a backend name")
    ap.add_argument("--ring-backward", default="auto",
                    choices=("auto", "cudnn", "flash", "math"),
                    help="kernel of the ring's block gradients (auto: first that serves)")
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-single", action="store_true",
                    help="do not time one GPU on the whole sequence (too long for it)")
    ap.add_argument("--single-max", type=int, default=0, metavar="S",
                    help="time one GPU at most at length S and scale by (S_seq / S)^2 beyond "
                         "(the row says so)")
    ap.add_argument("--no-cp", action="store_true",
                    help="do not time PyTorch's context parallelism beside the ring")
    ap.add_argument("--simulate", type=int, default=0, metavar="W",
                    help="one process, one device: W virtual ranks (no torchrun)")
    ap.add_argument("--check-seqlen", type=int, default=0,
                    help="with --simulate: also check ring vs one device at this length")
    ap.add_argument("--profile", default=None, metavar="PREFIX",
                    help="with --simulate: torch.profiler table of rank 0's step per length "
                         "and mode, written to PREFIX.<S>.<mode>.txt")
    ap.add_argument("--json", default=None, help="write the results here (rank 0)")
    ap.add_argument("--markdown", default=None, help="write the table here (rank 0)")
    ap.add_argument("--print-model", action="store_true",
                    help="print the paper model instead of measuring")
    args = ap.parse_args()
    if args.print_model:
        print_model()
        return
    if args.simulate:
        run_simulated(args)
        return
    if args.worlds is None:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        args.worlds = [w for w in (2, 4, 8, 16, 32, 64) if w <= size]
    run_benchmark(args)


if __name__ == "__main__":
    main()
