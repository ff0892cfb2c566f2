"""Entry point of the sm90_fa3 plugin: registers its backends through the public hook.

Importing this module imports no kernel: FA3 is imported in ``_load`` on first use, and its
capabilities come from the installed build's config module (plain Python).
"""

from __future__ import annotations

from typing import Callable

from attnhub.plugin import Backend, hookimpl

from .cudnn import CudnnBackend
from .fa3 import Fa3Backend
from .fa3_fp8 import Fa3Fp8Backend


@hookimpl
def attnhub_register_backends(register: Callable[[Backend], None]) -> None:
    """fa3, cudnn, fa3_fp8."""
    for backend in (Fa3Backend(), CudnnBackend(), Fa3Fp8Backend()):
        register(backend)
