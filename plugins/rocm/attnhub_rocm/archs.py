"""What the AMD tier needs to know about a gfx target, on top of ``attnhub.DeviceInfo``.

The core probe gives the vendor (``rocm`` from ``torch.version.hip``), the gfx arch (from
``gcnArchName``) and the CU count. Tile selection also needs the wave size (64 on CDNA, 32 on
RDNA), the LDS budget per workgroup and the kind of matrix unit (MFMA on CDNA, where Triton's
``matrix_instr_nonkdim`` picks 16x16 or 32x32 instructions; WMMA on RDNA, where it must stay 0).
Those are per-arch constants, kept here in one table; a live device's own properties
(``warp_size``, ``shared_memory_per_block``) win over the table when torch reports them.

Sources for the table: AMD's published specifications of the flagship parts (CU counts;
64 KiB LDS per CU on CDNA2/3, 160 KiB on CDNA4, 64 KiB per workgroup on RDNA; the CDNA3 and
CDNA4 LDS sizes are also what public gfx942/gfx950 kernels budget for), Triton's AMD backend
(``HIPOptions``: wave 32 for gfx10 and later, 64 before), AITER's README (CK/ASM kernels are
CDNA-only). No value here was read from a real AMD device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from attnhub import DeviceInfo

Family = Literal["cdna2", "cdna3", "cdna4", "rdna3", "rdna4", "unknown"]
MatrixUnit = Literal["mfma", "wmma", "none"]


@dataclass(frozen=True, slots=True)
class GfxArch:
    """Per-arch constants; ``cus`` is the flagship part's CU count (a live probe overrides it)."""

    name: str
    family: Family
    product: str
    cus: int
    wave_size: int
    lds_bytes: int
    matrix_unit: MatrixUnit
    #: MFMA instruction widths Triton may pick with ``matrix_instr_nonkdim`` (empty on WMMA).
    mfma_nonkdims: tuple[int, ...]
    #: XCDs (chiplets) that share the CUs; workgroups are dealt round-robin across them.
    xcds: int
    #: FP8 formats with native matrix support: "fnuz" (CDNA3) or "ocp" (CDNA4, RDNA4), or none.
    fp8: Literal["fnuz", "ocp", "none"]

    @property
    def is_cdna(self) -> bool:
        return self.family.startswith("cdna")


_KIB = 1024

#: The gfx targets the plugin knows by name. Anything else gets a generic entry from its major.
GFX_ARCHS: dict[str, GfxArch] = {
    "gfx90a": GfxArch("gfx90a", "cdna2", "AMD Instinct MI250X (one GCD)", 110, 64, 64 * _KIB,
                      "mfma", (16, 32), 1, "none"),
    "gfx942": GfxArch("gfx942", "cdna3", "AMD Instinct MI300X", 304, 64, 64 * _KIB,
                      "mfma", (16, 32), 8, "fnuz"),
    "gfx950": GfxArch("gfx950", "cdna4", "AMD Instinct MI355X", 256, 64, 160 * _KIB,
                      "mfma", (16, 32), 8, "ocp"),
    "gfx1100": GfxArch("gfx1100", "rdna3", "AMD Radeon RX 7900 XTX", 96, 32, 64 * _KIB,
                       "wmma", (), 1, "none"),
    "gfx1201": GfxArch("gfx1201", "rdna4", "AMD Radeon RX 9070 XT", 64, 32, 64 * _KIB,
                       "wmma", (), 1, "ocp"),
}


def gfx_name(gcn_arch_name: str) -> str:
    """``"gfx942:sramecc+:xnack-"`` -> ``"gfx942"`` (torch reports the target-feature suffix)."""
    return gcn_arch_name.strip().split(":")[0].lower()


def lookup_arch(name: str) -> GfxArch:
    """The table entry for ``name``, or a generic one built from its major version.

    An unknown CDNA-era part (gfx9xx) is treated as wave64/MFMA with 64 KiB LDS, an unknown
    RDNA part (gfx10xx-gfx12xx) as wave32/WMMA; ``family`` is ``"unknown"`` so callers can say
    that the tiles were not chosen for it.
    """
    key = gfx_name(name)
    if key in GFX_ARCHS:
        return GFX_ARCHS[key]
    digits = key.removeprefix("gfx")
    if not key.startswith("gfx") or len(digits) < 3 or not digits[:-2].isdigit():
        raise ValueError(f"{name!r} is not a gfx target name (expected e.g. gfx942, gfx1100)")
    major = int(digits[:-2])
    if major >= 10:
        return GfxArch(key, "unknown", "unknown RDNA part", 0, 32, 64 * _KIB, "wmma", (), 1,
                       "none")
    return GfxArch(key, "unknown", "unknown CDNA part", 0, 64, 64 * _KIB, "mfma", (16,), 1,
                   "none")


@dataclass(frozen=True, slots=True)
class RocmTarget:
    """An AMD device as the Triton configs see it: table constants plus live overrides."""

    arch: GfxArch
    cus: int
    wave_size: int
    lds_bytes: int
    simulated: bool

    @property
    def name(self) -> str:
        return self.arch.name

    def describe(self) -> str:
        sim = ", simulated" if self.simulated else ""
        return (f"{self.arch.name} ({self.arch.family}, {self.cus} CUs, wave{self.wave_size}, "
                f"{self.lds_bytes // _KIB} KiB LDS, {self.arch.matrix_unit}{sim})")


def rocm_target(device: DeviceInfo, props: Any | None = None) -> RocmTarget:
    """The AMD view of ``device``; ``props`` are torch device properties of a live GPU.

    Raises ``ValueError`` for a non-ROCm device, naming what to pass instead.
    """
    if device.vendor != "rocm":
        raise ValueError(f"attnhub_rocm: {device.arch} is a {device.vendor} device; pass a ROCm "
                         "device (probe on an AMD GPU, or simulate one with --hardware gfx942)")
    arch = lookup_arch(device.arch)
    cus = device.sm_count or arch.cus
    wave = arch.wave_size
    lds = arch.lds_bytes
    if props is not None:
        cus = int(getattr(props, "multi_processor_count", 0) or cus)
        wave = int(getattr(props, "warp_size", 0) or wave)
        lds = int(getattr(props, "shared_memory_per_block", 0) or lds)
    return RocmTarget(arch=arch, cus=cus, wave_size=wave, lds_bytes=lds,
                      simulated=device.simulated)


def live_properties(index: int = 0) -> Any | None:
    """torch's properties of ROCm device ``index``, or None on a machine without a ROCm GPU."""
    if not getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(index)


def device_from_properties(props: Any) -> DeviceInfo:
    """A ``DeviceInfo`` from torch's ROCm properties, the way the core probe builds one.

    For code that holds properties already (tests with a faked device, a multi-GPU host
    asking about device ``i``); the core ``attnhub.probe()`` stays the normal entry point.
    """
    return DeviceInfo(vendor="rocm", arch=gfx_name(str(getattr(props, "gcnArchName", "gfx"))),
                      name=str(getattr(props, "name", "")), capability=None,
                      sm_count=int(getattr(props, "multi_processor_count", 0)),
                      memory_gb=round(int(getattr(props, "total_memory", 0)) / 2**30, 1))


def probe_target(device: DeviceInfo, index: int = 0) -> RocmTarget:
    """``rocm_target`` with the live properties of device ``index`` when ``device`` is real."""
    props = None if device.simulated else live_properties(index)
    return rocm_target(device, props)
