"""``Registry.of``: the core's built-ins plus the backend objects given, no installed plugin."""

from __future__ import annotations

import pytest

from attnhub.core.builtin import ReferenceBackend
from attnhub.core.registry import Registry
from attnhub.errors import UnknownBackendError


class Mine(ReferenceBackend):
    name = "mine"


def test_registry_of_holds_the_backends_given_and_no_installed_plugin():
    a = Mine()
    reg = Registry.of(a, plugin="my_plugin")
    assert reg.get("mine") is a and reg.plugins["my_plugin"]
    assert "reference" in reg.backends  # the core's built-ins stay
    with pytest.raises(UnknownBackendError):
        reg.get("triton")  # an installed plugin's backend: not loaded
