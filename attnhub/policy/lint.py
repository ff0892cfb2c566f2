"""``attnhub policy check``: what a policy gets wrong before it binds anything.

Errors: unknown backend names, approximate backends outside layer selectors, contradictions
(FP8 routed to a backend without FP8, deterministic routed to a non-deterministic one), and
cells of (hardware x phase x dtype x mask) that no rule serves. Warnings: rules shadowed by an
earlier rule, FP8 without an accuracy gate, thresholds that are not powers of two, and cells
unserved only because a first-party plugin is not installed here.
"""

from __future__ import annotations

import heapq
import math
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

from ..core.backend import safe_capabilities
from ..core.capabilities import Capabilities
from ..core.device import simulate
from ..core.registry import Registry, did_you_mean
from ..core.spec import bucket
from .cells import Cell, cells
from .fp8_gate import METRICS, OUTLIER_KINDS, known_metric
from .loader import LoadedRule
from .profile import ProfileStore
from .match import selects_layers
from .resolver import Policy, accuracy_gated
from .schema import RANGE_MINIMUM, LayerSelector, ProfileCondition, Range, When

#: Backend names of the in-repo plugins -> the plugin directory that provides them.
FIRST_PARTY: dict[str, str] = {
    **dict.fromkeys(("reference", "torch_sdpa"), "core"),
    **dict.fromkeys(("triton", "triton_decode", "triton_decode_fp8", "flex"), "triton_portable"),
    **dict.fromkeys(("fa2", "fa2_torch", "flashinfer_decode", "flashinfer_prefill"), "sm80_fa2"),
    **dict.fromkeys(("fa3", "cudnn", "fa3_fp8"), "sm90_fa3"),
    **dict.fromkeys(("ck_fa", "triton_rocm"), "rocm"),
    **dict.fromkeys(("gla", "linear", "retention", "sliding_window", "longformer", "lsh"),
                    "hybrid_linear"),
    **dict.fromkeys(("ring", "torch_flash_cpu"), "ring"),
}
_FP8 = frozenset({"fp8_e4m3", "fp8_e5m2"})
_BUCKETED = ("seqlen", "seqlen_q", "seqlen_k", "batch")


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning"]
    where: str  # file:line:col
    path: str  # rules[3].use[1] (rule name)
    message: str

    def __str__(self) -> str:
        return f"{self.where} {self.path}: {self.level}: {self.message}"

    def to_json(self) -> dict[str, str]:
        return {"level": self.level, "location": self.where, "path": self.path,
                "message": self.message}


def lint_policy(policy: Policy, registry: Registry,
                hardware: tuple[str, ...] | None = None) -> list[Finding]:
    """Every finding for ``policy`` with the backends of ``registry``; cells are checked on
    ``hardware`` (default: the policy's ``targets``, which must name devices it can
    simulate: :class:`PolicyError`, located, otherwise)."""
    if not hardware:
        policy.check_targets()
    out: list[Finding] = []
    shadows = _ShadowIndex()
    for lr in policy.rules:
        out += _backend_names(lr, registry)
        out += _variant_names(lr, registry)
        out += _contradictions(lr, registry)
        out += _thresholds(lr)
        out += _impossible(lr)
        out += _repeated_candidates(lr)
        out += shadows.add(lr)
    out += _target_spelling(policy)
    out += _cells(policy, registry, hardware or policy.targets)
    return sorted(out, key=lambda f: (f.level != "error", _sort_key(f.where)))


def _target_spelling(policy: Policy) -> list[Finding]:
    """``targets`` entries that load only because targets ignore case (``H200`` plans as
    ``h200``, as ``--hardware`` and ``ATTNHUB_HARDWARE`` do): every name a condition matches
    (``hardware``, phases, dtypes, backends, rule names) is exact, so ``H200`` here reads as
    if ``hardware: SM90`` would work too (it is refused); the spelling that plans is said."""
    out = []
    for name, place in zip(policy.data.targets or (), policy.data.target_places):
        if name != name.lower():
            where, _, path = place.partition(" ")
            out.append(Finding("warning", where, path, (
                f"target {name!r} is read as {name.lower()!r}: targets ignore case, unlike "
                "the names of conditions (`hardware: SM90` is refused); expected "
                f"{name.lower()!r} as written")))
    return out


