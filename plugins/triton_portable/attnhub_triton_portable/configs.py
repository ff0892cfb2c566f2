"""Tile tables for the dense forward/backward kernels, keyed by architecture.

A config is a plain dict so that another plugin (the ROCm one) can build or edit its own and
pass it to the kernels: upper-case keys are kernel constants (``BLOCK_M``, ``BLOCK_N``,
``WARP_SPECIALIZE``, ``USE_TMA``), lower-case keys are Triton launch options (``num_warps``,
``num_stages``, AMD's ``waves_per_eu`` / ``matrix_instr_nonkdim``). The backward config holds
one such dict per kernel: ``{"dkdv": {...}, "dq": {...}, "dq_mode": "separate"|"atomic"}``.

Measured: the sm90 rows for head dims 65..128 in 16-bit dtypes (H200, bf16, d=128; see
docs/benchmarks/triton_dense.md), where 64x64 forward tiles on one warpgroup beat 128x128 on
two because two CTAs per SM interleave softmax and MMAs; a sweep of seven forward configs
(2026-12-01) found none faster. ``GLUON`` (with ``P_SMEM``) selects the Hopper Gluon forward
(:mod:`.fwd_gluon`) instead of the portable kernel; with ``WS`` the warp-specialised one
(:mod:`.fwd_gluon_ws`, Gluon's own ``warp_specialize``), which the autotuner times on sm90. The other rows (sm80, d<=64, d=256,
AMD) follow the shapes FlashAttention-2-style Triton kernels use on those parts and are
untuned starting points. ``WARP_SPECIALIZE`` is passed to ``tl.range``; Triton produces no
warp-specialised code from it on sm90, so no sm90 entry sets it (``WS`` does).
"""

from __future__ import annotations

from typing import Any

Config = dict[str, Any]

#: Keys that are kernel constants; everything else in a config is a launch option.
KERNEL_KEYS: frozenset[str] = frozenset({"BLOCK_M", "BLOCK_N", "WARP_SPECIALIZE", "USE_TMA",
                                        "GLUON", "P_SMEM", "WS", "PINGPONG", "KV_STAGES",
                                        "CONSUMER_REGS"})

AMD_ARCHS: frozenset[str] = frozenset({"gfx90a", "gfx942", "gfx950"})


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two (at least 16, the smallest dot tile)."""
    return max(16, 1 << (max(head_dim, 1) - 1).bit_length())


def _family(arch: str) -> str:
    """Collapse an arch string into the table's rows: cpu, sm80, sm90, gfx*, or generic."""
    if arch == "cpu":
        return "cpu"
    if arch.startswith("sm"):
        try:
            major = int(arch[2:]) // 10
        except ValueError:
            return "generic"
        return "sm90" if major >= 9 else "sm80"
    if arch in AMD_ARCHS:
        return arch
    return "generic"


def _cfg(bm: int, bn: int, warps: int, stages: int, **extra: Any) -> Config:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, **extra}


# fwd tables: family -> [(max BLOCK_D, config for 16-bit dtypes)]; fp32 halves the tiles.
_FWD: dict[str, list[tuple[int, Config]]] = {
    # Interpreter: small tiles, so that lengths of 17..113 cross several tiles in the tests.
    "cpu": [(256, _cfg(16, 16, 1, 1))],
    "sm80": [(64, _cfg(128, 64, 4, 3)), (128, _cfg(128, 64, 4, 2)), (256, _cfg(64, 64, 4, 2))],
    "sm90": [(64, _cfg(128, 128, 8, 3)), (128, _cfg(64, 64, 4, 3)),
             (256, _cfg(128, 64, 8, 2))],
    "gfx90a": [(64, _cfg(128, 64, 4, 1, waves_per_eu=2, matrix_instr_nonkdim=16)),
               (128, _cfg(128, 64, 4, 1, waves_per_eu=2, matrix_instr_nonkdim=16)),
               (256, _cfg(64, 64, 4, 1, waves_per_eu=2, matrix_instr_nonkdim=16))],
    "gfx942": [(64, _cfg(128, 64, 4, 2, waves_per_eu=2, matrix_instr_nonkdim=16)),
               (128, _cfg(128, 64, 4, 2, waves_per_eu=2, matrix_instr_nonkdim=16)),
               (256, _cfg(64, 64, 4, 2, waves_per_eu=1, matrix_instr_nonkdim=16))],
    "gfx950": [(64, _cfg(128, 128, 4, 2, waves_per_eu=2, matrix_instr_nonkdim=16)),
               (128, _cfg(128, 64, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16)),
               (256, _cfg(64, 64, 4, 2, waves_per_eu=1, matrix_instr_nonkdim=16))],
    "generic": [(64, _cfg(64, 64, 4, 2)), (128, _cfg(64, 64, 4, 2)), (256, _cfg(32, 32, 4, 1))],
}

