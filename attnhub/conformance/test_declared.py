"""Each case of the conformance grid as a pytest test (see conftest.py for the options)."""

from __future__ import annotations

import pytest

from attnhub.conformance import run_case
from attnhub.core.device import probe
from attnhub.core.registry import Registry

_REGISTRY: list[Registry] = []


def _registry() -> Registry:
    if not _REGISTRY:
        _REGISTRY.append(Registry.load())
    return _REGISTRY[0]


def test_declared_feature(kit_case) -> None:  # type: ignore[no-untyped-def]
    name, case = kit_case
    res = run_case(_registry().get(name), probe(), case)
    if res.status == "skip":
        pytest.skip(res.detail)
    assert res.status == "pass", f"{name} {case.feature} [{case.describe()}]: " \
                                 f"{res.status}: {res.detail}"
