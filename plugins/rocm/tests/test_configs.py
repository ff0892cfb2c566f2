"""AMD tile configs per gfx arch, and which launch options reach each Triton runtime."""

from __future__ import annotations

import pytest
import torch

import attnhub
from attnhub_rocm.archs import GFX_ARCHS, RocmTarget, lookup_arch, rocm_target
from attnhub_rocm.configs import (
    AMD_ONLY_OPTIONS,
    bwd_config,
    decode_config,
    fit_to_target,
    fwd_config,
    lds_estimate,
)
from attnhub_rocm.launch import for_runtime, runtime_for

ARCHS = sorted(GFX_ARCHS)


def _target(arch: str) -> RocmTarget:
    return rocm_target(attnhub.simulate(arch))


def _legal(cfg: dict, t: RocmTarget, d: int, dtype: str, lds: bool = True) -> None:
    assert not lds or lds_estimate(cfg, d, d, dtype) <= t.lds_bytes, (t.name, d, cfg)
    assert cfg["num_warps"] * t.wave_size <= 1024
    nonk = cfg["matrix_instr_nonkdim"]
    assert nonk == 0 or nonk in t.arch.mfma_nonkdims
    for key in ("BLOCK_M", "BLOCK_N"):
        assert cfg[key] >= 16 and cfg[key] & (cfg[key] - 1) == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_every_config_is_legal_for_its_target(arch: str, d: int, dtype: str) -> None:
    t = _target(arch)
    _legal(fwd_config(t, d, dtype), t, d, dtype)
    bwd = bwd_config(t, d, dtype)
    assert bwd["dq_mode"] == "separate"  # deterministic backward: no dq atomics
    _legal(bwd["dkdv"], t, d, dtype, lds=False)
    _legal(bwd["dq"], t, d, dtype, lds=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_matrix_unit_decides_the_amd_options(arch: str) -> None:
    t = _target(arch)
    cfg = fwd_config(t, 128, "bf16")
    if t.arch.matrix_unit == "mfma":
        assert cfg["matrix_instr_nonkdim"] == 16 and cfg["waves_per_eu"] >= 1
    else:  # WMMA: nonkdim selects MFMA widths and must stay 0; wave32 takes smaller tiles
        for c in (cfg, fwd_config(t, 64, "fp32"), bwd_config(t, 64, "bf16")["dq"]):
            assert c["matrix_instr_nonkdim"] == 0 and c["waves_per_eu"] == 0
        cdna = fwd_config(_target("gfx942"), 128, "bf16")
        assert cfg["BLOCK_M"] * cfg["BLOCK_N"] < cdna["BLOCK_M"] * cdna["BLOCK_N"]


def test_bigger_lds_keeps_bigger_tiles_at_head_dim_256() -> None:
    small, big = fwd_config(_target("gfx942"), 256, "bf16"), fwd_config(_target("gfx950"), 256,
                                                                        "bf16")
    assert big["BLOCK_M"] * big["BLOCK_N"] > small["BLOCK_M"] * small["BLOCK_N"]


def test_fit_shrinks_until_it_fits_and_fails_loudly() -> None:
    t = _target("gfx942")
    huge = {"BLOCK_M": 256, "BLOCK_N": 256, "num_warps": 32, "num_stages": 3,
            "waves_per_eu": 2, "matrix_instr_nonkdim": 32}
    fitted = fit_to_target(huge, t, 128, 128, "bf16")
    _legal(fitted, t, 128, "bf16")
    assert fitted["matrix_instr_nonkdim"] == 32 and fitted["num_warps"] == 16
    tiny_lds = RocmTarget(arch=lookup_arch("gfx942"), cus=1, wave_size=64, lds_bytes=1024,
                          simulated=True)
    with pytest.raises(ValueError, match="LDS"):
        fit_to_target(huge, tiny_lds, 256, 256, "fp32")


def test_head_dim_above_256_is_refused() -> None:
    with pytest.raises(ValueError, match="256"):
        fwd_config(_target("gfx942"), 320, "bf16")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_decode_tiles_fit_two_programs_per_cu(arch: str, dtype: str) -> None:
    t = _target(arch)
    cfg = decode_config(t, dtype)
    assert cfg.num_warps * t.wave_size <= 1024 and cfg.ctas_per_sm >= 2
    # K and V tiles of block_n keys x 128 dims per pipeline stage, for every resident program
    per_program = cfg.num_stages * 2 * cfg.block_n * 128 * (4 if dtype == "fp32" else 2)
    assert cfg.ctas_per_sm * per_program <= t.lds_bytes
    assert cfg.block_n == (64 if t.arch.is_cdna else 32) // (2 if dtype == "fp32" else 1)


def test_amd_options_stripped_off_hip(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = bwd_config(_target("gfx942"), 64, "bf16")
    for runtime in ("interpreter", "other"):
        out = for_runtime(cfg, runtime)  # type: ignore[arg-type]
        assert not AMD_ONLY_OPTIONS & set(out["dkdv"]) and not AMD_ONLY_OPTIONS & set(out["dq"])
        assert out["dkdv"]["BLOCK_N"] == cfg["dkdv"]["BLOCK_N"] and out["dq_mode"] == "separate"
    assert for_runtime(cfg, "hip") == cfg
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert runtime_for(torch.device("cpu")) == "interpreter"
    monkeypatch.setattr(torch.version, "hip", "6.3", raising=False)
    assert runtime_for(torch.device("cuda")) == "hip"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert runtime_for(torch.device("cuda")) == "other"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runtime_for(torch.device("cuda")) == "interpreter"
