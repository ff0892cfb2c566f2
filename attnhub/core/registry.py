"""Plugin discovery and the backend registry.

Plugins come from entry points in group ``attnhub.backends`` (how pip-installed plugins are
found) and from ``ATTNHUB_PLUGIN_MODULES`` (comma-separated module names, for source trees on
``PYTHONPATH`` without installed metadata). ``ATTNHUB_PLUGINS`` keeps only the plugins named
(``a,b``) or drops some (``-a,-b``). Each plugin is imported and asked to register in its own
guard: a plugin that raises anything (``SystemExit`` included; ``KeyboardInterrupt`` too
where it runs in the worker thread below, which Ctrl-C never reaches) is recorded and shown,
never fatal to the host. Its import and each of its hooks run in a worker
thread for at most ``ATTNHUB_PLUGIN_TIMEOUT`` seconds (default 60; 0: no limit): a plugin that
hangs is recorded as broken and left behind, and the host goes on. A plugin with no attnhub
hook, a misspelt hook name or a hook that returns a value is recorded too: it would
otherwise load "ok" and register nothing.

A backend name belongs to one provider. When two plugins register the same name neither gets
it (a plugin loaded first must not be able to take over another's name) unless the
deployment picks the provider with ``ATTNHUB_PROVIDERS=name=plugin,...``; a core name can be
taken by a plugin only that way.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import logging
import math
import os
import sys
import threading
import traceback
import types
import weakref
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

import pluggy

from .. import hookspecs
from ..errors import PluginError, UnknownBackendError
from . import process_state
from .backend import TIERS, Backend, plugin_fault
from .bounded import OwnInterrupt, Stalled, bounded, safe_str
from .capabilities import Capabilities
from .modsig import arity_error

log = logging.getLogger("attnhub")

ENTRY_POINT_GROUP = "attnhub.backends"
CORE_PLUGIN = "core"
PROVIDERS_ENV = "ATTNHUB_PROVIDERS"
TIMEOUT_ENV = "ATTNHUB_PLUGIN_TIMEOUT"
#: Seconds a plugin's import or one of its hooks may take (importing a CUDA kernel library
#: from a cold disk takes seconds, not minutes).
DEFAULT_TIMEOUT_S = 60.0
HOOKS = ("attnhub_register_backends", "attnhub_register_variants")


@dataclass
class PluginRecord:
    """What the host knows about one plugin: where it came from and what it gave or broke."""

    name: str
    module: str
    distribution: str | None = None
    version: str | None = None
    backends: list[str] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "module": self.module, "distribution": self.distribution,
                "version": self.version, "backends": self.backends, "variants": self.variants,
                "errors": self.errors}


@dataclass(frozen=True)
class Variant:
    """A named score/mask variant (FlexAttention-style callables) usable from YAML."""

    name: str
    score_mod: Callable[..., Any] | None
    mask_mod: Callable[..., Any] | None
    doc: str
    plugin: str


class Registry:
    """Backends and variants by name, with a record of every plugin's load."""

    def __init__(self, providers: dict[str, str] | None = None) -> None:
        self.pm = pluggy.PluginManager("attnhub")
        self.pm.add_hookspecs(hookspecs)
        self.backends: dict[str, Backend] = {}
        self.variants: dict[str, Variant] = {}
        #: id of a registered variant's callable -> its name: a call passing the callable
        #: itself is that variant to the policy (the registry keeps the callable alive; a
        #: callable registered under two names is the first one's, docs/plugins.md)
        self.variant_of: dict[int, str] = {}
        self.plugins: dict[str, PluginRecord] = {}
        #: Backend name -> the plugin the deployment picked to serve it (ATTNHUB_PROVIDERS).
        self.providers: dict[str, str] = dict(providers or {})
        #: Backend name -> every plugin that registered it, when two did and none was picked.
        self.conflicts: dict[str, list[str]] = {}
        #: Plugins whose import or hook ran past the timeout: their late calls are ignored.
        self._stalled: set[str] = set()
        self._lock = threading.RLock()
        #: Bumped after every change of what can be bound (``add_plugin``, a plugin loaded or
        #: taken back): decisions and runners made from this registry hold for one generation
        #: (the policy's cache keys on it, a hub compares it at bind time).
        self.generation = 0
        #: Bound methods (held weakly) called after each change: a hub drops its bindings
        #: then, so its hot path, which never reads the registry, never serves a stale one.
        self._listeners: list[weakref.WeakMethod[Callable[[Registry], None]]] = []

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def load(cls, *, allow: list[str] | None = None, modules: list[str] | None = None,
             entry_points: bool = True, deny: list[str] | None = None,
             providers: dict[str, str] | None = None) -> "Registry":
        """The core backends plus plugins from entry points and ``ATTNHUB_PLUGIN_MODULES``.

        ``allow``/``deny`` default to ``ATTNHUB_PLUGINS`` (comma-separated; unset means all,
        empty means only the core, ``-name`` entries deny that plugin and keep the rest).
        ``providers`` (default ``ATTNHUB_PROVIDERS``, ``backend=plugin,...``) picks who serves
        a backend name that more than one plugin registers.
        """
        named = None  # the plugin names ATTNHUB_PLUGINS lists, checked once all are found
        if allow is None and deny is None and "ATTNHUB_PLUGINS" in os.environ:
            allow, deny = parse_plugin_filter(os.environ["ATTNHUB_PLUGINS"])
            named = [*(allow or ()), *deny]
        if providers is None:
            providers = parse_providers(os.environ.get(PROVIDERS_ENV, ""))
        reg = cls(providers)
        timeout = plugin_timeout()
        from . import builtin

        core = reg.add_plugin(builtin, CORE_PLUGIN)
        core.distribution = "attnhub"
        core.version = _version("attnhub")
        denied = set(deny or ())
        if allow is not None:
            allow = [a for a in allow if a not in denied]
        if modules is None:
            env = os.environ.get("ATTNHUB_PLUGIN_MODULES", "")
            modules = [m.strip() for m in env.split(",") if m.strip()]
        seen_modules: set[str] = set()
        found = [CORE_PLUGIN]  # every plugin name on offer, loaded or filtered out
        if entry_points:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                found.append(ep.name)
                if (allow is not None and ep.name not in allow) or ep.name in denied:
                    continue
                dist = getattr(ep, "dist", None)
                seen_modules.add(ep.value.split(":")[0])
                reg._load_one(ep.name, ep.value, ep.load,
                              dist.name if dist else None, dist.version if dist else None,
                              timeout)
        for mod in modules:
            name = mod.rsplit(".", 1)[0].split(".")[0].removeprefix("attnhub_")
            found.append(name)
            if mod in seen_modules or (allow is not None and name not in allow) or name in denied:
                continue
            dist, version = _module_distribution(mod)
            reg._load_one(name, mod, lambda m=mod: importlib.import_module(m), dist, version,
                          timeout)
        if entry_points:  # otherwise plugins are added later (Registry.of) or left out
            core.errors += _shadowed_distributions()
            core.errors += _unknown_names("ATTNHUB_PLUGINS", named or [], found)
            core.errors += [reg._pick_problem(b) for b in providers
                            if b not in reg.backends and b not in reg.conflicts]
        return reg

    def _pick_problem(self, backend: str) -> str:
        """Why the deployment's provider pick for ``backend`` serves nothing."""
        pick = self.providers[backend]
        if pick not in self.plugins:
            hint = did_you_mean(pick, list(self.plugins))
            return (f"{PROVIDERS_ENV} picks plugin {pick!r} for backend {backend!r}, but no "
                    f"plugin of that name is loaded (loaded: {', '.join(self.plugins)}){hint}; "
                    f"no plugin serves {backend!r}")
        mine = self.plugins[pick].backends
        hint = did_you_mean(backend, mine)
        return (f"{PROVIDERS_ENV} picks plugin {pick!r} for backend {backend!r}, which that "
                f"plugin does not register (it registers: {', '.join(mine) or 'nothing'}){hint}")

    def _load_one(self, name: str, module: str, loader: Callable[[], Any],
                  dist: str | None, version: str | None,
                  timeout: float | None = None) -> PluginRecord:
        """Import one plugin and call its hooks; process-wide settings it changed on the way
        (torch's default dtype, kernel switches, logging, the environment) are put back and
        recorded against it."""
        watch, rec = process_state.Watch(), None
        try:
            rec = self._load_unguarded(name, module, loader, dist, version, timeout, watch)
            return rec
        finally:
            watch.settle()
            threads = process_state.stray_threads(watch.before)
            if watch.changed and rec is not None:
                rec.errors.append(
                    f"changed process-wide state while loading: {'; '.join(watch.changed)}; "
                    "put back (a plugin must not change the host's settings at import or "
                    "registration: set them inside forward(), or leave them to the deployment)")
            if threads and rec is not None:
                rec.errors.append(
                    f"started non-daemon thread(s) {', '.join(map(repr, threads))} while "
                    "loading, still running: the process cannot exit until they end (start "
                    "threads with daemon=True, and not at import)")
            self._changed()

    def _load_unguarded(self, name: str, module: str, loader: Callable[[], Any],
                        dist: str | None, version: str | None, timeout: float | None,
                        watch: process_state.Watch) -> PluginRecord:
        rec = PluginRecord(name=name, module=module, distribution=dist, version=version)
        if not self._claim(rec):
            return rec
        hung = _HUNG_IMPORTS.get(module)
        if hung is not None and hung.is_alive():  # it holds the module's import lock
            self._stall(rec, "its import (still running from an earlier load)")
            return rec
        # a module imported already, or being imported by this thread (a package that loads a
        # hub while it imports), has nothing left to hang on, and a worker would wait for this
        # thread's import lock: it loads here, unbounded
        bound = None if module.split(":")[0] in sys.modules else timeout
        try:
            obj = bounded(_settling(loader, watch), bound)
        except KeyboardInterrupt:
            raise
        except Stalled as exc:
            _HUNG_IMPORTS[module] = exc.args[0]
            self._stall(rec, "its import")
            return rec
        except BaseException as exc:  # SystemExit too: a plugin must not take the host down
            rec.errors.append(f"import failed: {_exc_text(exc)}")
            log.debug("plugin %s failed to import:\n%s", name, traceback.format_exc())
            return rec
        self._register_from(obj, rec, timeout, watch)
        return rec

    def _stall(self, rec: PluginRecord, what: str) -> None:
        """Skip a plugin that hung: what it registered before is taken back too."""
        with self._lock:
            self._stalled.add(rec.name)
            for name in rec.backends:
                if getattr(self.backends.get(name), "plugin", None) == rec.name:
                    del self.backends[name]
            for name in rec.variants:
                if self.variants[name].plugin == rec.name:
                    del self.variants[name]
            self.variant_of = {i: n for i, n in self.variant_of.items() if n in self.variants}
            rec.backends, rec.variants = [], []
            rec.errors.append(f"{what} did not finish within {plugin_timeout_text()}; the "
                              "plugin is skipped (fix the hang, or raise the limit with "
                              f"{TIMEOUT_ENV}=SECONDS)")

    @classmethod
    def of(cls, *backends: Backend, plugin: str = "local") -> Registry:
        """The core's built-in backends plus these backend objects, as one plugin named
        ``plugin``, and no installed plugin (no entry points): tests, notebooks, embedding."""

        class _Local:
            @hookspecs.hookimpl
            def attnhub_register_backends(self, register: Any) -> None:
                for b in backends:
                    register(b)

        reg = cls.load(entry_points=False, modules=[])
        reg.add_plugin(_Local(), plugin)
        return reg

    def add_plugin(self, obj: ModuleType | object, name: str) -> PluginRecord:
        """Register an already-imported plugin object (tests, notebooks, the core itself).
        Hubs already binding from this registry drop their decisions and runners (see
        :meth:`on_change`): a backend added (or replaced) now binds on their next call."""
        rec = PluginRecord(name=name, module=_object_name(obj))
        try:
            if self._claim(rec):
                self._register_from(obj, rec)
        finally:  # a Ctrl-C halfway still leaves what was registered, which binds
            self._changed()
        return rec

    def _claim(self, rec: PluginRecord) -> bool:
        """Record ``rec`` under its name, or, when a plugin of that name is loaded already,
        under a name of its own with why it is skipped: a second ``add_plugin(obj, "x")``
        (or ``"core"``) replaced the first's record, which then listed no backends while
        they still served, and a later provider pick failed to find them in it."""
        if rec.name not in self.plugins:
            self.plugins[rec.name] = rec
            return True
        rec.errors.append(f"plugin name {rec.name!r} already loaded from "
                          f"{self.plugins[rec.name].module}; skipped (give the plugin another "
                          "name, or load it once)")
        key, n = f"{rec.name}#{rec.module}", 1
        while key in self.plugins:  # the same module again: each attempt keeps its record
            n += 1
            key = f"{rec.name}#{rec.module}#{n}"
        self.plugins[key] = rec
        return False

    def on_change(self, callback: Callable[[Registry], None]) -> None:
        """Call ``callback(registry)`` after each change (a bound method, held weakly: a hub
        that is gone is not kept alive by its registry). Registering it again is a no-op."""
        ref = weakref.WeakMethod(callback)
        with self._lock:
            self._listeners = [r for r in self._listeners if r() is not None]
            if ref not in self._listeners:
                self._listeners.append(ref)

    def _changed(self) -> None:
        """A new generation; listeners are told outside the lock (a hub takes its own).
        Every listener is told, even after one raised (a caller's callback, a Ctrl-C in
        one): a hub not told would serve its stale bindings on its hot path; the first
        exception is raised once all were told."""
        with self._lock:
            self.generation += 1
            live = [f for f in (r() for r in self._listeners) if f is not None]
        first: BaseException | None = None
        for f in live:
            try:
                f(self)
            except BaseException as exc:  # noqa: BLE001 - raised below, after the others
                if first is None:
                    first = exc
        if first is not None:
            raise first

    def _register_from(self, obj: object, rec: PluginRecord, timeout: float | None = None,
                       watch: process_state.Watch | None = None) -> None:
        other = next((n for n, p in self.pm.list_name_plugin()
                      if getattr(p, "source", None) is obj), None)
        if other is not None:  # pluggy's refusal printed its whole table of plugins
            rec.errors.append(f"this plugin object is already loaded as plugin {other!r}; "
                              "skipped (load it once)")
            return
        try:  # pluggy reads every attribute: in a bounded worker, never on this thread
            hooks = bounded(_settling(lambda: self._hook_set(obj), watch), timeout)
            self.pm.register(hooks, name=rec.name)
        except KeyboardInterrupt:
            raise
        except Stalled:
            self._stall(rec, "reading its hooks (an attribute that hangs)")
            return
        except BaseException as exc:  # pluggy's reason spans lines (which arguments differ)
            rec.errors.append(f"invalid plugin: {_exc_text(exc, lines=4)}")
            return
        if not self._hooks_known(hooks, obj, rec):
            return
        for hook, adder in ((self.pm.hook.attnhub_register_backends, self._backend_adder),
                            (self.pm.hook.attnhub_register_variants, self._variant_adder)):
            for impl in hook.get_hookimpls():
                if impl.plugin_name == rec.name:
                    gate = _Gate(impl.function.__name__)
                    try:
                        self._call(rec, impl.function, adder(rec, gate, watch), timeout, watch)
                    finally:
                        with self._lock:
                            gate.open = False

    def _hook_set(self, obj: object) -> _HookSet:
        """``obj``'s hook implementations as pluggy would find them (its own test, each
        attribute read once), on an object of their own: registering that, pluggy runs none
        of the plugin's code (a property or module ``__getattr__`` that hangs would hang the
        host's thread there, outside every time limit)."""
        hooks = _HookSet(obj)
        for name in dir(obj):
            if self.pm.parse_hookimpl_opts(obj, name) is not None:
                setattr(hooks, name, getattr(obj, name))
        return hooks

    def _hooks_known(self, hooks: _HookSet, obj: object, rec: PluginRecord) -> bool:
        """False, with the reason recorded, when ``obj`` implements no attnhub hook: a
        misspelt hook name or a missing ``@hookimpl`` would register nothing, silently."""
        callers = self.pm.get_hookcallers(hooks) or []
        for hc in callers:
            if hc.spec is None:
                rec.errors.append(f"hook {hc.name!r} is not an attnhub hook and is never called"
                                  f"; expected one of: {', '.join(HOOKS)}"
                                  + did_you_mean(hc.name, list(HOOKS)))
        if any(hc.spec is not None for hc in callers):
            return True
        if callers:  # only misspelt hooks, each reported above
            return False
        bare = [h for h in HOOKS if callable(_unwrapped(_static(obj, h)))]
        rec.errors.append(
            f"{', '.join(bare)} not decorated with @attnhub.plugin.hookimpl, so never called"
            if bare else "implements no attnhub hook, so it registers nothing; expected "
                         "@hookimpl def attnhub_register_backends(register) (docs/plugins.md)")
        return False

    def _call(self, rec: PluginRecord, hook: Callable[..., Any], register: Callable[..., None],
              timeout: float | None, watch: process_state.Watch | None) -> None:
        if rec.name in self._stalled:
            return
        try:
            got = bounded(_settling(lambda: hook(register=register), watch), timeout)
        except KeyboardInterrupt:
            raise
        except Stalled:
            self._stall(rec, f"hook {hook.__name__}")
            return
        except BaseException as exc:
            rec.errors.append(f"registration raised {_exc_text(exc)}")
            return
        if got is not None:
            rec.errors.append(f"hook {hook.__name__} returned {type(got).__name__}, which is "
                              "ignored: a hook returns nothing and calls register(...) once per "
                              "backend or variant")

    def _backend_adder(self, rec: PluginRecord, gate: _Gate,
                       watch: process_state.Watch | None) -> Callable[[Any], None]:
        def register(backend: Any) -> None:
            if watch is not None:
                watch.settle()
            with self._lock:
                if rec.name in self._stalled or not gate.admits(rec, type(backend).__name__):
                    return
                try:  # one broken backend must not cost the plugin its other registrations
                    add(backend)
                except BaseException as exc:  # SystemExit from a property too
                    if not plugin_fault(exc):  # the user's Ctrl-C
                        raise
                    rec.errors.append(f"registering {type(backend).__name__} raised "
                                      f"{_exc_text(exc)}")

        def add(backend: Any) -> None:
            problem = _invalid_backend(backend) or self._same_object(backend) or \
                self._name_problem(backend.name, rec)
            if problem:
                rec.errors.append(problem)
                return
            backend.plugin = rec.name
            kept = _stored(backend, "plugin")  # a plain str's ==, not the plugin's own code
            if type(kept) is not str or kept != rec.name:
                rec.errors.append(
                    f"backend {backend.name!r}: its `plugin` attribute cannot be set (a "
                    f"property or descriptor of {type(backend).__name__}); the registry "
                    "sets it to the plugin that registered the backend: remove it")
                return
            self.backends[backend.name] = backend
            rec.backends.append(backend.name)

        return register

    def _same_object(self, backend: Backend) -> str | None:
        """Why ``backend`` cannot be registered again: one object served two names (its
        name changed between two ``register`` calls), and ``get(first)`` returned a backend
        named otherwise. Under the name it serves, another plugin's (the core's) instance
        is refused by :meth:`_name_problem` as a new instance would be: a conflict, so load
        order does not decide who serves a name two plugins register."""
        was = next((n for n, b in self.backends.items() if b is backend), None)
        if was is None or was == backend.name:  # the same name: a conflict, or this plugin's
            return None  # second registration (:meth:`_name_problem`), as for two instances
        return (f"backend {type(backend).__name__} (name {backend.name!r}): this object is "
                f"already registered as {was!r} by plugin {backend.plugin!r}; register a new "
                "instance for each backend name")

    def _name_problem(self, name: str, rec: PluginRecord) -> str | None:
        """Why ``rec`` may not serve backend ``name`` (None: it may). A name claimed twice
        without a pick is taken from both, so load order never decides who serves it."""
        pick = self.providers.get(name)
        if pick is not None and pick != rec.name:
            return (f"backend name {name!r} is not registered from {rec.name!r}: the deployment "
                    f"picks plugin {pick!r} for it ({PROVIDERS_ENV})")
        other = self.backends.get(name)
        holders = self.conflicts.get(name) or [getattr(other, "plugin", None)]
        if rec.name in holders:  # before the pick: it picks a plugin, not one of its objects
            # (the second replaced the first, and the record blamed the deployment)
            return f"backend name {name!r} is registered twice by this plugin"
        if name in self.conflicts:
            self.conflicts[name].append(rec.name)
            return self._conflict_text(name)
        if other is None or pick == rec.name:
            if other is not None:  # the deployment's pick replaces an earlier registration
                self.plugins[other.plugin].backends.remove(name)
                self.plugins[other.plugin].errors.append(
                    f"backend name {name!r} is served by plugin {rec.name!r}: the deployment "
                    f"picks it ({PROVIDERS_ENV})")
            return None
        if other.plugin == CORE_PLUGIN:
            return (f"backend name {name!r} is already registered by 'core' (attnhub's own); "
                    f"rename the backend, or set {PROVIDERS_ENV}={name}={rec.name} to replace it")
        del self.backends[name]
        self.plugins[other.plugin].backends.remove(name)
        self.conflicts[name] = [other.plugin, rec.name]
        self.plugins[other.plugin].errors.append(self._conflict_text(name))
        return self._conflict_text(name)

    def _conflict_text(self, name: str) -> str:
        who = ", ".join(f"{p!r} ({self.provider_text(p)})" for p in self.conflicts[name])
        return (f"backend name {name!r} is registered by more than one plugin: {who}; neither "
                f"serves it. Pick one with {PROVIDERS_ENV}={name}=<plugin>, or remove the "
                "other plugin (ATTNHUB_PLUGINS=-<plugin>)")

    def _variant_adder(self, rec: PluginRecord, gate: _Gate,
                       watch: process_state.Watch | None) -> Callable[..., None]:
        def register(name: str, score_mod: Callable[..., Any] | None = None,
                     mask_mod: Callable[..., Any] | None = None, doc: str = "") -> None:
            if watch is not None:
                watch.settle()
            with self._lock:
                if rec.name in self._stalled or not gate.admits(rec, f"variant {_short(name)}"):
                    return
                try:  # as for backends: one bad variant (a doc whose str() raises, a
                    # signature that cannot be read) cost the plugin every later registration
                    add(name, score_mod, mask_mod, doc)
                except BaseException as exc:
                    if not plugin_fault(exc):  # the user's Ctrl-C
                        raise
                    rec.errors.append(f"registering variant {_short(name)} raised "
                                      f"{_exc_text(exc)}")

        def add(name: Any, score_mod: Any, mask_mod: Any, doc: Any) -> None:
            if not _nameable(name):
                what = "an identifier" if not isinstance(name, str) or not name.isidentifier() \
                    else f"a plain str (got a {type(name).__name__})" if type(name) is not str \
                    else f"an ASCII identifier of at most {MAX_NAME} characters"
                rec.errors.append(f"variant name {_short(name)} is not {what} (a rule names it "
                                  "in `when.variant`, a call in score_mod=/mask_mod=)")
                return
            bad = [(k, f) for k, f in (("score_mod", score_mod), ("mask_mod", mask_mod))
                   if f is not None and not callable(f)]
            if bad:
                rec.errors.append(f"variant {name!r}: {bad[0][0]} is a "
                                  f"{type(bad[0][1]).__name__}, expected a callable "
                                  "(FlexAttention style) or None")
                return
            if name in self.variants:
                rec.errors.append(f"variant name {name!r} is already registered by "
                                  f"{self.variants[name].plugin!r}")
                return
            if score_mod is None and mask_mod is None:
                rec.errors.append(f"variant {name!r} has neither score_mod nor mask_mod")
                return
            why = arity_error("score_mod", score_mod, name) or \
                arity_error("mask_mod", mask_mod, name)
            if why:  # refused here, not at every call that names it
                rec.errors.append(why)
                return
            self.variants[name] = Variant(name, score_mod, mask_mod, str(doc), rec.name)
            for fn in (score_mod, mask_mod):
                if fn is not None:
                    self.variant_of.setdefault(id(fn), name)
            rec.variants.append(name)

        return register

    # -- lookup -----------------------------------------------------------------------------
    def get(self, name: str) -> Backend:
        try:
            return self.backends[name]
        except KeyError:
            raise UnknownBackendError(name, list(self.backends)) from None

    def variant(self, name: str) -> Variant:
        try:
            return self.variants[name]
        except KeyError:
            raise UnknownBackendError(f"variant:{name}", list(self.variants)) from None

    def names(self) -> list[str]:
        return list(self.backends)

    def provider(self, backend: str) -> dict[str, str | None] | None:
        """Who serves ``backend``: plugin, distribution and version (None if nobody)."""
        b = self.backends.get(backend)
        if b is None:
            return None
        rec = self.plugins.get(b.plugin)
        return {"plugin": b.plugin, "distribution": rec.distribution if rec else None,
                "version": rec.version if rec else None}

    def provider_text(self, plugin: str) -> str:
        rec = self.plugins.get(plugin)
        if rec is None or rec.distribution is None:
            return f"module {rec.module}" if rec else "?"
        return f"{rec.distribution} {rec.version or '?'}"

    def missing_reason(self, name: str) -> str:
        """Why no backend ``name`` is registered, for decision records."""
        if name in self.conflicts:
            return self._conflict_text(name)
        if name in self.providers:
            return self._pick_problem(name)
        return (f"unknown backend (no installed plugin registers it); known: "
                f"{', '.join(sorted(self.backends))}{did_you_mean(name, list(self.backends))}")

    def errors(self) -> list[tuple[str, str]]:
        return [(r.name, e) for r in self.plugins.values() for e in r.errors]


