"""Which launch options reach Triton, depending on where the kernel runs.

Triton's HIP backend reads ``waves_per_eu`` and ``matrix_instr_nonkdim`` (``HIPOptions``); its
CUDA backend rejects them ("Keyword argument ... was specified but unrecognised"); its CPU
interpreter drops every keyword the kernel signature does not name, silently. So the AMD-only
options go to a launch only on a ROCm GPU, and are stripped, explicitly, everywhere else
(the interpreter case included, so that a test sees exactly what was passed).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from attnhub_triton_portable.backend_dense import interpreter_on

from .configs import AMD_ONLY_OPTIONS, Config

Runtime = Literal["hip", "interpreter", "other"]


def runtime_for(device: torch.device) -> Runtime:
    """``hip`` for a ROCm GPU, ``interpreter`` under ``TRITON_INTERPRET=1`` or on the CPU."""
    if interpreter_on() or device.type == "cpu":
        return "interpreter"
    if device.type == "cuda" and getattr(torch.version, "hip", None):
        return "hip"
    return "other"


def for_runtime(cfg: Config, runtime: Runtime) -> Config:
    """``cfg`` without the AMD-only launch options unless ``runtime`` is ``hip``.

    Works on flat configs and on backward configs (``{"dkdv": {...}, "dq": {...}}``).
    """
    if runtime == "hip":
        return cfg
    out: dict[str, Any] = {}
    for key, val in cfg.items():
        if key in AMD_ONLY_OPTIONS:
            continue
        out[key] = for_runtime(val, runtime) if isinstance(val, dict) else val
    return out
