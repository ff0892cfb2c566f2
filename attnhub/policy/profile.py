"""The profile store: measurements the policy can act on, in one JSON file.

Location: ``ATTNHUB_PROFILE`` or ``~/.cache/attnhub/profile.json``. Measurements only hold for
the machine and software that produced them, so everything is keyed by a *device key* (device
name, arch and the library versions the probe reports, e.g. torch, CUDA, cuDNN, triton,
flash-attn) and, for per-shape data, by the *bucket key* of the (bucketed) spec. Schema
``attnhub.profile/1`` (also in docs/policy.md)::

    {"schema": "attnhub.profile/1",
     "devices": {"<device key>": {
        "device": {"name": str, "arch": str, "vendor": str, "versions": {lib: version}},
        "speed": {"<bucket key>": {"<backend>": {"seconds": float, "samples": int,
                                                  "updated": iso8601}}},
        "attention_share": {"<model>|<phase>": {"share": float, "updated": iso8601}},
        "accuracy": {"<bucket key or label>": {"<backend>": {"passed": bool,
                     "metrics": {name: float}, "reference": str, "updated": iso8601}}}}}}

``model`` and ``phase`` may be ``*`` (any); an accuracy label ``*`` covers every bucket of
that device. Writes go to a temporary file then ``os.replace`` (readers never see half a
file); before writing, a store re-reads the file if another process changed it, so records of
concurrent writers are merged (the last write of the *same* entry wins).
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import threading
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from ..core.device import DeviceInfo
from ..core.spec import AttentionSpec
from ..errors import PolicyError

SCHEMA = "attnhub.profile/1"
#: Versions that do not change kernel speed or accuracy (left out of the device key).
_NOT_IN_KEY = frozenset({"transformers"})
_ANY = "*"


def default_profile_path() -> Path:
    env = os.environ.get("ATTNHUB_PROFILE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "attnhub" / "profile.json"


def device_key(device: DeviceInfo) -> str:
    """``"NVIDIA H200 (sm90) cuda=13.0 cudnn=91900 torch=2.11.0 triton=3.6.0"``."""
    return _device_key(device.name or device.arch, device.arch, device.versions)


@functools.lru_cache(maxsize=256)
def _device_key(name: str, arch: str, versions: tuple[tuple[str, str], ...]) -> str:
    libs = " ".join(f"{k}={v}" for k, v in sorted(versions) if k not in _NOT_IN_KEY)
    return f"{name} ({arch}) {libs}".strip()


@functools.lru_cache(maxsize=4096)
def bucket_key(spec: AttentionSpec) -> str:
    """A stable, readable key of the bucketed spec, e.g. ``"decode bf16/bf16 d=128/128
    h=32:8 paged mask=causal(bottom_right) sq=1 sk=32768 b=16 page_size=16"``."""
    s = spec.bucketed()
    key = (f"{s.phase} {s.dtype}/{s.kv_dtype} d={s.head_dim}/{s.head_dim_v} "
           f"h={s.num_q_heads}:{s.num_kv_heads} {s.layout} mask={s.mask.describe()} "
           f"sq={s.max_seqlen_q} sk={s.max_seqlen_k} b={s.batch}")
    shown = {"phase", "dtype", "kv_dtype", "head_dim", "head_dim_v", "num_q_heads",
             "num_kv_heads", "layout", "mask", "max_seqlen_q", "max_seqlen_k", "batch"}
    for f in fields(s):  # flags and any field added later, when not at its default
        v = getattr(s, f.name)
        if f.name not in shown and v != f.default:
            key += f" {f.name}={v}"
    return key


@dataclass(frozen=True)
class AccuracyRecord:
    """An accuracy check of one backend against a reference (e.g. FP8 against BF16)."""

    passed: bool
    metrics: dict[str, float] = field(default_factory=dict)
    reference: str = ""
    updated: str = ""
    key: str = ""


