"""Decision records: why a backend was chosen, and why every other candidate was not."""

from __future__ import annotations

import logging
import operator
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from .spec import AttentionSpec
from ..errors import ArgumentError


@dataclass(frozen=True)
class BindContext:
    """Where in a model a call comes from; rules can bind per model, layer and layer kind.

    Its hash is computed once: a layer's context is part of every call's exact-shape key."""

    model: str | None = None
    layer: int | None = None
    layer_kind: str = "softmax"
    world_size: int = 1
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("layer", "world_size"):  # a numpy or torch integer: the int it holds
            value = getattr(self, name)
            if not isinstance(value, (int, type(None))) and hasattr(value, "__index__"):
                try:
                    object.__setattr__(self, name, operator.index(value))
                except TypeError:
                    pass  # a tensor of several values: refused below, by name
        why = _context_error(self)
        if why is not None:  # checked once, where a layer or a call builds its context
            raise ArgumentError(f"BindContext: {why}")
        object.__setattr__(self, "_hash", hash((self.model, self.layer, self.layer_kind,
                                                self.world_size)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        # rebuilt through __init__ (of a subclass too, with its own fields): a string's hash
        # differs between processes, so a pickled hash would break dict lookups there
        return (type(self), tuple(getattr(self, f.name) for f in fields(self) if f.init))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _context_error(c: BindContext) -> str | None:
    """What is wrong with a context's fields, or None. Rules compare them (``world_size:
    {ge: 2}`` binds ring), so a ``world_size`` of 0 or -2 bound a local kernel to a
    sharded sequence without a word, ``"2"`` raised a TypeError from the policy, ``2.5``
    reached ring, and ``True`` shared the bindings of 1."""
    if not (_is_int(c.world_size) and c.world_size >= 1):
        return (f"world_size={c.world_size!r}; pass the number of ranks the sequence is "
                "sharded over, an int >= 1 (1: not sharded)")
    if c.layer is not None and not (_is_int(c.layer) and c.layer >= 0):
        return f"layer={c.layer!r}; pass the layer's index, an int >= 0, or None"
    if not isinstance(c.layer_kind, str) or not c.layer_kind:
        return f"layer_kind={c.layer_kind!r}; pass a non-empty str (softmax, sliding, gla...)"
    if c.model is not None and not isinstance(c.model, str):
        return f"model={c.model!r} ({type(c.model).__name__}); pass the model's name, a str"
    return None


@dataclass(frozen=True)
class Rejection:
    backend: str
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Decision:
    """The outcome of resolving one spec: chosen backend (or None), the rule, the rejections.

    ``fallbacks`` are the remaining viable candidates, tried in order at run time when the
    rule says ``on_failure: next`` and the chosen backend raises.
    """

    spec: AttentionSpec
    device: str
    backend: str | None
    rule: str | None = None
    rule_location: str | None = None
    policy: str | None = None
    candidates: tuple[str, ...] = ()
    rejected: tuple[Rejection, ...] = ()
    fallbacks: tuple[str, ...] = ()
    on_failure: str = "next"
    context: BindContext = field(default_factory=BindContext)
    notes: tuple[str, ...] = ()
    #: For a distributed backend (ring): the decision for the local kernel it wraps.
    inner: "Decision | None" = None
    #: Candidates of the matched rule that no installed plugin registers: the call is served
    #: by a later candidate, so hubs warn once per (rule, backend) and count it.
    missing: tuple[str, ...] = ()
    #: Viable candidates (the bound one first) that a shipped pack measured within its tie
    #: margin: the hub times them on the first call and binds the fastest (``settle``).
    tied: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        c = self.context
        return {
            "spec": self.spec.describe(),
            "device": self.device,
            "backend": self.backend,
            "rule": self.rule,
            "rule_location": self.rule_location,
            "policy": self.policy,
            "candidates": list(self.candidates),
            "rejected": [{"backend": r.backend, "reasons": list(r.reasons)} for r in self.rejected],
            "fallbacks": list(self.fallbacks),
            "on_failure": self.on_failure,
            "context": {"model": c.model, "layer": c.layer, "layer_kind": c.layer_kind,
                        "world_size": c.world_size},
            "notes": list(self.notes),
            "missing": list(self.missing),
            "tied": list(self.tied),
            "inner": self.inner.to_json() if self.inner is not None else None,
        }

    def explain(self) -> str:
        """Human-readable record, as ``attnhub explain`` prints it."""
        lines = [f"spec:    {self.spec.describe()}", f"device:  {self.device}"]
        where = f" ({self.rule_location})" if self.rule_location else ""
        lines.append(f"rule:    {self.rule or '-'}{where}")
        lines.append(f"chosen:  {self.backend or 'NONE'}")
        for r in self.rejected:
            lines.append(f"  rejected {r.backend}: {'; '.join(r.reasons)}")
        if self.fallbacks:
            lines.append(f"  run-time fallbacks ({self.on_failure}): {', '.join(self.fallbacks)}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        if self.inner is not None:
            lines.append("local kernel inside " + (self.backend or "?") + ":")
            lines += ["  " + line for line in self.inner.explain().splitlines()]
        return "\n".join(lines)


def report_missing(d: Decision, counts: Counter[tuple[str, str]],
                   warned: set[tuple[str, str]]) -> None:
    """A rule named a backend that is not installed and a later candidate serves: warn once
    per (rule, backend) and count it as a fallback ``(missing, served_by)`` at bind time."""
    for name in d.missing:
        served = d.backend or "nothing"
        counts[(name, served)] += 1
        key = (f"rule:{d.rule}", name)
        if key not in warned:
            warned.add(key)
            logging.getLogger("attnhub").warning(
                "attnhub: rule %s (%s) names backend %s, which is not installed; %s serves "
                "instead (install its plugin or remove it from the rule)", d.rule,
                d.rule_location, name, served)
