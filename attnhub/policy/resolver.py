"""``Policy``: bind-time resolution of a spec to a backend, as a decision record.

First matching rule in file order (after overlays); its candidates in order (or by measured
speed for ``fastest``), each checked with ``backend.check(spec, device)`` plus the rule's
gates: approximate backends only through a layer selector or an accuracy gate, accuracy
records where ``requires.accuracy`` says so, and a local kernel for a distributed backend.
Results are cached per (spec, device, context), so the call path never runs policy code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.backend import Backend, safe_capabilities, safe_check
from ..core.decision import BindContext, Decision, Rejection
from ..core.device import DeviceInfo
from ..core.registry import Registry
from ..core.spec import AttentionSpec, bucket
from ..errors import PolicyError
from .fp8_gate import passed_note, record_hint, record_problems
from .loader import LoadedRule, PolicyData
from .match import Matcher, RuleIndex, set_bits
from .schema import target_problem
from .profile import (
    SETTLE_MARGIN,
    SETTLE_MARGIN_SHORT,
    SHORT_CALL_S,
    ProfileStore,
    Ranking,
    bucket_key,
    device_key,
)

DISTRIBUTED = "distributed"


@dataclass
class _Outcome:
    """What evaluating one rule's candidates found (shared by decisions; not mutated after)."""

    order: list[str]
    viable: list[str]
    rejected: list[Rejection]
    notes: list[str]
    on_failure: str = "next"
    fallbacks: list[str] = field(default_factory=list)
    inner: Decision | None = None
    missing: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)