# bwd tables: (dkdv config, dq config); dkdv tiles keys by BLOCK_N and walks queries by BLOCK_M.
_BWD: dict[str, list[tuple[int, tuple[Config, Config]]]] = {
    "cpu": [(256, (_cfg(16, 16, 1, 1), _cfg(16, 16, 1, 1)))],
    "sm80": [(64, (_cfg(64, 128, 8, 2), _cfg(128, 64, 8, 2))),
             (128, (_cfg(64, 128, 8, 2), _cfg(128, 64, 8, 2))),
             (256, (_cfg(32, 64, 4, 1), _cfg(64, 32, 4, 1)))],
    "sm90": [(64, (_cfg(64, 128, 8, 3), _cfg(128, 64, 8, 3))),
             (128, (_cfg(64, 128, 8, 3), _cfg(128, 128, 8, 2))),
             (256, (_cfg(32, 64, 4, 2), _cfg(64, 32, 4, 2)))],
    "gfx90a": [(128, (_cfg(64, 128, 8, 1, waves_per_eu=1, matrix_instr_nonkdim=16),
                      _cfg(128, 64, 8, 1, waves_per_eu=1, matrix_instr_nonkdim=16))),
               (256, (_cfg(32, 64, 4, 1, waves_per_eu=1, matrix_instr_nonkdim=16),
                      _cfg(64, 32, 4, 1, waves_per_eu=1, matrix_instr_nonkdim=16)))],
    "gfx942": [(128, (_cfg(64, 128, 8, 1, waves_per_eu=1, matrix_instr_nonkdim=16),
                      _cfg(128, 64, 8, 1, waves_per_eu=1, matrix_instr_nonkdim=16))),
               (256, (_cfg(32, 64, 4, 1, waves_per_eu=1, matrix_instr_nonkdim=16),
                      _cfg(64, 32, 4, 1, waves_per_eu=1, matrix_instr_nonkdim=16)))],
    "gfx950": [(128, (_cfg(64, 128, 8, 2, waves_per_eu=1, matrix_instr_nonkdim=16),
                      _cfg(128, 64, 8, 2, waves_per_eu=1, matrix_instr_nonkdim=16))),
               (256, (_cfg(32, 64, 4, 1, waves_per_eu=1, matrix_instr_nonkdim=16),
                      _cfg(64, 32, 4, 1, waves_per_eu=1, matrix_instr_nonkdim=16)))],
    "generic": [(128, (_cfg(32, 64, 4, 1), _cfg(64, 32, 4, 1))),
                (256, (_cfg(16, 32, 4, 1), _cfg(32, 16, 4, 1)))],
}


def _pick(rows: list[tuple[int, Any]], head_dim: int) -> Any:
    bd = block_d(head_dim)
    for max_bd, cfg in rows:
        if bd <= max_bd:
            return cfg
    raise ValueError(f"head dim {head_dim} is above the kernels' maximum of 256; "
                     "route it to another backend")


