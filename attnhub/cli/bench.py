"""``attnhub bench``: every available backend timed side by side, each checked first.

Shapes come from a grid (``--phases`` x ``--seqlens`` at the model sizes given) or from the
bindings of the built-in decoder (``--from-model``). Results go to the profile store (so that
``use: {fastest: [...]}`` rules can act on them), to a markdown table, and to a PNG on request.

``--regret`` times the policy's binding beside every backend that accepts each cell of the
standard grid (``attnhub.regret``) and prints policy vs best with the regret per cell;
``--out-json``/``--md``/``--plot`` write the report, ``--pack`` a shipped profile pack.

Flags and output paths are checked before anything is measured (a bad ``--md`` found after
the run would lose the report). If the profile store cannot be written, the measurements are
still printed (and written wherever else asked), the command says so and exits with status 3.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..core.backend import safe_available
from ..errors import InputError
from ._common import (STORE_FAILED, add_json, at_least, atomic_path, checked_kind, list_of,
                      name_list, print_json, progress, table, write_text_atomic)
from ._decoder import add_decoder_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time every available backend on a shape grid, each "
                                     "checked against the reference first")
    add_decoder_args(p, batch=1, prompt_len=256,
                     hardware_help="refused: timings need the real machine (plan with "
                                   "`attnhub explain` / `plan --hardware`)")
    g = p.add_argument_group("grid and timing")
    g.add_argument("--phases", default="prefill,decode",
                   help="comma list of prefill, decode (default both)")
    g.add_argument("--seqlens", type=list_of(at_least(1)), default=None,
                   help="comma list of context lengths (default: --prompt-len)")
    g.add_argument("--mask", choices=("causal", "none"), default="causal",
                   help="prefill mask (default causal)")
    g.add_argument("--from-model", action="store_true",
                   help="bench the spec buckets the decoder binds instead of the grid")
    g.add_argument("--backends", default=None,
                   type=name_list("backend", "torch_sdpa", "every exact backend here"),
                   help="comma list (default: every exact backend except reference)")
    g.add_argument("--warmup", type=at_least(0), default=3, help="untimed runs first (default 3)")
    g.add_argument("--repeats", type=at_least(1), default=10,
                   help="timed runs, median (default 10)")
    g.add_argument("--store", default=None, metavar="PATH",
                   help="profile store file (default ATTNHUB_PROFILE or "
                        "~/.cache/attnhub/profile.json)")
    g.add_argument("--no-store", action="store_true", help="do not record the results")
    g.add_argument("--md", default=None, metavar="FILE", help="also write the markdown table")
    g.add_argument("--plot", default=None, metavar="PNG", help="bar chart of the timings")
    g = p.add_argument_group("regret report (--regret)")
    g.add_argument("--regret", action="store_true",
                   help="time the policy's binding and every backend on the standard grid; "
                        "print policy vs best with the regret per cell")
    g.add_argument("--cells", default=None, metavar="TEXT,..",
                   type=name_list("cell", "decode", "every cell of the grid"),
                   help="only cells whose name contains one of these (comma list)")
    g.add_argument("--exclude", default=None, metavar="NAME,..",
                   type=name_list("backend", "fa2", "none left out"),
                   help="backends not to time (comma list; say why in the report)")
    g.add_argument("--scale", type=at_least(1), default=None,
                   help="divide the grid's lengths (default 1 on a GPU, 64 on the CPU)")
    g.add_argument("--rounds", type=at_least(1), default=2,
                   help="timing rounds, min of medians (default 2); within a round every "
                        "callable of a cell is sampled in turn")
    g.add_argument("--out-json", default=None, metavar="FILE", help="write the report JSON")
    g.add_argument("--pack", default=None, metavar="FILE",
                   help="write a profile pack of the forced timings (attnhub/profiles/*.json)")
    g.add_argument("--header", default="", help="extra text for the report header "
                                                "(e.g. the commit)")
    g.add_argument("--from-json", default=None, metavar="FILE,..",
                   type=name_list("report", "regret.json", "bench then measures"),
                   help="measure nothing: render --md/--plot from saved --out-json reports "
                        "(later files replace cells of the same name)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json(p)
    p.set_defaults(func=run)


def grid_specs(args: argparse.Namespace, dtype: str) -> list[Any]:
    """The exact-size specs of the grid (phases x seqlens at the given model sizes)."""
    from ..core.spec import AttentionSpec, MaskSpec

    hq, hkv = args.heads
    lens = args.seqlens or [args.prompt_len]
    out = []
    for phase in _phases(args.phases):
        for n in lens:
            decode = phase == "decode"
            out.append(AttentionSpec(
                phase=phase, dtype=dtype, head_dim=args.head_dim, num_q_heads=hq,
                num_kv_heads=hkv, layout="paged" if decode else "bshd",
                mask=MaskSpec(causal=args.mask == "causal" and not decode),
                max_seqlen_q=1 if decode else n, max_seqlen_k=n, batch=args.batch,
                page_size=args.page_size if decode else 0))
    return out


def _phases(text: str) -> list[str]:
    """``--phases``: a non-empty comma list of prefill, decode."""
    phases = [x.strip() for x in text.split(",") if x.strip()]
    if not phases or set(phases) - {"prefill", "decode"}:
        raise SystemExit(f"attnhub bench: --phases {text!r}: use a comma list of prefill, "
                         "decode")
    return phases


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output file asked for can be written, checked before anything is measured: a
    bad path found after the run would lose the report (and, before the store, the store's
    records) behind a traceback. The files are then written whole or not at all
    (``atomic_path``)."""
    import os

    _phases(args.phases)
    if not args.regret and not args.from_json:  # else they would do nothing, silently
        stray = [f"--{n.replace('_', '-')}" for n, unset in _REGRET_ONLY
                 if getattr(args, n) != unset]
        if stray:
            raise SystemExit(f"attnhub bench: {', '.join(stray)} belong to the regret report "
                             "and do nothing without it; add --regret, or drop them")
    seen: dict[str, str] = {}
    store = getattr(args, "store", None) or os.environ.get("ATTNHUB_PROFILE")
    if store:
        seen[os.path.realpath(store)] = "--store"
    for flag in ("md", "plot", "out_json", "pack"):
        given = getattr(args, flag)
        if not given:
            continue
        path = Path(given)
        folder, name = path.parent, f"--{flag.replace('_', '-')}"
        kind = checked_kind(name, path)
        why = ("is a folder" if kind == "folder" else f"folder {folder} does not exist"
               if checked_kind(name, folder) != "folder" else f"folder {folder} is not "
               "writable" if not os.access(folder, os.W_OK) else "is not a regular file (a "
               "device, FIFO or socket: it would be replaced by the report)"
               if kind == "other" else "")
        other = seen.get(os.path.realpath(path))
        if not why and other:
            why = f"is also {other}: one would replace the other"
        if not why and flag == "plot" and path.suffix.lower() not in _PLOT_SUFFIXES:
            why = (f"has suffix {path.suffix or '(none)'!r}, which names no image format; "
                   f"use one of {', '.join(_PLOT_SUFFIXES)}")
        if why:
            raise SystemExit(f"attnhub bench: {name} {given}: {why}; pass a file in a "
                             "writable folder")
        seen[os.path.realpath(path)] = name


