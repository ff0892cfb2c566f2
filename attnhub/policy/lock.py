"""Lockfiles: resolved bindings frozen with the versions that produced them, and drift.

A library upgrade (a new FlashInfer, cuDNN or plugin) can change which kernel runs without
anyone touching the policy. ``attnhub lock`` writes every binding (spec, context, device,
backend, rule, fallbacks, local kernel) plus library and plugin versions; ``attnhub lock
--check`` resolves the same bindings again and lists each one that changed.

Format ``attnhub.lock/1`` (JSON, written atomically)::

    {"schema": "attnhub.lock/1", "policy": {"name", "files", "digest"},
     "versions": {lib: version}, "plugins": {name: version},
     "bindings": [{"hardware", "simulated", "spec": {...}, "context": {...},
                   "backend", "rule", "fallbacks", "inner"}]}
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..core.decision import BindContext, Decision
from ..core.device import DeviceInfo, library_versions, probe, simulate
from ..core.registry import Registry
from ..core.spec import AttentionSpec, MaskSpec
from ..errors import PolicyError
from .profile import write_json_atomic
from .resolver import Policy

SCHEMA = "attnhub.lock/1"


def spec_to_json(spec: AttentionSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)


def spec_from_json(d: dict[str, Any]) -> AttentionSpec:
    """Inverse of :func:`spec_to_json`; fields this version does not know are ignored."""
    mask = dict(d.get("mask") or {})
    if mask.get("window") is not None:
        mask["window"] = tuple(mask["window"])
    known = {f.name for f in dataclasses.fields(MaskSpec)}
    m = MaskSpec(**{k: v for k, v in mask.items() if k in known})
    fields = {f.name for f in dataclasses.fields(AttentionSpec)} - {"mask"}
    return AttentionSpec(mask=m, **{k: v for k, v in d.items() if k in fields})


def binding(device: DeviceInfo, d: Decision) -> dict[str, Any]:
    """One lock entry from a decision."""
    c = d.context
    return {"hardware": device.arch, "simulated": device.simulated,
            "spec": spec_to_json(d.spec),
            "context": {"model": c.model, "layer": c.layer, "layer_kind": c.layer_kind,
                        "world_size": c.world_size},
            "backend": d.backend, "rule": d.rule, "fallbacks": list(d.fallbacks),
            "inner": d.inner.backend if d.inner is not None else None}


def build_lock(policy: Policy, registry: Registry,
               decisions: Iterable[tuple[DeviceInfo, Decision]]) -> dict[str, Any]:
    """A lock document from (device, decision) pairs (e.g. ``Hub.decide`` results)."""
    return {"schema": SCHEMA,
            "policy": {"name": policy.name, "files": list(policy.data.files),
                       "digest": policy.digest()},
            "versions": dict(library_versions()),
            "plugins": {n: r.version or "" for n, r in sorted(registry.plugins.items())},
            "bindings": [binding(dev, d) for dev, d in decisions]}


def write_lock(path: str | Path, lock: dict[str, Any]) -> None:
    write_json_atomic(Path(path), lock)


def read_lock(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PolicyError([f"{path}: cannot read the lockfile ({exc}); expected a file written "
                           "by `attnhub lock`"]) from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise PolicyError([f"{path}: not an attnhub lockfile (expected \"schema\": "
                           f"\"{SCHEMA}\"); regenerate it with `attnhub lock -o {path}`"])
    return data


@dataclass
class Drift:
    """What changed since the lock: bindings (drift, exit 1) and context (informative)."""

    changed: list[str] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    policy: list[str] = field(default_factory=list)

    @property
    def drifted(self) -> bool:
        return bool(self.changed)

    def to_json(self) -> dict[str, Any]:
        return {"drifted": self.drifted, "changed": self.changed, "versions": self.versions,
                "policy": self.policy}


def check_lock(lock: dict[str, Any], policy: Policy, registry: Registry,
               versions: dict[str, str] | None = None) -> Drift:
    """Resolve every locked binding again and report each difference."""
    drift = Drift()
    now = versions if versions is not None else dict(library_versions())
    drift.versions = _diff_maps(lock.get("versions", {}), now, "version")
    drift.versions += _diff_maps(lock.get("plugins", {}), {
        n: r.version or "" for n, r in registry.plugins.items()}, "plugin")
    locked_policy = lock.get("policy", {})
    if locked_policy.get("digest") != policy.digest():
        drift.policy.append(f"policy {locked_policy.get('name')} files changed since the lock "
                            f"(digest {locked_policy.get('digest')} -> {policy.digest()})")
    devices: dict[tuple[str, bool], DeviceInfo] = {}
    for b in lock.get("bindings", []):
        key = (b["hardware"], bool(b["simulated"]))
        if key not in devices:
            devices[key] = simulate(b["hardware"]) if key[1] else probe()
        dev = devices[key]
        spec = spec_from_json(b["spec"])
        if not key[1] and dev.arch != b["hardware"]:
            drift.changed.append(f"{spec.describe()}: locked on {b['hardware']}, this device is "
                                 f"{dev.arch}")
            continue
        ctx = BindContext(**b["context"])
        now_b = binding(dev, policy.resolve(spec, dev, registry, ctx))
        diffs = [f"{k} {b.get(k)!r} -> {now_b[k]!r}" for k in ("backend", "rule", "fallbacks",
                                                                 "inner") if b.get(k) != now_b[k]]
        if diffs:
            where = f"{b['hardware']} {spec.describe()}" + _ctx_text(ctx)
            drift.changed.append(f"{where}: {'; '.join(diffs)}")
    return drift


def _ctx_text(ctx: BindContext) -> str:
    parts = [f"model={ctx.model}" if ctx.model else "",
             f"layer={ctx.layer}" if ctx.layer is not None else "",
             f"kind={ctx.layer_kind}" if ctx.layer_kind != "softmax" else "",
             f"world_size={ctx.world_size}" if ctx.world_size != 1 else ""]
    text = " ".join(p for p in parts if p)
    return f" [{text}]" if text else ""


def _diff_maps(old: dict[str, str], new: dict[str, str], what: str) -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        if old.get(k) != new.get(k):
            out.append(f"{what} {k}: {old.get(k) or 'absent'} -> {new.get(k) or 'absent'}")
    return out
