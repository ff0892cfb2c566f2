"""Entry point of the ring plugin: registers its backend through the public hook."""

from __future__ import annotations

from attnhub.plugin import hookimpl

from .backend import RingBackend
from .local_cpu import TorchFlashCPUBackend


@hookimpl
def attnhub_register_backends(register):  # type: ignore[no-untyped-def]
    """The ``ring`` backend (the hub gives it the local kernel per call), and
    ``torch_flash_cpu``, a CPU local kernel that returns its LSE natively."""
    register(RingBackend())
    register(TorchFlashCPUBackend())
