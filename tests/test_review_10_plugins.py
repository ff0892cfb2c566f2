"""Review 10: a plugin added twice (under its own name, under ``core``'s, or the same object
under another name) is refused with its own record; the first one's record, backends and
provider stay as they were."""

from __future__ import annotations

from typing import Any

import pytest

from attnhub import AttentionOutput, Backend, Capabilities
from attnhub.core.registry import CORE_PLUGIN, Registry
from attnhub.hookspecs import hookimpl


class Mine(Backend):
    name = "mine"
    tier = "portable"
    capabilities = Capabilities(dtypes=frozenset({"fp32"}))

    def forward(self, q: Any, k: Any, v: Any, spec: Any, params: Any) -> AttentionOutput:
        raise NotImplementedError  # never called: only registration is under test


class Plugin:
    @hookimpl
    def attnhub_register_backends(self, register: Any) -> None:
        register(Mine())


@pytest.fixture()
def reg() -> Registry:
    return Registry.load(entry_points=False, modules=[])


@pytest.mark.parametrize("name", ["x", CORE_PLUGIN])
def test_a_second_plugin_of_a_loaded_name_keeps_the_first_record(reg: Registry,
                                                                 name: str) -> None:
    """The second ``add_plugin`` replaced the first's record: it listed no backends while
    they still served (``core``'s too), and its distribution and version were gone."""
    if name != CORE_PLUGIN:
        reg.add_plugin(Plugin(), name)
    first = reg.plugins[name]
    before = (list(first.backends), first.distribution, first.version, list(first.errors))
    second = reg.add_plugin(Plugin(), name)
    assert reg.plugins[name] is first
    assert (first.backends, first.distribution, first.version, first.errors) == before
    assert second.backends == [] and len(second.errors) == 1
    assert f"plugin name {name!r} already loaded from" in second.errors[0]
    assert "give the plugin another name" in second.errors[0]
    assert second in reg.plugins.values()  # shown by `attnhub plugins`, not lost
    assert reg.provider(first.backends[0])["plugin"] == name


def test_each_refused_attempt_keeps_its_record(reg: Registry) -> None:
    reg.add_plugin(Plugin(), "x")
    refused = [reg.add_plugin(Plugin(), "x") for _ in range(3)]
    assert len({id(r) for r in refused}) == 3
    assert all(any(r is x for x in reg.plugins.values()) for r in refused)


def test_the_same_object_under_another_name_is_named_plainly(reg: Registry) -> None:
    """pluggy's refusal was recorded whole: its table of every plugin object's repr."""
    obj = Plugin()
    reg.add_plugin(obj, "x")
    rec = reg.add_plugin(obj, "y")
    assert rec.errors == ["this plugin object is already loaded as plugin 'x'; skipped (load "
                          "it once)"]
    assert reg.plugins["x"].backends == ["mine"] and reg.backends["mine"].plugin == "x"


def test_a_provider_pick_after_a_refused_duplicate_still_replaces(reg: Registry) -> None:
    """With the first record replaced, a pick taking the name from it raised ValueError
    (the name was not in the replaced record's list) inside the picked plugin's hook."""
    reg.providers["mine"] = "z"
    reg.add_plugin(Plugin(), CORE_PLUGIN)  # refused: the core's record stays
    reg.providers["torch_sdpa"] = "z"

    class Sdpa(Mine):
        name = "torch_sdpa"

    class Picked:
        @hookimpl
        def attnhub_register_backends(self, register: Any) -> None:
            register(Sdpa())

    rec = reg.add_plugin(Picked(), "z")
    assert rec.errors == [] and rec.backends == ["torch_sdpa"]
    assert reg.backends["torch_sdpa"].plugin == "z"
    assert "torch_sdpa" not in reg.plugins[CORE_PLUGIN].backends
