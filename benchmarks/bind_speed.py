"""Bind-time cost: resolve a 64-layer model for three phases through a policy.

Every (layer, phase) pair is a distinct bind context, so each is a real resolution (rule
matching plus capability checks of every candidate); the goal is under 50 ms for all 192 on
the CPU machine. Also prints the cost of a cached lookup (what a second bind costs).

    python benchmarks/bind_speed.py [--policy P] [--hardware sm90] [--layers 64] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from attnhub.core.decision import BindContext
from attnhub.core.device import simulate
from attnhub.core.registry import Registry
from attnhub.core.spec import AttentionSpec, MaskSpec
from attnhub.policy import Policy, ProfileStore, load_policy


def model_specs() -> dict[str, AttentionSpec]:
    """Llama-8B-like attention (32/8 heads, d=128, causal) in each phase."""
    base = AttentionSpec(dtype="bf16", head_dim=128, num_q_heads=32, num_kv_heads=8,
                         mask=MaskSpec(causal=True), max_seqlen_k=4096, batch=16)
    return {"train": base.with_(phase="train", max_seqlen_q=4096, needs_grad=True).bucketed(),
            "prefill": base.with_(phase="prefill", max_seqlen_q=4096).bucketed(),
            "decode": base.with_(phase="decode", max_seqlen_q=1, layout="paged",
                                 page_size=16).bucketed()}


def bind_all(policy: Policy, registry: Registry, hardware: str, layers: int) -> float:
    """Seconds to resolve every (layer, phase) once on a fresh cache."""
    device = simulate(hardware)
    specs = model_specs()
    t0 = time.perf_counter()
    for layer in range(layers):
        ctx = BindContext(model="bench", layer=layer)
        for spec in specs.values():
            d = policy.resolve(spec, device, registry, ctx)
            assert d.backend is not None, d.explain()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default=None)
    ap.add_argument("--hardware", default="sm90")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    registry = Registry.load()
    with tempfile.TemporaryDirectory() as tmp:  # no measurements: list order everywhere
        store = ProfileStore(Path(tmp) / "profile.json")
        cold = []
        for _ in range(args.repeat):
            policy = load_policy(args.policy, profile=store)  # fresh decision cache
            cold.append(bind_all(policy, registry, args.hardware, args.layers))
        warm = [bind_all(policy, registry, args.hardware, args.layers) for _ in range(5)]
    n = args.layers * 3
    print(f"policy {policy.name} on simulated {args.hardware}, {len(registry.backends)} backends: "
          f"{args.layers} layers x 3 phases = {n} bindings")
    print(f"  cold bind: median {statistics.median(cold) * 1e3:.2f} ms, "
          f"max {max(cold) * 1e3:.2f} ms over {args.repeat} runs (goal < 50 ms)")
    print(f"  cached:    median {statistics.median(warm) * 1e3:.3f} ms "
          f"({statistics.median(warm) / n * 1e6:.2f} us per lookup)")


if __name__ == "__main__":
    main()