class _HookSet:
    """What pluggy registers for a plugin (``Registry._hook_set``): its hook functions as
    attributes, and the plugin object itself as ``source``."""

    def __init__(self, source: object) -> None:
        self.source = source


class _Gate:
    """Open while the hook that was handed a ``register`` callback runs. A plugin that keeps
    the callback and calls it later (from a thread, or on first use) would change the
    registry after the host planned, explained or locked with it: refused and recorded."""

    __slots__ = ("hook", "open")

    def __init__(self, hook: str) -> None:
        self.hook, self.open = hook, True

    def admits(self, rec: PluginRecord, what: str) -> bool:
        if self.open:
            return True
        msg = (f"register({what}) was called after hook {self.hook} returned (the callback "
               "was kept and called later); ignored: call register(...) inside the hook")
        if msg not in rec.errors:
            rec.errors.append(msg)
        return False


#: Module -> the worker still importing it past the timeout: a later load in this process
#: would wait on the module's import lock, so it is skipped at once while that runs.
_HUNG_IMPORTS: dict[str, threading.Thread] = {}


def _settling(fn: Callable[[], Any], watch: process_state.Watch | None) -> Callable[[], Any]:
    """``fn`` (a plugin's import or hook), with what it changed process-wide put back as it
    returns, in its own thread: before the host's code runs on under it."""
    if watch is None:
        return fn

    def run() -> Any:
        try:
            return fn()
        finally:
            watch.settle()
    return run


