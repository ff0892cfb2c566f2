"""Rule matching: a rule's ``when`` compiled once into a list of small predicates.

Binding a 64-layer model for three phases resolves a few hundred (spec, context) pairs, so
each rule is turned into closures at load time and matching is a loop of cheap calls. Every
predicate has the ``when`` key it came from, so a non-match can say which key failed.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Callable

from ..core.decision import BindContext
from ..core.device import DeviceInfo
from ..core.spec import AttentionSpec
from .schema import LayerSelector, Range, When

if TYPE_CHECKING:
    from .profile import ProfileStore

Pred = Callable[[AttentionSpec, DeviceInfo, BindContext], bool]

#: ``when`` keys whose value is compared with one attribute of the spec by ``Range``.
_SPEC_RANGES: dict[str, Callable[[AttentionSpec], float]] = {
    "head_dim": lambda s: s.head_dim,
    "head_dim_v": lambda s: s.head_dim_v or s.head_dim,
    "num_q_heads": lambda s: s.num_q_heads,
    "num_kv_heads": lambda s: s.num_kv_heads,
    "gqa_ratio": lambda s: s.gqa_ratio,
    "seqlen": lambda s: max(s.max_seqlen_q, s.max_seqlen_k),
    "seqlen_q": lambda s: s.max_seqlen_q,
    "seqlen_k": lambda s: s.max_seqlen_k,
    "batch": lambda s: s.batch,
}
#: ``when`` keys whose value is a list the spec attribute must be in.
_SPEC_SETS: dict[str, Callable[[AttentionSpec], str]] = {
    "phase": lambda s: s.phase,
    "dtype": lambda s: s.dtype,
    "kv_dtype": lambda s: s.kv_dtype or s.dtype,
    "layout": lambda s: s.layout,
}
_SPEC_FLAGS = ("needs_grad", "deterministic", "return_lse", "dropout")


def hardware_matches(entries: list[str] | tuple[str, ...], device: DeviceInfo) -> bool:
    """An entry names the arch (``sm90``, ``gfx942``) or the vendor (``cuda``, ``rocm``)."""
    return device.arch in entries or device.vendor in entries


def capability_value(device: DeviceInfo) -> float | None:
    """Compute capability as a number (9.0, 8.6) for ``when.capability``; None off CUDA."""
    cap = device.capability
    return None if cap is None else cap[0] + cap[1] / 10


def selects_layers(when: When) -> bool:
    """Whether ``when`` opts particular layers in (what lets an approximate backend bind): an
    index or every-n-th selector, or layer kinds other than ``softmax``. A kind selector that
    holds ``softmax`` matches every call made without a layer context (its kind is softmax),
    so it opts in everything, as a rule without a selector would."""
    layer = when.layer
    if layer is None:
        return False
    if layer.index is not None or layer.every is not None:
        return True
    return layer.kind is not None and "softmax" not in layer.kind


class Matcher:
    """A compiled ``when``: ``failed(...)`` returns the first key that does not hold."""

    __slots__ = ("preds", "profile", "has_layer_selector")

    def __init__(self, when: When):
        self.preds: list[tuple[str, Pred]] = _compile(when)
        self.profile = when.profile
        self.has_layer_selector = selects_layers(when)

    def failed(self, spec: AttentionSpec, device: DeviceInfo, ctx: BindContext,
               store: "ProfileStore | None") -> tuple[str | None, str | None]:
        """``(failed_key, note)``: ``failed_key`` None means the rule matches; ``note`` says
        when a profile condition could not be judged because nothing was measured."""
        for key, pred in self.preds:
            if not pred(spec, device, ctx):
                return key, None
        if self.profile is not None and self.profile.attention_share is not None:
            share = store.attention_share(device, ctx.model, spec.phase) if store else None
            if share is None:
                return "profile.attention_share", (
                    f"no attention share measured for model {ctx.model or '*'} ({spec.phase}) "
                    f"on this device, so the profile condition does not hold")
            if not self.profile.attention_share.contains(share):
                return "profile.attention_share", None
        return None, None


def _compile(w: When) -> list[tuple[str, Pred]]:
    preds: list[tuple[str, Pred]] = []
    if w.hardware is not None:
        hw = tuple(w.hardware)
        preds.append(("hardware", lambda s, d, c: hardware_matches(hw, d)))
    if w.capability is not None:
        preds.append(("capability", _range_pred(w.capability, None)))
    if w.device_name is not None:
        globs = tuple(w.device_name)
        preds.append(("device_name", lambda s, d, c: any(fnmatchcase(d.name, g) for g in globs)))
    for key, get in _SPEC_SETS.items():
        allowed = getattr(w, key)
        if allowed is not None:
            preds.append((key, _set_pred(frozenset(allowed), get)))
    for key, get in _SPEC_RANGES.items():
        if getattr(w, key) is not None:
            preds.append((key, _range_pred(getattr(w, key), get)))
    for key in _SPEC_FLAGS:
        want = getattr(w, key)
        if want is not None:
            preds.append((key, lambda s, d, c, k=key, v=want: getattr(s, k) == v))
    preds += _mask_preds(w)
    if w.world_size is not None:
        ws = w.world_size
        preds.append(("world_size", lambda s, d, c: ws.contains(c.world_size)))
    if w.model is not None:
        pats = tuple(w.model)
        preds.append(("model", lambda s, d, c: c.model is not None
                      and any(fnmatchcase(c.model, p) for p in pats)))
    if w.layer is not None:
        sel = w.layer
        preds.append(("layer", lambda s, d, c: layer_matches(sel, c)))
    return preds


def _mask_preds(w: When) -> list[tuple[str, Pred]]:
    preds: list[tuple[str, Pred]] = []
    if w.mask is not None:
        within = frozenset(w.mask)
        preds.append(("mask", lambda s, d, c: s.mask.kinds <= within))
    if w.mask_any is not None:
        anyof = frozenset(w.mask_any)
        preds.append(("mask_any", lambda s, d, c: bool(s.mask.kinds & anyof)))
    if w.variant is not None:
        names = frozenset(w.variant)
        preds.append(("variant", lambda s, d, c: s.mask.score_mod in names
                      or s.mask.mask_mod in names))
    return preds


def _set_pred(allowed: frozenset[str], get: Callable[[AttentionSpec], str]) -> Pred:
    return lambda s, d, c: get(s) in allowed


def _range_pred(rng: Range, get: Callable[[AttentionSpec], float] | None) -> Pred:
    """A range over a spec attribute, or over the compute capability when ``get`` is None."""
    if get is None:
        return lambda s, d, c: (x := capability_value(d)) is not None and rng.contains(x)
    return lambda s, d, c: rng.contains(get(s))


def layer_matches(sel: LayerSelector, ctx: BindContext) -> bool:
    """Index range, every-n-th with offsets, and layer kind; all given parts must hold."""
    if sel.kind is not None and ctx.layer_kind not in sel.kind:
        return False
    if sel.index is None and sel.every is None:
        return True
    if ctx.layer is None:
        return False
    if sel.index is not None and not sel.index.contains(ctx.layer):
        return False
    if sel.every is not None and ctx.layer % sel.every not in (sel.offset or [0]):
        return False
    return True


#: ``when`` keys whose value names the one spec/device attribute the prefilter indexes.
_INDEXED: dict[str, Callable[[AttentionSpec, DeviceInfo], tuple[str, ...]]] = {
    "phase": lambda s, d: (s.phase,),
    "dtype": lambda s, d: (s.dtype,),
    "layout": lambda s, d: (s.layout,),
    "hardware": lambda s, d: (d.arch, d.vendor),
}


class RuleIndex:
    """Which rules can match a spec on a device, by the listed keys alone, as a bitset over
    rule positions: resolving then calls the full matcher only on those (in file order), so
    a policy of thousands of rules resolves in near-constant time per rule that could
    match, instead of testing every rule."""

    def __init__(self, whens: list[When]):
        self.n = len(whens)
        everyone = (1 << self.n) - 1
        self.free: dict[str, int] = {}  # rules without the key: always candidates
        self.bits: dict[str, dict[str, int]] = {}
        for key in _INDEXED:
            free, bits = 0, {}
            for i, w in enumerate(whens):
                values = getattr(w, key)
                if values is None:
                    free |= 1 << i
                else:
                    for v in values:
                        bits[v] = bits.get(v, 0) | (1 << i)
            self.free[key], self.bits[key] = free, bits
        self.everyone = everyone

    def candidates(self, spec: AttentionSpec, device: DeviceInfo) -> int:
        mask = self.everyone
        for key, get in _INDEXED.items():
            allowed = self.free[key]
            for v in get(spec, device):
                allowed |= self.bits[key].get(v, 0)
            mask &= allowed
        return mask


def set_bits(mask: int) -> list[int]:
    """Positions of the set bits of ``mask``, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
