"""Every error attnhub raises on purpose; each message names the place and the fix."""

from __future__ import annotations

__all__ = [
    "AttnhubError",
    "InputError",
    "DeviceMismatchError",
    "DTypeMismatchError",
    "ShapeError",
    "LayoutError",
    "SeqlensError",
    "ArgumentError",
    "OutputContractError",
    "BackendUnavailableError",
    "UnknownBackendError",
    "PluginError",
    "PolicyError",
    "NoBackendError",
    "CacheFullError",
    "HardwareError",
]


class AttnhubError(Exception):
    """Base class: catch this to handle any attnhub failure."""


class InputError(AttnhubError, ValueError):
    """A tensor or argument given to attention is wrong; the message says which and how to fix it."""


class DeviceMismatchError(InputError):
    """q, k, v (or a side tensor) live on different devices."""


class DTypeMismatchError(InputError):
    """q, k, v have dtypes that cannot be used together."""


class ShapeError(InputError):
    """Wrong rank, head-dim mismatch, Hq % Hkv != 0, batch mismatch."""


class LayoutError(InputError):
    """The layout is unknown or cannot be inferred from the shapes."""


class SeqlensError(InputError):
    """cu_seqlens / block tables are of the wrong dtype, not monotonic or out of bounds."""


class ArgumentError(InputError):
    """A scalar or side argument has the wrong type, a value out of range, or does not belong
    to the call's layout (``seqlens_k`` with ``layout="bshd"``)."""


class OutputContractError(AttnhubError, RuntimeError):
    """A backend returned an output of the wrong shape, dtype or device (or NaN from inputs
    without NaN, in debug mode): the hub treats it as that backend failing."""


class BackendUnavailableError(AttnhubError, RuntimeError):
    """A backend cannot serve this call (forced and refusing it, or finding at run time what
    its check could not see); ``reasons`` lists why. ``lasting``: it will
    refuse every later call of the same binding too (a per-shape build budget spent, say),
    so the hub moves it behind the binding's other candidates instead of trying it first
    on every call."""

    def __init__(self, backend: str, reasons: list[str], lasting: bool = False):
        self.backend = backend
        self.reasons = list(reasons)
        self.lasting = lasting
        lines = "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(f"backend {backend!r} cannot serve this call:\n{lines}")


class UnknownBackendError(AttnhubError, KeyError):
    """A backend name that no loaded plugin registered."""

    def __init__(self, name: str, known: list[str]):
        self.name = name
        self.known = sorted(known)
        super().__init__(name)

    def __str__(self) -> str:
        return (
            f"unknown backend {self.name!r}; known backends: {', '.join(self.known)} "
            "(see `attnhub backends`; a plugin that failed to load is listed by `attnhub plugins`)"
        )


class PluginError(AttnhubError):
    """A plugin declared something invalid (bad backend object, duplicate name)."""


class PolicyError(AttnhubError):
    """A policy file is invalid; ``problems`` holds every located message."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class NoBackendError(AttnhubError, RuntimeError):
    """No candidate could serve a request; carries the decision record that explains why."""

    def __init__(self, message: str, decision: object | None = None):
        self.decision = decision
        super().__init__(message)


class CacheFullError(AttnhubError, RuntimeError):
    """The paged KV cache has no free block; other sequences are left intact."""


class HardwareError(AttnhubError, ValueError):
    """A hardware name (``--hardware``, ``Hub(hardware=...)``, ``ATTNHUB_HARDWARE``) that is
    not a known device; the message lists the known names."""