def _sort_key(where: str) -> tuple[str, int, int]:
    file, line, col = where.rsplit(":", 2)
    return file, int(line), int(col)


def _label(lr: LoadedRule, *sub: Any) -> str:
    text = f"rules[{lr.path[1]}]"
    for s in sub:
        text += f"[{s}]" if isinstance(s, int) else f".{s}"
    return f"{text} ({lr.rule.name})"


def _use_where(lr: LoadedRule, j: int) -> str:
    for sub in (("use", "fastest", j), ("use", "order", j), ("use", j)):
        if lr.path + sub in lr.doc.values:
            return lr.where(*sub)
    return lr.where("use")


def _backend_names(lr: LoadedRule, registry: Registry) -> list[Finding]:
    out = []
    for j, name in enumerate(lr.rule.use.names):
        b = registry.backends.get(name)
        where, label = _use_where(lr, j), _label(lr, "use", j)
        if b is None and name in FIRST_PARTY:
            plugin = FIRST_PARTY[name]
            out.append(Finding("warning", where, label, (
                f"backend {name!r} is not installed here (plugin attnhub-{plugin}: pip install "
                f"-e plugins/{plugin}); resolution skips it with that reason")))
        elif b is None:
            known = sorted(set(registry.backends) | set(FIRST_PARTY))
            out.append(Finding("error", where, label, (
                f"unknown backend {name!r}, expected one of: {', '.join(known)}"
                + did_you_mean(name, known))))
        elif isinstance(caps := safe_capabilities(b), str):
            out.append(Finding("warning", where, label, f"{caps}; resolution rejects it"))
        elif not caps.exact and not (selects_layers(lr.rule.when) or accuracy_gated(lr, name)):
            out.append(Finding("error", where, label, (
                f"{name} is approximate (error budget {caps.error_budget}), expected "
                "it only in a rule with a layer selector (when.layer) or with `requires: "
                "{accuracy: ...}` for it; the resolver never binds it here")))
        elif caps.fp8 and not accuracy_gated(lr, name):
            out.append(Finding("warning", where, label, (
                f"{name} computes in FP8 without an accuracy gate; FP8 attention lost accuracy "
                "badly on outlier inputs (rel. error 0.17-0.26 vs 0.0018 for BF16 on an H200): "
                "expected `requires: {accuracy: {backends: [" + name + "]}}`")))
    out += _gate_names(lr)
    out += _gate_metrics(lr)
    return out


def _variant_names(lr: LoadedRule, registry: Registry) -> list[Finding]:
    """``when.variant`` names no installed plugin registers: a typo there never raises, the
    rule just never matches (a call's own callable matches only by its ``__name__``)."""
    out = []
    for j, name in enumerate(lr.rule.when.variant or ()):
        if name in registry.variants:
            continue
        known = sorted(registry.variants)
        out.append(Finding("warning", lr.where("when", "variant", j),
                           _label(lr, "when", "variant", j), (
            f"no installed plugin registers variant {name!r}, so the rule matches only calls "
            f"whose score_mod/mask_mod callable is named {name!r}; expected one of: "
            f"{', '.join(known) or '(none installed)'}" + did_you_mean(name, known))))
    return out


def _repeated_candidates(lr: LoadedRule) -> list[Finding]:
    """A backend named twice in one ``use``: tried (and fallen back to) twice."""
    seen: set[str] = set()
    out = []
    for j, name in enumerate(lr.rule.use.names):
        if name in seen:
            out.append(Finding("warning", _use_where(lr, j), _label(lr, "use", j),
                               f"{name} is named twice in this rule's candidates; expected each "
                               "backend once"))
        seen.add(name)
    return out


