"""Plugins, ninth round: one registration that raised ``SystemExit`` (a ``capabilities``
property) or any exception in a variant's registration (a ``doc`` whose ``str()`` raises)
went up through the plugin's hook, so every later backend and variant of that plugin was
lost; a backend's or variant's name whose ``repr()`` raises did the same."""

from __future__ import annotations

from typing import Any

import pytest

from attnhub.core.registry import Registry
from attnhub.hookspecs import hookimpl
from attnhub.plugin import Backend, Capabilities


pytestmark = pytest.mark.usefixtures("core_only")


class _Good(Backend):
    name = "good_one"
    tier = "portable"
    capabilities = Capabilities()

    def forward(self, *args: Any) -> Any:  # pragma: no cover - never called
        raise NotImplementedError


def _raising_caps(exc: BaseException) -> Backend:
    class Broken(_Good):
        name = "broken_one"

        @property
        def capabilities(self) -> Any:  # type: ignore[override]
            raise exc

    return Broken()


def _load(plugin: object) -> Any:
    return Registry.load(entry_points=False, modules=[]).add_plugin(plugin, "p")


@pytest.mark.parametrize("exc", [SystemExit(3), GeneratorExit()])
def test_a_backend_raising_base_exceptions_costs_only_itself(exc: BaseException) -> None:
    class Plugin:
        @hookimpl
        def attnhub_register_backends(self, register: Any) -> None:
            register(_raising_caps(exc))
            register(_Good())

    rec = _load(Plugin())
    assert rec.backends == ["good_one"], rec.errors
    assert len(rec.errors) == 1 and "broken_one" in rec.errors[0], rec.errors
    assert type(exc).__name__ in rec.errors[0]


class _NoStr:
    def __str__(self) -> str:
        raise ValueError("no text")


class _NoRepr(str):
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def _score(s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
    return s


@pytest.mark.parametrize("first", [
    {"name": "v1", "score_mod": _score, "doc": _NoStr()},
    {"name": _NoRepr("v 1"), "score_mod": _score},
    {"name": "v1", "score_mod": _score, "mask_mod": _score, "doc": _NoStr()},
])
def test_a_variant_that_cannot_register_costs_only_itself(first: dict[str, Any]) -> None:
    class Plugin:
        @hookimpl
        def attnhub_register_variants(self, register: Any) -> None:
            register(**first)
            register("v2", score_mod=_score)

    rec = _load(Plugin())
    assert rec.variants == ["v2"], rec.errors
    assert len(rec.errors) == 1, rec.errors


@pytest.mark.parametrize("arch", ["sm90\n", "sm\u0669\u0660", " sm90", "gfx942\n"])
def test_an_arch_no_device_has_is_refused(arch: str) -> None:
    """The arch pattern used ``$`` and ``\\d``: a trailing newline or foreign digits passed,
    and the backend then never matched any device."""
    from attnhub.plugin import Capabilities

    with pytest.raises(TypeError, match="archs must be device archs"):
        Capabilities(archs=frozenset({arch}))
