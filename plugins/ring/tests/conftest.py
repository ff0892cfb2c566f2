"""Fixtures of the ring tests: ``run_on_ranks`` runs a function on N gloo processes."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"attnhub_ring_tests_{name}",
                                                  HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


#: the tests' ``import ring_ranks`` (no package here; the ranks' script registers itself)
sys.modules.setdefault("ring_ranks", _load("ring_ranks"))


@pytest.fixture(scope="session")
def run_on_ranks() -> Callable[..., list[Any]]:
    """``run_on_ranks(file, function, world_size, *args, timeout=60)`` (see ring_ranks.py)."""
    return _load("ring_ranks").run_on_ranks


@pytest.fixture(scope="session")
def ring_cases() -> Any:
    """The module of per-rank cases (ring_cases.py), loaded by path like the ranks load it."""
    return _load("ring_cases")