def _gate_names(lr: LoadedRule) -> list[Finding]:
    req = lr.rule.requires
    gate = req.accuracy.backends if req is not None and req.accuracy is not None else None
    return [Finding("error", lr.where("requires", "accuracy", "backends", i),
                    _label(lr, "requires", "accuracy", "backends", i), (
                        f"{name!r} is not a candidate of this rule, expected one of: "
                        f"{', '.join(lr.rule.use.names)}"))
            for i, name in enumerate(gate or []) if name not in lr.rule.use.names]


def _gate_metrics(lr: LoadedRule) -> list[Finding]:
    """``requires.accuracy.max`` keys no ``fp8-check`` record holds: the gate then refuses
    every record (metric missing), so the backend never binds, found only at run time. A
    warning, not an error: a record of one's own (``ProfileStore.record_accuracy``) may
    hold other metrics."""
    req = lr.rule.requires
    bounds = req.accuracy.max if req is not None and req.accuracy is not None else {}
    known = [*METRICS, "rel_error_<kind>_x<M>", "max_error_<kind>_x<M>"]
    return [Finding("warning", lr.where("requires", "accuracy", "max", name, key=True),
                    _label(lr, "requires", "accuracy", "max", name), (
                        f"unknown metric {name!r}: attnhub fp8-check records "
                        f"{', '.join(known)} (<kind>: {', '.join(OUTLIER_KINDS)}); a record "
                        "without it fails this gate, so the backend never binds; expected one "
                        "of these" + did_you_mean(name, list(METRICS))))
            for name in bounds if not known_metric(name)]


def _contradictions(lr: LoadedRule, registry: Registry) -> list[Finding]:
    w, out = lr.rule.when, []
    fp8_only = w.dtype is not None and set(w.dtype) <= _FP8
    fp8_kv = w.kv_dtype is not None and set(w.kv_dtype) <= _FP8
    for j, name in enumerate(lr.rule.use.names):
        b = registry.backends.get(name)
        c = None if b is None else safe_capabilities(b)
        if not isinstance(c, Capabilities):  # missing or unreadable: reported above
            continue
        where, label = _use_where(lr, j), _label(lr, "use", j)
        if fp8_only and not set(w.dtype or ()) & c.dtypes:
            out.append(Finding("error", where, label, (
                f"rule routes FP8 ({', '.join(w.dtype or ())}) to {name}, which supports "
                f"{', '.join(sorted(c.dtypes))}; expected an FP8-capable backend")))
        if fp8_kv and not set(w.kv_dtype or ()) & (c.kv_dtypes or frozenset()):
            out.append(Finding("error", where, label, (
                f"rule routes an FP8 KV cache to {name}, which declares no FP8 KV dtype; "
                "expected an FP8-KV-capable backend")))
        grad = w.needs_grad or (w.phase is not None and set(w.phase) == {"train"})
        if w.deterministic and (not c.deterministic_forward
                                or (grad and not c.deterministic_backward)):
            part = "backward" if c.deterministic_forward else "forward"
            out.append(Finding("error", where, label, (
                f"rule routes deterministic requests to {name}, whose {part} is not "
                "deterministic; expected a deterministic backend")))
        if w.dropout and not c.dropout:
            out.append(Finding("error", where, label, (
                f"rule routes dropout requests (dropout_p > 0) to {name}, which declares no "
                "attention dropout; expected a backend that draws it (Capabilities.dropout: "
                "torch_sdpa, reference, fa2)")))
    return out


#: Every value a bucketed length or batch takes (``core.spec.bucket``): 0 and powers of two.
_BUCKET_VALUES = (0, *(1 << i for i in range(63)))


def _is_bucket(x: float) -> bool:
    return x == int(x) and (x == 0 or (x >= 1 and not int(x) & (int(x) - 1)))


