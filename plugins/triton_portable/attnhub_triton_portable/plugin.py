"""Entry point of the triton_portable plugin: registers its backends through the public hook."""

from __future__ import annotations

from attnhub.plugin import hookimpl


@hookimpl
def attnhub_register_backends(register):  # type: ignore[no-untyped-def]
    """The portable tier's backends (constructing one imports no kernel)."""
    from .backend_dense import TritonDenseBackend
    from .backend_decode import TritonDecodeBackend, TritonDecodeFp8Backend
    from .backend_flex import FlexBackend

    register(TritonDenseBackend())
    register(TritonDecodeBackend())
    register(TritonDecodeFp8Backend())
    register(FlexBackend())


@hookimpl
def attnhub_register_variants(register):  # type: ignore[no-untyped-def]
    """Named score/mask variants (softcap30, alibi32, window4096...): see variants.py."""
    from .variants import register_variants

    register_variants(register)
