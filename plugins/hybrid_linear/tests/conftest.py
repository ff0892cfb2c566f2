"""Fixtures for the hybrid_linear tests: seeded randomness, the Triton interpreter on demand."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Our Triton GLA kernels, run by the Triton interpreter on the CPU (or natively on a GPU).

    The interpreter must be on before ``triton.jit`` decorates the kernels, so the module is
    imported here, after setting TRITON_INTERPRET, never at test collection.
    """
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return importlib.import_module("attnhub_hybrid_linear.linear_triton")


@pytest.fixture
def torch_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin the linear layers to the torch forms (fast on the CPU, whatever other tests set)."""
    monkeypatch.setenv("ATTNHUB_LINEAR_IMPL", "torch")