#: Flags of the regret report, with their defaults (``--regret``).
_REGRET_ONLY = (("cells", None), ("exclude", None), ("scale", None), ("rounds", 2),
                ("out_json", None), ("pack", None), ("header", ""))
#: Image formats ``--plot`` writes (matplotlib's, by the file's suffix).
_PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def run(args: argparse.Namespace) -> int:
    _check_outputs(args)
    if args.from_json:  # measure nothing (with or without --regret)
        return render_saved(args)
    if args.regret:
        return run_regret(args)
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
    bar = progress(args, "bench", len(specs) * len(names), unit="run")
    results = []
    for spec in specs:
        results += measure(s.hub, spec, names, s.device, warmup=args.warmup,
                           repeats=args.repeats, on_step=bar.update if bar else None)
    if bar:
        bar.close()
    md = markdown(results)
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
    # the table is printed and the store written first: a report that cannot be written
    # (a full disk) loses no measurement
    stored = args.no_store or _store(args, s.hub.device, [
        (m.spec, m.backend, m.ms) for m in results if m.ms is not None])
    if not _reports(args, md, lambda path: plot(results, path), stored):
        return STORE_FAILED
    return 1 if any(m.failed for m in results) else 0


def run_regret(args: argparse.Namespace) -> int:
    """The regret report over the standard grid (see ``attnhub.regret``)."""
    import datetime

    import torch

    from .. import regret as rg
    from ..hub import Hub

    hub = Hub(policy=args.policy, hardware=args.hardware)
    if hub.device.simulated:
        raise SystemExit("attnhub bench --regret: timings need the real machine (no --hardware)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    if gpu and device.index is None:  # "cuda" and "cuda:0" compare unequal in device checks
        device = torch.device("cuda", torch.cuda.current_device())
    cells = rg.standard_grid(args.dtype or ("bf16" if gpu else "fp32"),
                             args.scale or (1 if gpu else 64))
    if args.cells:
        want = [w.strip().lower() for w in args.cells.split(",") if w.strip()]
        cells = [c for c in cells if any(w in c.name.lower() for w in want)]
        if not cells:  # a typo would time nothing and report an empty grid as a success
            raise SystemExit(f"attnhub bench: --cells {args.cells!r} matches no cell of the "
                             "grid; names: " + ", ".join(c.name for c in rg.standard_grid()))
    names, absent = _backends(args, hub)
    excluded = {x.strip() for x in (args.exclude or "").split(",") if x.strip()}
    for n in excluded:  # a typo would time the backend it meant to leave out
        hub.registry.get(n)  # unknown names fail now, listing the known ones
    names = [n for n in names if n not in excluded]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = {"measured": when, "device": hub.device.describe(), "commit": args.header,
            "command": "attnhub bench --regret", "versions": dict(hub.device.versions),
            "backends": names, "excluded": sorted(excluded),
            "not_available": absent, "warmup": args.warmup, "repeats": args.repeats,
            "rounds": args.rounds}
    results: list[rg.CellResult] = []

    def report(complete: bool) -> dict[str, Any]:
        return {**meta, "complete": complete, "bound": rg.BOUND,
                "cells": [r.to_json() for r in results]}

    def write_data(complete: bool) -> None:
        """JSON report and pack, rewritten after every cell: a run cut short keeps its cells."""
        from ..policy.profile import write_json_atomic

        with _report_write("--out-json", args.out_json, _MID_RUN):
            if args.out_json:
                write_json_atomic(Path(args.out_json), report(complete))
        with _report_write("--pack", args.pack, _MID_RUN):
            if args.pack:
                write_json_atomic(Path(args.pack), rg.pack_data(
                    results, hub.device, {**meta, "complete": complete}, args.repeats))

    for i, cell in enumerate(cells):
        rg.stderr_log(f"[{i + 1}/{len(cells)}] {cell.name}")
        r = rg.measure_cell(cell, names, hub.registry, device, policy=args.policy,
                            warmup=args.warmup, repeats=args.repeats, rounds=args.rounds,
                            log=None if args.no_progress else rg.stderr_log)
        rg.stderr_log(f"  -> policy {r.policy_backend} {r.policy_ms} ms, best {r.best}, "
                      f"regret {r.regret} ({r.seconds:.1f} s)")
        results.append(r)
        write_data(complete=False)
    write_data(complete=True)
    head = (f"Regret report, {when}, {hub.device.describe()}, {args.header}\n\n"
            f"through attnhub.attention (policy, or backend= forced), raw libraries called "
            f"directly; each checked against the fp64 reference first. Per callable: median "
            f"of {args.repeats} samples after {args.warmup} warm-up calls, each read against "
            "its repeat's median sample (the median ratio times the median reference), min "
            f"over {args.rounds} rounds; within each repeat the policy's call, every forced backend "
            "and every raw library take one sample in turn (in orders where each follows "
            "every other equally often); a "
            f"sample is one call from an idle GPU, or, where a call is under {rg.BATCH_BELOW_MS:g} ms, "
            f"a batch of back-to-back calls (calls/sample, about {rg.BATCH_MS:g} ms) between "
            "CUDA events, per call; host time counts "
            "where the "
            f"GPU waits for it; no cache flush for any; a callable over {rg.DROP_ABOVE:g}x the "
            "fastest after a round keeps that figure and sits out the next, one over "
            f"{rg.SKIP_ABOVE:g}x in three calibration calls sits out every round.\n")
    md = rg.markdown(results, head)
    _print_report(args, md, report(complete=True))
    if args.pack:
        rg.stderr_log(f"wrote profile pack {args.pack}")
    # stored before the reports are written: a report that cannot be written loses no timing
    stored = args.no_store or _store(args, hub.device, [
        (r.spec, b, ms) for r in results if r.spec is not None for b, ms in r.times.items()])
    if not _reports(args, md, lambda path: rg.plot(
            results, path, title=f"attnhub policy regret, {hub.device.describe()}, {when} "
                                 f"{args.header}"), stored):
        return STORE_FAILED
    return 1 if rg.misses(results) else 0


def render_saved(args: argparse.Namespace) -> int:
    """``--from-json``: one report (md, png) from saved JSON reports, cells in grid order."""
    import json

    from .. import regret as rg
    from ..policy.loader import TooBig, read_limited
    from ..policy.profile import MAX_STORE_BYTES

    cells: dict[str, Any] = {}
    heads = []
    for f in [x.strip() for x in args.from_json.split(",") if x.strip()]:
        try:
            data = json.loads(read_limited(Path(f), MAX_STORE_BYTES))  # not a FIFO's wait
            heads += [f"{Path(f).name}: {m.get('measured')}, {m.get('device')}, "
                      f"{m.get('commit')}" for m in data.get("parts", [data])]  # combined: parts
            cells.update((c["cell"], rg.from_json(c)) for c in data["cells"])
        except (OSError, TooBig, ValueError, KeyError, TypeError, AttributeError,
                RecursionError) as exc:
            raise SystemExit(f"attnhub bench: --from-json {f}: not a saved --out-json report "
                             f"({type(exc).__name__}: {exc})") from None
    grid = [c.name for c in rg.standard_grid()]
    results = sorted(cells.values(), key=lambda r: grid.index(r.cell) if r.cell in grid
                     else len(grid))
    md = rg.markdown(results, args.header + "\n\nfrom " + "; ".join(heads) + "\n")
    _print_report(args, md, {"header": args.header, "sources": heads, "bound": rg.BOUND,
                             "cells": [r.to_json() for r in results]})
    _write_md_plot(args, md, lambda path: rg.plot(results, path, title=args.header),
                   left="the report above is printed; nothing was measured")
    return 1 if rg.misses(results) else 0


def _print_report(args: argparse.Namespace, md: str, data: dict[str, Any]) -> None:
    """The regret report on stdout: markdown, or with --json the same data as --out-json."""
    if args.json:
        print_json(data)
    else:
        print(md)


#: What a report written after each cell of ``--regret`` leaves when it cannot be written
_MID_RUN = ("the run stopped there: the cells measured so far are neither printed nor "
            "stored")


@contextlib.contextmanager
def _report_write(flag: str, path: Any,
                  left: str = "the measurements above are printed and stored"
                  ) -> Iterator[None]:
    """A report file that cannot be written (a full disk, a folder that is a file) is an
    error naming its flag and path, not a traceback, saying what the run ``left``."""
    try:
        yield
    except OSError as exc:
        raise InputError(f"{flag} {path}: cannot write it ({exc.strerror or exc}); free space "
                         f"or pass another path ({left})") from None


def _reports(args: argparse.Namespace, md: str, draw: Any, stored: bool) -> bool:
    """``--md`` and ``--plot`` after the measurements were printed (and stored, unless
    ``--no-store`` or the store could not be written: ``stored`` False). A report that cannot
    be written says what the run left; with the store failed too, the status stays the
    store's (STORE_FAILED, returned as False), the report error said on stderr."""
    if args.no_store:
        left = "the measurements above are printed; nothing was stored, --no-store"
    elif not stored:
        left = ("the measurements above are printed; the profile store was not written "
                "either (see above)")
    else:
        left = "the measurements above are printed and stored"
    try:
        _write_md_plot(args, md, draw, left=left)
    except InputError as exc:
        if stored:
            raise
        print(f"attnhub bench: error: {exc}", file=sys.stderr)
        return False
    return bool(stored)


def _write_md_plot(args: argparse.Namespace, md: str, draw: Any, **left: str) -> None:
    """``--md`` and ``--plot``, each written whole or not at all: ``draw(path)`` saves the
    figure to a temporary file beside ``--plot`` that replaces it once complete."""
    with _report_write("--md", args.md, **left):
        if args.md:
            write_text_atomic(args.md, md + "\n")
    with _report_write("--plot", args.plot, **left):
        if args.plot:
            with atomic_path(args.plot) as tmp:
                draw(str(tmp))


def _backends(args: argparse.Namespace, hub: Any) -> tuple[list[str], dict[str, str]]:
    """The backends to bench (named, or every exact non-reference one available here) and,
    for the ones left out, the first reason they cannot run on this device."""
    if args.backends:
        names = [b.strip() for b in args.backends.split(",") if b.strip()]
        for n in names:
            caps = hub.registry.get(n).capabilities  # unknown names fail now, listing all
            if not caps.exact:
                raise SystemExit(
                    f"attnhub bench: --backends {n}: {n} is not exact softmax attention "
                    f"(exact=False, error budget {caps.error_budget}), and bench checks "
                    "every backend against the exact fp64 reference first; drop it (for FP8 "
                    "accuracy use `attnhub fp8-check`)")
        return names, {}
    names, absent = [], {}
    for n, b in hub.registry.backends.items():
        if b.tier == "reference" or not b.capabilities.exact:
            continue
        why = safe_available(b, hub.device)
        if why:
            absent[n] = why[0]
        else:
            names.append(n)
    return names, absent


def _store(args: argparse.Namespace, device: Any, timed: list[tuple[Any, str, float]]) -> bool:
    """Record (spec, backend, ms) in the profile store; False (and says so) if it cannot be
    written: the measurements were printed already and are not lost with it."""
    from ..policy.profile import ProfileStore
    from ._common import recorded

    store = ProfileStore(args.store)

    def record() -> None:
        with store.batch():  # every measurement, or none
            for spec, backend, ms in timed:
                store.record_speed(device, spec, backend, ms / 1e3, samples=args.repeats)

    return recorded("bench", store.path, record)


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
