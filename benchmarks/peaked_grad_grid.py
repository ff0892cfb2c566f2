"""Half-precision gradients on nearly one-hot softmaxes, every GPU backend beside torch's raw
kernels (the known gap of docs/contract.md, "Gradients in fp16/bf16 on a nearly one-hot
softmax"): is it the FlashAttention family's, or only ours?

Per (dtype, scale, keys, causal) cell and seed: q, k, v ~ N(0, 1), D=64, one batch, 2 heads;
the gradients of ``sum(out * dout)`` against the fp64 reference, as a ratio of the
FlashAttention rule's bound (3x the same-precision reference's error, plus the rounding
floor): a ratio above 1 breaks the rule. Rows: each attnhub backend forced through
``attnhub.attention`` (those that decline a cell say why) and torch's SDPA kernels called
directly (flash, efficient, cuDNN). Prints a table of the worst ratio per row and cell, and
writes the raw ratios to ``--json``.

    python3 benchmarks/peaked_grad_grid.py [--seeds 8] [--json out.json] [--smoke]

``--smoke``: the CPU, tiny grid (checks the script; CPU kernels only).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnhub
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.testing import fa_rule_error

D = 64
RAW = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
       "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}


def raw_sdpa(kernel: SDPBackend) -> Callable[..., torch.Tensor]:
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             causal: bool) -> torch.Tensor:
        with sdpa_kernel([kernel]):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                is_causal=causal).transpose(1, 2)
    return call


def hub_backend(hub: attnhub.Hub, name: str) -> Callable[..., torch.Tensor]:
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             causal: bool) -> torch.Tensor:
        return hub.attention(q, k, v, scale=scale, causal=causal, backend=name)
    return call


def worst_ratio(call: Callable[..., torch.Tensor], dtype: torch.dtype, scale: float,
                keys: int, causal: bool, seeds: int, device: str) -> float:
    worst = 0.0
    p = AttnParams(scale=scale, causal=causal)
    for seed in range(seeds):
        g = torch.Generator(device="cpu").manual_seed(seed)
        q, k, v = (torch.randn(1, n, 2, D, generator=g).to(device, dtype).requires_grad_()
                   for n in (keys if causal else 1, keys, keys))
        out = call(q, k, v, scale, causal)
        dout = torch.randn(out.shape, generator=g).to(device, dtype)
        ref64 = reference_attention(q, k, v, p)[0]
        same = reference_attention(q, k, v, p, compute_dtype=dtype)[0]
        grads = [torch.autograd.grad(o, (q, k, v), d) for o, d in
                 ((out, dout), (ref64, dout.double()), (same, dout))]
        for x, y, z in zip(*grads):
            err, allowed = fa_rule_error(x, y, z, mult=3.0)
            worst = max(worst, err / allowed)
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    device = "cpu" if a.smoke else "cuda"
    hub = attnhub.Hub()
    names = ["torch_sdpa"] if a.smoke else ["triton", "cudnn", "fa2", "torch_sdpa", "flashinfer"]
    rows: dict[str, Callable[..., torch.Tensor]] = {n: hub_backend(hub, n) for n in names}
    if not a.smoke:  # torch's own kernels right after ours: the comparison that matters
        rows = {"triton": rows.pop("triton"), **{n: raw_sdpa(k) for n, k in RAW.items()},
                **rows}
    cells = [(dt, s, n, c) for dt in (torch.bfloat16, torch.float16) for s in (1.0, 3.0, 12.5)
             for n in ((5, 9) if a.smoke else (5, 9, 64, 1024)) for c in (False, True)]
    seeds = 2 if a.smoke else a.seeds
    results: list[dict[str, Any]] = []
    for name, call in rows.items():
        for dt, s, n, c in cells:
            cell = {"row": name, "dtype": str(dt).removeprefix("torch."), "scale": s, "keys": n,
                    "causal": c}
            try:
                cell["ratio"] = worst_ratio(call, dt, s, n, c, seeds, device)
            except Exception as e:  # a backend declining a cell says why, and the grid goes on
                cell["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            results.append(cell)
            print(json.dumps(cell), flush=True)
    print("\n| row | cells | broken (ratio > 1) | worst ratio | worst cell |")
    print("|---|---|---|---|---|")
    for name in rows:
        mine = [r for r in results if r["row"] == name and "ratio" in r]
        if not mine:
            why = next((r["error"] for r in results if r["row"] == name), "-")
            print(f"| {name} | 0 | - | - | {why} |")
            continue
        top = max(mine, key=lambda r: r["ratio"])
        bad = sum(r["ratio"] > 1 for r in mine)
        print(f"| {name} | {len(mine)} | {bad} | {top['ratio']:.2f} | {top['dtype']} scale "
              f"{top['scale']} keys {top['keys']}{' causal' if top['causal'] else ''} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"seeds": seeds, "head_dim": D, "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
