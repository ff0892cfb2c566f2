"""Entry point of the sm80_fa2 plugin: registers its backends through the public hook.

Importing this module imports no kernel library: each backend imports its library in
``_load`` on first use and reads its capabilities from the installed files.
"""

from __future__ import annotations

from typing import Callable

from attnhub.plugin import Backend, hookimpl

from .fa2 import FlashAttn2Backend
from .fa2_torch import TorchFlashBackend
from .flashinfer_paged import FlashInferDecodeBackend, FlashInferPrefillBackend


@hookimpl
def attnhub_register_backends(register: Callable[[Backend], None]) -> None:
    """fa2, fa2_torch, flashinfer_decode, flashinfer_prefill."""
    for backend in (FlashAttn2Backend(), TorchFlashBackend(), FlashInferDecodeBackend(),
                    FlashInferPrefillBackend()):
        register(backend)
