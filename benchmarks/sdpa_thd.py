"""torch_sdpa on packed documents (thd): the loop-free paths against the per-document loop
they replace, through the public API, beside torch's varlen op called directly.

Per case: each variant is checked against the fp64 reference (FlashAttention rule) and
timed with ``attnhub.timing.interleaved_ms`` (variants sampled in turn); host syncs per call
are counted with torch's sync debug mode. Variants: ``shipped`` (what torch_sdpa picks:
equal documents as one bshd call, else varlen flash on CUDA where exact, else padded),
``no uniform`` (the same without the bshd view: flash where exact, else padded; the loop on
the CPU), ``padded`` (flash off), ``loop`` (the old per-document path), ``raw varlen``
(``torch.ops.aten._flash_attention_forward``).

    python3 benchmarks/sdpa_thd.py [--json OUT.json] [--cpu]   # --cpu: tiny sizes, dry run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from contextlib import contextmanager
from typing import Any

import torch

import attnhub
from attnhub.core import builtin
from attnhub.core.spec import AttnParams
from attnhub.testing import fa_references, fa_rule_error
from attnhub.timing import interleaved_ms, source_commit


@contextmanager
def variant(name: str):  # type: ignore[no-untyped-def]
    """Force one of torch_sdpa's thd paths for the calls inside."""
    saved = builtin._uniform_docs, builtin.flash_varlen_window, builtin._padded_fits
    if name != "shipped":
        builtin._uniform_docs = lambda *a: False  # type: ignore[assignment]
    if name in ("padded", "loop"):
        builtin.flash_varlen_window = lambda *a, **k: None  # type: ignore[assignment]
        builtin._padded_fits = lambda device, n: name == "padded"  # type: ignore[assignment]
    try:
        yield
    finally:
        builtin._uniform_docs, builtin.flash_varlen_window, builtin._padded_fits = saved


def cases(cpu: bool) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    s = 64 if cpu else 1

    def rand(n: int, hi: int) -> list[int]:
        lens = torch.randint(0, hi // s + 1, (n,), generator=g).tolist()
        lens[0] = 0  # an empty document
        return lens

    dt = torch.float32 if cpu else torch.bfloat16

    def case(name: str, lq: list[int], lk: list[int], heads: tuple[int, int] = (32, 8),
             d: int = 128, dtype: torch.dtype = dt, **kw: Any) -> dict[str, Any]:
        return {"name": name, "lq": lq, "lk": lk, "heads": heads, "d": d, "dtype": dtype,
                "causal": True, **kw}

    docs, n2k = rand(16, 4096), [2048 // s] * 8
    return [
        case("8 docs x 2k causal (the regret grid's varlen cell)", n2k, n2k),
        case("16 ragged docs 0-4k causal, one empty", docs, docs),
        case("chunks: 8 docs, 256 new queries on 0-4k keys", [256 // s] * 8,
             [n + 256 // s for n in rand(8, 4096)]),
        case("varlen decode: 64 docs x 1 query, 0-4k keys", [1] * 64,
             [n + 1 for n in rand(64, 4096)]),
        case("window 256, 8 docs x 2k", n2k, n2k, window=(256 // s, 0)),
        case("fp32, 8 docs x 512 causal (no flash: padded vs loop)", [512 // s] * 8,
             [512 // s] * 8, heads=(8, 2), d=64, dtype=torch.float32),
    ]


def run_case(c: dict[str, Any], device: torch.device, repeats: int) -> dict[str, Any]:
    hq, hkv = c["heads"]

    def cu(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                            device=device)

    cu_q, cu_k = cu(c["lq"]), cu(c["lk"])
    q = torch.randn(sum(c["lq"]), hq, c["d"], device=device).to(c["dtype"])
    k = torch.randn(sum(c["lk"]), hkv, c["d"], device=device).to(c["dtype"])
    v = torch.randn(sum(c["lk"]), hkv, c["d"], device=device).to(c["dtype"])
    kw = {"layout": "thd", "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "causal": c["causal"],
              "window": c.get("window"), "max_seqlen_q": max(c["lq"]), "max_seqlen_k": max(c["lk"])}
    p = AttnParams(scale=1 / math.sqrt(c["d"]), causal=c["causal"], window=c.get("window"),
                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=kw["max_seqlen_q"],
                   max_seqlen_k=kw["max_seqlen_k"])
    ref64, _, same = fa_references(q, k, v, p, layout="thd")
    hubs = {name: attnhub.Hub() for name in ("shipped", "no uniform", "padded", "loop")}
    fns: dict[str, Any] = {}
    row: dict[str, Any] = {"case": c["name"], "dtype": str(c["dtype"]).split(".")[-1],
                           "errors": {}, "syncs": {}}
    for name, hub in hubs.items():
        def call(hub=hub, name=name):  # type: ignore[no-untyped-def]
            with variant(name):
                return hub.attention(q, k, v, backend="torch_sdpa", **kw)
        fns[name] = call
    window = builtin.flash_varlen_window(p, q.device, q.dtype, c["d"], c["d"], p.max_seqlen_q,
                                         p.max_seqlen_k)
    if window is not None:
        fns["raw varlen"] = lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, p.max_seqlen_q, p.max_seqlen_k, 0.0,
            p.causal and window == (-1, 0), False, scale=p.scale, window_size_left=window[0],
            window_size_right=window[1])[0]
    for name, fn in fns.items():
        out = fn()
        err, allowed = fa_rule_error(out, ref64, same)
        row["errors"][name] = f"{err:.2e} <= {allowed:.2e}" if err <= allowed else \
            f"WRONG {err:.2e} > {allowed:.2e}"
        row["syncs"][name] = count_syncs(fn, device)
    t = interleaved_ms(fns, device, warmup=3, repeats=repeats, rounds=2)
    row["ms"], row["batch"] = t.ms, t.batch
    return row


def count_syncs(fn: Any, device: torch.device) -> int | None:
    """Host syncs one call makes (torch's CUDA sync debug mode, warn level); None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (dry run)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    rows = [run_case(c, device, args.repeats if gpu else 2) for c in cases(not gpu)]
    names = ["shipped", "no uniform", "padded", "loop", "raw varlen"]
    print(f"torch_sdpa thd paths, {torch.cuda.get_device_name() if gpu else 'CPU'}, torch "
          f"{torch.__version__}, commit {source_commit()}; ms per call (host syncs per call)")
    print("| case | " + " | ".join(names) + " | loop / shipped | calls/sample |")
    print("|---" * (len(names) + 3) + "|")
    wrong = False
    for r in rows:
        cells = []
        for n in names:
            ms = r["ms"].get(n)
            s = r["syncs"].get(n)
            cells.append("-" if ms is None else f"{ms:.4g}" + (f" ({s})" if s is not None else ""))
            wrong |= r["errors"].get(n, "").startswith("WRONG")
        ratio = r["ms"]["loop"] / r["ms"]["shipped"]
        print(f"| {r['case']} ({r['dtype']}) | " + " | ".join(cells) +
              f" | {ratio:.2f} | {r['batch']} |")
    for r in rows:
        print(f"check {r['case']}: " + "; ".join(f"{n} {e}" for n, e in r["errors"].items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name() if gpu else "cpu",
                       "torch": torch.__version__, "commit": source_commit(), "rows": rows},
                      f, indent=2, default=str)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