def plugin_timeout() -> float | None:
    """``ATTNHUB_PLUGIN_TIMEOUT`` in seconds (None: no limit)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0:
        raise PluginError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds, expected one >= 0 "
                          "(0 or inf: no limit)")
    # past threading.TIMEOUT_MAX a wait raises OverflowError (a healthy plugin recorded as
    # broken): as good as no limit
    return value if 0 < value < threading.TIMEOUT_MAX else None


def plugin_timeout_text() -> str:
    t = plugin_timeout()
    return f"{t:g} s ({TIMEOUT_ENV})" if t is not None else "the limit"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_plugin_filter(text: str) -> tuple[list[str] | None, list[str]]:
    """``ATTNHUB_PLUGINS``: ``"a,b"`` -> allow a and b; ``"-c"`` -> all but c; ``""`` ->
    only the core. Returns (allow or None for all, deny)."""
    items = [a.strip() for a in text.split(",") if a.strip()]
    deny = [a[1:].strip() for a in items if a.startswith("-")]
    allow = [a for a in items if not a.startswith("-")]
    return (allow if allow or not deny else None), deny


def parse_providers(text: str) -> dict[str, str]:
    """``ATTNHUB_PROVIDERS="flex=triton_portable,fa2=sm80_fa2"`` -> {backend: plugin}."""
    out: dict[str, str] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, plugin = item.partition("=")
        if not sep or not name.strip() or not plugin.strip():
            raise PluginError(f"{PROVIDERS_ENV}: {item!r} is not backend=plugin (e.g. "
                              "flex=triton_portable)")
        name, plugin = name.strip(), plugin.strip()
        if out.setdefault(name, plugin) != plugin:
            raise PluginError(f"{PROVIDERS_ENV}: backend {name!r} is given two providers "
                              f"({out[name]!r} and {plugin!r}), expected one pick per backend")
    return out


def did_you_mean(name: str, names: list[str]) -> str:
    """`` (did you mean 'x'?)``, or "". Names are case-sensitive, and difflib alone missed
    ``Torch_SDPA`` for ``torch_sdpa`` (half its letters differ in case)."""
    folded = {n.casefold(): n for n in names}
    hint = [folded[name.casefold()]] if name.casefold() in folded else [
        folded[h] for h in difflib.get_close_matches(name.casefold(), list(folded), n=1)]
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def _shadowed_distributions() -> list[str]:
    """A line for each plugin distribution installed more than once on ``sys.path`` in
    copies that differ (version or entry points): ``importlib.metadata`` serves only the
    first copy, so the other was skipped without a word (an upgrade that never loads)."""
    copies: dict[str, list[tuple[str, str, str]]] = {}
    for dist in importlib.metadata.distributions():
        try:
            eps = sorted(f"{ep.name}={ep.value}" for ep in dist.entry_points
                         if ep.group == ENTRY_POINT_GROUP)
            if eps:
                name = dist.metadata["Name"] or "?"
                key = name.lower().replace("_", "-").replace(".", "-")
                copies.setdefault(key, []).append((dist.version or "?", ", ".join(eps),
                                                   str(dist.locate_file(""))))
        except Exception:  # one broken metadata folder must not hide the others
            continue
    return [f"plugin distribution {name!r} is installed {len(found)} times: "
            + "; ".join(f"{v} ({eps}) in {where}" for v, eps, where in found)
            + "; only the first on sys.path is loaded, expected one copy (uninstall or "
              "remove the others from the path)"
            for name, found in copies.items() if len({c[:2] for c in found}) > 1]


def _unknown_names(env: str, named: list[str], found: list[str]) -> list[str]:
    """A line for each plugin ``env`` names that is not on offer: a misspelt allow entry
    would load nothing of it, a misspelt deny entry would load it anyway."""
    return [f"{env} names plugin {n!r}, which is not installed (installed: "
            f"{', '.join(sorted(set(found)))}){did_you_mean(n, found)}"
            for n in dict.fromkeys(named) if n not in found]


def _exc_text(exc: BaseException, lines: int = 1) -> str:
    kind = "KeyboardInterrupt" if isinstance(exc, OwnInterrupt) else type(exc).__name__
    text = safe_str(exc)
    if not text:
        return kind
    return "; ".join(f"{kind}: {text}".splitlines()[:lines])[:300 * lines]


def _module_distribution(module: str) -> tuple[str | None, str | None]:
    """The installed distribution that ships top-level ``module`` (editable installs
    included), so plugins named by module still record a provider and version."""
    top = module.split(".")[0]
    try:
        dists = importlib.metadata.packages_distributions().get(top) or []
    except Exception:  # broken metadata of some other package
        return None, None
    return (dists[0], _version(dists[0])) if dists else (None, None)


#: The longest backend or variant name: what a policy may write (``policy.schema``).
MAX_NAME = 128


def _nameable(name: Any) -> bool:
    """A name a policy can write: ASCII (a Cyrillic 'а' in "triton" lists like the real one
    and no policy could name it) and short (a megabyte name filled every listing)."""
    return (type(name) is str and name.isascii() and name.isidentifier()
            and len(name) <= MAX_NAME)


def _short(v: Any) -> str:
    """``repr(v)`` cut to one short line; one that raises (a plugin's object) is its type."""
    try:
        text = repr(v)
    except BaseException as exc:
        if not plugin_fault(exc):  # the user's Ctrl-C
            raise
        text = f"<{type(v).__name__}: repr() raised {type(exc).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _static(obj: object, attr: str) -> Any:
    """``obj.attr`` found without running the plugin's code (None if absent): a module's
    ``__getattr__`` or an object's property that raised (``SystemExit`` too) or hung went up
    through the registry's guard and took the host down."""
    try:
        return inspect.getattr_static(obj, attr, None)
    except Exception:  # a metaclass or __dict__ that cannot be searched
        return None


def _unwrapped(v: Any) -> Any:
    """The function a ``staticmethod``/``classmethod`` found by :func:`_static` wraps (a
    ``classmethod`` object is not callable itself)."""
    return v.__func__ if isinstance(v, (staticmethod, classmethod)) else v


def _stored(obj: object, attr: str) -> Any:
    """The value ``obj`` stores for ``attr`` (its ``__dict__``, or a ``__slots__`` entry),
    read without running its code; a property or other descriptor is returned itself."""
    v = inspect.getattr_static(obj, attr, None)
    if type(v) is types.MemberDescriptorType:  # a slot: read by the interpreter's own getter
        try:
            return v.__get__(obj, type(obj))
        except AttributeError:  # an empty slot
            return None
    return v


def _object_name(obj: object) -> str:
    """What a plugin object is known by in its record: a module's or class's name, else its
    type's (read without running its code, as :func:`_static`)."""
    name = _static(obj, "__name__") if isinstance(obj, ModuleType) else \
        obj.__name__ if isinstance(obj, type) else None
    return name if isinstance(name, str) else type(obj).__name__


def _invalid_backend(obj: Any) -> str | None:
    if isinstance(obj, type) and issubclass(obj, Backend):
        return (f"registered the class {obj.__name__}, expected an instance: "
                f"register({obj.__name__}())")
    if not isinstance(obj, Backend):
        return f"registered {type(obj).__name__!r}, which is not an attnhub Backend subclass"
    try:
        name = getattr(obj, "name", None)
        static = inspect.getattr_static(obj, "name", None)
    except BaseException as exc:  # SystemExit, GeneratorExit from a property: the plugin's
        if not plugin_fault(exc):  # the user's Ctrl-C
            raise
        return f"backend {type(obj).__name__}: reading its name raised {_exc_text(exc)}"
    if name is not static and not isinstance(static, types.MemberDescriptorType):
        # a property: another value each read (the policy's name, later); a slot holds one
        return (f"backend {type(obj).__name__} computes its name ({type(static).__name__}); "
                "a backend is known by one name: set name = '...' as a class or instance "
                "attribute")
    if not _nameable(name):
        sub = f", a {type(name).__name__}: a str subclass's own ==/hash would decide every " \
            "lookup" if isinstance(name, str) and type(name) is not str else ""
        return (f"backend {type(obj).__name__} has an invalid name {_short(name)}{sub} (use a "
                f"plain str, an ASCII identifier of at most {MAX_NAME} characters: a policy "
                "names it)")
    try:
        tier = obj.tier
        ok = isinstance(tier, str) and tier in TIERS
    except BaseException as exc:
        if not plugin_fault(exc):  # the user's Ctrl-C
            raise
        return f"backend {name!r}: reading its tier raised {_exc_text(exc)}"
    if not ok:
        return f"backend {name!r} has unknown tier {tier!r} (use one of {', '.join(TIERS)})"
    try:
        caps = obj.capabilities
    except BaseException as exc:
        if not plugin_fault(exc):  # the user's Ctrl-C
            raise
        return f"backend {name!r}: reading its capabilities raised {_exc_text(exc)}"
    if not isinstance(caps, Capabilities):
        return (f"backend {name!r} declares capabilities as {type(caps).__name__}, expected an "
                "attnhub.plugin.Capabilities instance (see docs/plugins.md)")
    return None
