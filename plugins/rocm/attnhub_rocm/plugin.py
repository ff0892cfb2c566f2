"""Entry point of the rocm plugin: registers the AMD tier's backends through the public hook."""

from __future__ import annotations

from attnhub.plugin import hookimpl


@hookimpl
def attnhub_register_backends(register):  # type: ignore[no-untyped-def]
    """``ck_fa`` (CK flash attention via aiter or flash_attn) and ``triton_rocm`` (AMD-tuned
    triton_portable kernels); constructing them imports no kernel and touches no GPU."""
    from .ck_fa import CKFlashBackend
    from .triton_rocm import TritonRocmBackend

    register(CKFlashBackend())
    register(TritonRocmBackend())
