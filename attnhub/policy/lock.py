"""Lockfiles: resolved bindings frozen with the versions that produced them, and drift.

A library upgrade (a new FlashInfer, cuDNN or plugin) can change which kernel runs without
anyone touching the policy. ``attnhub lock`` writes every binding (spec, context, device,
backend, rule, fallbacks, local kernel) plus library and plugin versions; ``attnhub lock
--check`` resolves the same bindings again and lists each one that changed.

Format ``attnhub.lock/2`` (JSON, written atomically)::

    {"schema": "attnhub.lock/2", "policy": {"name", "files", "digest"},
     "versions": {lib: version}, "plugins": {name: version},
     "providers": {backend: {"plugin", "distribution", "version"}},
     "bindings": [{"hardware", "simulated", "spec": {...}, "context": {...},
                   "backend", "rule", "fallbacks", "inner"}]}

``providers`` names who served every bound backend (chosen, fallback or local kernel): a
different plugin or distribution serving the same name is drift, as a changed binding is. A
hand-edited lock with a missing key or a value of the wrong type is a :class:`LockfileError`
located at ``file:line:col`` (``attnhub lock --check`` exits 3 for it, 1 for drift).
"""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..core.decision import BindContext, Decision
from ..core.device import _MODELS, DeviceInfo, library_versions, probe, simulate
from ..core.registry import Registry
from ..core.spec import AttentionSpec, MaskSpec
from ..errors import PolicyError
from .profile import write_json_atomic
from .resolver import Policy

SCHEMA = "attnhub.lock/2"
#: Keys of a binding's context this version reads (others, as in specs, are ignored).
_CONTEXT_FIELDS = frozenset(f.name for f in dataclasses.fields(BindContext) if f.init)
#: ``attnhub lock --check`` exit status when nothing could be checked (drift is 1): an
#: unreadable or malformed lockfile, or a policy or plugin setting that does not load.
EXIT_BAD_LOCK = 3


class LockfileError(PolicyError):
    """The lockfile cannot be read or does not match the schema; each problem is located."""


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


def hardware_name(device: DeviceInfo) -> str:
    """The name that gives ``device`` back: its arch, or for a simulated model other than
    its arch's preset (``h20``, ``h200``: rules on ``device_name`` tell them from the H100)
    the model's alias. Locks and plans keyed by arch alone resolved a locked H20 as an
    H100 again (every ``h20-dense`` binding reported as drift) and showed one column for
    both."""
    if not device.simulated:
        return device.arch
    for name in (device.arch, *device.name.lower().split()):
        try:
            if simulate(name) == device:
                return name
        except ValueError:  # a word of the model's name that names no device
            continue
    return device.arch


def binding(device: DeviceInfo, d: Decision) -> dict[str, Any]:
    """One lock entry from a decision."""
    c = d.context
    return {"hardware": hardware_name(device), "simulated": device.simulated,
            "spec": spec_to_json(d.spec),
            "context": {"model": c.model, "layer": c.layer, "layer_kind": c.layer_kind,
                        "world_size": c.world_size},
            "backend": d.backend, "rule": d.rule, "fallbacks": list(d.fallbacks),
            "inner": d.inner.backend if d.inner is not None else None}


def build_lock(policy: Policy, registry: Registry,
               decisions: Iterable[tuple[DeviceInfo, Decision]]) -> dict[str, Any]:
    """A lock document from (device, decision) pairs (e.g. ``Hub.decide`` results)."""
    bindings = [binding(dev, d) for dev, d in decisions]
    return {"schema": SCHEMA,
            "policy": {"name": policy.name, "files": list(policy.data.files),
                       "digest": policy.digest()},
            "versions": dict(library_versions()),
            "plugins": {n: r.version or "" for n, r in sorted(registry.plugins.items())},
            "providers": {n: registry.provider(n) for n in sorted(_bound_names(bindings))
                          if registry.provider(n) is not None},
            "bindings": bindings}


def _bound_names(bindings: list[dict[str, Any]]) -> set[str]:
    return {n for b in bindings for n in (b["backend"], b["inner"], *b["fallbacks"]) if n}


#: Far above a lock of every cell on every known hardware (about 3 MiB).
MAX_LOCK_BYTES = 256 * 2**20


def write_lock(path: str | Path, lock: dict[str, Any]) -> None:
    """Write atomically (a temporary file renamed over ``path``): a reader or a concurrent
    writer never sees half a lock."""
    try:
        write_json_atomic(Path(path), lock)
    except OSError as exc:
        # the failing path may be a parent in the way (a file where a folder should be)
        parent = str(exc.filename or "").rstrip("/")
        where = f" at {parent}" if parent and str(path).startswith(parent + "/") else ""
        raise LockfileError([f"{path}: cannot write the lockfile ({exc.strerror or exc}"
                             f"{where}); expected a writable file path (not a folder) in a "
                             "writable folder"]) from None


