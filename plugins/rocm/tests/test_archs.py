"""Probe helpers with faked ROCm device properties, and the gfx table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import attnhub
from attnhub_rocm.archs import (
    GFX_ARCHS,
    device_from_properties,
    gfx_name,
    live_properties,
    lookup_arch,
    probe_target,
    rocm_target,
)

MI300X = SimpleNamespace(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-",
                         multi_processor_count=304, total_memory=192 * 2**30, warp_size=64,
                         shared_memory_per_block=65536)


@pytest.fixture
def fake_rocm(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A ROCm torch with one MI300X, as far as torch.version and torch.cuda tell."""
    monkeypatch.setattr(torch.version, "hip", "6.3.42131", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: MI300X)
    return MI300X


def test_gfx_name_drops_target_features() -> None:
    assert gfx_name("gfx942:sramecc+:xnack-") == "gfx942"
    assert gfx_name("gfx1100") == "gfx1100"


@pytest.mark.parametrize("arch,wave,lds_kib,unit", [
    ("gfx90a", 64, 64, "mfma"), ("gfx942", 64, 64, "mfma"), ("gfx950", 64, 160, "mfma"),
    ("gfx1100", 32, 64, "wmma"), ("gfx1201", 32, 64, "wmma")])
def test_table_per_arch(arch: str, wave: int, lds_kib: int, unit: str) -> None:
    a = lookup_arch(arch)
    assert (a.wave_size, a.lds_bytes // 1024, a.matrix_unit) == (wave, lds_kib, unit)
    assert bool(a.mfma_nonkdims) == (unit == "mfma")
    assert a.is_cdna == (unit == "mfma")


def test_every_simulated_gfx_preset_is_in_the_table() -> None:
    for arch in GFX_ARCHS:
        dev = attnhub.simulate(arch)
        t = rocm_target(dev)
        assert t.arch is GFX_ARCHS[arch] and t.cus == dev.sm_count and t.simulated


@pytest.mark.parametrize("name,wave,unit", [("gfx1030", 32, "wmma"), ("gfx908", 64, "mfma"),
                                            ("gfx1151:xnack-", 32, "wmma")])
def test_unknown_arch_gets_a_generic_entry(name: str, wave: int, unit: str) -> None:
    a = lookup_arch(name)
    assert (a.family, a.wave_size, a.matrix_unit) == ("unknown", wave, unit)


@pytest.mark.parametrize("bad", ["sm90", "gfx", "cpu", "gfxabc"])
def test_not_a_gfx_name(bad: str) -> None:
    with pytest.raises(ValueError, match="not a gfx target"):
        lookup_arch(bad)


def test_non_rocm_device_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="--hardware gfx942"):
        rocm_target(attnhub.simulate("sm90"))


def test_faked_rocm_device_probes(fake_rocm: SimpleNamespace) -> None:
    props = live_properties()
    assert props is fake_rocm
    dev = device_from_properties(props)
    assert (dev.vendor, dev.arch, dev.sm_count, dev.memory_gb) == ("rocm", "gfx942", 304, 192.0)
    t = probe_target(dev)
    assert (t.cus, t.wave_size, t.lds_bytes, t.simulated) == (304, 64, 65536, False)


def test_live_properties_override_the_table(monkeypatch: pytest.MonkeyPatch,
                                            fake_rocm: SimpleNamespace) -> None:
    # a cut-down part (fewer CUs) and a runtime reporting wave32: the live values win
    part = SimpleNamespace(**{**vars(fake_rocm), "multi_processor_count": 228, "warp_size": 32})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: part)
    t = probe_target(device_from_properties(part))
    assert (t.cus, t.wave_size) == (228, 32)
    assert "228 CUs" in t.describe() and "wave32" in t.describe()


def test_simulated_device_ignores_live_properties(fake_rocm: SimpleNamespace) -> None:
    t = probe_target(attnhub.simulate("gfx950"))
    assert (t.cus, t.lds_bytes) == (256, 160 * 1024)


def test_no_rocm_torch_means_no_live_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert live_properties() is None