class ProfileStore:
    """Read and record measurements; every public method takes a ``DeviceInfo``."""

    def __init__(self, path: str | os.PathLike[str] | None = None):
        self.path = Path(path).expanduser() if path is not None else default_profile_path()
        self.revision = 0  # bumped on every change this process sees (policy cache key)
        self._data: dict[str, Any] | None = None
        self._stamp: tuple[int, int] | None = None
        self._lock = threading.Lock()

    # -- recording ----------------------------------------------------------------------
    def record_speed(self, device: DeviceInfo, spec: AttentionSpec, backend: str,
                     seconds: float, *, samples: int = 1) -> None:
        """One backend's measured time (median seconds per call) for a spec bucket."""
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"seconds={seconds!r}; expected a positive finite time per call")
        entry = {"seconds": float(seconds), "samples": int(samples), "updated": _now()}
        self._update(lambda d: _section(d, device, "speed", bucket_key(spec)).__setitem__(
            backend, entry))

    def record_attention_share(self, device: DeviceInfo, model: str | None, share: float, *,
                               phase: str = _ANY) -> None:
        """Attention time / model step time for ``model`` (None = any) in ``phase``."""
        if not (isinstance(share, (int, float)) and 0.0 <= share <= 1.0):
            raise ValueError(f"share={share!r}; expected a fraction between 0 and 1")
        key = f"{model or _ANY}|{phase}"
        self._update(lambda d: _device(d, device).setdefault("attention_share", {}).__setitem__(
            key, {"share": float(share), "updated": _now()}))

    def record_accuracy(self, device: DeviceInfo, spec_or_shape: AttentionSpec | str,
                        backend: str, passed: bool, metrics: dict[str, float] | None = None,
                        *, reference: str = "bf16") -> None:
        """Outcome of an accuracy check (``spec_or_shape``: a spec, or a label; ``*`` covers
        every bucket of the device). ``metrics`` e.g. ``{"rel_error": 0.004}``."""
        entry = {"passed": bool(passed), "reference": reference, "updated": _now(),
                 "metrics": {k: float(v) for k, v in (metrics or {}).items()}}
        key = _acc_key(spec_or_shape)
        self._update(lambda d: _section(d, device, "accuracy", key).__setitem__(backend, entry))

    # -- reading ------------------------------------------------------------------------
    def speed(self, device: DeviceInfo, spec: AttentionSpec, backend: str) -> float | None:
        rec = self._get(device, "speed", bucket_key(spec)).get(backend)
        return float(rec["seconds"]) if rec else None

    def fastest(self, device: DeviceInfo, spec: AttentionSpec,
                backends: list[str]) -> list[tuple[str, float | None]]:
        """``backends`` ordered by measured time; unmeasured ones follow in the given order."""
        section = self._get(device, "speed", bucket_key(spec))
        timed = [(b, float(section[b]["seconds"]) if b in section else None) for b in backends]
        measured = sorted((t for t in timed if t[1] is not None), key=lambda t: t[1] or 0.0)
        return measured + [t for t in timed if t[1] is None]

    def attention_share(self, device: DeviceInfo, model: str | None, phase: str) -> float | None:
        """Most specific record first: (model, phase), (model, *), (*, phase), (*, *)."""
        shares = self._device_data(device).get("attention_share", {})
        for m in ((model, _ANY) if model else (_ANY,)):
            for p in (phase, _ANY):
                rec = shares.get(f"{m}|{p}")
                if rec is not None:
                    return float(rec["share"])
        return None

    def accuracy(self, device: DeviceInfo, spec_or_shape: AttentionSpec | str,
                 backend: str) -> AccuracyRecord | None:
        """The record for this bucket (or label), else the device-wide ``*`` record."""
        for key in dict.fromkeys((_acc_key(spec_or_shape), _ANY)):
            rec = self._get(device, "accuracy", key).get(backend)
            if rec is not None:
                return AccuracyRecord(
                    passed=bool(rec["passed"]), metrics=dict(rec.get("metrics", {})),
                    reference=str(rec.get("reference", "")),
                    updated=str(rec.get("updated", "")), key=key)
        return None

    def data(self) -> dict[str, Any]:
        """The whole store as stored (a copy)."""
        return json.loads(json.dumps(self._read()))

    # -- file handling --------------------------------------------------------------------
    def _device_data(self, device: DeviceInfo) -> dict[str, Any]:
        return self._read()["devices"].get(device_key(device), {})

    def _get(self, device: DeviceInfo, section: str, key: str) -> dict[str, Any]:
        return self._device_data(device).get(section, {}).get(key, {})

    def _read(self) -> dict[str, Any]:
        stamp = _stamp(self.path)
        if self._data is None or self._stamp != stamp:
            self._data, self._stamp = _load(self.path), stamp
        return self._data

    def _update(self, change: Callable[[dict[str, Any]], None]) -> None:
        with self._lock:
            data = self._read()
            change(data)
            write_json_atomic(self.path, data)
            self._stamp = _stamp(self.path)
            self.revision += 1


def _acc_key(spec_or_shape: AttentionSpec | str) -> str:
    return spec_or_shape if isinstance(spec_or_shape, str) else bucket_key(spec_or_shape)


def _device(data: dict[str, Any], device: DeviceInfo) -> dict[str, Any]:
    entry = data["devices"].setdefault(device_key(device), {})
    entry["device"] = {"name": device.name, "arch": device.arch, "vendor": device.vendor,
                       "versions": dict(device.versions)}
    return entry


def _section(data: dict[str, Any], device: DeviceInfo, section: str, key: str) -> dict[str, Any]:
    return _device(data, device).setdefault(section, {}).setdefault(key, {})


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _load(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"schema": SCHEMA, "devices": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PolicyError([f"{path}: the profile store cannot be read ({exc}); fix or delete "
                           "it, or point ATTNHUB_PROFILE elsewhere"]) from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(
            data.get("devices"), dict):
        raise PolicyError([f"{path}: not an attnhub profile store (expected \"schema\": "
                           f"\"{SCHEMA}\" and a \"devices\" mapping); move it away or point "
                           "ATTNHUB_PROFILE elsewhere"])
    return data


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to a temporary file in the same folder, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
