"""Probe the device (or simulate one) so that backends and policies can reason about it.

``ATTNHUB_HARDWARE=sm90`` (or ``--hardware sm90``) gives a simulated device for offline
planning: it says what a fleet machine *would* bind without owning one.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from ..errors import HardwareError

Vendor = Literal["cpu", "cuda", "rocm"]

#: Optional kernel libraries whose versions the probe reports (distribution names).
KERNEL_LIBRARIES: tuple[str, ...] = (
    "triton",
    "flash-attn",
    "fa3-fwd",
    "flash-attn-3",
    "flashinfer-python",
    "fla-core",
    "aiter",
    "transformers",
)


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What a backend needs to know about the machine; hashable, so it joins cache keys."""

    vendor: Vendor
    arch: str  # "cpu", "sm90", "gfx942"
    name: str = ""
    capability: tuple[int, int] | None = None
    sm_count: int = 0
    memory_gb: float = 0.0
    simulated: bool = False
    versions: tuple[tuple[str, str], ...] = field(default=(), compare=False, hash=False)

    @property
    def tier(self) -> str:
        """``cpu``, ``cuda`` or ``rocm``: the coarse family a rule can match on."""
        return self.vendor

    @property
    def torch_device(self) -> str:
        return "cpu" if self.vendor == "cpu" else "cuda"

    def version(self, library: str) -> str | None:
        return dict(self.versions).get(library)

    def describe(self) -> str:
        sim = " (simulated)" if self.simulated else ""
        units = "CUs" if self.vendor == "rocm" else "SMs"
        extra = f", {self.sm_count} {units}" if self.sm_count else ""
        return f"{self.arch} {self.name}{extra}{sim}".replace("  ", " ")


#: Presets for simulated devices: arch -> (vendor, name, capability, units, memory GB).
_PRESETS: dict[str, tuple[Vendor, str, tuple[int, int] | None, int, float]] = {
    "cpu": ("cpu", "CPU", None, 0, 0.0),
    "sm75": ("cuda", "NVIDIA T4", (7, 5), 40, 16),
    "sm80": ("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 108, 80),
    "sm86": ("cuda", "NVIDIA RTX A6000", (8, 6), 84, 48),
    "sm89": ("cuda", "NVIDIA L40S", (8, 9), 142, 48),
    "sm90": ("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 132, 80),
    "sm100": ("cuda", "NVIDIA B200", (10, 0), 148, 180),
    "sm120": ("cuda", "NVIDIA RTX PRO 6000", (12, 0), 188, 96),
    "gfx90a": ("rocm", "AMD Instinct MI250X", None, 110, 64),
    "gfx942": ("rocm", "AMD Instinct MI300X", None, 304, 192),
    "gfx950": ("rocm", "AMD Instinct MI355X", None, 256, 288),
    "gfx1100": ("rocm", "AMD Radeon RX 7900 XTX", None, 96, 24),
    "gfx1201": ("rocm", "AMD Radeon RX 9070 XT", None, 64, 16),
}
_ALIASES = {"h100": "sm90", "h200": "sm90", "a100": "sm80", "h20": "sm90", "mi300": "gfx942",
            "mi300x": "gfx942", "b200": "sm100", "l40s": "sm89", "mi250": "gfx90a"}
#: Aliases of another model than their arch's preset: (name, units, memory GB), so a rule on
#: ``device_name`` (H200) matches the simulated device as it would the real one.
_MODELS: dict[str, tuple[str, int, float]] = {"h200": ("NVIDIA H200", 132, 141),
                                              "h20": ("NVIDIA H20", 78, 96)}


def known_hardware() -> list[str]:
    return sorted(_PRESETS)


def library_versions() -> tuple[tuple[str, str], ...]:
    """Versions of torch, CUDA, cuDNN, ROCm and each optional kernel library that is installed."""
    out: dict[str, str] = {"torch": torch.__version__}
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    if getattr(torch.version, "hip", None):
        out["rocm"] = str(torch.version.hip)
    try:
        if torch.backends.cudnn.is_available():
            out["cudnn"] = str(torch.backends.cudnn.version())
    except Exception:  # cudnn probing can fail on odd builds; the version is only informative
        pass
    for dist in KERNEL_LIBRARIES:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(sorted(out.items()))


def simulate(hardware: str) -> DeviceInfo:
    """A simulated device for planning: ``sm90``, ``gfx942``, ``h100``, ``cpu``..."""
    key = _ALIASES.get(hardware.strip().lower(), hardware.strip().lower())
    if key not in _PRESETS:
        raise HardwareError(
            f"unknown hardware {hardware!r}; use one of {', '.join(known_hardware())} "
            f"(or an alias: {', '.join(sorted(_ALIASES))})"
        )
    vendor, name, cap, units, mem = _PRESETS[key]
    name, units, mem = _MODELS.get(hardware.strip().lower(), (name, units, mem))
    return DeviceInfo(vendor=vendor, arch=key, name=name, capability=cap, sm_count=units,
                      memory_gb=mem, simulated=True, versions=library_versions())


def _probe_real(index: int = 0) -> DeviceInfo:
    versions = library_versions()
    if not torch.cuda.is_available():
        return DeviceInfo(vendor="cpu", arch="cpu", name="CPU", versions=versions)
    props = torch.cuda.get_device_properties(index)
    mem = round(props.total_memory / 2**30, 1)
    if getattr(torch.version, "hip", None):
        arch = str(getattr(props, "gcnArchName", "gfx")).split(":")[0]
        return DeviceInfo(vendor="rocm", arch=arch, name=props.name, capability=None,
                          sm_count=props.multi_processor_count, memory_gb=mem, versions=versions)
    cap = (props.major, props.minor)
    return DeviceInfo(vendor="cuda", arch=f"sm{props.major}{props.minor}", name=props.name,
                      capability=cap, sm_count=props.multi_processor_count, memory_gb=mem,
                      versions=versions)


@functools.lru_cache(maxsize=None)
def _probe_cached(hardware: str | None) -> DeviceInfo:
    return simulate(hardware) if hardware else _probe_real()


def probe(hardware: str | None = None) -> DeviceInfo:
    """This machine's device, or a simulated one from ``hardware`` / ``ATTNHUB_HARDWARE``."""
    if hardware:
        return _probe_cached(hardware)
    named = os.environ.get("ATTNHUB_HARDWARE") or None
    try:
        return _probe_cached(named)
    except HardwareError as exc:  # say where the name came from: no flag was given
        raise HardwareError(f"ATTNHUB_HARDWARE: {exc}; or unset it to use this machine") \
            from None


def with_versions(device: DeviceInfo, **versions: str) -> DeviceInfo:
    """A copy with library versions replaced (used by tests and lockfile drift checks)."""
    merged = dict(device.versions)
    merged.update(versions)
    return replace(device, versions=tuple(sorted(merged.items())))