def _shrink_fp32(cfg: Config) -> Config:
    """fp32 tiles take twice the shared memory: halve the larger tile side (not below 16)."""
    out = dict(cfg)
    key = "BLOCK_M" if out["BLOCK_M"] >= out["BLOCK_N"] else "BLOCK_N"
    out[key] = max(16, out[key] // 2)
    return out


def fwd_config(arch: str, head_dim: int, dtype: str, causal: bool) -> Config:
    """Tile config of the forward kernel for ``arch`` (``sm90``, ``gfx942``, ``cpu``...).

    ``causal`` is part of the key so that tables can differ; today they only differ in the
    autotuned candidates (``fwd_candidates``).
    """
    cfg = dict(_pick(_FWD[_family(arch)], head_dim))
    return _shrink_fp32(cfg) if dtype == "fp32" and arch != "cpu" else cfg


def bwd_config(arch: str, head_dim: int, dtype: str, causal: bool) -> Config:
    """Tile configs of the backward kernels: ``{"dkdv": cfg, "dq": cfg, "dq_mode": ...}``.

    ``dq_mode`` "separate" runs a dq kernel of its own (no atomics: deterministic);
    "atomic" accumulates dq inside the dk/dv kernel with fp32 atomics (not deterministic).
    """
    dkdv, dq = _pick(_BWD[_family(arch)], head_dim)
    if dtype == "fp32" and arch != "cpu":
        dkdv, dq = _shrink_fp32(dkdv), _shrink_fp32(dq)
    return {"dkdv": dict(dkdv), "dq": dict(dq), "dq_mode": "separate"}


def fwd_candidates(arch: str, head_dim: int, dtype: str, causal: bool) -> list[Config]:
    """A small set of forward configs to autotune over on the GPU (the table's entry first).

    On sm90 they span one CTA of two warpgroups per SM (128 query rows, 8 warps) to two or
    three CTAs of one warpgroup (64 rows, 4 warps) whose softmax and MMAs interleave.
    """
    base = fwd_config(arch, head_dim, dtype, causal)
    if _family(arch) != "sm90" or dtype == "fp32" or block_d(head_dim) > 128:
        return [base]
    out = [base, _cfg(128, 128, 8, 3), _cfg(64, 64, 4, 2), _cfg(64, 32, 4, 3)]
    if block_d(head_dim) == head_dim:  # the Gluon kernels take unpadded d = 64 / 128 only
        out += GLUON_SM90 + GLUON_WS_WINNERS
    return _unique(out)


#: Hopper Gluon forward (:mod:`.fwd_gluon`), one candidate per cell it won on the H200
#: (2026-12-01): 128x128 on two warpgroups with P through shared memory (16k full/causal,
#: causal + window), with P in registers (1k full, 4k), and 64x64 on one warpgroup with P in
#: registers (1k causal). Taken only where ``fwd.gluon_unsupported`` is None.
GLUON_SM90: list[Config] = [_cfg(128, 128, 8, 1, GLUON=True, P_SMEM=True),
                            _cfg(128, 128, 8, 1, GLUON=True, P_SMEM=False),
                            _cfg(64, 64, 4, 1, GLUON=True, P_SMEM=False)]

#: The warp-specialised Gluon forward (:mod:`.fwd_gluon_ws`): a TMA producer warp and two
#: consumer warpgroups of 64 rows, with (PINGPONG 1/2) or without (0) the explicit schedule
#: between them. Every one is checked and timed by ``benchmarks/gluon_ws.py``.
GLUON_WS_SM90: list[Config] = [
    _cfg(128, 128, 4, 1, GLUON=True, WS=True, PINGPONG=pp, KV_STAGES=kv)
    for kv in (2, 3) for pp in (1, 2, 0)]


def _ws(pingpong: int, kv_stages: int) -> Config:
    return next(c for c in GLUON_WS_SM90
                if (c["PINGPONG"], c["KV_STAGES"]) == (pingpong, kv_stages))


#: The warp-specialised configs that won a cell on the H200 (2026-12-01, bf16 d128 16k,
#: docs/benchmarks/triton_dense.md), so autotuning times them: no ping-pong with 2 KV stages
#: (full 614-616, causal 16/16 596 TFLOP/s), with 3 (causal GQA 32/8 599), and the
#: barrier-only ping-pong with 2 (causal + window 4096: 582). The pp1 schedule lost everywhere
#: (453-506).
GLUON_WS_WINNERS: list[Config] = [_ws(0, 2), _ws(0, 3), _ws(2, 2)]


def bwd_candidates(arch: str, head_dim: int, dtype: str, causal: bool,
                   deterministic: bool) -> list[Config]:
    """Backward configs to autotune over on the GPU; atomic dq only when not deterministic.

    On sm90 the dk/dv kernel keeps 128 keys of dk and dv in registers across two warpgroups
    (64-row query tiles spill a few registers yet measured fastest on the H200).
    """
    base = bwd_config(arch, head_dim, dtype, causal)
    if _family(arch) != "sm90" or dtype == "fp32" or block_d(head_dim) > 128:
        return [base]
    out = [base,
           {"dkdv": _cfg(64, 128, 8, 2), "dq": _cfg(128, 128, 8, 2), "dq_mode": "separate"}]
    if not deterministic and block_d(head_dim) == head_dim:
        out.append(GLUON_BWD_SM90)  # 5 GEMMs, dq by TMA reduce-add (taken where it serves)
    return _unique(out)


#: The Hopper Gluon backward (:mod:`.bwd_gluon`): one kernel, 128 keys a program, 64 query
#: rows a step, dq summed by TMA reduce-add (not deterministic). On the H200 at 16k (bf16,
#: d128, 16 heads) it ran 476 TFLOP/s full and 450 causal against 391 / 321 for the
#: atomic-free pair (benchmarks/bwd_probe.py, 2026-12-05): the autotuner times both.
GLUON_BWD_SM90: Config = {"GLUON": True, "dq_mode": "atomic",
                          "dkdv": _cfg(64, 128, 8, 1), "dq": _cfg(64, 128, 8, 1)}


def _unique(cfgs: list[Any]) -> list[Any]:
    seen: list[Any] = []
    for c in cfgs:
        if c not in seen:
            seen.append(c)
    return seen


def split_config(cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """(kernel constants, launch options) of a config."""
    consts = {k: v for k, v in cfg.items() if k in KERNEL_KEYS}
    launch = {k: v for k, v in cfg.items() if k not in KERNEL_KEYS}
    return consts, launch
