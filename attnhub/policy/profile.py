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
that device. A writer holds an exclusive lock on the sidecar ``.<name>.lock`` (``fcntl.flock``;
``msvcrt.locking`` on Windows) while it re-reads the file from disk, applies its change and
writes a temporary file that ``os.replace`` puts in place: readers never see half a file and
no record of a concurrent writer, thread or process, is lost (the last write of the *same*
entry wins). A file of the right schema with entries of the wrong type is a ``PolicyError``
naming the entry.

Shipped profile packs (``attnhub/profiles/*.json``, package data; ``ATTNHUB_PROFILE_PACKS``
names another folder, or ``off``) have the same schema plus a ``pack`` header (when, which
command, which commit). ``ranking`` orders a ``fastest`` rule's candidates from the user's
store first, then a pack measured on this device name with these library versions, then the
list order, and says which it used; a pack for this device name measured with other versions
is stale: ignored, with the differing versions in the note.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import glob
import json
import math
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from ..core.device import DeviceInfo
from ..core.spec import AttentionSpec
from ..errors import PolicyError
from .loader import DuplicateKey, TooBig, no_duplicate_keys, read_limited
from .located import clip

SCHEMA = "attnhub.profile/1"
#: Versions that do not change kernel speed or accuracy (left out of the device key).
_NOT_IN_KEY = frozenset({"transformers"})
_ANY = "*"


def _user_path(raw: str | os.PathLike[str], where: str) -> Path:
    """``raw`` with ``~`` expanded; a home that cannot be found (``~nouser/p.json``, no HOME)
    is a :class:`PolicyError` naming where the path came from."""
    try:
        return Path(raw).expanduser()
    except RuntimeError as exc:
        raise PolicyError([f"{where}={os.fspath(raw)!r}: {exc} (a '~user' that does not "
                           "exist, or no HOME): give the path without '~', or an absolute "
                           "one"]) from None


def default_profile_path() -> Path:
    env = os.environ.get("ATTNHUB_PROFILE")
    if env:
        return _user_path(env, "ATTNHUB_PROFILE")
    try:
        home = Path.home()
    except RuntimeError as exc:
        raise PolicyError([f"no ATTNHUB_PROFILE and no home folder for the profile store "
                           f"({exc}): set ATTNHUB_PROFILE to a path"]) from None
    return home / ".cache" / "attnhub" / "profile.json"


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


@dataclass(frozen=True)
class Ranking:
    """A ``fastest`` rule's candidates in the order to try, with seconds where measured,
    where the figures came from (``store``, ``pack``, ``list order``) and a readable note."""

    ranked: list[tuple[str, float | None]]
    source: str
    note: str

    @property
    def order(self) -> list[str]:
        return [b for b, _ in self.ranked]

    def tied(self, viable: list[str]) -> list[str]:
        """The ``viable`` candidates a shipped pack times within ``SETTLE_MARGIN`` of the
        fastest of them (``SETTLE_MARGIN_SHORT`` for calls of at most ``SHORT_CALL_S``),
        the bound one first; [] unless the figures come from a pack
        (another machine: on the H200, three decode kernels within 1% in one run came 8%
        apart on another host) and a call is short enough to time at bind time
        (``SETTLE_BELOW_S``)."""
        secs = {b: s for b, s in self.ranked if s is not None}
        timed = [b for b in viable if b in secs]
        if self.source != "pack" or len(timed) < 2:
            return []
        fastest = min(secs[b] for b in timed)
        margin = SETTLE_MARGIN_SHORT if fastest <= SHORT_CALL_S else SETTLE_MARGIN
        tied = [b for b in timed if secs[b] <= fastest * (1 + margin)]
        ok = len(tied) > 1 and tied[0] == viable[0] and fastest <= SETTLE_BELOW_S
        return tied if ok else []


class ProfileStore:
    """Read and record measurements; every public method takes a ``DeviceInfo``.

    ``packs``: the folder of shipped profile packs (default ``ATTNHUB_PROFILE_PACKS``, else
    ``attnhub/profiles``; ``"off"`` for none)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 packs: str | os.PathLike[str] | None = None):
        self.path = _user_path(path, "the store path") if path is not None \
            else default_profile_path()
        self.packs = packs_dir(packs)
        self.revision = 0  # bumped on every change this process sees (policy cache key)
        self._data: dict[str, Any] | None = None
        self._stamp: tuple[int, ...] | None = None
        self._lock = threading.Lock()
        #: per thread and per asyncio task (a context variable: each task and thread has its
        #: own copy), the open :meth:`batch` blocks as (thread, pending changes), innermost
        #: last; an immutable tuple, set on entry and reset with its token on exit
        self._batches: contextvars.ContextVar[
            tuple[tuple[int, list[Callable[[dict[str, Any]], None]]], ...]] = \
            contextvars.ContextVar(f"attnhub_profile_batches_{id(self)}", default=())

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
        """``backends`` ordered by measured time in this store; unmeasured ones follow in
        the given order (``ranking`` also consults the shipped packs)."""
        return _ranked(self._get(device, "speed", bucket_key(spec)), backends)

    def ranking(self, device: DeviceInfo, spec: AttentionSpec, backends: list[str]) -> Ranking:
        """The order a ``fastest`` rule tries ``backends`` in: measured in this store, else
        in a shipped pack for this device and these versions, else as listed; with a note."""
        key = bucket_key(spec)
        ranked = _ranked(self._get(device, "speed", key), backends)
        if ranked and ranked[0][1] is not None:
            return Ranking(ranked, "store", _timed(ranked) + f" (user store {self.path})")
        pack = shipped_pack(device, self.packs)
        if pack.speed is not None:
            ranked = _ranked(pack.speed.get(key, {}), backends)
            if ranked and ranked[0][1] is not None:
                return Ranking(ranked, "pack", _timed(ranked) + f" (shipped profile pack "
                               f"{pack.path.name}, measured {pack.measured})")
        why = f"nothing measured for this bucket on {device_key(device)} in {self.path}"
        return Ranking([(b, None) for b in backends], "list order",
                       f"{why}; {pack.note}; using list order (record with attnhub bench)")

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

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Records this thread makes inside are written together when it closes: all of them,
        or none (a full disk after the first of several records left some and said "not
        recorded"). Another thread's or asyncio task's records are its own (written at once,
        or with its own batch); a batch inside another joins it, written when the outer one
        closes."""
        pending: list[Callable[[dict[str, Any]], None]] = []
        token = self._batches.set(self._batches.get() + ((threading.get_ident(), pending),))
        try:
            yield
        finally:
            self._batches.reset(token)  # its own entry, whatever else opened meanwhile
        if not pending:
            return
        outer = self._open_batches()
        if outer:  # nested: all or none with the outer batch
            outer[-1].extend(pending)
            return
        self._update(lambda d: [change(d) for change in pending])

    def _open_batches(self) -> list[list[Callable[[dict[str, Any]], None]]]:
        """This task's open batches, made by this thread (a thread started with a copy of the
        context, ``asyncio.to_thread``, keeps its records its own)."""
        me = threading.get_ident()
        return [pending for thread, pending in self._batches.get() if thread == me]

    def _update(self, change: Callable[[dict[str, Any]], None]) -> None:
        """Read-modify-write under the cross-process lock, always from the file on disk (a
        cached copy could miss a write made within the file clock's resolution); inside a
        :meth:`batch` of this thread, kept for its one write."""
        stack = self._open_batches()
        if stack:
            stack[-1].append(change)
            return
        target = Path(os.path.realpath(self.path))  # a symlink's target: its lock, its file
        try:
            with self._lock, file_lock(target):
                data = _load(self.path)  # named as configured; the same file
                change(data)
                # never write what a read refuses (a NaN metric): every record would be lost
                bad = list(_type_problems(data["devices"]))
                if bad:
                    raise ValueError(f"{self.path}: {bad[0][0]}: {bad[0][1]}; not recorded "
                                     "(the store holds finite numbers only), the store is "
                                     "unchanged")
                write_json_atomic(target, data)
                self._data, self._stamp = data, _stamp(self.path)
                self.revision += 1
        except OSError as exc:  # the store on disk is as it was (the write is atomic); the
            # failing path may be the store, its folder, its lock or the temporary file
            where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(
                self.path) else ""
            raise PolicyError([f"{self.path}: cannot write the profile store "
                               f"({exc.strerror or exc}{where}); free space or make the "
                               "folder writable (a file or folder in the way of the store, "
                               "its folder or its .lock: move it), or point ATTNHUB_PROFILE "
                               "elsewhere"]) from None


def _acc_key(spec_or_shape: AttentionSpec | str) -> str:
    return spec_or_shape if isinstance(spec_or_shape, str) else bucket_key(spec_or_shape)


def _device(data: dict[str, Any], device: DeviceInfo) -> dict[str, Any]:
    entry = data["devices"].setdefault(device_key(device), {})
    entry["device"] = {"name": device.name, "arch": device.arch, "vendor": device.vendor,
                       "versions": dict(device.versions)}
    return entry


def _section(data: dict[str, Any], device: DeviceInfo, section: str, key: str) -> dict[str, Any]:
    return _device(data, device).setdefault(section, {}).setdefault(key, {})


def _stamp(path: Path) -> tuple[int, ...] | None:
    """What tells the file changed since it was read: the inode and ctime too, since
    another writer's same-size replace within the clock's tick keeps mtime and size (every
    write renames a new file into place: ``write_json_atomic``)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns, st.st_mtime_ns, st.st_size


#: Far above a store of every bucket of every backend on a few devices (about 1 MiB each).
MAX_STORE_BYTES = 256 * 2**20


def _load(path: Path, env: str = "ATTNHUB_PROFILE") -> dict[str, Any]:
    """The store at ``path`` (empty when there is none; ``env`` is the variable that points
    elsewhere, named in the fix). Read as the policy loader reads: a
    FIFO or ``/dev/zero`` in its place hung every reader, and JSON nested past Python's
    recursion limit escaped as a RecursionError traceback."""
    try:
        raw = read_limited(path, MAX_STORE_BYTES)
    except FileNotFoundError:
        return {"schema": SCHEMA, "devices": {}}
    except (OSError, TooBig) as exc:
        what = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise PolicyError([f"{path}: the profile store cannot be read ({what}); expected a "
                           f"JSON file of at most {MAX_STORE_BYTES // 2**20} MiB: move it "
                           f"away, or point {env} elsewhere"]) from None
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as exc:
        raise PolicyError([f"{path}: duplicate key {exc.args[0]!r} (JSON keeps the last one "
                           f"silently); keep one, or delete the file or point {env} "
                           "elsewhere"]) from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise PolicyError([f"{path}: the profile store cannot be read ({_first_line(exc)}); "
                           f"fix or delete it, or point {env} elsewhere"]) from None
    other = data.get("schema") if isinstance(data, dict) else None
    if isinstance(other, str) and other != SCHEMA and other.startswith(SCHEMA.split("/")[0]):
        # another version's store: "not an attnhub profile store, move it away" misled
        raise PolicyError([f"{path}: written by another attnhub version (schema "
                           f"{clip(other)!r}; this one reads {SCHEMA!r}); use that version, "
                           f"or point {env} elsewhere (the file is left as it is)"])
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(
            data.get("devices"), dict):
        raise PolicyError([f"{path}: not an attnhub profile store (expected \"schema\": "
                           f"\"{SCHEMA}\" and a \"devices\" mapping); move it away or point "
                           f"{env} elsewhere"])
    problems = list(_type_problems(data["devices"]))
    if problems:
        raise PolicyError([f"{path}: {where}: {what}; fix or delete that entry (or the file)"
                           for where, what in problems[:20]])
    return data


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


def _is_num(x: Any) -> bool:
    """A finite real number that a float holds (a 400-digit integer in a store is not)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


#: Per section: field -> (check, what it must be). Entries are section[key][backend] except
#: attention_share, whose entries are section[key].
_FIELDS: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "speed": {"seconds": (lambda x: _is_num(x) and x > 0, "a positive number of seconds"),
              "samples": (lambda x: isinstance(x, int) and not isinstance(x, bool),
                          "an integer")},
    "accuracy": {"passed": (lambda x: isinstance(x, bool), "true or false"),
                 "metrics": (lambda x: isinstance(x, dict) and all(
                     _is_num(v) for v in x.values()), "a mapping of names to numbers")},
    "attention_share": {"share": (lambda x: _is_num(x) and 0 <= x <= 1,
                                  "a fraction between 0 and 1")},
}
_REQUIRED = {"speed": ("seconds",), "accuracy": ("passed",), "attention_share": ("share",)}


def _type_problems(devices: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(location, problem) for every entry whose type the readers would trip on."""
    for dkey, entry in devices.items():
        at = f"devices[{dkey!r}]"
        if not isinstance(entry, dict):
            yield at, f"expected a mapping, got {type(entry).__name__}"
            continue
        yield from _device_problems(at, entry.get("device", {}))
        for section, fields_ in _FIELDS.items():
            sec = entry.get(section, {})
            if not isinstance(sec, dict):
                yield f"{at}.{section}", f"expected a mapping, got {type(sec).__name__}"
                continue
            for key, val in sec.items():
                recs = {None: val} if section == "attention_share" else val
                if not isinstance(recs, dict):
                    yield f"{at}.{section}[{key!r}]", "expected a mapping of backends"
                    continue
                for backend, rec in recs.items():
                    where = f"{at}.{section}[{key!r}]" + (
                        f"[{backend!r}]" if backend is not None else "")
                    if not isinstance(rec, dict):
                        yield where, f"expected a mapping, got {type(rec).__name__}"
                        continue
                    for name in _REQUIRED[section]:
                        if name not in rec:
                            yield f"{where}", f"missing {name!r}"
                    for name, (ok, what) in fields_.items():
                        if name in rec and not ok(rec[name]):
                            yield f"{where}.{name}", f"expected {what}, got {rec[name]!r}"


def _device_problems(at: str, dev: Any) -> Iterator[tuple[str, str]]:
    """The ``device`` entry a shipped pack is matched by: name and arch strings, versions a
    mapping of library to version string."""
    if not isinstance(dev, dict):
        yield f"{at}.device", f"expected a mapping (name, arch, versions), got {_kind(dev)}"
        return
    for key in ("name", "arch"):
        if key in dev and not isinstance(dev[key], str):
            yield f"{at}.device.{key}", f"expected a string, got {_kind(dev[key])}"
    vers = dev.get("versions", {})
    if not isinstance(vers, dict) or not all(
            isinstance(a, str) and isinstance(b, str) for a, b in vers.items()):
        yield f"{at}.device.versions", ("expected a mapping of library name to version "
                                        f"string, got {_kind(vers)}")


def _kind(x: Any) -> str:
    return type(x).__name__


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock across processes on the sidecar ``.<name>.lock`` (held until the
    block ends; released by the OS if the process dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(f".{path.name}.lock")
    with open(lock, "a+b") as f:
        if os.name == "nt":  # pragma: no cover - exercised on Windows only
            import msvcrt

            f.seek(0)
            msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)
            try:
                yield
            finally:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# -- shipped profile packs ------------------------------------------------------------------
PACKS_ENV = "ATTNHUB_PROFILE_PACKS"


def packs_dir(packs: str | os.PathLike[str] | None = None) -> Path | None:
    """The folder of shipped packs: the argument, else ``ATTNHUB_PROFILE_PACKS``, else the
    package's ``attnhub/profiles``; None when switched off (``off``, ``none``, empty)."""
    raw = os.fspath(packs) if packs is not None else os.environ.get(PACKS_ENV)
    if raw is None:
        return Path(__file__).resolve().parent.parent / "profiles"
    return None if raw.strip().lower() in ("", "off", "none", "0") \
        else _user_path(raw, PACKS_ENV)


@dataclass(frozen=True)
class PackMatch:
    """The shipped pack's speed section for a device (None: none usable), and why."""

    speed: dict[str, Any] | None
    note: str
    path: Path = Path()
    measured: str = ""


def shipped_pack(device: DeviceInfo, folder: Path | None) -> PackMatch:
    """The pack entry measured on this device name and arch with these library versions
    (``_version_diff``); else a note saying whether packs are off, missing for this device,
    or stale."""
    if folder is None:
        return PackMatch(None, f"shipped profile packs switched off ({PACKS_ENV})")
    return _shipped_pack(device_key(device), device.name or device.arch, device.arch,
                         tuple(sorted(device.versions)), folder, _folder_stamp(folder))


def _folder_stamp(folder: Path) -> tuple[tuple[str, int], ...]:
    try:
        return tuple(sorted((p.name, p.stat().st_mtime_ns) for p in folder.glob("*.json")))
    except OSError:
        return ()


@functools.lru_cache(maxsize=64)
def _shipped_pack(key: str, name: str, arch: str, versions: tuple[tuple[str, str], ...],
                  folder: Path, stamp: tuple[tuple[str, int], ...]) -> PackMatch:
    stale: list[str] = []
    for fname, _ in stamp:
        path = folder / fname
        data = _load(path, PACKS_ENV)
        measured = str(data.get("pack", {}).get("measured", "date unknown")) \
            if isinstance(data.get("pack"), dict) else "date unknown"
        for dkey, entry in data["devices"].items():
            dev = entry.get("device", {}) if isinstance(entry, dict) else {}
            if dkey != key and (dev.get("name") != name or dev.get("arch") != arch):
                continue
            diff = _version_diff(dict(dev.get("versions", {})), dict(versions))
            if not diff:
                return PackMatch(entry.get("speed", {}), f"shipped pack {fname} matches",
                                 path, measured)
            stale.append(f"{fname} is stale for this machine ({diff}); ignored: re-measure "
                         "with attnhub bench --regret")
    if stale:
        return PackMatch(None, "; ".join(stale))
    return PackMatch(None, f"no shipped profile pack for {name} ({arch}) in {folder}")


#: Libraries every backend's speed depends on: a pack must have been measured with the same.
_CORE_LIBS = frozenset({"torch", "cuda", "rocm", "cudnn", "triton"})


def _version_diff(pack: dict[str, str], here: dict[str, str]) -> str:
    """The versions that make a pack stale here ("" if none): a core library that differs,
    or a kernel library installed on both sides at different versions. A kernel library on
    one side only is no reason: its backends are either unavailable here (so never bound)
    or unmeasured in the pack (so ranked after the measured ones, as the note says)."""
    libs = sorted((set(pack) | set(here)) - _NOT_IN_KEY)
    diff = [f"{lib} {pack.get(lib, 'absent')} in the pack, {here.get(lib, 'absent')} here"
            for lib in libs if pack.get(lib) != here.get(lib)
            and (lib in _CORE_LIBS or (lib in pack and lib in here))]
    return ", ".join(diff)


#: Measured times within this fraction of the fastest remaining one count as a tie: the run
#: to run spread of one kernel on the H200 was a few percent, so among tied backends the
#: rule's list order decides rather than noise.
TIE = 0.03


#: A pack's candidates within this fraction of its fastest are timed again at bind time
#: (``Ranking.tied``): wider than ``TIE``, because a pack is one run on one host. On the H200
#: (2026-12-02) fa3 through the API on prefill at a new length per call (d64, 8/2 heads)
#: timed 0.159 ms in one run and 0.221 ms in the next while torch_sdpa held at 0.168, so a
#: pack's 6% lead bound a backend 1.32x slower in the next run.
SETTLE_MARGIN = 0.10
#: Calls this short are bound by host work more than by the kernel, so their ranking moves
#: with the host (the same H200 run timed a growing-cache decode step at d64 with fa2_torch
#: 19% slower than torch_sdpa in one step and 6% faster in the next): within
#: ``SETTLE_MARGIN_SHORT`` they are timed at bind time too.
SHORT_CALL_S = 2e-4
SETTLE_MARGIN_SHORT = 0.25

#: Ties are settled by timing them at bind time only when a call takes at most this long (in
#: the pack): three candidates' warm-up and samples then cost well under 0.1 s, once.
SETTLE_BELOW_S = 0.002


def _ranked(section: dict[str, Any], backends: list[str]) -> list[tuple[str, float | None]]:
    """Measured backends fastest first (ties within ``TIE`` in list order), then the rest
    in list order."""
    timed = [(b, float(section[b]["seconds"]) if b in section else None) for b in backends]
    rest = [t for t in timed if t[1] is not None]
    out: list[tuple[str, float | None]] = []
    while rest:
        fastest = min(t[1] for t in rest if t[1] is not None)
        pick = next(t for t in rest if t[1] is not None and t[1] <= fastest * (1 + TIE))
        out.append(pick)
        rest.remove(pick)
    return out + [t for t in timed if t[1] is None]


def _timed(ranked: list[tuple[str, float | None]]) -> str:
    timed = "measured " + ", ".join(f"{b} {s * 1e6:.1f} us" for b, s in ranked if s is not None)
    timed += f" (ties within {TIE:.0%} keep list order)"
    rest = [b for b, s in ranked if s is None]
    return timed + (f"; unmeasured {', '.join(rest)} kept in list order after them"
                    if rest else "")


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to a temporary file in the same folder, flush it to disk, then rename over
    ``path`` (without the flush a crash after the rename can leave an empty file there). A
    symlink is followed: the rename replaces the file it points to, not the link."""
    path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file() and not path.is_dir():  # a device or FIFO
        raise PolicyError([f"{path} is not a regular file (a device, FIFO or socket, which "
                           "the write would replace); pass the path of a file to write"])
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(path)
    kept = kept_mode(path)
    made: list[Path] = []
    try:
        with os.fdopen(open_temp(path, ".tmp", made), "w", encoding="utf-8") as f:  # owns it
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        if kept is not None:
            os.chmod(made[-1], kept)
        os.replace(made[-1], path)
    except BaseException:
        discard(made)
        raise


def temp_name(path: Path, suffix: str) -> Path:
    """A fresh name beside ``path`` for a write that replaces it: named before the file is
    made, so a ``try`` around the making can remove it. ``tempfile.mkstemp`` made the file
    before the caller knew its name: a Ctrl-C as it returned (or before the ``try``) left a
    temporary file behind each time."""
    return path.with_name(f".{path.name}.{secrets.token_hex(8)}{suffix}")


def open_new(tmp: Path) -> int:
    """Create ``tmp`` (it must not exist) for writing, with an ordinary new file's mode (0666
    less the umask, as ``open`` gives); its file descriptor."""
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
                   | getattr(os, "O_BINARY", 0), 0o666)


#: Names drawn for one temporary file before giving up (each taken by another file).
_TEMP_TRIES = 100


def open_temp(path: Path, suffix: str, made: list[Path]) -> int:
    """Create a temporary file beside ``path`` (:func:`temp_name`, :func:`open_new`); its
    file descriptor. Its name is appended to ``made`` before the file is made, so the
    caller's ``try`` around this call removes it (:func:`discard`) whatever interrupts it; a
    name found taken is another writer's file: taken out of ``made`` again (the cleanup
    removed that writer's file, failing both writes) and another name is drawn."""
    for _ in range(_TEMP_TRIES):
        tmp = temp_name(path, suffix)
        made.append(tmp)
        try:
            return open_new(tmp)
        except FileExistsError:
            made.remove(tmp)
    raise FileExistsError(f"no free temporary name beside {path} after {_TEMP_TRIES} tries")


def discard(made: list[Path]) -> None:
    """Remove the temporary files of a write that failed; one that cannot be removed (gone,
    or a folder made read-only meanwhile) does not hide the write's own error."""
    for tmp in made:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def kept_mode(path: Path) -> int | None:
    """The permission bits of the regular file at ``path`` that a write replaces, for the file
    replacing it (None: no such file; the new one gets an ordinary new file's mode). A store a
    user made private (``chmod 600``) or shared (``chmod 664``) came back 0644 after a write."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return stat.S_IMODE(st.st_mode) & 0o777 if stat.S_ISREG(st.st_mode) else None


#: A temporary file of a write older than this was left by a writer that died mid-write
#: (killed, power loss): a live write takes milliseconds.
STALE_TMP_S = 600.0


def _sweep_stale(path: Path) -> None:
    """Remove the temporary files of earlier writes to ``path`` that never finished (a
    SIGKILL between create and rename leaves one, truncated, each time)."""
    cutoff = time.time() - STALE_TMP_S
    try:
        for p in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
                if p.is_file() and p.stat().st_mtime < cutoff:
                    p.unlink()
    except OSError:
        pass


def _read_umask() -> int:
    """The process umask, read once at import: reading it means setting it, and a second
    thread creating a file in between would get the temporary value."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