def _unprintable(data: Any) -> Iterator[tuple[str, str, str]]:
    """(path, what, text) of each string (key or value) holding a control character, a lone
    surrogate (JSON's ``"\\ud800"``: printing it raised UnicodeEncodeError) or a bidi
    override: a hand-edited or hostile lock, refused before anything prints it."""
    stack: list[tuple[str, Any]] = [("$", data)]
    while stack:
        where, x = stack.pop()
        if isinstance(x, dict):
            for k, v in x.items():
                stack += [(f"{where} key", k), (f"{where}.{k}", v)]
        elif isinstance(x, list):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(x)]
        elif isinstance(x, str):
            bad = next((c for c in x if unicodedata.category(c) in ("Cc", "Cs")
                        or c in _BIDI), None)
            if bad is not None:
                what = ("a lone surrogate" if unicodedata.category(bad) == "Cs"
                        else "a control character")
                yield ascii(where)[1:-1], what, ascii(x)[:60]


_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def read_lock(path: str | Path) -> dict[str, Any]:
    """The lock document, checked against the schema; :class:`LockfileError` otherwise."""
    from .loader import DuplicateKey, TooBig, no_duplicate_keys, read_limited
    from .lock_schema import validate_lock

    regen = f"regenerate it with `attnhub lock -o {path}`"
    try:
        text = read_limited(Path(path), MAX_LOCK_BYTES).decode("utf-8")
        data = json.loads(text, object_pairs_hook=no_duplicate_keys)
    except OSError as exc:
        raise LockfileError([f"{path}: cannot read the lockfile ({exc.strerror}); expected a "
                             "file written by `attnhub lock -o FILE`"]) from None
    except TooBig as exc:
        raise LockfileError([f"{path}: the lockfile is {exc}; expected a file written by "
                             f"`attnhub lock`; {regen}"]) from None
    except UnicodeDecodeError as exc:
        raise LockfileError([f"{path}: byte {exc.start} is not UTF-8; expected a file "
                             f"written by `attnhub lock`; {regen}"]) from None
    except json.JSONDecodeError as exc:
        raise LockfileError([f"{path}:{exc.lineno}:{exc.colno} (json): {exc.msg}; expected "
                             f"the JSON `attnhub lock` writes; {regen}"]) from None
    except DuplicateKey as exc:
        from .located import read_yaml

        found = [p for p in read_yaml(text, str(path))[1] if "duplicate key" in p]
        raise LockfileError([f"{p}; {regen}" for p in found] or [
            f"{path}: duplicate key {exc.args[0]!r}, expected each key once; {regen}"]) from None
    except (RecursionError, ValueError) as exc:  # nesting, or an int of thousands of digits
        raise LockfileError([f"{path}: not a lockfile ({_first_line(exc)}); expected the JSON "
                             f"`attnhub lock` writes; {regen}"]) from None
    problems = [f"{path}: {where}: holds {what} ({text_}), which `attnhub lock` never "
                f"writes and a terminal would print raw; {regen}"
                for where, what, text_ in _unprintable(data)][:20]
    problems = problems or validate_lock(data, text, str(path))
    if problems:
        raise LockfileError(problems)
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
    drift.changed += _provider_drift(lock.get("providers", {}), registry)
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
        ctx = BindContext(**{k: v for k, v in b["context"].items() if k in _CONTEXT_FIELDS})
        now_b = binding(dev, policy.resolve(spec, dev, registry, ctx))
        diffs = [f"{k} {b.get(k)!r} -> {now_b[k]!r}" for k in ("backend", "rule", "fallbacks",
                                                                 "inner") if b.get(k) != now_b[k]]
        if diffs:
            where = f"{b['hardware']} {spec.describe()}" + _ctx_text(ctx)
            drift.changed.append(f"{where}: {'; '.join(diffs)}"
                                 + _model_hint(b, dev, spec, ctx, policy, registry))
    return drift


def _model_hint(b: dict[str, Any], dev: DeviceInfo, spec: AttentionSpec, ctx: BindContext,
                policy: Policy, registry: Registry) -> str:
    """For a simulated binding keyed by its arch that another model of that arch (``h20``,
    ``h200``) would still resolve as locked: a lock from before :func:`hardware_name` keyed
    an H20 as ``sm90``, which resolves as an H100; said, so the fix is to regenerate, not
    to chase the drift (it stays drift: an H100 binding may have changed to that too)."""
    if not b["simulated"] or b["hardware"] != dev.arch:
        return ""
    for alias in sorted(_MODELS):
        other = simulate(alias)
        if other.arch != dev.arch or other == dev:
            continue
        again = binding(other, policy.resolve(spec, other, registry, ctx))
        if all(b.get(k) == again[k] for k in ("backend", "rule", "fallbacks", "inner")):
            return (f" (as locked on {alias}: a lock written before attnhub named simulated "
                    f"models by alias records {alias} as {dev.arch}; regenerate it with "
                    f"`attnhub lock --hardware {alias}`)")
    return ""


def _provider_drift(locked: dict[str, Any], registry: Registry) -> list[str]:
    """A bound backend name now served by another plugin or distribution (or by nobody)."""
    out = []
    for name, was in sorted(locked.items()):
        now = registry.provider(name)
        if now is None or (now["plugin"], now["distribution"]) != (was.get("plugin"),
                                                                   was.get("distribution")):
            out.append(f"backend {name}: provider {_who(was)} -> "
                       f"{_who(now) if now else registry.missing_reason(name)}")
    return out


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else \
        type(exc).__name__


def _who(p: dict[str, Any]) -> str:
    dist = f"{p.get('distribution')} {p.get('version') or '?'}" if p.get("distribution") \
        else "no distribution"
    return f"plugin {p.get('plugin')!r} ({dist})"


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
