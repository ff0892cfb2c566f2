"""Entry point of the sm90_fa3 plugin: registers its backends through the public hook."""

from __future__ import annotations

from attnhub.plugin import hookimpl


@hookimpl
def attnhub_register_backends(register):  # type: ignore[no-untyped-def]
    """Nothing registered yet."""
