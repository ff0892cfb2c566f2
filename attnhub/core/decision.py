"""Decision records: why a backend was chosen, and why every other candidate was not."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .spec import AttentionSpec


@dataclass(frozen=True)
class BindContext:
    """Where in a model a call comes from; rules can bind per model, layer and layer kind."""

    model: str | None = None
    layer: int | None = None
    layer_kind: str = "softmax"
    world_size: int = 1


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
