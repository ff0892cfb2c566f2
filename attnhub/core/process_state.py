"""Process-wide settings a plugin must not change while it loads, checked and put back.

A plugin imported by the host that sets torch's default dtype, turns on deterministic
algorithms, switches an SDPA kernel off, silences logging or sets ``ATTNHUB_BACKEND`` would
change every later attention call of the host, silently. So would one that changes the
working directory (relative policy and lock paths), replaces ``sys.stdout`` or the exception
hooks (the CLI printed nothing, a crash left no traceback), lowers the recursion limit, turns
every warning into an error, removes modules from ``sys.modules`` or monkeypatches attnhub
itself. The registry takes a :func:`snapshot` before a plugin's import and hooks and calls
:func:`restore` after them: what changed is put back and reported against the plugin.
A :class:`Watch` puts it back at every return from the plugin's code, before the host's own
code runs on (under a recursion limit of 60 or ``simplefilter("error")`` the host's next
call failed, and the plugin got a second, misleading error).
Threads cannot be put back: :func:`stray_threads` names the ones that would keep the process
from exiting.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import sys
import threading
import weakref
import warnings
from types import ModuleType
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch

_log = logging.getLogger("attnhub")


def _attr(obj: Any, name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return (lambda: getattr(obj, name)), (lambda v: setattr(obj, name, v))


def _set_determinism(v: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(v[0], warn_only=v[1])


def _set_device(d: torch.device) -> None:
    torch.set_default_device(None if d == torch.device("cpu") else d)


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # deleted: nothing to compare or go back to
        return None


def _chdir(path: str | None) -> None:
    if path is not None:
        os.chdir(path)


def _catch_all(f: tuple[Any, ...]) -> bool:
    """A filter for every warning from everywhere (``simplefilter("error")``); a library's
    filter for its own messages or modules is its business."""
    return f[1] is None and f[3] is None and f[2] is Warning


def _warn_all() -> list[tuple[Any, ...]]:
    return [f for f in warnings.filters if _catch_all(f)]


def _set_warn_all(old: list[tuple[Any, ...]]) -> None:
    warnings.filters[:] = [f for f in warnings.filters if not _catch_all(f) or f in old]
    warnings._filters_mutated()  # type: ignore[attr-defined]  # the caches read the list


def _set_root_handlers(old: list[logging.Handler]) -> None:
    logging.root.handlers[:] = old  # logging.basicConfig() added one: every record doubled


class _State(bytes):
    """A generator state: compared by value, shown by its size (not 5 KB of bytes)."""

    def __repr__(self) -> str:
        return f"<state {hash(bytes(self)) & 0xffff:04x}>"


def _rng_state() -> bytes:
    """torch's CPU generator as bytes (comparable): a plugin that seeds or draws at import
    moves every later draw of a seeded run."""
    return _State(torch.random.get_rng_state().numpy().tobytes())


def _set_rng_state(state: bytes) -> None:
    torch.random.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


def _autocast(device: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    def get() -> bool:
        try:
            return torch.is_autocast_enabled(device)
        except RuntimeError:
            return False
    return get, lambda on: torch.set_autocast_enabled(device, on)


def _mode_stack(length: Callable[[], int],
                pop: Callable[[], Any]) -> tuple[Callable[[], int], Callable[[int], None]]:
    """A torch mode stack (``TorchFunctionMode``/``TorchDispatchMode``): modes entered and
    left on it intercept every later op; put back by popping them."""
    def put(old: int) -> None:
        while length() > old:
            pop()
        if length() < old:
            raise RuntimeError("modes the host had entered were popped")
    return length, put


def _no_inference_exit(old: bool) -> None:
    raise RuntimeError("an inference_mode guard is held; it ends only where it was entered")


def _handler(sig: signal.Signals) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    def put(old: Any) -> None:
        if old is not None and threading.current_thread() is threading.main_thread():
            signal.signal(sig, old)

    return (lambda: signal.getsignal(sig)), put


#: interval timers a plugin could arm (``signal.alarm`` at import killed the host later)
_TIMERS = tuple((n, getattr(signal, f"ITIMER_{n}")) for n in ("REAL", "VIRTUAL", "PROF")
                if hasattr(signal, f"ITIMER_{n}"))


def _timer(which: int) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Whether a timer is armed (its remaining time moves, so the state is compared, not
    the value); put back means disarmed, as it was."""
    def put(was: bool) -> None:
        if not was:
            signal.setitimer(which, 0)
    return (lambda: signal.getitimer(which)[0] > 0), put


