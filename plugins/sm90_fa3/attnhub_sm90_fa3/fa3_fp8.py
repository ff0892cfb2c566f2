"""``fa3_fp8``: FlashAttention-3's FP8 (e4m3) forward, bf16 in and out.

bf16 q/k/v are quantized per (batch, KV head) with the recipe in ``ATTNHUB_FP8_RECIPE``
(default ``smooth_k``; see ``fp8.py``) or ``params.extra["fp8_recipe"]``; an FP8 KV cache is
taken as is with ``params.extra["k_descale"]``/``["v_descale"]`` (B, Hkv). FP8 is not exact:
the backend declares ``exact=False`` with a relative-error budget, and the policy binds it
only where ``attnhub fp8-check`` has stored a passing accuracy record.
"""

from __future__ import annotations

import os

import torch

from attnhub.plugin import (
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Capabilities,
    DeviceInfo,
    InputError,
    natural_lse,
    top_left_reason,
)

from .build import Fa3Build
from .fa3 import Fa3Backend, fa3_masks
from .fp8 import E4M3, RECIPES, Fp8Operands, emulate, lse_shift, quantize, quantize_operands

#: Relative L2 error against an fp32 reference that the FP8 path is declared to stay within
#: on inputs without outliers: e4m3 keeps 3 mantissa bits (about 3.6% RMS rounding per
#: element), and the CPU model of the kernel gives 0.046 on random inputs. ``attnhub
#: fp8-check`` measures it per shape and device.
FP8_ERROR_BUDGET = 0.08
ENV_RECIPE = "ATTNHUB_FP8_RECIPE"


def fa3_fp8_capabilities(build: Fa3Build) -> Capabilities:
    """FP8 forward only; bf16 queries (output bf16), bf16 or e4m3 KV."""
    return Capabilities(
        vendors=frozenset({"cuda"}), archs=frozenset({"sm90"}), dtypes=frozenset({"bf16"}),
        kv_dtypes=frozenset({"fp8_e4m3"}), max_head_dim=build.max_head_dim,
        head_dim_multiple=8, masks=fa3_masks(build) - {"document"},
        layouts=frozenset({"bshd", "bhsd"}), phases=frozenset({"prefill", "decode"}),
        exact=False, error_budget=FP8_ERROR_BUDGET, deterministic_forward=True, gqa=True,
        returns_lse=True, top_left_causal=True,
    )


def kv_descale(name: str, d: object, batch: int, kv_heads: int,
               device: torch.device) -> torch.Tensor:
    """A descale of an e4m3 bshd cache as FA3 takes it: float32 (B, Hkv) on the cache's device
    (``CHECK_SHAPE(k_descale, batch_size, num_heads_k)`` in ``hopper/flash_api.cpp``).

    The hub passes on what its contract allows (a number, or a tensor per batch and KV head):
    anything that broadcasts to (B, Hkv), as ``triton_decode_fp8`` reads it (a number, a 0-d
    tensor, one per KV head ``(Hkv,)`` or ``(1, Hkv)``, one per sequence ``(B, 1)``); any
    other shape (per-page descales belong to a paged cache) is the caller's error, named
    here, not a shape check failing inside the kernel library."""
    t = torch.as_tensor(d, dtype=torch.float32, device=device)
    try:
        return torch.broadcast_to(t, (batch, kv_heads)).contiguous()
    except RuntimeError:
        raise InputError(f"fa3_fp8: extra[{name!r}] has shape {tuple(t.shape)}; an e4m3 bshd "
                         f"cache takes one descale per (batch, KV head) = ({batch}, {kv_heads}),"
                         f" per KV head ({kv_heads},), per sequence ({batch}, 1), or a number"
                         ) from None


class Fa3Fp8Backend(Fa3Backend):
    """FA3 FP8 forward with per-(batch, KV head) descales behind an accuracy record (the same
    build probe, requirements and kernel loading as ``fa3``)."""

    name = "fa3_fp8"
    tier = "vendor"
    description = ("FlashAttention-3 FP8 e4m3 forward, per-(batch, KV head) descales, bf16 out; "
                   "bound only behind a passing fp8-check accuracy record")

    #: Quantization recipes a call can pick with ``params.extra["fp8_recipe"]``.
    recipes: tuple[str, ...] = RECIPES

    def __init__(self, recipe: str | None = None) -> None:
        super().__init__()
        self.recipe = recipe or os.environ.get(ENV_RECIPE) or "smooth_k"
        if self.recipe not in RECIPES:
            raise ValueError(f"{ENV_RECIPE}={self.recipe!r}: use one of {', '.join(RECIPES)}")

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return fa3_fp8_capabilities(self.build)

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        r = top_left_reason(spec)
        if not self.build.has("FP8"):
            r.append(f"this FA3 build was compiled without FP8 ({self.build.source})")
        if spec.phase == "decode" and spec.kv_dtype == spec.dtype:
            r.append("decode over a bf16 KV cache would quantize the whole cache every step "
                     "(H200, 1 x 32k: 0.72 ms against 0.06 ms for fa3); keep the cache in FP8")
        if self.recipe == "smooth_k" and spec.mask.softcap and spec.kv_dtype == spec.dtype:
            r.append(f"recipe smooth_k is not softmax-invariant under softcap; set "
                     f"{ENV_RECIPE}=plain")
        return r

    def operands(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 params: AttnParams) -> Fp8Operands:
        """Quantized operands for this call (bf16 inputs, or an FP8 KV cache with descales)."""
        if k.dtype != E4M3:
            recipe = params.extra.get("fp8_recipe", self.recipe)
            if recipe == "smooth_k" and params.softcap:
                raise InputError("fp8_recipe='smooth_k' cannot be used with softcap; "
                                 "pass fp8_recipe='plain'")
            return quantize_operands(q, k, v, recipe)
        try:
            kd, vd = params.extra["k_descale"], params.extra["v_descale"]
        except KeyError:
            raise InputError("an e4m3 KV cache needs params.extra['k_descale'] and "
                             "['v_descale'], (B, Hkv) float32") from None
        b, hkv = k.shape[0], k.shape[2]
        q8, qd = quantize(q, hkv)
        return Fp8Operands(q8, k, v, qd, kv_descale("k_descale", kd, b, hkv, k.device),
                           kv_descale("v_descale", vd, b, hkv, k.device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        ops = self.operands(q, k, v, params)
        out, lse = self._run(ops.q, ops.k, ops.v, spec, params, **ops.descales())
        return self._finish(q, ops, out, lse, params)

    @staticmethod
    def _finish(q: torch.Tensor, ops: Fp8Operands, out: torch.Tensor,
                lse: torch.Tensor | None, params: AttnParams) -> AttentionOutput:
        """The LSE, when asked for, moved back by what smoothing took off each row (from the
        original q, so the correction adds no quantization error)."""
        if not params.return_lse or lse is None:
            return AttentionOutput(out, None)
        lse = natural_lse(lse)
        if ops.k_mean is not None:
            lse = lse + lse_shift(q, ops.k_mean, params.scale)
        return AttentionOutput(out, lse)

    def emulate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        """A model of this backend's numerics on any device (same quantization, the kernel's
        FP8 arithmetic modelled in fp32): for ``attnhub fp8-check --emulate`` and tests."""
        ops = self.operands(q, k, v, params)
        return self._finish(q, ops, *emulate(ops, params), params)
