"""``triton_rocm``: triton_portable's kernels launched with AMD tiles chosen from the gfx probe.

Dense calls (training, prefill, varlen) go to triton_portable's differentiable
``flash_attention`` with forward/backward configs from :mod:`.configs`; decode calls that the
split-KV kernel serves (contiguous or paged KV, at most 16 query tokens, its masks) go to its
``decode_attention`` with the AMD decode tiles. The capabilities are triton_portable's own,
restricted to ROCm devices, so the two plugins cannot drift apart.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

import attnhub
from attnhub.plugin import (
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    BackendUnavailableError,
    DeviceInfo,
    InputError,
    dtype_name,
    learned_slopes,
)
from attnhub_triton_portable.backend_decode import TritonDecodeBackend
from attnhub_triton_portable.backend_dense import CPU_REASON, TritonDenseBackend, interpreter_on

from .archs import RocmTarget, device_from_properties, rocm_target
from .configs import bwd_config, decode_config, fwd_config
from .launch import for_runtime, runtime_for

_DENSE = TritonDenseBackend()
_DECODE = TritonDecodeBackend()
#: Any ROCm device: the decode kernel's spec checks do not depend on the gfx arch.
_ANY_ROCM = DeviceInfo(vendor="rocm", arch="gfx942", simulated=True)


@functools.lru_cache(maxsize=1024)
def uses_decode_kernel(spec: AttentionSpec) -> bool:
    """Whether a call goes to the split-KV decode kernel: every paged call, and contiguous
    decode calls that kernel fully serves (the dense kernels take the rest)."""
    if spec.layout == "paged":
        return True
    return (spec.phase == "decode" and spec.layout in ("bshd", "bhsd")
            and not _DECODE.capabilities.check(spec, _ANY_ROCM))


@functools.lru_cache(maxsize=None)
def _live_target(index: int) -> RocmTarget:
    props = torch.cuda.get_device_properties(index)
    return rocm_target(device_from_properties(props), props)


class TritonRocmBackend(Backend):
    """triton_portable's flash attention and split-KV decode with per-gfx AMD tiles."""

    name = "triton_rocm"
    tier = "portable"
    description = ("triton_portable kernels with AMD tiles per gfx arch (BLOCK_M/N, warps, "
                   "stages, waves_per_eu, MFMA width); split-KV decode for decode")
    capabilities = replace(
        _DENSE.capabilities, vendors=frozenset({"rocm"}), min_capability=None,
        layouts=_DENSE.capabilities.layouts | _DECODE.capabilities.layouts)
    requires = dict(_DENSE.requires)

    def __init__(self, target: RocmTarget | None = None) -> None:
        """``target`` pins the AMD tiles (tests, CPU dry runs); by default a ROCm GPU's own
        properties decide, and CPU tensors use the simulated device (``--hardware gfx942``)."""
        super().__init__()
        self.target = target

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        if spec.layout == "paged":  # only the decode kernel reads pages
            return [f"paged KV (split-KV decode kernel): {r}"
                    for r in _DECODE.capabilities.check(spec, device)]
        return _DENSE.extra_checks(spec, device)

    def _load(self) -> None:
        from attnhub_triton_portable.autograd import flash_attention
        from attnhub_triton_portable.decode import decode_attention

        self._attention = flash_attention
        self._decode = decode_attention

    def target_for(self, device: torch.device) -> RocmTarget:
        """The gfx target whose tiles a call on ``device`` uses."""
        if self.target is not None:
            return self.target
        if device.type == "cuda" and getattr(torch.version, "hip", None):
            return _live_target(device.index or 0)
        sim = attnhub.probe()
        if sim.vendor != "rocm":
            raise InputError("triton_rocm: tensors on a non-ROCm device and no ROCm target: run "
                             "on an AMD GPU, or for a CPU dry run set ATTNHUB_HARDWARE=gfx942 "
                             "and TRITON_INTERPRET=1")
        return rocm_target(sim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        if params.alibi_slopes is not None and (why := learned_slopes(params)):
            raise BackendUnavailableError(self.name, [why])  # its backward gives them none
        if q.device.type == "cpu" and not interpreter_on():
            raise InputError(f"triton_rocm: {CPU_REASON}")
        target = self.target_for(q.device)
        dtype = dtype_name(q.dtype)
        if uses_decode_kernel(spec):
            paged = spec.layout == "paged"
            out, lse = self._decode(
                q, k, v, scale=params.scale, causal=params.causal,
                alignment=params.alignment, window=params.window, softcap=params.softcap,
                alibi_slopes=params.alibi_slopes,
                block_table=params.block_table if paged else None,
                seqlens_k=params.seqlens_k if paged else None,
                max_seqlen_k=params.max_seqlen_k if paged else None,
                config=decode_config(target, dtype))
            return AttentionOutput(out, lse if params.return_lse else None)
        runtime = runtime_for(q.device)
        d, dv = q.shape[-1], v.shape[-1]
        out, lse = self._attention(
            q, k, v, params, spec.layout,
            fwd_cfg=for_runtime(fwd_config(target, d, dtype, dv), runtime),
            bwd_cfg=for_runtime(bwd_config(target, d, dtype, dv), runtime))
        return AttentionOutput(out, lse if params.return_lse else None)