class Policy:
    """A loaded policy; implements the hub's ``Resolver`` protocol."""

    def __init__(self, data: PolicyData, profile: ProfileStore | None = None):
        self.data = data
        self.name = data.name
        self.rules: tuple[LoadedRule, ...] = data.rules
        self._matchers = [Matcher(r.rule.when) for r in data.rules]
        self._index = RuleIndex([r.rule.when for r in data.rules])
        #: Layer kinds some rule selects (``when.layer.kind``); others bind as softmax layers.
        self._kinds = frozenset(k for r in data.rules if r.rule.when.layer is not None
                                for k in r.rule.when.layer.kind or ())
        self._profile = profile
        self._cache: dict[tuple[Any, ...], Decision] = {}
        self._outcomes: dict[tuple[Any, ...], _Outcome] = {}

    def __repr__(self) -> str:
        return f"<Policy {self.name!r} v{self.data.version}: {len(self.rules)} rules from " \
               f"{', '.join(self.data.files)}>"

    @property
    def profile(self) -> ProfileStore:
        """The profile store (``ATTNHUB_PROFILE`` or the default path, opened lazily)."""
        if self._profile is None:
            self._profile = ProfileStore()
        return self._profile

    @profile.setter
    def profile(self, store: ProfileStore) -> None:
        self._profile = store
        self._cache.clear()
        self._outcomes.clear()

    @property
    def targets(self) -> tuple[str, ...]:
        """Hardware the policy is written for (``targets:``); lint and plan default to it."""
        return self.data.targets or ("cpu", "sm80", "sm90", "gfx942")

    def check_targets(self) -> None:
        """Raise :class:`PolicyError`, located, for ``targets:`` entries that name no device
        ``plan`` and ``policy check`` can simulate (the call path never reads targets)."""
        problems = [f"{where}: {why}" for t, where in zip(self.data.targets or (),
                                                           self.data.target_places)
                    if (why := target_problem(t)) is not None]
        if problems:
            raise PolicyError(problems)

    def digest(self) -> str:
        """sha256 over the policy files (base first), for lockfiles."""
        h = hashlib.sha256()
        for f in self.data.paths:
            h.update(f.read_bytes())
        return h.hexdigest()[:16]

    # -- resolution -------------------------------------------------------------------------
    def resolve(self, spec: AttentionSpec, device: DeviceInfo, registry: Registry,
                ctx: BindContext = BindContext()) -> Decision:
        """The decision record for ``spec`` (bucketed first: conditions compare buckets) on
        ``device`` in bind context ``ctx``; cached."""
        return self._resolve(_bucketed(spec), device, registry, ctx, local=False)

    def trace(self, spec: AttentionSpec, device: DeviceInfo,
              ctx: BindContext = BindContext()) -> list[tuple[LoadedRule, str | None]]:
        """Each rule up to the matching one, with the ``when`` key that failed (None: match)."""
        out, spec = [], _bucketed(spec)
        for lr, m in zip(self.rules, self._matchers):
            failed, _ = m.failed(spec, device, ctx, self.profile)
            out.append((lr, failed))
            if failed is None:
                break
        return out

    def _resolve(self, spec: AttentionSpec, device: DeviceInfo, registry: Registry,
                 ctx: BindContext, local: bool) -> Decision:
        key = (spec, device, device.versions, ctx, registry, registry.generation,
               self.profile.revision, local)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._decide(spec, device, registry, ctx, local)
        return hit

    def _decide(self, spec: AttentionSpec, device: DeviceInfo, registry: Registry,
                ctx: BindContext, local: bool) -> Decision:
        skipped: list[str] = []
        for i in set_bits(self._index.candidates(spec, device)):
            lr, m = self.rules[i], self._matchers[i]
            failed, note = m.failed(spec, device, ctx, self.profile)
            if note:
                skipped.append(f"rule {lr.rule.name} skipped: {note}")
            if failed is None:
                out = self._outcome(i, spec, device, registry, ctx, local)
                chosen = out.viable[0] if out.viable else None
                skipped += self._context_notes(ctx, chosen, registry)
                return Decision(
                    spec=spec, device=device.describe(), backend=chosen, rule=lr.rule.name,
                    rule_location=lr.location, policy=self.name, candidates=tuple(out.order),
                    rejected=tuple(out.rejected), fallbacks=tuple(out.fallbacks),
                    on_failure=out.on_failure, context=ctx, notes=tuple(skipped + out.notes),
                    inner=out.inner if _distributed(chosen, registry) else None,
                    missing=tuple(out.missing), tied=tuple(out.tied))
        reason = (f"no rule of policy {self.name!r} matches {spec.describe()} on {device.arch} "
                  f"(context {_ctx(ctx)}); rules are tried in file order and the first match "
                  "wins: add a rule for this case (a last rule without `when` catches all)")
        return Decision(spec=spec, device=device.describe(), backend=None, policy=self.name,
                        rejected=(Rejection(f"policy:{self.name}", (reason,)),), context=ctx,
                        on_failure=self.data.defaults.on_failure, notes=tuple(skipped))

    def _context_notes(self, ctx: BindContext, chosen: str | None,
                       registry: Registry) -> list[str]:
        """Say when the bind context asked for something no rule gave, instead of binding as
        if it had not been asked: a layer kind no rule selects (a typo binds as softmax), and
        a world size above 1 served by a single-device kernel."""
        notes = []
        if ctx.layer_kind != "softmax" and ctx.layer_kind not in self._kinds:
            named = ", ".join(sorted(self._kinds)) or "none"
            notes.append(f"layer kind {ctx.layer_kind!r} is selected by no rule of policy "
                         f"{self.name!r} (kinds it selects: {named}); the layer is bound by "
                         "its shape and mask like a softmax layer")
        if ctx.world_size > 1 and chosen is not None and not _distributed(chosen, registry):
            notes.append(f"world_size={ctx.world_size}, but {chosen} is a single-device "
                         "kernel (no distributed rule serves this phase or layout): each rank "
                         "must pass whole, unsharded sequences")
        return notes

    def _outcome(self, i: int, spec: AttentionSpec, device: DeviceInfo, registry: Registry,
                 ctx: BindContext, local: bool) -> _Outcome:
        """Rule ``i``'s candidates checked for ``spec``. Backend checks do not depend on the
        bind context, so outcomes are shared across layers, except for rules with a
        distributed candidate, whose local kernel is resolved in that context."""
        lr = self.rules[i]
        per_ctx = any(_distributed(n, registry) for n in lr.rule.use.names)
        key = (i, spec, device, device.versions, registry, registry.generation,
               self.profile.revision, local)
        out = None if per_ctx else self._outcomes.get(key)
        if out is None:
            out = self._evaluate(lr, self._matchers[i], spec, device, registry, ctx, local)
            if not per_ctx:
                self._outcomes[key] = out
        return out

    def _evaluate(self, lr: LoadedRule, m: Matcher, spec: AttentionSpec, device: DeviceInfo,
                  registry: Registry, ctx: BindContext, local: bool) -> _Outcome:
        notes: list[str] = []
        ranking = self._ranking(lr.rule.use, spec, device, notes)
        out = _Outcome(ranking.order if ranking else list(lr.rule.use.order), [], [], notes,
                       on_failure=lr.rule.on_failure or self.data.defaults.on_failure)
        for name in out.order:
            reasons = self._reasons(name, lr, m, spec, device, registry, ctx, local, out)
            if reasons:
                out.rejected.append(Rejection(name, tuple(reasons)))
            else:
                out.viable.append(name)
        gated = [n for n in out.viable if accuracy_gated(lr, n)]
        if lr.rule.use.fastest is not None and gated and gated[0] != out.viable[0]:
            # a passing accuracy record is an opt-in (FP8): it leads, as in a plain list
            out.viable = gated + [n for n in out.viable if n not in gated]
            notes.append(f"fastest: {', '.join(gated)} passed the rule's accuracy gate and "
                         "leads (opted in by its accuracy record)")
        if ranking is not None:
            out.tied = [n for n in ranking.tied(out.viable) if not _distributed(n, registry)
                        and (not gated or n in gated)]  # timing never unseats an opt-in
            if len(out.tied) > 1:
                notes.append(f"near-tie in the pack: {', '.join(out.tied)} within "
                             f"{SETTLE_MARGIN:.0%} ({SETTLE_MARGIN_SHORT:.0%} for calls under "
                             f"{SHORT_CALL_S * 1e3:g} ms); the hub times them on this machine "
                             "at the first call and binds the fastest (ATTNHUB_SETTLE_TIES=0 "
                             "keeps this order)")
            else:
                out.tied = []
        if out.viable:
            out.fallbacks = _fallbacks(out.viable[0], out.viable[1:], registry, out.on_failure,
                                       notes)
        for name in out.missing:
            served = f"{out.viable[0]} serves instead" if out.viable else "nothing serves it"
            notes.append(f"rule {lr.rule.name!r} names {name}, which is not installed "
                         f"here; {served} (see `attnhub plugins`)")
        return out

    def _ranking(self, use: Any, spec: AttentionSpec, device: DeviceInfo,
                 notes: list[str]) -> Ranking | None:
        """A ``fastest`` rule's candidates by measured speed (None: a list, as written)."""
        if use.fastest is None:
            return None
        ranking = self.profile.ranking(device, spec, list(use.fastest))  # store, pack, list
        notes.append(f"fastest ({ranking.source}): {ranking.note}")
        return ranking

    def _reasons(self, name: str, lr: LoadedRule, m: Matcher, spec: AttentionSpec,
                 device: DeviceInfo, registry: Registry, ctx: BindContext, local: bool,
                 out: _Outcome) -> list[str]:
        backend = registry.backends.get(name)
        if backend is None:
            out.missing.append(name)
            return [registry.missing_reason(name)]
        caps = safe_capabilities(backend)
        if isinstance(caps, str):
            return [caps]
        reasons = safe_check(backend, spec, device)
        gated = accuracy_gated(lr, name)
        if not caps.exact and not (m.has_layer_selector or gated):
            reasons.append(f"approximate backend (error budget {caps.error_budget}) is bound "
                           "only by a rule with a layer selector (when.layer: an index, "
                           "every-n-th, or kinds other than softmax, which every call "
                           "without a layer context has) or one that requires an accuracy "
                           f"record for it; {lr.rule.name!r} has neither")
        if gated:
            # the opt-in note only for a backend nothing else rejects (never a misleading one)
            reasons += self._accuracy_reasons(name, lr, spec, device, backend,
                                              registry.provider_text(backend.plugin),
                                              [] if reasons else out.notes)
        if local and caps.lse_second_pass:
            reasons.append("computes the LSE by a second pass over materialised fp32 scores, "
                           "not in the kernel (lse_second_pass); a distributed backend merges "
                           "every block by its LSE and needs a kernel that returns it natively")
        if _distributed(name, registry) and not reasons:
            reasons += self._local_kernel(backend, spec, device, registry, ctx, local, out)
        return reasons

    def _accuracy_reasons(self, name: str, lr: LoadedRule, spec: AttentionSpec,
                          device: DeviceInfo, backend: Backend, provider: str,
                          notes: list[str]) -> list[str]:
        req = lr.rule.requires.accuracy  # type: ignore[union-attr]
        rec = self.profile.accuracy(device, spec, name)
        if rec is None:
            return [f"rule {lr.rule.name!r} requires a passing accuracy record and there is "
                    f"none for {name} on {device_key(device)} (bucket {bucket_key(spec)!r}) in "
                    f"{self.profile.path}; record one with {record_hint(name, spec)}"]
        if not rec.passed:
            return [f"accuracy record ({rec.key}, against {rec.reference}) failed: "
                    f"{_metrics(rec.metrics)}"]
        bad = [f"{k}={rec.metrics.get(k)} (max {v})" for k, v in req.max.items()
               if rec.metrics.get(k) is None or rec.metrics[k] > v]
        out = record_problems(rec, backend, provider) + (
            [f"accuracy record ({rec.key}) exceeds the rule's bounds: {', '.join(bad)}"]
            if bad else [])
        if not out:
            notes.append(passed_note(name, rec))
        return out

    def _local_kernel(self, backend: Backend, spec: AttentionSpec, device: DeviceInfo,
                      registry: Registry, ctx: BindContext, local: bool,
                      out: _Outcome) -> list[str]:
        """A distributed backend runs a local kernel per block: resolve it (world size 1,
        LSE required because blocks are merged by LSE)."""
        if local:
            return ["a distributed backend cannot be the local kernel of another one"]
        inner = self._resolve(replace(spec, return_lse=True), device, registry,
                              replace(ctx, world_size=1), local=True)
        if inner.backend is None:
            why = "; ".join(f"{r.backend}: {' / '.join(r.reasons)}" for r in inner.rejected)
            return [f"no local kernel for {backend.name} ({why})"]
        if out.inner is None:
            out.inner = inner
        return []