def _thresholds(lr: LoadedRule) -> list[Finding]:
    """Bucketed keys compare powers of two (or 0): a listed value that is none never holds
    (``batch: 3``, ``seqlen: 3000``), and a range between two neighbouring powers of two
    (``seqlen: {gt: 4096, lt: 8192}``) admits no call at all; both loaded without a word."""
    out = []
    for key in _BUCKETED:
        rng: Range | None = getattr(lr.rule.when, key)
        if rng is None or rng.empty() or (
                not any(x == int(x) for x in rng.in_) if rng.in_ is not None
                else _no_whole(rng, RANGE_MINIMUM[key])):
            continue  # said by _impossible / _out_of_domain (once: not twice for one slip)
        where, label = lr.where("when", key), _label(lr, "when", key)
        if not any(rng.contains(b) for b in _BUCKET_VALUES):
            out.append(Finding("warning", where, label, (
                f"{key} is compared after bucketing to the next power of two, and no power "
                f"of two (or 0) satisfies {rng.model_dump(exclude_none=True, by_alias=True)}, "
                "so this rule can never match; expected bounds or values that are powers of "
                "two (e.g. 4096, 8192)")))
            continue
        never = [x for x in rng.in_ or () if not _is_bucket(x)]
        whole = [x for x in never if x == int(x)]
        if whole:
            out.append(Finding("warning", where, label, (
                f"value {whole[0]:g} never holds: {key} is compared after bucketing to the "
                f"next power of two (a call of {whole[0]:g} is seen as "
                f"{_next_bucket(whole[0]):g}); expected powers of two (e.g. 4096, 8192)")))
        elif never:  # a fraction: no call has it, bucketed or not
            out.append(Finding("warning", where, label, (
                f"value {never[0]:g} never holds: {key} is a whole number (compared after "
                "bucketing to the next power of two); expected powers of two (e.g. 4096, "
                "8192)")))
        bounds = [b for b in (rng.ge, rng.gt, rng.le, rng.lt) if b is not None]
        odd = [b for b in bounds if not _is_bucket(b)]
        if odd:
            out.append(Finding("warning", where, label, (
                f"bound {odd[0]:g} is not a power of two, but {key} is compared after bucketing "
                "to the next power of two; expected a power of two (e.g. 4096, 8192)")))
    return out


def _no_whole(rng: Range, least: float) -> bool:
    """Bounds that admit no whole number from ``least`` (``{gt: 1, lt: 2}``), which
    :func:`_no_whole_number` reports."""
    lo, hi = _whole_bounds(rng, least)
    return lo > hi


def _next_bucket(x: float) -> int:
    """The bucket a call of ``x`` (whole) is seen as, however large (a value past the last
    of ``_BUCKET_VALUES`` raised StopIteration out of lint)."""
    return bucket(int(x))


def _impossible(lr: LoadedRule) -> list[Finding]:
    """Ranges no value satisfies (``{ge: 8192, lt: 1024}``): the rule can never match."""
    w, out = lr.rule.when, []
    ranges = [(k, getattr(w, k)) for k in w.model_fields_set if isinstance(getattr(w, k), Range)]
    if w.layer is not None and w.layer.index is not None:
        ranges.append(("layer.index", w.layer.index))
    for key, rng in ranges:
        if rng.empty():
            path = tuple(key.split("."))
            out.append(Finding("warning", lr.where("when", *path), _label(lr, "when", *path), (
                f"no value satisfies {rng.model_dump(exclude_none=True, by_alias=True)}, so this "
                "rule can never match; expected bounds with lower <= upper")))
    return out + [Finding("warning", lr.where("when", key), _label(lr, "when", key),
                          f"{why}, so this rule can never match; expected conditions that "
                          "can hold together")
                  for key, why in _exclusive(w)]


