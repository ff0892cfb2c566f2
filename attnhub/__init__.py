"""attnhub: attention bound by policy to the best backend for the machine, explained.

    import attnhub
    out = attnhub.attention(q, k, v, causal=True)          # BSHD, policy-chosen backend
    for runner in attnhub.default_hub().bound():            # every binding made so far
        print(runner.decision.explain())                     # and why that backend
"""

from __future__ import annotations

from .core.backend import AttentionOutput, Backend
from .core.capabilities import Capabilities
from .core.decision import BindContext, Decision
from .core.device import DeviceInfo, probe, simulate
from .core.spec import AttentionSpec, AttnParams, MaskSpec
from .errors import (
    AttnhubError,
    BackendUnavailableError,
    InputError,
    NoBackendError,
    PolicyError,
    UnknownBackendError,
)
from .hub import Hub, attention, default_hub, set_default_hub
from .bind import BindingTable, bind  # noqa: E402  (after .hub: bind builds on it)

__version__ = "0.1.0"

__all__ = [
    "AttentionOutput",
    "AttentionSpec",
    "AttnParams",
    "AttnhubError",
    "Backend",
    "BackendUnavailableError",
    "BindContext",
    "BindingTable",
    "Capabilities",
    "Decision",
    "DeviceInfo",
    "Hub",
    "InputError",
    "MaskSpec",
    "NoBackendError",
    "PolicyError",
    "UnknownBackendError",
    "attention",
    "bind",
    "default_hub",
    "probe",
    "set_default_hub",
    "simulate",
]
