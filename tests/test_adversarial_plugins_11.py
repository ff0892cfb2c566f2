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
from attnhub.testing import plugin_of


pytestmark = pytest.mark.usefixtures("core_only")


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



# -- second pass (test_review_11_second had these; one file, one set of helpers) ----------


# -- process state ------------------------------------------------------------------------
def test_a_setting_unreadable_before_the_plugin_is_not_blamed_on_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    @hookimpl
    def attnhub_register_backends(register: Any) -> None:
        register(_Mine())

    mod = types.ModuleType("attnhub_innocent")
    mod.attnhub_register_backends = attnhub_register_backends  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "attnhub_innocent", mod)
    monkeypatch.setattr(logging.getLogger("attnhub"), "filters", None)  # the host's own
    reg = Registry.load(entry_points=False, modules=["attnhub_innocent"], deny=[])
    rec = reg.plugins["innocent"]
    assert rec.backends == ["mine_one"] and rec.errors == []


# -- registry -----------------------------------------------------------------------------
def test_one_object_registered_by_two_plugins_under_one_name_is_a_conflict() -> None:
    """As two instances would be: neither serves it, whichever loaded first."""
    shared = _Mine()
    reg = Registry.load(entry_points=False, modules=[])
    first = reg.add_plugin(plugin_of(shared), "a")
    second = reg.add_plugin(plugin_of(shared), "b")
    assert "mine_one" not in reg.backends and reg.conflicts["mine_one"] == ["a", "b"]
    assert not first.backends and not second.backends
    assert all("more than one plugin" in r.errors[0] for r in (first, second))
    assert shared.plugin == "a"


def test_a_slotted_plugin_attribute_keeps_the_registrys_value() -> None:
    class Slotted(_Mine):
        __slots__ = ("plugin",)
        name = "slotted"

    reg = Registry.load(entry_points=False, modules=[])
    rec = reg.add_plugin(plugin_of(Slotted()), "s")
    assert rec.backends == ["slotted"] and rec.errors == []
    assert reg.provider("slotted")["plugin"] == "s"  # type: ignore[index]


class _Sticky:
    """A descriptor that ignores the assignment and compares equal to everything."""

    def __get__(self, obj: Any, owner: Any = None) -> str:
        return "core"

    def __set__(self, obj: Any, value: Any) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = object.__hash__


def test_a_plugin_descriptor_that_compares_equal_is_still_refused() -> None:
    class Spoof(_Mine):
        name = "spoof"
        plugin = _Sticky()  # type: ignore[assignment]

    reg = Registry.load(entry_points=False, modules=[])
    rec = reg.add_plugin(plugin_of(Spoof()), "p")
    assert "spoof" not in reg.backends and reg.provider("spoof") is None
    assert "`plugin` attribute cannot be set" in rec.errors[0]


def test_an_undecorated_classmethod_hook_is_named() -> None:
    class Plugin:
        @classmethod
        def attnhub_register_backends(cls, register: Any) -> None:  # pragma: no cover
            register(_Mine())

    reg = Registry.load(entry_points=False, modules=[])
    rec = reg.add_plugin(Plugin(), "cm")
    assert rec.errors == ["attnhub_register_backends not decorated with "
                          "@attnhub.plugin.hookimpl, so never called"]
