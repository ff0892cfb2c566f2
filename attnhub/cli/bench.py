"""``attnhub bench``: every available backend timed side by side, each checked first.

Shapes come from a grid (``--phases`` x ``--seqlens`` at the model sizes given) or from the
bindings of the built-in decoder (``--from-model``). Results go to the profile store (so that
``use: {fastest: [...]}`` rules can act on them), to a markdown table, and to a PNG on request.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ._common import add_json, print_json, table
from ._decoder import add_decoder_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time every available backend on a shape grid, each "
                                     "checked against the reference first")
    add_decoder_args(p, batch=1, prompt_len=256)
    g = p.add_argument_group("grid and timing")
    g.add_argument("--phases", default="prefill,decode",
                   help="comma list of prefill, decode (default both)")
    g.add_argument("--seqlens", default=None,
                   help="comma list of context lengths (default: --prompt-len)")
    g.add_argument("--mask", choices=("causal", "none"), default="causal",
                   help="prefill mask (default causal)")
    g.add_argument("--from-model", action="store_true",
                   help="bench the spec buckets the decoder binds instead of the grid")
    g.add_argument("--backends", default=None,
                   help="comma list (default: every exact backend except reference)")
    g.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    g.add_argument("--repeats", type=int, default=10, help="timed runs, median (default 10)")
    g.add_argument("--store", default=None, metavar="PATH",
                   help="profile store (default ATTNHUB_PROFILE or ~/.cache/attnhub)")
    g.add_argument("--no-store", action="store_true", help="do not record the results")
    g.add_argument("--md", default=None, metavar="FILE", help="also write the markdown table")
    g.add_argument("--plot", default=None, metavar="PNG", help="bar chart of the timings")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json(p)
    p.set_defaults(func=run)


def grid_specs(args: argparse.Namespace, dtype: str) -> list[Any]:
    """The exact-size specs of the grid (phases x seqlens at the given model sizes)."""
    from ..core.spec import AttentionSpec, MaskSpec

    hq, hkv = args.heads
    lens = [int(x) for x in (args.seqlens or str(args.prompt_len)).split(",")]
    out = []
    for phase in [x.strip() for x in args.phases.split(",") if x.strip()]:
        if phase not in ("prefill", "decode"):
            raise SystemExit(f"attnhub bench: --phases {args.phases!r}: use prefill, decode")
        for n in lens:
            decode = phase == "decode"
            out.append(AttentionSpec(
                phase=phase, dtype=dtype, head_dim=args.head_dim, num_q_heads=hq,
                num_kv_heads=hkv, layout="paged" if decode else "bshd",
                mask=MaskSpec(causal=args.mask == "causal" and not decode),
                max_seqlen_q=1 if decode else n, max_seqlen_k=n, batch=args.batch,
                page_size=args.page_size if decode else 0))
    return out


def run(args: argparse.Namespace) -> int:
    from ..benchmark import measure
    from ..core.spec import dtype_name
    from ._decoder import build

    s = build(args)
    if s.simulated:
        raise SystemExit("attnhub bench: --hardware simulates a device for planning; timings "
                         "need the real machine (run bench there, without --hardware)")
    specs = ([r.decision.spec for r in s.table] if args.from_model
             else grid_specs(args, dtype_name(s.dtype)))
    specs = list(dict.fromkeys(specs))
    names, absent = _backends(args, s.hub)
    bar = _bar(args, len(specs) * len(names))
    results = []
    for spec in specs:
        results += measure(s.hub, spec, names, s.device, warmup=args.warmup,
                           repeats=args.repeats, on_step=bar.update if bar else None)
    if bar:
        bar.close()
    if not args.no_store:
        _store(args, s.hub.device, results)
    md = markdown(results)
    if args.md:
        Path(args.md).write_text(md + "\n", encoding="utf-8")
    if args.plot:
        plot(results, args.plot)
    if args.json:
        print_json({"device": s.hub.device.describe(), "results": [m.to_json() for m in results]})
    else:
        print(f"device {s.hub.device.describe()}; median of {args.repeats} after "
              f"{args.warmup} warm-up runs; each backend checked against the fp64 reference "
              "first\n")
        print(md)
        if absent:
            print("\nnot available on this device: " + "; ".join(
                f"{n} ({why})" for n, why in absent.items()))
    return 1 if any(m.failed for m in results) else 0


def _backends(args: argparse.Namespace, hub: Any) -> tuple[list[str], dict[str, str]]:
    """The backends to bench (named, or every exact non-reference one available here) and,
    for the ones left out, the first reason they cannot run on this device."""
    if args.backends:
        names = [b.strip() for b in args.backends.split(",") if b.strip()]
        for n in names:
            hub.registry.get(n)  # unknown names fail now, listing the known ones
        return names, {}
    names, absent = [], {}
    for n, b in hub.registry.backends.items():
        if b.tier == "reference" or not b.capabilities.exact:
            continue
        why = b.available(hub.device)
        if why:
            absent[n] = why[0]
        else:
            names.append(n)
    return names, absent


def _bar(args: argparse.Namespace, total: int):  # type: ignore[no-untyped-def]
    if args.json or args.no_progress:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc="bench", file=sys.stderr, leave=False)


def _store(args: argparse.Namespace, device: Any, results: list[Any]) -> None:
    from ..policy.profile import ProfileStore

    store = ProfileStore(args.store)
    for m in results:
        if m.ms is not None:
            store.record_speed(device, m.spec, m.backend, m.ms / 1e3, samples=args.repeats)


def _shape(spec: Any) -> str:
    s = spec
    return (f"{s.phase} b={s.batch} sq={s.max_seqlen_q} sk={s.max_seqlen_k} "
            f"h={s.num_q_heads}:{s.num_kv_heads} d={s.head_dim} {s.dtype} "
            f"{s.mask.describe()}{' paged/' + str(s.page_size) if s.page_size else ''}")


def markdown(results: list[Any]) -> str:
    """One row per (shape, backend): time, throughput, check outcome."""
    rows = []
    for m in results:
        t = m.throughput()
        check = ("-" if m.skipped else f"FAIL: {m.failed}" if m.failed else
                 f"ok ({m.error:.2g} <= {m.allowed:.2g})")
        rows.append((_shape(m.spec), m.backend, f"{m.ms:.4f}" if m.ms is not None else "-",
                     f"{t[0]:.3g} {t[1]}" if t else "-",
                     check if not m.skipped else f"skipped: {_first(m.skipped)}"))
    return table(rows, ("shape", "backend", "median ms", "throughput", "check"))


def _first(reasons: str) -> str:
    parts = reasons.split("; ")
    return parts[0] + (f" (+{len(parts) - 1} more)" if len(parts) > 1 else "")


def plot(results: list[Any], path: str) -> None:
    """Grouped bars: one group per shape, one bar per backend that was timed (ms, log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(_shape(m.spec) for m in results))
    backends = list(dict.fromkeys(m.backend for m in results if m.ms is not None))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes) * max(1, len(backends)) / 2), 4))
    width = 0.8 / max(1, len(backends))
    for j, b in enumerate(backends):
        ys = {_shape(m.spec): m.ms for m in results if m.backend == b and m.ms is not None}
        xs = [i for i, sh in enumerate(shapes) if sh in ys]
        ax.bar([i + j * width for i in xs], [ys[shapes[i]] for i in xs], width, label=b)
    ax.set_xticks([i + width * (len(backends) - 1) / 2 for i in range(len(shapes))])
    ax.set_xticklabels([s.replace(" h=", "\nh=") for s in shapes], fontsize=7)
    ax.set_ylabel("median ms (lower is better)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
