"""AMD tile configurations for the triton_portable kernels, chosen from the probed gfx target.

Configs use triton_portable's format (a dict: upper-case keys are kernel constants such as
``BLOCK_M``/``BLOCK_N``, lower-case keys are launch options such as ``num_warps``,
``num_stages``, ``waves_per_eu``, ``matrix_instr_nonkdim``), so they go straight to its kernels.

Where the numbers come from (none were tuned here: no AMD GPU was available):
* CDNA3/CDNA4 forward: AITER's Triton MHA defaults for MI300X and MI350X
  (``aiter/ops/triton/configs/MI3x0X-MHA-DEFAULT.json``: BLOCK_M 128, BLOCK_N 64, 4 warps,
  1 stage, waves_per_eu 2; fp32 32x32 with 2 warps) and its backward kernels'
  ``matrix_instr_nonkdim`` 16 with waves_per_eu 1-2.
* CDNA2 (MI250X): the CDNA3 shapes, not checked against any published MI250X table.
* RDNA3/RDNA4: wave32 and WMMA, so ``matrix_instr_nonkdim`` stays 0 (it selects MFMA widths)
  and tiles are halved (BLOCK_M 64, BLOCK_N 32, the size reported for AITER's gfx1151 MHA
  config, which users stand in for gfx1201).
Then every config is made legal for the target (MFMA widths it has, at most 1024 threads per
workgroup) and forward tiles are fitted to its LDS (an estimate: the Q tile plus
``num_stages`` K and V tiles). Decode configs are triton_portable's ``DecodeConfig``, which
has no slot for AMD-only launch options: AMD decode runs without ``waves_per_eu``.
"""

from __future__ import annotations

from typing import Any

from attnhub_triton_portable.decode_configs import DecodeConfig

from .archs import RocmTarget

Config = dict[str, Any]

#: Launch options that only the HIP backend of Triton understands.
AMD_ONLY_OPTIONS: frozenset[str] = frozenset({"waves_per_eu", "matrix_instr_nonkdim", "kpack"})

_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _pow2(d: int) -> int:
    return max(16, 1 << (max(d, 1) - 1).bit_length())


def _c(bm: int, bn: int, warps: int, stages: int, wpe: int, nonk: int) -> Config:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
            "waves_per_eu": wpe, "matrix_instr_nonkdim": nonk}


# family -> rows of (max padded head dim, forward config for 16-bit inputs).
_FWD: dict[str, list[tuple[int, Config]]] = {
    "cdna": [(128, _c(128, 64, 4, 1, 2, 16)), (256, _c(64, 64, 4, 1, 1, 16))],
    "cdna4": [(128, _c(128, 64, 4, 1, 2, 16)), (256, _c(128, 64, 8, 1, 1, 16))],
    "rdna": [(128, _c(64, 32, 4, 1, 0, 0)), (256, _c(32, 32, 4, 1, 0, 0))],
}
# family -> rows of (max padded head dim, (dk/dv kernel config, dq kernel config)).
_BWD: dict[str, list[tuple[int, tuple[Config, Config]]]] = {
    "cdna": [(128, (_c(32, 128, 4, 1, 1, 16), _c(128, 32, 4, 1, 1, 16))),
             (256, (_c(16, 64, 4, 1, 1, 16), _c(64, 16, 4, 1, 1, 16)))],
    "rdna": [(128, (_c(32, 64, 4, 1, 0, 0), _c(64, 32, 4, 1, 0, 0))),
             (256, (_c(16, 32, 4, 1, 0, 0), _c(32, 16, 4, 1, 0, 0)))],
}
# family -> split-KV decode tiles. Two programs per CU: K and V tiles of 64 keys x 128 dims
# in bf16 take 32 KiB per stage, so 64 KiB CDNA2/3 CUs hold two at one stage, CDNA4's
# 160 KiB at two stages; RDNA's wave32 programs take 32-key tiles.
_DECODE: dict[str, DecodeConfig] = {
    "cdna": DecodeConfig(block_n=64, num_warps=4, num_stages=1, ctas_per_sm=2),
    "cdna4": DecodeConfig(block_n=64, num_warps=4, num_stages=2, ctas_per_sm=2),
    "rdna": DecodeConfig(block_n=32, num_warps=4, num_stages=1, ctas_per_sm=2),
}
_FP32_FWD = _c(32, 32, 2, 1, 1, 16)


def _family(target: RocmTarget) -> str:
    if target.arch.family == "cdna4":
        return "cdna4"
    return "rdna" if target.arch.matrix_unit == "wmma" else "cdna"