def _exclusive(w: When) -> list[tuple[str, str]]:
    """``when`` keys that contradict another key: (the key, why)."""
    out = []
    kinds = set(w.mask) if w.mask is not None else None
    if kinds is not None and w.mask_any is not None and not kinds & set(w.mask_any):
        out.append(("mask_any", f"mask_any {sorted(w.mask_any)} needs a kind outside `mask` "
                                f"{sorted(kinds)}"))
    if kinds is not None and w.variant is not None and not kinds & {"score_mod", "mask_mod"}:
        out.append(("variant", f"a variant is a score_mod or mask_mod, which `mask` "
                               f"{sorted(kinds)} leaves out"))
    if w.capability is not None and w.hardware is not None and not any(
            h == "cuda" or h.startswith("sm") for h in w.hardware):
        out.append(("capability", f"compute capability exists only on CUDA, and `hardware` is "
                                  f"{', '.join(w.hardware)}"))
    return out + _out_of_domain(w)


#: ``when`` keys whose values are whole numbers (head dims, counts, bucketed lengths).
_WHOLE = ("head_dim", "head_dim_v", "num_q_heads", "num_kv_heads", "gqa_ratio", "seqlen",
          "seqlen_q", "seqlen_k", "batch", "world_size")


def _out_of_domain(w: When) -> list[tuple[str, str]]:
    """Conditions no call can meet although the range itself is satisfiable: only fractions
    for a whole-number key, an attention share outside [0, 1], layer offsets the remainder
    never reaches, an empty device-name glob."""
    out = []
    for key in _WHOLE:
        rng: Range | None = getattr(w, key)
        if rng is not None and rng.in_ is not None and not any(x == int(x) for x in rng.in_):
            out.append((key, f"{key} is a whole number and {key}: {rng.in_} lists none"))
    share = w.profile.attention_share if w.profile is not None else None
    if share is not None and _misses(share, 0.0, 1.0):
        out.append(("profile", "attention_share is between 0 and 1, and the condition "
                               "admits no value there"))
    layer = w.layer
    if layer is not None and layer.every is not None and layer.offset is not None:
        if all(o >= layer.every for o in layer.offset):
            out.append(("layer", f"offset {layer.offset} is never reached (layer % "
                                 f"{layer.every} is at most {layer.every - 1})"))
    if w.device_name is not None and not any(w.device_name):
        out.append(("device_name", "a device name is never empty, and `device_name` is ''"))
    return out + _no_whole_number(w) + _capability_misses(w) + _lengths_disagree(w) \
        + _layers_never(w)


def _whole_bounds(rng: Range, least: float) -> tuple[float, float]:
    """The smallest and largest whole numbers ``rng``'s bounds admit, from ``least``."""
    lo, hi = least, math.inf
    if rng.ge is not None:
        lo = max(lo, math.ceil(rng.ge))
    if rng.gt is not None:
        lo = max(lo, math.floor(rng.gt) + 1)
    if rng.le is not None:
        hi = min(hi, math.floor(rng.le))
    if rng.lt is not None:
        hi = min(hi, math.ceil(rng.lt) - 1)
    return lo, hi


def _no_whole_number(w: When) -> list[tuple[str, str]]:
    """Bounds that admit reals but no count: ``head_dim: {gt: 64, lt: 65}``, ``{lt: 1}``."""
    ranges = [(k, getattr(w, k), RANGE_MINIMUM[k]) for k in _WHOLE]
    if w.layer is not None:
        ranges.append(("layer", w.layer.index, 0))
    out = []
    for key, rng, least in ranges:
        if rng is not None and rng.in_ is None and not rng.empty():
            lo, hi = _whole_bounds(rng, least)
            if lo > hi:
                out.append((key, f"{key} is a whole number >= {least:g} and "
                                 f"{rng.model_dump(exclude_none=True, by_alias=True)} admits "
                                 "none"))
    return out


