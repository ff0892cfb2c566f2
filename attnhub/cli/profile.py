"""``attnhub profile``: how much of a model step is attention, for prefill and for decode.

The share (attention time / step time, medians over repeated steps of the bound built-in
decoder) is what a policy's ``when: {profile: {attention_share: ...}}`` conditions read: where
attention is a small part of a step, a faster attention kernel buys little. Results go to the
profile store under the model's name and the phase.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from ._common import STORE_FAILED, add_json, at_least, print_json, recorded, table
from ._decoder import add_decoder_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure the attention share of a model step (prefill "
                                       "and decode) and store it for the policy")
    add_decoder_args(p, hardware_help="refused: measurements need the real machine (plan with "
                                      "`attnhub explain` / `plan --hardware`)")
    p.add_argument("--repeats", type=at_least(1), default=5,
                   help="steps measured per phase, median (default 5)")
    p.add_argument("--warmup", type=at_least(0), default=1, help="untimed steps first (default 1)")
    p.add_argument("--store", default=None, metavar="PATH",
                   help="profile store file (default ATTNHUB_PROFILE or "
                        "~/.cache/attnhub/profile.json)")
    p.add_argument("--no-store", action="store_true", help="do not record the results")
    add_json(p)
    p.set_defaults(func=run)


def measure_shares(model: Any, prompts: Any, *, page_size: int, repeats: int,
                   warmup: int) -> dict[str, dict[str, float]]:
    """Median step time, attention time and share for a prefill of ``prompts`` and for a
    decode step after it (the model must be bound)."""
    from ..core.kvcache import free_all
    from ..nn import timed_attention
    from ..timing import CallClock, Stopwatch

    b, p = prompts.shape
    cache = model.new_cache(b, p + warmup + repeats, page_size=page_size)
    clock = CallClock(model.device)

    def timed(fn: Any) -> tuple[float, float, Any]:
        clock.reset()
        with timed_attention(clock), Stopwatch(model.device) as sw:
            out = fn()
        return sw.seconds, clock.seconds(), out

    pre: list[tuple[float, float]] = []
    for i in range(warmup + repeats):
        step, attn, (seqs, logits) = timed(lambda: model.prefill(cache, prompts))
        if i + 1 < warmup + repeats:
            free_all(cache, seqs)
        if i >= warmup:
            pre.append((step, attn))
    dec: list[tuple[float, float]] = []
    tok = logits.argmax(-1)
    for i in range(warmup + repeats):
        step, attn, logits = timed(lambda t=tok: model.decode(cache, seqs, t))
        tok = logits.argmax(-1)
        if i >= warmup:
            dec.append((step, attn))
    return {"prefill": _summary(pre), "decode": _summary(dec)}


def _summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    step = statistics.median(s for s, _ in samples)
    attn = statistics.median(a for _, a in samples)
    share = statistics.median(min(1.0, a / s) for s, a in samples)
    return {"step_ms": step * 1e3, "attention_ms": attn * 1e3, "share": share}


def run(args: argparse.Namespace) -> int:
    from ..models.decoder import random_prompts
    from ._decoder import build

    s = build(args)
    if s.simulated:
        raise SystemExit("attnhub profile: --hardware simulates a device for planning; "
                         "measurements need the real machine")
    s.table.check()
    prompts = random_prompts(s.model.cfg, args.batch, args.prompt_len, s.device)
    shares = measure_shares(s.model, prompts, page_size=args.page_size,
                            repeats=args.repeats, warmup=args.warmup)
    name = s.table.model
    if args.json:
        print_json({"model": name, "device": s.hub.device.describe(), "phases": shares})
    else:
        print(f"model {name} on {s.hub.device.describe()}: batch {args.batch}, prompt "
              f"{args.prompt_len}, median of {args.repeats} steps")
        print(table([(ph, f"{r['step_ms']:.3f}", f"{r['attention_ms']:.3f}",
                      f"{r['share']:.1%}") for ph, r in shares.items()],
                    ("phase", "step ms", "attention ms", "attention share")))
    if args.no_store:
        return 0
    # after the results are printed: a store that cannot be written loses none of them
    from ..policy.profile import ProfileStore

    store = ProfileStore(args.store)

    def record() -> None:
        with store.batch():  # every phase, or none
            for phase, r in shares.items():
                store.record_attention_share(s.hub.device, name, r["share"], phase=phase)

    if not recorded("profile", store.path, record):
        return STORE_FAILED
    if not args.json:
        print("recorded in the profile store (attention_share, per phase)")
    return 0
