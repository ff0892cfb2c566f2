"""``attnhub run``: bind the built-in decoder with a policy and run it for real.

Prints the binding table (every layer and phase, the backend, the rule, rejected candidates),
the time and tokens/s of prefill and decode through the paged KV cache, and a check of the
first steps against the ``reference`` backend. ``--compare-decode`` also times decode with
every backend that can serve it, from the same prefill, next to the policy's binding.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ._common import add_json, at_least, print_json, table
from ._decoder import add_decoder_args, build, describe, progress_bar


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="bind the built-in decoder with a policy and run prefill "
                                   "and decode with the paged KV cache")
    add_decoder_args(p)
    g = p.add_argument_group("checks and comparisons")
    g.add_argument("--check-steps", type=at_least(0), default=4,
                   help="steps (prefill + decode) compared against the reference backend "
                        "(default 4; 0 skips the check)")
    g.add_argument("--check-batch", type=at_least(1), default=2,
                   help="prompts in the reference check (default 2)")
    g.add_argument("--compare-decode", action="store_true",
                   help="also time decode with each available decode backend")
    g.add_argument("--compare-rounds", type=at_least(1), default=1,
                   help="with --compare-decode: decode each backend this many times, in a "
                        "random order per round, and report the median (default 1)")
    g.add_argument("--warmup", type=at_least(0), default=2,
                   help="untimed decode steps before each timed decode (default 2)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..models.decoder import random_prompts
    from ..models.generate import compare_decode, decode, prefill, reference_check

    s = build(args)
    report: dict[str, Any] = {"model": s.model.cfg.to_json(), "device": s.hub.device.describe(),
                              "dtype": str(s.dtype).removeprefix("torch."),
                              "bindings": s.table.to_json()}
    if not args.json:
        print(s.table)
        print(f"(each rule is in the policy file; `--json` lists every rejected candidate's "
              f"reasons)\n{describe(args, s)}", flush=True)
    if s.simulated:
        report["note"] = "simulated device: binding plan only, nothing was run"
        _finish(args, report, ["simulated device: binding plan only, nothing was run"])
        return 0
    s.table.check()
    b, p, n = args.batch, args.prompt_len, args.new_tokens
    prompts = random_prompts(s.model.cfg, b, p, s.device)
    per_fork = -(-(p + n) // args.page_size) - -(-p // args.page_size) + 1
    warm_rows = b if s.device.type == "cuda" and args.warmup else 0
    cache = s.model.new_cache(b + warm_rows, p, page_size=args.page_size,
                              spare_pages=b * per_fork)
    if warm_rows:  # compile prefill kernels outside the timed prefill
        warm, _, _ = prefill(s.model, cache, prompts)
        for q in warm:
            cache.free(q)
    seqs, first_logits, prefill_s = prefill(s.model, cache, prompts)
    first = first_logits.argmax(-1)
    k = max(0, min(args.check_steps, n + 1))
    if args.warmup:
        decode(s.model, cache, seqs, first, min(args.warmup, n))
    d = decode(s.model, cache, seqs, first, n, keep=max(k - 1, 0),
               progress=progress_bar(args, "decode", n))
    report["phases"] = {
        "prefill": {"tokens": b * p, "seconds": prefill_s, "tokens_per_s": b * p / prefill_s},
        "decode": {"tokens": b * n, "seconds": d.seconds,
                   "tokens_per_s": b * n / d.seconds if d.seconds else None},
    }
    lines = [table([(ph, r["tokens"], f"{r['seconds']:.3f}", _rate(r["tokens_per_s"]))
                    for ph, r in report["phases"].items()],
                   ("phase", "tokens", "seconds", "tokens/s"))]
    if s.hub.forced_backend:  # the binding table shows the policy's choice, not this
        report["forced_backend"] = s.hub.forced_backend
        lines.append(f"note: ATTNHUB_BACKEND={s.hub.forced_backend} forced every call onto "
                     "that backend; the binding table above is what the policy would bind")
    ok = True
    if k:
        rows = min(args.check_batch, b)
        logits = torch.cat([first_logits[:rows, None], d.logits[:rows, : k - 1]], 1)
        tokens = torch.cat([first[:rows, None], d.tokens[:rows, : k - 1]], 1)
        chk = reference_check(s.model, s.hub, s.table, prompts[:rows], logits, tokens,
                              page_size=args.page_size)
        report["check"] = chk.to_json()
        ok = chk.ok
        same = "yes" if all(chk.agree) else "no" + (" (near ties only)" if chk.ok else "")
        lines.append(f"check vs reference ({rows} prompts, first {k} steps): max |logit diff| "
                     f"{chk.max_abs_diff:.3g} (tolerance {chk.tolerance:.3g}), same greedy "
                     f"tokens: {same} -> {'ok' if chk.ok else 'FAILED'}")
    if args.compare_decode:
        rows_ = compare_decode(s.model, s.hub, s.table, cache, seqs, first, n,
                               warmup=args.warmup, rounds=args.compare_rounds,
                               progress=progress_bar(args, "compare", n))
        report["decode_backends"] = rows_
        lines.append(f"decode with each available backend (same prefill, {n} steps, "
                     f"{args.warmup} warm-up steps, median of {args.compare_rounds} "
                     "round(s)):")
        absent = [r["backend"] for r in rows_
                  if r.get("skipped", "").startswith("not on this device")]
        here = [r for r in rows_ if r["backend"] not in absent]
        lines.append(table([(r["backend"], _rate(r.get("tokens_per_s")),
                             f"{r['vs_best']:.3f}" if "vs_best" in r else "-",
                             r.get("steps_equal_to_policy", "-"),
                             r.get("error") or r.get("skipped") or "")
                            for r in here], ("backend", "decode tokens/s", "vs best",
                                             "steps same as policy", "note")))
        if absent:
            lines.append("not available on this device: " + ", ".join(absent))
    _finish(args, report, lines)
    return 0 if ok else 1


def _rate(x: float | None) -> str:
    return f"{x:,.1f}" if x else "-"


def _finish(args: argparse.Namespace, report: dict[str, Any], lines: list[str]) -> None:
    if args.json:
        print_json(report)
    else:
        print("\n" + "\n\n".join(lines))