def _bucketed(spec: AttentionSpec) -> AttentionSpec:
    """``spec.bucketed()``, skipping the copy when it already is (the common case). A
    ``bhsd`` spec is resolved as the ``bshd`` one the hub makes of that call (it transposes
    views): ``layout: bshd`` rules missed it, so ``decide`` differed from the call."""
    if spec.layout == "bhsd":
        spec = replace(spec, layout="bshd")
    if (bucket(spec.max_seqlen_q) == spec.max_seqlen_q and bucket(spec.batch) == spec.batch
            and bucket(spec.max_seqlen_k) == spec.max_seqlen_k):
        return spec
    return spec.bucketed()


def accuracy_gated(lr: LoadedRule, backend: str) -> bool:
    """Does the rule require a passing accuracy record for this backend?"""
    req = lr.rule.requires
    return req is not None and req.accuracy is not None and req.accuracy.applies(backend)


def _distributed(name: str | None, registry: Registry) -> bool:
    b = registry.backends.get(name) if name else None
    return b is not None and b.tier == DISTRIBUTED


def _fallbacks(chosen: str | None, rest: list[str], registry: Registry, on_failure: str,
               notes: list[str]) -> list[str]:
    """Run-time fallbacks: the remaining viable candidates when ``on_failure: next``."""
    if chosen is None or not rest:
        return []
    if on_failure == "error":
        notes.append(f"on_failure=error: viable {', '.join(rest)} will not be tried if "
                     f"{chosen} raises at run time")
        return []
    if _distributed(chosen, registry):
        local = [n for n in rest if not _distributed(n, registry)]
        if local:
            notes.append(f"{', '.join(local)} not used as run-time fallbacks of {chosen}: "
                         "a local kernel on sharded inputs would compute the wrong attention")
        return [n for n in rest if n not in local]
    return rest


def _metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in metrics.items()) or "no metrics"


def _ctx(ctx: BindContext) -> str:
    return (f"model={ctx.model or '-'} layer={ctx.layer if ctx.layer is not None else '-'} "
            f"kind={ctx.layer_kind} world_size={ctx.world_size}")
