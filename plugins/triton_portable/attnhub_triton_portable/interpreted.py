"""Triton's CPU interpreter patches process-wide state while it runs a kernel (the ``tl``
functions, the program ids of the grid), so two threads interpreting at once corrupt each
other's results: a review measured errors up to 4e34 and ``InterpreterError``s with four
threads. Calls on CPU tensors (the interpreter) take this lock; GPU launches never do."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

_LOCK = threading.RLock()
_NONE = contextlib.nullcontext()  # reusable: one object for every GPU call


def serialized(t: torch.Tensor) -> Any:
    """The interpreter's lock for a call on ``t``'s device (a no-op context off the CPU)."""
    return _LOCK if t.device.type == "cpu" else _NONE
