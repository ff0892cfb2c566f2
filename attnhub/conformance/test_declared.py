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


_HUNG: dict[str, str] = {}  # backend -> the feature whose call is still running


def test_declared_feature(kit_case, request) -> None:  # type: ignore[no-untyped-def]
    name, case = kit_case
    if name in _HUNG:  # the hung call still holds the backend
        pytest.skip(f"not run: an earlier case hung ({_HUNG[name]})")
    res = run_case(_registry().get(name), probe(), case,
                   timeout_s=request.config.getoption("--case-timeout"))
    if res.hung:
        _HUNG[name] = case.feature
    if res.status == "skip":
        pytest.skip(res.detail)
    assert res.status == "pass", f"{name} {case.feature} [{case.describe()}]: " \
                                 f"{res.status}: {res.detail}"
