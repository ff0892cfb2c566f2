"""Entry point of the hybrid_linear plugin: registers its backends through the public hook.

Importing this module imports no kernel: Triton and fla are loaded on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnhub.plugin import hookimpl

from .linear_backends import GLABackend, LinearBackend, RetentionBackend
from .sparse_backends import LongformerBackend, LSHBackend, SlidingWindowBackend

BACKENDS = (GLABackend, LinearBackend, RetentionBackend, SlidingWindowBackend,
            LongformerBackend, LSHBackend)


@hookimpl
def attnhub_register_backends(register: Callable[[Any], None]) -> None:
    """gla, linear, retention, sliding_window, longformer, lsh."""
    for cls in BACKENDS:
        register(cls())
