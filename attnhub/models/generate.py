"""Greedy generation with the paged KV cache, timed per phase, and the checks around it.

Decoding always runs on forks of the prefilled prompt sequences: the prompt's cache pages are
shared, so the same prefill serves the policy's run, a warm-up, and one timed decode per
backend in a side-by-side comparison, and freeing the forks returns the cache to the prompt
state.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..bind import BindingTable
from ..core.backend import safe_available, safe_check
from ..core.kvcache import PagedKVCache, free_all
from ..hub import Hub
from ..nn import Attention, override_backend
from ..timing import Stopwatch
from .decoder import Decoder

Progress = Callable[[Iterable[int]], Iterable[int]]


@dataclass
class Decoded:
    """Tokens (B, steps) and the logits of the first ``keep`` steps (B, keep, vocab)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    seconds: float


def prefill(model: Decoder, cache: PagedKVCache,
            prompts: torch.Tensor) -> tuple[list[int], torch.Tensor, float]:
    """Prompt sequences, their last-position logits (B, vocab) and the seconds it took."""
    with Stopwatch(model.device) as sw:
        seqs, logits = model.prefill(cache, prompts)
    return seqs, logits, sw.seconds


def decode(model: Decoder, cache: PagedKVCache, seqs: Sequence[int], first: torch.Tensor,
           steps: int, *, keep: int = 0, progress: Progress | None = None) -> Decoded:
    """Greedy decode of ``steps`` tokens on forks of ``seqs`` (freed afterwards); ``first``
    (B,) is the token each fork starts from (the prefill's greedy choice)."""
    forks: list[int] = []
    toks, kept = [first], []
    rng: Iterable[int] = range(steps)
    try:  # forks made inside: one refused half-way (a full state store, Ctrl-C) leaks none
        for s in seqs:
            forks.append(cache.fork(s))
        with Stopwatch(model.device) as sw:
            for i in (progress(rng) if progress else rng):
                logits = model.decode(cache, forks, toks[-1])
                if i < keep:
                    kept.append(logits)
                toks.append(logits.argmax(-1))
    finally:
        free_all(cache, forks)
    empty = first.new_zeros(first.shape[0], 0, model.cfg.vocab_size, dtype=torch.float32)
    return Decoded(torch.stack(toks[1:], 1) if steps else first.new_zeros(first.shape[0], 0),
                   torch.stack(kept, 1) if kept else empty, sw.seconds)


def exact_layers(hub: Hub, table: BindingTable) -> Callable[[Attention], bool]:
    """A filter for layers whose every binding is an exact backend: those a reference run may
    replace (an approximate layer, bound by name in a policy, keeps its backend)."""
    approx = {r.layer for r in table if r.backend is not None
              and not hub.registry.get(r.backend).capabilities.exact}
    return lambda m: m.layer_idx not in approx


@dataclass
class Check:
    """The first steps of a run against the same model with the ``reference`` backend."""

    rows: int
    steps: int
    max_abs_diff: float
    per_step: list[float]
    agree: list[bool]
    near_tie: list[bool] = field(default_factory=list)
    #: the largest logit error an exact backend's rounding explains (``LOGIT_TOLERANCE``
    #: of the reference's largest logit)
    tolerance: float = math.inf

    @property
    def ok(self) -> bool:
        """Logits within the rounding tolerance, and greedy tokens equal or differing only
        where the reference's top two logits are closer than twice the logit error (a tie
        that rounding may break either way). Before the tolerance, a wrong backend excused
        itself: its large error made every mismatch a "near tie" (linear attention forced:
        logits 5.1 off, tokens differing, "ok")."""
        return self.max_abs_diff <= self.tolerance and all(
            a or t for a, t in zip(self.agree, self.near_tie))

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "steps": self.steps, "max_abs_diff": self.max_abs_diff,
                "per_step_max_abs_diff": self.per_step, "same_greedy_tokens": all(self.agree),
                "mismatches_at_near_ties": sum(not a and t for a, t in
                                               zip(self.agree, self.near_tie)),
                "tolerance": self.tolerance, "ok": self.ok}