def _capability_misses(w: When) -> list[tuple[str, str]]:
    """``capability`` is major.minor (9.0 on sm90): a range the named archs never reach, or
    one written as ``90``."""
    rng = w.capability
    if rng is None:
        return []
    sm = [h for h in (w.hardware or ()) if h.startswith("sm") and h[2:].isdigit()]
    if sm and len(sm) == len(w.hardware or ()):
        caps = [int(h[2:-1]) + int(h[-1]) / 10 for h in sm]
        if not any(rng.contains(c) for c in caps):
            return [("capability", f"`hardware` {', '.join(sm)} has compute capability "
                                   f"{', '.join(f'{c:.1f}' for c in caps)}, which "
                                   f"{rng.model_dump(exclude_none=True, by_alias=True)} "
                                   "leaves out")]
    elif _misses(rng, 1.0, 15.0):
        return [("capability", "compute capabilities are major.minor numbers (9.0 on sm90, "
                               "8.0 on sm80), and the condition admits none of them")]
    return []


def _lengths_disagree(w: When) -> list[tuple[str, str]]:
    """``seqlen`` is the longer of seqlen_q and seqlen_k: it is never below either."""
    if w.seqlen is None or w.seqlen.in_ is not None:
        return []
    top = _whole_bounds(w.seqlen, 0)[1]
    for key in ("seqlen_q", "seqlen_k"):
        rng = getattr(w, key)
        if rng is not None and rng.in_ is None and _whole_bounds(rng, 0)[0] > top:
            return [(key, f"seqlen (the longer of seqlen_q and seqlen_k) is at most {top:g}, "
                          f"and {key} is above it")]
    return []


def _layers_never(w: When) -> list[tuple[str, str]]:
    """Listed layer indices none of which ``every``/``offset`` selects."""
    layer = w.layer
    if (layer is None or layer.index is None or layer.index.in_ is None
            or layer.every is None):
        return []
    offsets = layer.offset if layer.offset is not None else [0]
    if not any(int(i) % layer.every in offsets for i in layer.index.in_ if i == int(i)):
        listed = [f"{i:g}" for i in layer.index.in_]
        return [("layer", f"none of the layers {listed} is at an offset {list(offsets)} of "
                          f"every {layer.every}")]
    return []


def _misses(rng: Range, lo: float, hi: float) -> bool:
    """True when no value of ``rng`` lies in [lo, hi]."""
    if rng.in_ is not None:
        return not any(lo <= x <= hi and rng.contains(x) for x in rng.in_)
    return bool((rng.ge is not None and rng.ge > hi) or (rng.gt is not None and rng.gt >= hi)
                or (rng.le is not None and rng.le < lo) or (rng.lt is not None and rng.lt <= lo))


class _Posting:
    """Rule indices in the order they were added (ascending) and as a set for lookups."""

    __slots__ = ("order", "members")

    def __init__(self) -> None:
        self.order: list[int] = []
        self.members: set[int] = set()

    def add(self, i: int) -> None:
        self.order.append(i)
        self.members.add(i)


_NONE = _Posting()


