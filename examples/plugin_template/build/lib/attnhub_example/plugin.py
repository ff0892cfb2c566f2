"""The module the ``attnhub.backends`` entry point names: hooks only, nothing heavy."""

from __future__ import annotations

from typing import Any, Callable

from attnhub.plugin import hookimpl

from .backend import ExampleBackend


@hookimpl
def attnhub_register_backends(register: Callable[[Any], None]) -> None:
    register(ExampleBackend())
