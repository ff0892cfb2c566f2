"""The backend contract every plugin implements.

A backend is cheap to construct and to ask questions of: ``capabilities`` is data, ``check``
returns reasons, and kernels are imported only by ``load()``, on first use, so that listing or
planning never touches a GPU or a heavy library.
"""

from __future__ import annotations

import importlib.util
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, NamedTuple

import torch

from . import process_state
from .bounded import Stalled, bounded, safe_str
from .capabilities import Capabilities
from .device import DeviceInfo
from .seqstate import SequenceStore, StateGeometry
from .spec import AttentionSpec, AttnParams

TIERS: tuple[str, ...] = ("reference", "portable", "vendor", "serving", "variant", "approximate",
                          "distributed")


def unit_head_stride(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors with a head dim (last dim) of stride 1, copied where it is not. The API
    passes views on as they come; a raw kernel that reads the head dim as dense returns
    garbage for any other stride (compiled flex on the H200: error 3.06; torch's CPU flash
    op: 2.7), and cuDNN / FlashAttention refuse them."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)


def module_available(name: str) -> bool:
    """Whether top-level module ``name`` can be imported, found without importing it (a module
    already in ``sys.modules`` counts, also one a test put there without a spec)."""
    import sys

    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def raised_reason(backend: object, what: str, exc: BaseException) -> str:
    """A rejection reason for plugin code that raised, naming the backend and the plugin."""
    return _bug(backend, what, f"raised {type(exc).__name__}: {safe_str(exc)}")


def plugin_fault(exc: BaseException) -> bool:
    """Whether ``exc``, raised by plugin code a host called, is that plugin's fault (said as
    a reason) rather than the user's: everything (SystemExit included, which would end the
    host with no word) except a KeyboardInterrupt on the main thread, where Ctrl-C lands."""
    return not (isinstance(exc, KeyboardInterrupt)
                and threading.current_thread() is threading.main_thread())


def _bug(backend: object, what: str, text: str) -> str:
    text = text.splitlines()[0][:220] if text else text
    return (f"{what}() of backend {getattr(backend, 'name', '?')!r} {text} (a bug in "
            f"plugin {getattr(backend, 'plugin', '?')!r}; report it to its authors)")


def reasons_of(backend: object, what: str, value: object) -> list[str]:
    """What a plugin's ``check``/``available``/``extra_checks`` returned, as reasons.

    Only an iterable of non-empty strings is taken as is. Anything else is one reason naming
    the bug, so the candidate is rejected: a str would become one "reason" per character, an
    empty str or a dict would read as "serves it", and None or numbers say nothing."""
    items: object = value
    if not isinstance(value, (str, bytes, Mapping)) and isinstance(value, Iterable):
        items = list(value)  # a generator is read once: show what it gave
        if all(isinstance(x, str) and x.strip() for x in items):
            return items  # type: ignore[return-value]
    shown = repr(items)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return [_bug(backend, what, f"returned {type(value).__name__} {shown}, expected a list of "
                 "reason sentences (empty: it can)")]


def _fields(objs: tuple) -> list[tuple]:
    return [tuple(getattr(o, f) for f in type(o).__slots__) for o in objs]


def _side_effects(backend: "Backend", what: str, objs: tuple, before: list[tuple],
                  settings: Any) -> str | None:
    """What a plugin method did besides answering, undone: torch settings it changed (put
    back) and frozen arguments it edited with ``object.__setattr__`` (their fields put back:
    the host's cached ``DeviceInfo`` is shared by every later decision); a reason that
    rejects the backend, or None."""
    changed = process_state.call_restore(settings)
    for o, vals in zip(objs, before):
        for f, v in zip(type(o).__slots__, vals):
            if getattr(o, f) is not v:
                object.__setattr__(o, f, v)
                changed.append(f"its argument's {type(o).__name__}.{f}")
    if not changed:
        return None
    return _bug(backend, what, f"changed {'; '.join(changed)} (put back; a {what}() must "
                               "only answer)")


def safe_check(backend: "Backend", spec: AttentionSpec, device: DeviceInfo) -> list[str]:
    """``backend.check`` for hosts: a subclass that overrides ``check`` and raises (or
    returns something other than a list of reasons, or changes torch's settings or its
    arguments) gives a reason instead."""
    objs = (spec, spec.mask, device)
    before, settings = _fields(objs), process_state.call_snapshot()
    try:
        got = reasons_of(backend, "check", backend.check(spec, device))
    except BaseException as exc:
        if not plugin_fault(exc):
            process_state.call_restore(settings)
            raise
        got = [raised_reason(backend, "check", exc)]
    bad = _side_effects(backend, "check", objs, before, settings)
    return got if bad is None else [bad, *got]


def safe_capabilities(backend: "Backend") -> Capabilities | str:
    """``backend.capabilities`` for hosts, read once: a property that raises (a driver probe
    that failed after registration) or returns something other than ``Capabilities`` is a
    reason (the ``str``) that rejects the backend, not a crash of the resolver."""
    settings = process_state.call_snapshot()
    try:
        caps = backend.capabilities
    except BaseException as exc:
        if not plugin_fault(exc):
            process_state.call_restore(settings)
            raise
        caps = raised_reason(backend, "capabilities", exc)
    bad = _side_effects(backend, "capabilities", (), [], settings)
    if bad is not None or isinstance(caps, str):
        return bad or caps  # type: ignore[return-value]
    if not isinstance(caps, Capabilities):
        return _bug(backend, "capabilities", f"returned a {type(caps).__name__}, not "
                                              "attnhub.plugin.Capabilities")
    return caps


def safe_available(backend: "Backend", device: DeviceInfo,
                   timeout: float | None = None) -> list[str]:
    """``backend.available`` for hosts, as :func:`safe_check`; with ``timeout`` (seconds) a
    call that has not returned by then is a reason too (listing commands: ``attnhub
    backends``, ``doctor``, ``check-plugin`` hung on one plugin's probe)."""
    objs = (device,)
    before, settings = _fields(objs), process_state.call_snapshot()
    try:
        got = bounded(lambda: backend.available(device), timeout,
                      name=f"attnhub-available-{getattr(backend, 'name', '?')}")
        got = reasons_of(backend, "available", got)
    except Stalled:
        return [_bug(backend, "available", f"did not return within {timeout:g} s")]
    except BaseException as exc:
        if not plugin_fault(exc):
            process_state.call_restore(settings)
            raise
        got = [raised_reason(backend, "available", exc)]
    bad = _side_effects(backend, "available", objs, before, settings)
    return got if bad is None else [bad, *got]


#: The load lock of backends whose ``__init__`` did not call ``Backend.__init__``.
_SHARED_LOAD_LOCK = threading.Lock()


class AttentionOutput(NamedTuple):
    """``out`` in the query layout; ``lse`` (B, Hq, Sq) or (Hq, total_q) natural-log, or None."""

    out: torch.Tensor
    lse: torch.Tensor | None = None


class Backend(ABC):
    """Base class for attention backends.

    Subclasses set ``name``, ``tier``, ``capabilities`` and implement ``forward``. Override
    ``extra_checks`` for what data cannot express (a library build flag, a page size), and
    ``requires`` with the importable modules the backend needs (checked without importing).
    """

    name: ClassVar[str]
    tier: ClassVar[str] = "portable"
    description: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: Modules that must be importable, each with the command that installs it.
    requires: ClassVar[dict[str, str]] = {}

    #: Set by the registry: the plugin (entry-point name) that registered this backend.
    plugin: str = "?"
    #: True for a backend that keeps per-sequence state between calls (a linear layer's
    #: recurrent state, for O(1) decode): it implements ``new_sequence_store``, and a bound
    #: model keeps that store beside its KV cache (see ``attnhub.core.seqstate``).
    keeps_sequence_state: ClassVar[bool] = False

    #: Class defaults, so that a subclass whose ``__init__`` forgets ``super().__init__()``
    #: still loads (it shares one lock: its first load is serialised with other such ones).
    _loaded: bool = False
    _load_lock: threading.Lock = _SHARED_LOAD_LOCK

    def __init__(self) -> None:
        self._loaded = False
        self._load_lock = threading.Lock()

    # -- questions (cheap, no kernels imported) -------------------------------------------
    def missing_requirements(self) -> list[str]:
        """Reasons from libraries that are not installed, each with its install command."""
        return [
            f"{mod} is not installed ({hint})"
            for mod, hint in self.requires.items()
            if importlib.util.find_spec(mod.split(".")[0]) is None
        ]

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """Checks the capability data cannot express; reasons, empty means fine."""
        return []

    def check(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """Every reason this backend cannot serve ``spec`` on ``device``; empty means it can.

        A plugin's own code raising here (``extra_checks``, a capabilities property) becomes
        a rejection reason naming the plugin: a buggy check never reaches the host."""
        try:
            reasons = self.capabilities.check(spec, device)
            if not device.simulated:
                reasons += self.missing_requirements()
            return reasons + reasons_of(self, "extra_checks", self.extra_checks(spec, device))
        except Exception as exc:
            return [self._raised("check", exc)]

    def available(self, device: DeviceInfo) -> list[str]:
        """Reasons the backend cannot run on this device at all (any spec)."""
        try:
            reasons = self.capabilities._check_device(device)
            if not device.simulated:
                reasons += self.missing_requirements()
            return reasons
        except Exception as exc:
            return [self._raised("available", exc)]

    def _raised(self, what: str, exc: Exception) -> str:
        return raised_reason(self, what, exc)

    # -- doing ----------------------------------------------------------------------------
    def load(self) -> None:
        """Import kernels once; idempotent and thread-safe. Override ``_load``."""
        if self._loaded:
            return
        with self._load_lock:
            if not self._loaded:
                self._load()
                self._loaded = True

    def _load(self) -> None:
        """Import the kernel library; called once by ``load``."""

    def new_sequence_store(self, geometry: StateGeometry) -> SequenceStore:
        """A store for the per-sequence state of ``geometry.layers`` (only when
        ``keeps_sequence_state``); calls then find it in ``params.extra``."""
        raise NotImplementedError(f"{self.name} keeps no per-sequence state "
                                  "(keeps_sequence_state is False)")

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        spec: AttentionSpec, params: AttnParams,
    ) -> AttentionOutput:
        """Attention for one call. q/k/v arrive in ``spec.layout`` (never ``bhsd``: the API
        turns it into a ``bshd`` view). Autograd must flow when ``capabilities.backward``."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} from {self.plugin}>"