class _ShadowIndex:
    """Rules seen so far, indexed so that finding an earlier rule that covers a new one
    costs a walk over the shortest index list that any cover must be in, not a scan (or set
    operations over) every earlier rule: a cover has keys that are a subset of the new
    rule's, and for each of them, lists that hold all of its values (``covers`` then
    decides on the few candidates). 27,000 rules took a minute with set operations."""

    def __init__(self) -> None:
        self.rules: list[LoadedRule] = []
        self.exact: dict[str, int] = {}
        self.by_keys: dict[frozenset[str], _Posting] = {}
        self.values: dict[tuple[str, Any], _Posting] = defaultdict(_Posting)
        self.unindexed: dict[str, _Posting] = defaultdict(_Posting)

    def add(self, lr: LoadedRule) -> list[Finding]:
        w = lr.rule.when
        keys = frozenset(k for k in w.model_fields_set if getattr(w, k) is not None)
        sig = w.model_dump_json(exclude_none=True)
        same = self.exact.get(sig)  # an identical earlier rule covers; an even earlier may too
        found = self._first_cover(w, keys, before=same)
        if found is None:
            found = same
        i = len(self.rules)
        self.rules.append(lr)
        self.exact.setdefault(sig, i)
        self.by_keys.setdefault(keys, _Posting()).add(i)
        for k in keys:
            vals = _index_values(getattr(w, k), k)
            if vals is None:
                self.unindexed[k].add(i)
            for x in vals or ():
                self.values[(k, x)].add(i)
        if found is None:
            return []
        e = self.rules[found]
        return [Finding("warning", lr.where(), _label(lr), (
            f"can never match: earlier rule {e.rule.name!r} ({e.location}) matches every "
            "call this one does; expected it before that rule or narrower conditions there"))]

    def _first_cover(self, w: When, keys: frozenset[str], before: int | None = None
                     ) -> int | None:
        best = before
        wanted = {k: v for k in keys if (v := _index_values(getattr(w, k), k)) is not None}
        for ks, group in self.by_keys.items():
            if ks <= keys:
                j = self._first_in_group(w, {k: wanted[k] for k in ks if k in wanted}, group,
                                         best)
                best = j if j is not None else best
        return best if best != before else None

    def _hits(self, k: str, x: Any) -> tuple[_Posting, ...]:
        """Where an earlier rule whose ``k`` holds ``x`` is listed (hardware: an earlier
        vendor entry, cuda, covers an arch, sm90, as in covers())."""
        own = self.values.get((k, x), _NONE)
        return (own, self.values.get((k, _vendor(x)), _NONE)) if k == "hardware" else (own,)

    def _first_in_group(self, w: When, wanted: dict[str, tuple[Any, ...]], group: _Posting,
                        before: int | None) -> int | None:
        """The first rule of ``group`` (all with the same keys) before ``before`` covering
        ``w``, walking the shortest list every cover is in: the group, or for one value x of
        a key, the rules listing x there or having that key as a range with bounds."""
        parts: tuple[_Posting, ...] = (group,)
        for k, vals in wanted.items():
            for x in vals:
                mine = (*self._hits(k, x), self.unindexed.get(k, _NONE))
                if sum(len(q.order) for q in mine) < sum(len(q.order) for q in parts):
                    parts = mine
        for j in heapq.merge(*(q.order for q in parts)):
            if before is not None and j >= before:
                break
            if j in group.members and all(
                    j in self.unindexed.get(k, _NONE).members
                    or all(any(j in q.members for q in self._hits(k, x)) for x in vals)
                    for k, vals in wanted.items()) and covers(self.rules[j].rule.when, w):
                return j
        return None


def _index_values(v: Any, key: str = "") -> tuple[Any, ...] | None:
    """The values a condition is indexed by (None: not indexable, always a candidate; globs
    too: ``model: '*'`` covers ``model: llama`` without sharing a value)."""
    if key in _GLOB_KEYS:
        return None
    if isinstance(v, list):
        return tuple(v)
    if isinstance(v, bool):
        return (v,)
    if isinstance(v, Range) and v.in_ is not None and all(
            x is None for x in (v.ge, v.gt, v.le, v.lt)):
        return tuple(v.in_)
    return None


def covers(a: When, b: When) -> bool:
    """Provably: every call that matches ``b`` also matches ``a`` (conservative)."""
    for key in a.model_fields_set:
        va, vb = getattr(a, key), getattr(b, key)
        if va is None:
            continue
        if vb is None:
            return False
        if key == "hardware":
            if not all(x in va or _vendor(x) in va for x in vb):
                return False
        elif isinstance(va, Range):
            if not vb.within(va):
                return False
        elif key in _GLOB_KEYS:
            if not all(_glob_covers(va, p) for p in vb):
                return False
        elif isinstance(va, list):
            if not set(vb) <= set(va):
                return False
        elif isinstance(va, LayerSelector):
            if not _layers_cover(va, vb):
                return False
        elif isinstance(va, ProfileCondition):
            if not (va.attention_share is None or (vb.attention_share is not None and
                                                   vb.attention_share.within(va.attention_share))):
                return False
        elif va != vb:
            return False
    return True


