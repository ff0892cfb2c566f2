"""Shared fixtures for the core tests."""

from __future__ import annotations

import types

import pytest
import torch

import attnhub
from attnhub.core.builtin import ReferenceBackend
from attnhub.core.registry import Registry
from attnhub.hookspecs import hookimpl


class WrongBackend(ReferenceBackend):
    """Fast-looking and wrong (the reference's output x 1.01): correctness gates must report
    it as failed and never time it."""

    name = "wrong"
    tier = "portable"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        out = super().forward(q, k, v, spec, params)
        return out._replace(out=out.out * 1.01)


@pytest.fixture
def wrong_registry() -> Registry:
    """The installed plugins plus ``WrongBackend`` as the plugin ``wrong_plugin``."""

    @hookimpl
    def attnhub_register_backends(register):  # type: ignore[no-untyped-def]
        register(WrongBackend())

    reg = Registry.load()
    reg.add_plugin(types.SimpleNamespace(attnhub_register_backends=attnhub_register_backends),
                   "wrong_plugin")
    return reg


@pytest.fixture
def core_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the core's backends: no installed plugin, no provider preference from the
    environment (a test's registry then holds just what it adds)."""
    monkeypatch.setenv("ATTNHUB_PLUGINS", "")
    monkeypatch.delenv("ATTNHUB_PROVIDERS", raising=False)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def hub() -> attnhub.Hub:
    """A hub on the CPU with every installed plugin and the default policy."""
    return attnhub.Hub(hardware="cpu")


class VirtualClock:
    """The clock ``attnhub.timing`` reads, advanced only by ``advance``: a test that ranks
    callables by their cost gives each a cost here instead of sleeping, so a loaded CI core
    (a descheduled thread, an oversubscribed OpenMP barrier: milliseconds on a tiny call)
    cannot reorder them."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    """``attnhub.timing`` timed on a :class:`VirtualClock` for this test."""
    import attnhub.timing

    clock = VirtualClock()
    monkeypatch.setattr(attnhub.timing, "time", types.SimpleNamespace(
        perf_counter=clock.perf_counter, sleep=clock.advance))
    return clock