def reference_check(model: Decoder, hub: Hub, table: BindingTable, prompts: torch.Tensor,
                    logits: torch.Tensor, tokens: torch.Tensor, *, page_size: int) -> Check:
    """Rerun the first ``logits.shape[1]`` steps of rows ``prompts`` with ``reference`` on
    every exact layer, feeding the run's own tokens, and compare logits and greedy choices.

    ``logits`` (R, K, vocab): the run's prefill logits then K-1 decode steps; ``tokens``
    (R, K): the tokens the run chose at those steps.
    """
    rows, k = logits.shape[:2]
    cache = model.new_cache(rows, prompts.shape[1] + k, page_size=page_size)
    ref = []
    with override_backend(model, "reference", only=exact_layers(hub, table)):
        seqs, first = model.prefill(cache, prompts)
        ref.append(first)
        for i in range(k - 1):
            ref.append(model.decode(cache, seqs, tokens[:, i]))
    r = torch.stack(ref, 1)
    diff = (r - logits).abs().amax(dim=(0, 2))
    agree, tie = [], []
    for i in range(k):
        ref_tok = r[:, i].argmax(-1)
        same = ref_tok == tokens[:, i]
        agree.append(bool(same.all()))
        margin = r[:, i].gather(1, ref_tok[:, None]) - r[:, i].gather(1, tokens[:, i, None])
        tie.append(bool((margin.squeeze(1)[~same] <= 2 * diff[i]).all()))
    tol = LOGIT_TOLERANCE.get(logits.dtype, 1e-3) * float(r.abs().max())
    return Check(rows, k, float(diff.max()), [float(d) for d in diff], agree, tie, tol)


#: Largest logit difference from the reference run, relative to its largest logit, that the
#: rounding of an exact attention backend explains, by the model's dtype (fp32 runs measured
#: ~1e-6 of it; half precision is generous for ~1-2% per-logit rounding over a few layers).
LOGIT_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 0.1,
                   torch.float16: 0.05}


def decode_candidates(hub: Hub, table: BindingTable) -> tuple[list[str], dict[str, str]]:
    """Exact backends that can serve every exact layer's decode bindings on this device (the
    ``reference`` oracle excluded), and, for the others, the first reason they cannot."""
    specs = {r.decision.spec for r in table if r.phase == "decode" and r.backend is not None
             and hub.registry.get(r.backend).capabilities.exact}
    ok, skipped = [], {}
    for name, b in hub.registry.backends.items():
        if b.tier == "reference" or not b.capabilities.exact:
            continue
        absent = safe_available(b, hub.device)
        reasons = absent or [x for s in specs for x in safe_check(b, s, hub.device)]
        if reasons:
            skipped[name] = ("not on this device: " if absent else "") + reasons[0]
        else:
            ok.append(name)
    return ok, skipped


def compare_decode(model: Decoder, hub: Hub, table: BindingTable, cache: PagedKVCache,
                   seqs: Sequence[int], first: torch.Tensor, steps: int, *,
                   warmup: int = 2, rounds: int = 1,
                   progress: Progress | None = None) -> list[dict[str, Any]]:
    """Decode tokens/s of the policy's binding and of each candidate decode backend forced on
    the exact layers, all from the same prefill, each after ``warmup`` untimed steps.

    With ``rounds`` > 1 every backend decodes once per round, in a fresh (seeded) random
    order each round, and the median is reported: a decode loop is host-bound at small
    per-layer work, and one slow stretch of the host must not decide a comparison; a random
    order also gives no backend a fixed predecessor (``attnhub.timing.interleaved_ms``).
    """
    names, skipped = decode_candidates(hub, table)
    only = exact_layers(hub, table)
    runs: dict[str | None, list[float]] = {n: [] for n in [None, *names]}
    errors: dict[str | None, str] = {}
    tokens: dict[str | None, torch.Tensor] = {}
    rng = random.Random(0)
    for r in range(rounds):
        order: list[str | None] = [None, *names]
        if r:  # the first round in list order (the policy first), then shuffled
            rng.shuffle(order)
        for name in order:
            if name in errors:
                continue
            with override_backend(model, name, only=only):
                try:
                    decode(model, cache, seqs, first, warmup)
                    d = decode(model, cache, seqs, first, steps, progress=progress)
                except Exception as exc:  # noqa: BLE001  one failing must not hide the others
                    errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    continue
            runs[name].append(d.seconds)
            tokens[name] = d.tokens
    out: list[dict[str, Any]] = []
    for name, secs in runs.items():
        row: dict[str, Any] = {"backend": name or "policy"}
        if name in errors:
            row["error"] = errors[name]
        elif secs:
            med = statistics.median(secs)
            row.update(decode_s=med, rounds_s=secs,
                       tokens_per_s=first.shape[0] * steps / med if med else None,
                       steps_equal_to_policy=_common_prefix(tokens[name], tokens.get(None)))
        out.append(row)
    timed = [r for r in out if r.get("tokens_per_s")]
    best = max((r["tokens_per_s"] for r in timed), default=None)
    for r in timed:
        r["vs_best"] = r["tokens_per_s"] / best
    out += [{"backend": n, "skipped": why} for n, why in skipped.items()]
    return out


def _common_prefix(a: torch.Tensor, b: torch.Tensor | None) -> int:
    """How many leading steps two greedy runs (B, steps) chose the same tokens in."""
    if b is None or a.shape != b.shape:
        return 0
    differ = (a != b).any(0).nonzero()
    return int(differ[0]) if differ.numel() else a.shape[1]
