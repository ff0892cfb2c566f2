"""Shared fixtures for the core tests."""

from __future__ import annotations

import pytest
import torch

import attnhub


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def hub() -> attnhub.Hub:
    """A hub on the CPU with every installed plugin and the default policy."""
    return attnhub.Hub(hardware="cpu")
