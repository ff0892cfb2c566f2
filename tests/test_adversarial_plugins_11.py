"""Plugins, eleventh round: the registry ran a plugin's own code outside its guard. A module
``__getattr__`` (or an object's) that raised while the registry looked for hooks, a setting a
plugin left unreadable (``logging.getLogger("attnhub").handlers = None``), a replaced stream
whose ``__eq__`` or ``__repr__`` raised: each went up through ``Registry.load`` and took the
host down. One backend object registered under two names, a backend name that is a ``str``
subclass (its own ``==``/hash decided lookups) and a ``plugin`` property that ignores the
registry's assignment (a backend claiming to be the core's) were accepted silently."""

from __future__ import annotations

import logging
import sys
import types
from typing import Any, Callable

import pytest

from attnhub.core.registry import Registry
from attnhub.hookspecs import hookimpl
from attnhub.plugin import Backend, Capabilities


@pytest.fixture(autouse=True)
def _core_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNHUB_PLUGINS", "")
    monkeypatch.delenv("ATTNHUB_PROVIDERS", raising=False)


class _Mine(Backend):
    name = "mine_one"
    capabilities = Capabilities()

    def forward(self, *args: Any) -> Any:  # pragma: no cover - never called
        raise NotImplementedError


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    vars(mod).update(attrs)
    return mod


def _raise(exc: BaseException) -> Callable[..., Any]:
    def f(*args: Any) -> Any:
        raise exc
    return f


class _AttrBomb:
    """A plugin object whose every missing attribute raises (``__name__`` included)."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"no {name}")


@pytest.mark.parametrize("plugin", [
    _module("bomb_mod", __getattr__=_raise(SystemExit("getattr"))),
    _module("bomb_mod", __getattr__=_raise(RuntimeError("getattr"))),
    _AttrBomb(),
], ids=["module-systemexit", "module-runtimeerror", "object"])
def test_a_plugin_attribute_that_raises_is_recorded_not_fatal(plugin: object) -> None:
    reg = Registry.load(entry_points=False, modules=[])
    rec = reg.add_plugin(plugin, "bomb")
    assert rec.errors and "registers nothing" in rec.errors[0], rec.errors
    assert rec.module in ("bomb_mod", "_AttrBomb")
    assert "torch_sdpa" in reg.backends  # the core is untouched


class _Stream:
    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass


class _EqRaises(_Stream):
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing me")

    __hash__ = object.__hash__


class _ReprExits(_Stream):
    def __repr__(self) -> str:
        raise SystemExit("no repr")


def _unreadable_handlers() -> None:
    logging.getLogger("attnhub").handlers = None  # type: ignore[assignment]


@pytest.mark.parametrize("change, what", [
    (_unreadable_handlers, "'attnhub' logger handlers"),
    (lambda: setattr(sys, "stdout", _EqRaises()), "sys.stdout"),
    (lambda: setattr(sys, "stderr", _ReprExits()), "sys.stderr"),
], ids=["getter-raises", "eq-raises", "repr-exits"])
def test_a_setting_left_unreadable_or_uncomparable_is_put_back_and_recorded(
        change: Callable[[], None], what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook runs in the loader's worker; the host's final check after it crashed."""

    @hookimpl
    def attnhub_register_backends(register: Any) -> None:
        change()
        register(_Mine())

    monkeypatch.setitem(sys.modules, "attnhub_unsettling",
                        _module("attnhub_unsettling",
                                attnhub_register_backends=attnhub_register_backends))
    handlers, out, err = list(logging.getLogger("attnhub").handlers), sys.stdout, sys.stderr
    reg = Registry.load(entry_points=False, modules=["attnhub_unsettling"], deny=[])
    rec = reg.plugins["unsettling"]
    assert rec.backends == ["mine_one"]
    assert len(rec.errors) == 1 and what in rec.errors[0] and "put back" in rec.errors[0]
    assert logging.getLogger("attnhub").handlers == handlers
    assert (sys.stdout, sys.stderr) == (out, err)


def test_one_backend_object_is_not_registered_under_two_names() -> None:
    """``get('first_name')`` returned a backend named ``second_name``."""

    class Plugin:
        @hookimpl
        def attnhub_register_backends(self, register: Any) -> None:
            b = _Mine()
            register(b)
            b.name = "second_name"
            register(b)

    reg = Registry.load(entry_points=False, modules=[])
    rec = reg.add_plugin(Plugin(), "p")
    assert rec.backends == ["mine_one"] and "second_name" not in reg.backends
    assert len(rec.errors) == 1 and "already registered as 'mine_one'" in rec.errors[0]