#: ``when`` keys holding shell-style globs (``model: '*'`` holds for every named model).
_GLOB_KEYS = frozenset({"device_name", "model"})


def _glob_covers(globs: list[str], pattern: str) -> bool:
    """Every name ``pattern`` matches is matched by one of ``globs`` (conservative: the same
    glob, ``*``, or a plain name one of them matches)."""
    return pattern in globs or "*" in globs or (
        not any(c in pattern for c in "*?[") and any(fnmatchcase(pattern, g) for g in globs))


def _layers_cover(a: LayerSelector, b: LayerSelector) -> bool:
    """Every layer ``b`` selects, ``a`` selects (each part of ``a`` implied by ``b``'s):
    ``{kind: [gla, linear]}`` covers ``{kind: gla}``, ``{every: 2}`` covers ``{every: 4}``."""
    if a.kind is not None and (b.kind is None or not set(b.kind) <= set(a.kind)):
        return False
    if a.index is not None and (b.index is None or not b.index.within(a.index)):
        return False
    if a.every is None:
        return True
    if b.every is None or b.every % a.every:
        return False
    return {o % a.every for o in (b.offset or [0])} <= set(a.offset or [0])


def _vendor(arch: str) -> str:
    return "cuda" if arch.startswith("sm") else "rocm" if arch.startswith("gfx") else arch


def _cells(policy: Policy, registry: Registry, hardware: tuple[str, ...]) -> list[Finding]:
    """Cells without a backend, grouped by (hardware, rule). Resolved without measurements
    so that the verdict does not depend on this machine's profile store."""
    with tempfile.TemporaryDirectory() as tmp:
        iso = Policy(policy.data, profile=ProfileStore(Path(tmp) / "profile.json"))
        groups: dict[tuple[str, str | None, bool], list[tuple[Cell, Any]]] = defaultdict(list)
        for hw in hardware:
            dev = simulate(hw)
            for cell in cells():
                d = iso.resolve(cell.spec(), dev, registry)
                if d.backend is None:
                    groups[(hw, d.rule, cell.dropout)].append((cell, d))
    rules = {lr.rule.name: lr for lr in policy.rules}
    out = []
    for (hw, rule, dropout), items in groups.items():
        lr = rules.get(rule) if rule else None
        missing = sorted({r.backend for _, d in items for r in d.rejected
                          if r.backend in FIRST_PARTY and r.backend not in registry.backends})
        where = lr.where() if lr else f"{policy.data.files[-1]}:1:1"
        label = _label(lr) if lr else "rules"
        listed = ", ".join(c.label for c, _ in items[:6]) + (
            f" and {len(items) - 6} more" if len(items) > 6 else "")
        if missing:
            out.append(Finding("warning", where, label, (
                f"on {hw}, {len(items)} cell(s) have no installed backend ({listed}); not "
                f"installed here: {', '.join(missing)}")))
        elif dropout:  # a policy for models trained without attention dropout may leave
            first = items[0][1]  # these to an error at run time: said, not failed
            why = "; ".join(f"{r.backend}: {r.reasons[0]}" for r in first.rejected)
            out.append(Finding("warning", where, label, (
                f"on {hw}, {len(items)} training cell(s) with attention dropout are served "
                f"by no backend ({listed}); first: {why}; a model trained with "
                "attention_dropout > 0 would fail there: route `when: {dropout: true}` to a "
                "backend that declares dropout (torch_sdpa, reference, fa2)")))
        else:
            first = items[0][1]
            why = "; ".join(f"{r.backend}: {r.reasons[0]}" for r in first.rejected)
            out.append(Finding("error", where, label, (
                f"on {hw}, {len(items)} cell(s) are served by no backend ({listed}); first: "
                f"{why}; expected a candidate (or rule) that serves them")))
    return out
