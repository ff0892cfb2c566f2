"""``python -m attnhub.cli``: the same as the ``attnhub`` command."""

from . import run

run()