_B = torch.backends
#: (what, getter, setter): torch's numerics and kernel switches, the host's logging, and the
#: interpreter state every later call (and the CLI's output) depends on.
#: ``enable_cudnn_sdp`` is left out: the core flips it around some CUDA calls.
SETTINGS: tuple[tuple[str, Callable[[], Any], Callable[[Any], None]], ...] = (
    ("torch default dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("torch default device", torch.get_default_device, _set_device),
    ("torch grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    ("torch inference mode", torch.is_inference_mode_enabled, _no_inference_exit),
    ("torch autocast (cpu)", *_autocast("cpu")),
    ("torch autocast (cuda)", *_autocast("cuda")),
    ("torch function mode stack depth", *_mode_stack(torch._C._len_torch_function_stack,
                                                     torch._C._pop_torch_function_stack)),
    ("torch dispatch mode stack depth", *_mode_stack(torch._C._len_torch_dispatch_stack,
                                                     torch._C._pop_torch_dispatch_stack)),
    ("torch deterministic algorithms",
     lambda: (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled()), _set_determinism),
    ("torch anomaly detection", torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    ("torch float32 matmul precision", torch.get_float32_matmul_precision,
     torch.set_float32_matmul_precision),
    ("torch.backends.cuda.matmul.allow_tf32", *_attr(_B.cuda.matmul, "allow_tf32")),
    ("torch.backends.cudnn.allow_tf32", *_attr(_B.cudnn, "allow_tf32")),
    ("torch.backends.cudnn.enabled", *_attr(_B.cudnn, "enabled")),
    ("torch.backends.cudnn.deterministic", *_attr(_B.cudnn, "deterministic")),
    ("torch.backends.cudnn.benchmark", *_attr(_B.cudnn, "benchmark")),
    ("SDPA flash kernel switch", _B.cuda.flash_sdp_enabled, _B.cuda.enable_flash_sdp),
    ("SDPA memory-efficient kernel switch", _B.cuda.mem_efficient_sdp_enabled,
     _B.cuda.enable_mem_efficient_sdp),
    ("SDPA math kernel switch", _B.cuda.math_sdp_enabled, _B.cuda.enable_math_sdp),
    *((("SDPA math kernel's fp16/bf16 reductions", _B.cuda.fp16_bf16_reduction_math_sdp_allowed,
        _B.cuda.allow_fp16_bf16_reduction_math_sdp),)
      if hasattr(_B.cuda, "fp16_bf16_reduction_math_sdp_allowed") else ()),
    ("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
     *_attr(_B.cuda.matmul, "allow_fp16_reduced_precision_reduction")),
    ("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
     *_attr(_B.cuda.matmul, "allow_bf16_reduced_precision_reduction")),
    ("torch.backends.mkldnn.enabled", *_attr(_B.mkldnn, "enabled")),
    ("torch threads", torch.get_num_threads, torch.set_num_threads),
    ("logging.disable level", lambda: logging.root.manager.disable, logging.disable),
    ("'attnhub' logger level", lambda: _log.level, _log.setLevel),
    ("'attnhub' logger disabled", *_attr(_log, "disabled")),
    ("'attnhub' logger propagation", *_attr(_log, "propagate")),
    ("'attnhub' logger filters", lambda: list(_log.filters),
     lambda old: setattr(_log, "filters", list(old))),
    ("'attnhub' logger handlers", lambda: list(_log.handlers),
     lambda old: setattr(_log, "handlers", list(old))),
    ("working directory", _cwd, _chdir),
    ("sys.stdout", *_attr(sys, "stdout")),
    ("sys.stderr", *_attr(sys, "stderr")),
    ("sys.stdin", *_attr(sys, "stdin")),
    ("sys.excepthook", *_attr(sys, "excepthook")),
    ("threading.excepthook", *_attr(threading, "excepthook")),
    ("recursion limit", sys.getrecursionlimit, sys.setrecursionlimit),
    ("root logger level", lambda: logging.root.level, logging.root.setLevel),
    ("root logger handlers", lambda: list(logging.root.handlers), _set_root_handlers),
    ("random generator state (torch, CPU)", _rng_state, _set_rng_state),
    ("warnings filter for every warning", _warn_all, _set_warn_all),
    *((f"{sig.name} handler", *_handler(sig))
      for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGALRM", None)) if sig),
    *((f"{name} interval timer armed", *_timer(which)) for name, which in _TIMERS),
)
#: Changes that stay, neither put back nor blamed: a raised recursion limit (torch.compile
#: raises it to 2000 while compiling; a library that raised it at import needs it later).
_KEPT: dict[str, Callable[[Any, Any], bool]] = {"recursion limit": lambda old, new: new > old}
# a timer that ran out (or that another thread armed or disarmed meanwhile) is the host's:
# only one armed where none was is a plugin's doing
_KEPT.update({f"{name} interval timer armed": lambda old, new: old or not new
              for name, _ in _TIMERS})
#: Class attributes that Python or pydantic set lazily, on first use: not a plugin's doing
#: (``isinstance`` against a Protocol creates ``__annotations__``, ``copy``/``pickle`` of an
#: instance ``__slotnames__``).
_LAZY = ("__pydantic", "_abc_", "__warningregistry__", "__abstractmethods__",
         "__annotations__", "__slotnames__")


def _own_env() -> dict[str, str]:
    """The host's own variables (``ATTNHUB_*``): the ones that steer every later call. Other
    variables are left alone: libraries a plugin imports set theirs legitimately (torch sets
    ``CUDA_MODULE_LOADING`` when CUDA starts), which must not read as the plugin's bug."""
    return {k: v for k, v in os.environ.items() if k.startswith("ATTNHUB_")}


def _namespaces() -> dict[str, Any]:
    """Every imported attnhub module and the classes it defines, by dotted name."""
    out: dict[str, Any] = {}
    for name, mod in list(sys.modules.items()):
        if not isinstance(mod, ModuleType) or not (name == "attnhub" or
                                                   name.startswith("attnhub.")):
            continue
        out[name] = mod
        for v in list(vars(mod).values()):
            if isinstance(v, type) and v.__module__ == name:
                out[f"{name}.{v.__qualname__}"] = v
    return out


def _watched(obj: Any, key: str, value: Any) -> bool:
    """What a monkeypatch replaces: a module's functions and classes (its other globals are
    state, such as a lazily made default hub), and a class's attributes."""
    if isinstance(obj, type):
        return not key.startswith(_LAZY)
    return inspect.isfunction(value) or inspect.isclass(value)


def _attnhub_attrs() -> dict[str, tuple[Any, dict[str, Any]]]:
    return {label: (obj, dict(vars(obj))) for label, obj in _namespaces().items()}


def _restore_attnhub(before: dict[str, tuple[Any, dict[str, Any]]]) -> list[str]:
    """Put attnhub's functions and class attributes back; the dotted names that changed."""
    changed: list[str] = []
    for label, (obj, old) in before.items():
        now = vars(obj)
        for key in [k for k, v in old.items() if _watched(obj, k, v) and now.get(k, _GONE)
                    is not v]:
            setattr(obj, key, old[key])
            changed.append(f"{label}.{key}")
        if isinstance(obj, type):
            for key in [k for k in now if k not in old and _watched(obj, k, now[k])]:
                delattr(obj, key)
                changed.append(f"{label}.{key}")
    return changed


def _dropped_modules(before: dict[str, Any]) -> list[str]:
    """Modules taken out of ``sys.modules`` (or set to None there: every later import of
    them fails); put back."""
    gone = [n for n, m in before.items() if m is not None and sys.modules.get(n) is None]
    for n in gone:
        sys.modules[n] = before[n]
    return gone


_GONE = object()


def _never(old: Any, new: Any) -> bool:
    return False


def _shown(v: Any) -> str:
    """``repr`` for a message, short, and never raising (a plugin's stream object may, with
    ``SystemExit`` too)."""
    try:
        text = repr(v)
    except BaseException as exc:
        _reraise_ctrl_c(exc)
        text = f"<{type(v).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def _reraise_ctrl_c(exc: BaseException) -> None:
    """Raise ``exc`` again when it is the user's Ctrl-C (a ``KeyboardInterrupt`` on the main
    thread); anything else a plugin's object raised is that plugin's, reported."""
    if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is \
            threading.main_thread():
        raise exc


class _Unreadable:
    """A setting whose getter raised (a plugin set ``logging.getLogger("attnhub").handlers =
    None``, and ``list(None)`` raised out of the registry's guard, crashing the host)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"<unreadable: {self.error}>"


def _read(get: Callable[[], Any]) -> Any:
    try:
        return get()
    except BaseException as exc:
        _reraise_ctrl_c(exc)
        return _Unreadable(type(exc).__name__)


def _differs(old: Any, new: Any) -> bool:
    """``new != old`` that cannot raise: a plugin's object in ``sys.stdout`` whose ``__eq__``
    raises (or answers with a tensor, whose truth is ambiguous) differs. A setting unreadable
    before and after is unchanged as far as anyone can tell (the host's own state: every
    plugin load and vetted call was blamed for it, with nothing to put back)."""
    if new is old or (isinstance(old, _Unreadable) and isinstance(new, _Unreadable)):
        return False
    try:
        return bool(new != old)
    except BaseException as exc:
        _reraise_ctrl_c(exc)
        return True
State = tuple[list[Any], dict[str, str], dict[str, Any], dict[str, Any], set[int],
              dict[str, tuple[Any, dict[str, Any]]]]


def snapshot() -> State:
    """The current values of :data:`SETTINGS`, the host's ``ATTNHUB_*`` variables, attnhub's
    functions and classes, ``sys.modules``, the running threads and torch's functions."""
    return ([_read(get) for _, get, _ in SETTINGS], _own_env(), _attnhub_attrs(),
            dict(sys.modules), {t.ident or 0 for t in threading.enumerate()}, _torch_attrs())


#: torch namespaces whose functions the core calls: a plugin that replaced
#: ``F.scaled_dot_product_attention`` at import made ``torch_sdpa`` return zeros.
_TORCH_NAMESPACES = {"torch": torch, "torch.nn.functional": torch.nn.functional,
                     "torch.Tensor": torch.Tensor}


def _torch_attrs() -> dict[str, tuple[Any, dict[str, Any]]]:
    return {label: (obj, {k: v for k, v in list(vars(obj).items()) if callable(v)})
            for label, obj in _TORCH_NAMESPACES.items()}


def _restore_torch(before: dict[str, tuple[Any, dict[str, Any]]]) -> list[str]:
    """Put torch's functions back: those replaced, and on ``torch.Tensor`` those added (they
    shadow the methods it inherits); a module's new names are torch's own lazy imports."""
    changed = []
    for label, (obj, old) in before.items():
        now = vars(obj)
        for key in [k for k, v in old.items() if now.get(k, _GONE) is not v]:
            setattr(obj, key, old[key])
            changed.append(f"{label}.{key}")
        if isinstance(obj, type):
            for key in [k for k, v in list(now.items()) if k not in old and callable(v)]:
                delattr(obj, key)
                changed.append(f"{label}.{key}")
    return changed


#: Non-daemon threads plugins left running while loading (``stray_threads``): the
#: ``attnhub`` process exits without waiting for them (``attnhub.cli.run``).
STRAY: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def stray_threads(before: State) -> list[str]:
    """Names of the threads started since ``before`` that still run and are not daemons:
    the interpreter waits for them at exit, so the host (``attnhub plugins``) never ends.
    They are kept in :data:`STRAY`."""
    stray = [t for t in threading.enumerate()
             if t.ident not in before[4] and not t.daemon and t.is_alive()]
    STRAY.update(stray)
    return [t.name for t in stray]


#: Settings torch keeps per thread: read in another thread than the snapshot's (a plugin's
#: import runs in a worker, ``bounded``) they show that thread's values, not the host's.
THREAD_LOCAL = frozenset({"torch grad mode", "torch inference mode", "torch autocast (cpu)",
                          "torch autocast (cuda)", "torch function mode stack depth",
                          "torch dispatch mode stack depth"})


def _put_back(settings: tuple[tuple[str, Callable[[], Any], Callable[[Any], None]], ...],
              values: list[Any], skip: frozenset[str] = frozenset()) -> list[str]:
    changed: list[str] = []
    for (what, get, put), old in zip(settings, values):
        if what in skip:
            continue
        new = _read(get)
        if _differs(old, new) and (isinstance(new, _Unreadable) or isinstance(old, _Unreadable)
                                   or not _KEPT.get(what, _never)(old, new)):
            try:
                if isinstance(old, _Unreadable):  # nothing known to go back to
                    raise LookupError
                put(old)
            except Exception as exc:  # e.g. the old working directory was deleted meanwhile
                what += f" (not put back: {type(exc).__name__})"
            changed.append(f"{what} {_shown(old)} -> {_shown(new)}")
    return changed


#: What a backend's ``forward()`` must leave as it found it: torch's numerics and kernel
#: switches (the slow lane checks them around each call it vets: a backend that set the
#: default dtype or turned grad mode off changed every later call of the host).
CALL_SETTINGS = tuple(s for s in SETTINGS if s[0].startswith(("torch", "SDPA")))


class _Flips:
    """attnhub's own flips of SDPA's kernel switches (process-wide, not per thread) around
    one call (:func:`flipping_sdpa_switches`): how many run now, and a count of starts and
    ends. A vetted call in another thread that saw one cannot tell its backend's changes
    from these, so its switches are neither compared nor put back (putting back would undo
    the flip while that other call runs)."""

    lock = threading.Lock()
    active = 0
    events = 0


@contextlib.contextmanager
def flipping_sdpa_switches() -> Iterator[None]:
    """Mark code that sets SDPA's kernel switches and puts them back (``sdpa_kernel``, or
    the switches set by hand) for the slow lane's settings check in other threads."""
    with _Flips.lock:
        _Flips.active += 1
        _Flips.events += 1
    try:
        yield
    finally:
        with _Flips.lock:
            _Flips.active -= 1
            _Flips.events += 1


_SDPA_SWITCHES = frozenset(s[0] for s in CALL_SETTINGS if s[0].startswith("SDPA"))


#: torch's process-wide switches that torch itself sets for a block and puts back (its
#: ``torch.backends.cudnn.flags(...)``, ``torch.backends.mkldnn.flags(...)``,
#: ``sdpa_kernel``, ``detect_anomaly``): another thread may hold one of those blocks while a
#: call runs. Every other setting (default dtype, matmul precision, thread count,
#: deterministic algorithms, reduced-precision reductions) has no such block in torch and is
#: put back and blamed whichever threads run: a Jupyter kernel always runs a few.
_SCOPED = frozenset({"torch.backends.cudnn.allow_tf32", "torch.backends.cudnn.enabled",
                     "torch.backends.cudnn.deterministic", "torch.backends.cudnn.benchmark",
                     "torch.backends.mkldnn.enabled", "torch anomaly detection",
                     *_SDPA_SWITCHES})


def others_running(mine: Iterable[int]) -> bool:
    """Whether a Python thread runs besides ``mine`` and attnhub's own workers (named
    ``attnhub-*``). While one does, a scoped switch (:data:`_SCOPED`) that changed may be
    its own block's, which no comparison can tell from a plugin's doing: those are neither
    blamed nor put back (that would undo the other thread's setting while it runs)."""
    mine = set(mine)
    return any(t.ident not in mine and not t.name.startswith("attnhub-")
               for t in threading.enumerate())


def call_snapshot() -> tuple[list[Any], tuple[int, int, bool]]:
    """The values of :data:`CALL_SETTINGS` (for :func:`call_restore`), where attnhub's own
    switch flips stood, and whether another thread ran (:func:`others_running`)."""
    return ([_read(get) for _, get, _ in CALL_SETTINGS],
            (_Flips.active, _Flips.events, others_running((threading.get_ident(),))))


def call_restore(snap: tuple[list[Any], tuple[int, int, bool]]) -> list[str]:
    """Put back what of :data:`CALL_SETTINGS` changed since :func:`call_snapshot`; a line
    per change. torch's scoped switches (:data:`_SCOPED`) are compared only while no other
    thread runs (:func:`others_running`). SDPA's switches are skipped as well when attnhub
    flipped them meanwhile (:class:`_Flips`); this thread's own flips end before it returns."""
    values, (active, events, others) = snap
    if others or others_running((threading.get_ident(),)):
        return _put_back(CALL_SETTINGS, values, _SCOPED)
    flipped = active > 0 or _Flips.active > 0 or _Flips.events != events
    return _put_back(CALL_SETTINGS, values, _SDPA_SWITCHES if flipped else frozenset())


def restore(before: State, other_thread: bool = False,
            mine: Iterable[int] = ()) -> list[str]:
    """Put back what changed since ``before``; one line per change (environment values are
    not shown: they may be secrets). ``other_thread``: ``before`` was taken in another
    thread, whose thread-local settings (:data:`THREAD_LOCAL`) are not this one's.
    torch's scoped switches (:data:`_SCOPED`) are left to the host while a thread runs
    besides this one, ``mine`` and attnhub's workers (:func:`others_running`)."""
    values, env, attrs, modules, _, torch_attrs = before
    skip = THREAD_LOCAL if other_thread else frozenset()
    if others_running({threading.get_ident(), *mine}):
        skip = skip | _SCOPED
    changed = _put_back(SETTINGS, values, skip)
    now = _own_env()
    keys = sorted(k for k in env.keys() | now.keys() if env.get(k) != now.get(k))
    for k in keys:
        if k in env:
            os.environ[k] = env[k]
        else:
            del os.environ[k]
    if keys:
        changed.append(f"environment variable(s) {', '.join(keys)}")
    gone = _dropped_modules(modules)
    if gone:
        changed.append(f"module(s) removed from sys.modules: {', '.join(gone[:5])}"
                       + (f" and {len(gone) - 5} more" if len(gone) > 5 else ""))
    patched = _restore_attnhub(attrs) + _restore_torch(torch_attrs)
    if patched:
        changed.append(f"attnhub or torch replaced (monkeypatched): {', '.join(patched[:5])}"
                       + (f" and {len(patched) - 5} more" if len(patched) > 5 else ""))
    return changed


class Watch:
    """The state before a plugin loads, put back each time its code returns to the host
    (:meth:`settle`); the changes seen accumulate in :attr:`changed`, each once."""

    def __init__(self) -> None:
        self.before = snapshot()
        self.thread = threading.get_ident()
        self.limit = self.before[0][_RECURSION]
        self.changed: list[str] = []

    def settle(self) -> None:
        """Put everything back. The recursion limit goes first, by C calls only: under a
        limit the plugin lowered below this thread's depth every Python call fails."""
        low = sys.getrecursionlimit()
        if low < self.limit:
            sys.setrecursionlimit(self.limit)
        lines = restore(self.before, threading.get_ident() != self.thread, (self.thread,))
        if low < self.limit:
            lines.insert(0, f"recursion limit {self.limit} -> {low}")
        self.changed += [line for line in lines if line not in self.changed]


_RECURSION = [what for what, _, _ in SETTINGS].index("recursion limit")
