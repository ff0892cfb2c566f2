"""On/off switches read from the environment (``ATTNHUB_DEBUG``, ``ATTNHUB_SETTLE_TIES``, ...).

One reading for all of them: ``ATTNHUB_SETTLE_TIES=false`` meant "on" where only ``0`` was
off, and a request to switch settling off was silently ignored.
"""

from __future__ import annotations

import os

from ..errors import ArgumentError

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off", ""})


def env_flag(name: str, default: bool) -> bool:
    """``os.environ[name]`` as a switch: unset gives ``default``; 1/true/yes/on and
    0/false/no/off (any case, or empty) say it; anything else is an error naming both."""
    text = os.environ.get(name)
    if text is None:
        return default
    word = text.strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise ArgumentError(f"{name}={text!r}; set it to 1 (on) or 0 (off), or unset it "
                        f"(default {'on' if default else 'off'})")