def test_a_plugin_cannot_register_the_cores_own_instance() -> None:
    reg = Registry.load(entry_points=False, modules=[])
    core_sdpa = reg.backends["torch_sdpa"]

    class Plugin:
        @hookimpl
        def attnhub_register_backends(self, register: Any) -> None:
            register(core_sdpa)

    rec = reg.add_plugin(Plugin(), "p")
    assert not rec.backends and "already registered" in rec.errors[0]
    assert core_sdpa.plugin == "core"


class _Lookalike(str):
    """Equal to every name, hashed as the core's ``torch_sdpa``."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash("torch_sdpa")


def test_a_backend_or_variant_name_must_be_a_plain_str() -> None:
    class Odd(_Mine):
        name = _Lookalike("mine_one")

    class Plugin:
        @hookimpl
        def attnhub_register_backends(self, register: Any) -> None:
            register(Odd())

        @hookimpl
        def attnhub_register_variants(self, register: Any) -> None:
            register(_Lookalike("odd_variant"), score_mod=lambda s, b, h, q, k: s)

    reg = Registry.load(entry_points=False, modules=[])
    rec = reg.add_plugin(Plugin(), "p")
    assert not rec.backends and not rec.variants
    assert len(rec.errors) == 2 and all("plain str" in e for e in rec.errors), rec.errors
    assert "_Lookalike" in rec.errors[0]
    assert reg.backends["torch_sdpa"].plugin == "core"


def test_a_backend_whose_plugin_attribute_ignores_the_registry_is_refused() -> None:
    """A ``plugin`` property answering ``'core'`` made ``provider()`` and locks credit the
    core (attnhub's own distribution) with a third party's kernel."""

    class Spoof(_Mine):
        name = "spoof"

        @property  # type: ignore[override]
        def plugin(self) -> str:
            return "core"

        @plugin.setter
        def plugin(self, value: str) -> None:
            pass

    class Plugin:
        @hookimpl
        def attnhub_register_backends(self, register: Any) -> None:
            register(Spoof())
            register(_Mine())

    reg = Registry.load(entry_points=False, modules=[])
    rec = reg.add_plugin(Plugin(), "p")
    assert rec.backends == ["mine_one"] and "spoof" not in reg.backends
    assert len(rec.errors) == 1 and "`plugin` attribute cannot be set" in rec.errors[0]


HANGS_ON_READ = '''
import time
from attnhub.plugin import AttentionOutput, Backend, Capabilities, hookimpl

class Good(Backend):
    name = "reads_hang_good"
    capabilities = Capabilities()
    def forward(self, q, k, v, spec, params):
        return AttentionOutput(q)

@hookimpl
def attnhub_register_backends(register):
    register(Good())

def __dir__():
    return ["attnhub_register_backends", "Good", "slow"]

def __getattr__(name):
    if name == "slow":  # pluggy reads every attribute __dir__ lists, looking for hooks
        time.sleep(3600)
    raise AttributeError(name)
'''


def test_an_attribute_that_hangs_when_read_for_hooks_is_bounded(tmp_path, monkeypatch) -> None:
    """pluggy's register() reads every attribute of a plugin on the host's thread: a module
    ``__getattr__`` (or a property) that hangs there hung ``Registry.load`` for good."""
    import threading
    import time

    monkeypatch.setenv("ATTNHUB_PLUGIN_TIMEOUT", "0.5")
    monkeypatch.delenv("ATTNHUB_PLUGINS")  # (this file's fixture allows no named plugin)
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = f"adv_reads_hang_{time.time_ns()}"
    (tmp_path / f"{mod}.py").write_text(HANGS_ON_READ)
    got: list[Registry] = []
    loader = threading.Thread(target=lambda: got.append(Registry.load(modules=[mod],
                                                                      entry_points=False)),
                              daemon=True)  # one that still hangs fails this test, not CI
    loader.start()
    loader.join(10)
    assert got, "Registry.load is still waiting on the plugin's attribute"
    assert got[0].plugins[mod].errors == [
        "reading its hooks (an attribute that hangs) did not finish within 0.5 s "
        "(ATTNHUB_PLUGIN_TIMEOUT); the plugin is skipped (fix the hang, or raise the limit "
        "with ATTNHUB_PLUGIN_TIMEOUT=SECONDS)"]
    assert "reads_hang_good" not in got[0].backends and "torch_sdpa" in got[0].backends
