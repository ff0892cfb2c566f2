"""``python -m attnhub``: the same as the ``attnhub`` command."""

from .cli import run

run()