def _rows(table: dict[str, list[tuple[int, Any]]], fam: str) -> list[tuple[int, Any]]:
    return table.get(fam) or table["cdna"]


def _pick(rows: list[tuple[int, Any]], head_dim: int) -> Any:
    bd = _pow2(head_dim)
    for max_bd, cfg in rows:
        if bd <= max_bd:
            return cfg
    raise ValueError(f"attnhub_rocm: head dim {head_dim} is above the Triton kernels' 256; "
                     "route it to another backend")


def lds_estimate(cfg: Config, head_dim: int, head_dim_v: int, dtype: str) -> int:
    """Bytes of LDS a forward tile needs: Q (BLOCK_M x D) plus ``num_stages`` K and V tiles."""
    stages = max(1, int(cfg.get("num_stages", 1)))
    b = _BYTES.get(dtype, 2)
    return b * (cfg["BLOCK_M"] * _pow2(head_dim)
                + stages * cfg["BLOCK_N"] * (_pow2(head_dim) + _pow2(head_dim_v)))


def legalize(cfg: Config, target: RocmTarget) -> Config:
    """``cfg`` with what ``target`` cannot take removed: an MFMA width it lacks (0 lets the
    compiler choose; WMMA parts must have 0), the CDNA occupancy hint on non-MFMA parts, and
    warps beyond 1024 threads per workgroup."""
    out = dict(cfg)
    if out.get("matrix_instr_nonkdim", 0) not in target.arch.mfma_nonkdims:
        out["matrix_instr_nonkdim"] = 0
    if target.arch.matrix_unit != "mfma":
        out["waves_per_eu"] = 0
    while out["num_warps"] * target.wave_size > 1024 and out["num_warps"] > 1:
        out["num_warps"] //= 2
    return out


def fit_to_target(cfg: Config, target: RocmTarget, head_dim: int, head_dim_v: int,
                  dtype: str) -> Config:
    """A forward ``cfg`` made legal for ``target`` (see ``legalize``) with tiles halved
    (the larger side first, not below 16) until the LDS estimate fits."""
    out = legalize(cfg, target)
    while lds_estimate(out, head_dim, head_dim_v, dtype) > target.lds_bytes:
        key = "BLOCK_N" if out["BLOCK_N"] >= out["BLOCK_M"] else "BLOCK_M"
        if out[key] <= 16:
            key = "BLOCK_M" if key == "BLOCK_N" else "BLOCK_N"
            if out[key] <= 16:
                raise ValueError(f"attnhub_rocm: no tile for head dim {head_dim} fits "
                                 f"{target.lds_bytes} bytes of LDS on {target.name}")
        out[key] //= 2
    return out


def fwd_config(target: RocmTarget, head_dim: int, dtype: str,
               head_dim_v: int | None = None) -> Config:
    """Forward tiles for ``target``; fp32 (tests, accuracy runs) uses AITER's 32x32 tile."""
    dv = head_dim_v or head_dim
    base = _FP32_FWD if dtype == "fp32" else _pick(_rows(_FWD, _family(target)),
                                                   max(head_dim, dv))
    return fit_to_target(base, target, head_dim, dv, dtype)


def bwd_config(target: RocmTarget, head_dim: int, dtype: str,
               head_dim_v: int | None = None) -> Config:
    """Backward tiles: ``{"dkdv": cfg, "dq": cfg, "dq_mode": "separate"}`` (no dq atomics,
    so the backward is deterministic). Only legalized: the forward's LDS estimate does not
    model these kernels (their resident K/V or Q/dO tiles live in registers), so the table's
    shapes, AITER's backward tiles, stand as they are."""
    dv = head_dim_v or head_dim
    fam = "rdna" if _family(target) == "rdna" else "cdna"
    dkdv, dq = _pick(_BWD[fam], max(head_dim, dv))
    return {"dkdv": legalize(dkdv, target), "dq": legalize(dq, target), "dq_mode": "separate"}


def decode_config(target: RocmTarget, dtype: str) -> DecodeConfig:
    """Split-KV decode tiles for ``target`` (fp32 halves the key tile, as on NVIDIA).

    The number of splits is left to triton_portable's heuristic, which reads the CU count
    from the device (``multi_processor_count`` is the CU count under ROCm).
    """
    cfg = _DECODE[_family(target)]
    return cfg.with_(block_n=max(16, cfg.block_n // 2)) if dtype == "fp32" else cfg
