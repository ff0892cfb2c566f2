"""Plugin discovery and the backend registry.

Plugins come from entry points in group ``attnhub.backends`` (how pip-installed plugins are
found) and from ``ATTNHUB_PLUGIN_MODULES`` (comma-separated module names, for source trees on
``PYTHONPATH`` without installed metadata). Each plugin is imported and asked to register in
its own try/except: a broken plugin is recorded and shown, never fatal to the host.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import traceback
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

import pluggy

from .. import hookspecs
from ..errors import UnknownBackendError
from .backend import TIERS, Backend

log = logging.getLogger("attnhub")

ENTRY_POINT_GROUP = "attnhub.backends"
CORE_PLUGIN = "core"


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

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("attnhub")
        self.pm.add_hookspecs(hookspecs)
        self.backends: dict[str, Backend] = {}
        self.variants: dict[str, Variant] = {}
        self.plugins: dict[str, PluginRecord] = {}

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def load(cls, *, allow: list[str] | None = None, modules: list[str] | None = None,
             entry_points: bool = True) -> "Registry":
        """The core backends plus plugins from entry points and ``ATTNHUB_PLUGIN_MODULES``.

        ``allow`` (default: ``ATTNHUB_PLUGINS``, comma-separated; unset means all, empty means
        only the core) keeps only the plugins named.
        """
        reg = cls()
        from . import builtin

        core = reg.add_plugin(builtin, CORE_PLUGIN)
        core.distribution = "attnhub"
        core.version = _version("attnhub")
        if allow is None and "ATTNHUB_PLUGINS" in os.environ:
            allow = [a.strip() for a in os.environ["ATTNHUB_PLUGINS"].split(",") if a.strip()]
        if modules is None:
            env = os.environ.get("ATTNHUB_PLUGIN_MODULES", "")
            modules = [m.strip() for m in env.split(",") if m.strip()]
        seen_modules: set[str] = set()
        if entry_points:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if allow is not None and ep.name not in allow:
                    continue
                dist = getattr(ep, "dist", None)
                seen_modules.add(ep.value.split(":")[0])
                reg._load_one(ep.name, ep.value, ep.load,
                              dist.name if dist else None, dist.version if dist else None)
        for mod in modules:
            name = mod.rsplit(".", 1)[0].split(".")[0].removeprefix("attnhub_")
            if mod in seen_modules or (allow is not None and name not in allow):
                continue
            reg._load_one(name, mod, lambda m=mod: importlib.import_module(m), None, None)
        return reg

    def _load_one(self, name: str, module: str, loader: Callable[[], Any],
                  dist: str | None, version: str | None) -> PluginRecord:
        rec = PluginRecord(name=name, module=module, distribution=dist, version=version)
        if name in self.plugins:
            rec.errors.append(f"plugin name {name!r} already loaded from "
                              f"{self.plugins[name].module}; skipped")
            self.plugins[f"{name}#{module}"] = rec
            return rec
        self.plugins[name] = rec
        try:
            obj = loader()
        except Exception as exc:  # a broken plugin must not take the host down
            rec.errors.append(f"import failed: {type(exc).__name__}: {exc}")
            log.debug("plugin %s failed to import:\n%s", name, traceback.format_exc())
            return rec
        self._register_from(obj, rec)
        return rec

    def add_plugin(self, obj: ModuleType | object, name: str) -> PluginRecord:
        """Register an already-imported plugin object (tests, notebooks, the core itself)."""
        rec = PluginRecord(name=name, module=getattr(obj, "__name__", type(obj).__name__))
        self.plugins[name] = rec
        self._register_from(obj, rec)
        return rec

    def _register_from(self, obj: object, rec: PluginRecord) -> None:
        try:
            self.pm.register(obj, name=rec.name)
        except Exception as exc:
            rec.errors.append(f"invalid plugin: {type(exc).__name__}: {exc}")
            return
        for impl in self.pm.hook.attnhub_register_backends.get_hookimpls():
            if impl.plugin_name == rec.name:
                self._call(rec, lambda: impl.function(register=self._backend_adder(rec)))
        for impl in self.pm.hook.attnhub_register_variants.get_hookimpls():
            if impl.plugin_name == rec.name:
                self._call(rec, lambda: impl.function(register=self._variant_adder(rec)))

    @staticmethod
    def _call(rec: PluginRecord, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            rec.errors.append(f"registration raised {type(exc).__name__}: {exc}")

    def _backend_adder(self, rec: PluginRecord) -> Callable[[Any], None]:
        def register(backend: Any) -> None:
            problem = _invalid_backend(backend)
            if problem is None and backend.name in self.backends:
                other = self.backends[backend.name].plugin
                problem = f"backend name {backend.name!r} is already registered by {other!r}"
            if problem:
                rec.errors.append(problem)
                return
            backend.plugin = rec.name
            self.backends[backend.name] = backend
            rec.backends.append(backend.name)

        return register

    def _variant_adder(self, rec: PluginRecord) -> Callable[..., None]:
        def register(name: str, score_mod: Callable[..., Any] | None = None,
                     mask_mod: Callable[..., Any] | None = None, doc: str = "") -> None:
            if name in self.variants:
                rec.errors.append(f"variant name {name!r} is already registered by "
                                  f"{self.variants[name].plugin!r}")
                return
            if score_mod is None and mask_mod is None:
                rec.errors.append(f"variant {name!r} has neither score_mod nor mask_mod")
                return
            self.variants[name] = Variant(name, score_mod, mask_mod, doc, rec.name)
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

    def errors(self) -> list[tuple[str, str]]:
        return [(r.name, e) for r in self.plugins.values() for e in r.errors]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _invalid_backend(obj: Any) -> str | None:
    if not isinstance(obj, Backend):
        return f"registered {type(obj).__name__!r}, which is not an attnhub Backend subclass"
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        return f"backend {type(obj).__name__} has an invalid name {name!r} (use an identifier)"
    if obj.tier not in TIERS:
        return f"backend {name!r} has unknown tier {obj.tier!r} (use one of {', '.join(TIERS)})"
    return None
