"""Process-wide settings a plugin must not change while it loads, checked and put back.

A plugin imported by the host that sets torch's default dtype, turns on deterministic
algorithms, switches an SDPA kernel off, silences logging or sets ``ATTNHUB_BACKEND`` would
change every later attention call of the host, silently. The registry takes a
:func:`snapshot` before a plugin's import and hooks and calls :func:`restore` after them:
what changed is put back and reported against the plugin.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch

_log = logging.getLogger("attnhub")


def _attr(obj: Any, name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return (lambda: getattr(obj, name)), (lambda v: setattr(obj, name, v))


def _set_determinism(v: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(v[0], warn_only=v[1])


def _set_device(d: torch.device) -> None:
    torch.set_default_device(None if d == torch.device("cpu") else d)


_B = torch.backends
#: (what, getter, setter): torch's numerics and kernel switches, and the host's logging.
#: ``enable_cudnn_sdp`` is left out: the core flips it around some CUDA calls.
SETTINGS: tuple[tuple[str, Callable[[], Any], Callable[[Any], None]], ...] = (
    ("torch default dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("torch default device", torch.get_default_device, _set_device),
    ("torch grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    ("torch deterministic algorithms",
     lambda: (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled()), _set_determinism),
    ("torch anomaly detection", torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    ("torch float32 matmul precision", torch.get_float32_matmul_precision,
     torch.set_float32_matmul_precision),
    ("torch.backends.cuda.matmul.allow_tf32", *_attr(_B.cuda.matmul, "allow_tf32")),
    ("torch.backends.cudnn.allow_tf32", *_attr(_B.cudnn, "allow_tf32")),
    ("torch.backends.cudnn.enabled", *_attr(_B.cudnn, "enabled")),
    ("torch.backends.cudnn.deterministic", *_attr(_B.cudnn, "deterministic")),
    ("torch.backends.cudnn.benchmark", *_attr(_B.cudnn, "benchmark")),
    ("SDPA flash kernel switch", _B.cuda.flash_sdp_enabled, _B.cuda.enable_flash_sdp),
    ("SDPA memory-efficient kernel switch", _B.cuda.mem_efficient_sdp_enabled,
     _B.cuda.enable_mem_efficient_sdp),
    ("SDPA math kernel switch", _B.cuda.math_sdp_enabled, _B.cuda.enable_math_sdp),
    ("torch threads", torch.get_num_threads, torch.set_num_threads),
    ("logging.disable level", lambda: logging.root.manager.disable, logging.disable),
    ("'attnhub' logger level", lambda: _log.level, _log.setLevel),
    ("'attnhub' logger disabled", *_attr(_log, "disabled")),
)


def _own_env() -> dict[str, str]:
    """The host's own variables (``ATTNHUB_*``): the ones that steer every later call. Other
    variables are left alone: libraries a plugin imports set theirs legitimately (torch sets
    ``CUDA_MODULE_LOADING`` when CUDA starts), which must not read as the plugin's bug."""
    return {k: v for k, v in os.environ.items() if k.startswith("ATTNHUB_")}


def snapshot() -> tuple[list[Any], dict[str, str]]:
    """The current values of :data:`SETTINGS` and the host's ``ATTNHUB_*`` variables."""
    return [get() for _, get, _ in SETTINGS], _own_env()


def restore(before: tuple[list[Any], dict[str, str]]) -> list[str]:
    """Put back what changed since ``before``; one line per change (environment values are
    not shown: they may be secrets)."""
    values, env = before
    changed: list[str] = []
    for (what, get, put), old in zip(SETTINGS, values):
        new = get()
        if new != old:
            put(old)
            changed.append(f"{what} {old!r} -> {new!r}")
    now = _own_env()
    keys = sorted(k for k in env.keys() | now.keys() if env.get(k) != now.get(k))
    for k in keys:
        if k in env:
            os.environ[k] = env[k]
        else:
            del os.environ[k]
    if keys:
        changed.append(f"environment variable(s) {', '.join(keys)}")
    return changed
