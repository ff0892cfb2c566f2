"""Host cost of the hub's call path over the bound backend, with a null backend on the CPU.

The null backend returns preallocated tensors of the right shape, so the time measured is the
hub's own per-call work: argument checks, the exact-shape lookup, the output contract. Prints
the median per call of ``hub.attention`` minus that of calling the backend's ``forward``
directly (the goal of issue 15 is <= 5 us), for a plain call, a call with side tensors
(ALiBi slopes, softcap, scale), a paged decode call, a varlen (``thd``) call, and a cache
one key longer per call (``growing_cache``: the length-bucket table) or per 32 calls
(``growing_cache_32_layers``: a decoder's layers at one step, as HF DynamicCache calls).

On ``--device cuda`` the tensors live on the GPU (nothing is launched): the paged and varlen
memos then prove their tables unchanged by stamps, as in serving, where on the CPU they
compare contents. Beside ``benchmarks/overhead.py`` (the real backend) this separates the
hub's own work from what the real backend's call costs around it.

    python benchmarks/hub_null_overhead.py [--device cuda] [--calls 20000] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

import attnhub
from attnhub import AttentionOutput, AttnParams, Backend, Capabilities
from attnhub.core.capabilities import ALL_MASKS
from attnhub.core.registry import Registry
from attnhub.hookspecs import hookimpl
from attnhub.timing import median_ms


class NullBackend(Backend):
    """Serves anything, computes nothing: returns a new view of a preallocated output of the
    right shape (a view per call: the hub refuses to admit a backend that hands back the very
    tensor the caller still holds from its previous call)."""

    name = "null"
    tier = "portable"
    capabilities = Capabilities(dtypes=frozenset({"fp32", "fp16", "bf16"}), max_head_dim=1024,
                                layouts=frozenset({"bshd", "thd", "paged"}),
                                different_v_dim=True, gqa=True, masks=ALL_MASKS)

    def __init__(self) -> None:
        super().__init__()
        self.outs: dict[tuple, torch.Tensor] = {}

    def forward(self, q, k, v, spec, params):  # type: ignore[override]
        shape = (*q.shape[:-1], v.shape[-1])
        out = self.outs.get(shape)
        if out is None:
            out = self.outs[shape] = q.new_zeros(shape)
        return AttentionOutput(out.view(shape), None)


def _grow_call(hub: attnhub.Hub, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return hub.attention(q, kv, kv, causal=True, backend="null")


def median_us(fn, calls: int) -> float:
    return median_ms(fn, "cpu", warmup=500, repeats=calls) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    reg = Registry.load(entry_points=False, modules=[])
    null = NullBackend()

    class NullPlugin:
        @hookimpl
        def attnhub_register_backends(self, register) -> None:  # type: ignore[no-untyped-def]
            register(null)

    reg.add_plugin(NullPlugin(), "null")
    hub = attnhub.Hub(registry=reg, hardware="cpu")  # the null backend serves any device
    q = torch.randn(1, 1, 32, 128, device=dev)
    k = torch.randn(1, 128, 8, 128, device=dev)
    v = torch.randn_like(k)
    slopes = torch.rand(32, device=dev)
    pages = torch.randn(16, 16, 8, 128, device=dev)
    bt = torch.arange(16, dtype=torch.int32, device=dev).view(2, 8)
    sl = torch.tensor([100, 60], dtype=torch.int32, device=dev)
    qp = torch.randn(2, 1, 32, 128, device=dev)
    qt, kt = torch.randn(96, 32, 128, device=dev), torch.randn(96, 8, 128, device=dev)
    cu = torch.tensor([0, 40, 96], dtype=torch.int32, device=dev)
    buf = torch.randn(8 * 4096 * 128, device=dev)
    grow = [buf[:8 * s * 128].view(1, 8, s, 128).transpose(1, 2) for s in range(2049, 4097)]
    nxt = itertools.cycle(grow).__next__
    layers = itertools.cycle([kv for kv in grow for _ in range(32)]).__next__
    spec = hub.runner_for(attnhub.AttentionSpec(dtype="fp32", num_q_heads=32, num_kv_heads=8),
                          backend="null").decision.spec
    params = AttnParams(scale=1 / math.sqrt(128))
    res = {}
    direct = median_us(lambda: null.forward(q, k, v, spec, params), args.calls)
    # the cycling's own cost (a next() per call) is in the growing cases, not the hub's
    direct_cycled = median_us(lambda: null.forward(q, nxt(), v, spec, params), args.calls)
    cases = {
        "plain": lambda: hub.attention(q, k, v, backend="null"),
        "side_tensors": lambda: hub.attention(q, k, v, backend="null", alibi_slopes=slopes,
                                              softcap=30.0, scale=0.1, causal=True),
        "paged_decode": lambda: hub.attention(qp, pages, pages, layout="paged",
                                              block_table=bt, seqlens_k=sl, backend="null"),
        "varlen_thd": lambda: hub.attention(qt, kt, kt, layout="thd", cu_seqlens_q=cu,
                                            cu_seqlens_k=cu, causal=True, backend="null"),
        "growing_cache": lambda: _grow_call(hub, q, nxt()),
        "growing_cache_32_layers": lambda: _grow_call(hub, q, layers()),
    }
    for name, fn in cases.items():
        res[name + "_us"] = median_us(fn, args.calls)
        res[name + "_added_us"] = res[name + "_us"] - (
            direct_cycled if name.startswith("growing") else direct)
    res["direct_null_forward_us"] = direct
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"null backend forward called directly: {direct:.2f} us")
    for name in cases:
        print(f"  {name:13s} hub.attention {res[name + '_us']:.2f} us "
              f"(+{res[name + '_added_us']:.2f} us hub overhead)")


if __name__ == "__main__":
    main()
