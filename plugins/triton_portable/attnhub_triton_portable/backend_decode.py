"""The ``triton_decode`` backend: this plugin's split-KV decode kernel behind the Backend API."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch

from attnhub.plugin import (
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    Capabilities,
    DeviceInfo,
    InputError,
    refuse_stray_descales,
)

from .backend_dense import CPU_REASON, interpreter_on
from .interpreted import serialized

_MASKS = frozenset({"none", "causal", "sliding_window", "softcap", "alibi"})


class TritonDecodeBackend(Backend):
    """Flash-Decoding in Triton: contiguous or paged KV (any page size), 1..16 query tokens
    per sequence, GQA heads packed so each KV head is read once, splits merged by LSE."""

    name = "triton_decode"
    tier = "serving"
    description = ("own Triton split-KV decode (Flash-Decoding): contiguous and paged KV, "
                   "GQA packed, per-sequence lengths, LSE merge")
    capabilities = Capabilities(
        vendors=frozenset({"cpu", "cuda", "rocm"}),
        min_capability=(8, 0),
        dtypes=frozenset({"fp32", "fp16", "bf16"}),
        max_head_dim=256,
        masks=_MASKS,
        phases=frozenset({"decode"}),
        layouts=frozenset({"bshd", "paged"}),
        backward=False,
        deterministic_forward=True,
        gqa=True,
        returns_lse=True,
        top_left_causal=True,
        max_query_len_decode=16,
    )
    requires: ClassVar[dict[str, str]] = {
        "triton": "pip install triton (ships with torch on Linux x86-64)"}

    def available(self, device: DeviceInfo) -> list[str]:
        return super().available(device) + _cpu_reasons(device)

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """What the data cannot say: on the CPU the kernel only runs in Triton's interpreter."""
        return _cpu_reasons(device)

    def _load(self) -> None:
        from . import decode

        self._decode = decode.decode_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        """The LSE is returned when ``params.return_lse`` asks for it, else None (the
        kernels then write it to scratch: one allocation less per call)."""
        if params.extra:
            refuse_stray_descales(self.name, k.dtype, params.extra)
        with serialized(q):
            return self._run(q, k, v, spec, params, None, None)

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
             params: AttnParams, k_descale: torch.Tensor | None,
             v_descale: torch.Tensor | None) -> AttentionOutput:
        _refuse_unserved(params, spec.layout)
        paged = spec.layout == "paged"
        out, lse = self._decode(
            q, k, v, scale=params.scale, causal=params.causal, alignment=params.alignment,
            window=params.window, softcap=params.softcap, alibi_slopes=params.alibi_slopes,
            block_table=params.block_table if paged else None,
            seqlens_k=params.seqlens_k if paged else None,
            max_seqlen_k=params.max_seqlen_k if paged else None, k_descale=k_descale,
            v_descale=v_descale, return_lse=params.return_lse)
        return AttentionOutput(out, lse)


#: Relative L2 error of the output against fp32 attention over the unquantized cache that
#: an e4m3 KV cache (per-(page, KV head) descales, bf16 queries) is allowed: FA3's FP8
#: budget. e4m3 keeps 3 mantissa bits; seen on CPU (random N(0,1) k/v written by appends,
#: 29..80 keys): 0.02-0.05; `attnhub fp8-check --kv` records it per bucket.
FP8_KV_ERROR_BUDGET = 0.08


class TritonDecodeFp8Backend(TritonDecodeBackend):
    """The same split-KV decode over an FP8 (e4m3) KV cache: half the bytes per step.

    K/V stay e4m3 in memory and are widened to the query dtype in registers; the descales
    (``params.extra["k_descale"]``/``["v_descale"]``: (num_pages, Hkv) for a paged cache as
    ``core.kvquant`` keeps them, (B, Hkv) for a contiguous one, or per head / scalar) scale
    the scores and the probabilities. Approximate: bound only behind an accuracy record
    (``attnhub fp8-check --backend triton_decode_fp8``)."""

    name = "triton_decode_fp8"
    description = ("own Triton split-KV decode over an e4m3 KV cache (per-page/head descales, "
                   "16-bit queries and output); behind an fp8-check accuracy record")
    capabilities = replace(
        TritonDecodeBackend.capabilities,
        vendors=frozenset({"cpu", "cuda"}),
        min_capability=(8, 9),  # Triton converts e4m3 (float8e4nv) from sm89 on
        dtypes=frozenset({"fp16", "bf16"}),
        kv_dtypes=frozenset({"fp8_e4m3"}),
        exact=False,
        error_budget=FP8_KV_ERROR_BUDGET,
    )

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        r = super().extra_checks(spec, device)
        if spec.kv_dtype != "fp8_e4m3":
            r.append(f"reads an e4m3 KV cache only (this cache is {spec.kv_dtype}); a 16-bit "
                     "cache goes to triton_decode")
        return r

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        kd, vd = params.extra.get("k_descale"), params.extra.get("v_descale")
        if not isinstance(kd, torch.Tensor) or not isinstance(vd, torch.Tensor):
            raise InputError("triton_decode_fp8: an e4m3 KV cache needs extra={'k_descale': "
                             "..., 'v_descale': ...} float32 tensors ((num_pages, Hkv) for a "
                             "paged cache, e.g. PagedKVCache.scales.descales(layer))")
        try:
            with serialized(q):
                return self._run(q, k, v, spec, params, kd, vd)
        except ValueError as exc:  # the descales' shape/device: the caller's input
            raise InputError(f"triton_decode_fp8: {exc}") from None


def _cpu_reasons(device: DeviceInfo) -> list[str]:
    if device.vendor == "cpu" and not device.simulated and not interpreter_on():
        return [CPU_REASON]
    return []


def _refuse_unserved(params: AttnParams, layout: str) -> None:
    """Per-call data the kernel would otherwise ignore: an error, never a silent change.

    Runs on every call, so the common case (nothing unserved) is one chain of ``is None``.
    """
    if (params.prefix_lens is None and params.colmask_start is None
            and params.cu_seqlens_q is None and params.score_mod is None
            and params.mask_mod is None and (layout != "bshd" or params.seqlens_k is None)):
        return
    unserved: dict[str, Any] = {
        "prefix_lens": params.prefix_lens, "colmask_start": params.colmask_start,
        "cu_seqlens_q": params.cu_seqlens_q, "score_mod": params.score_mod,
        "mask_mod": params.mask_mod,
    }
    given = [name for name, value in unserved.items() if value is not None]
    if given:
        raise InputError(f"triton_decode: {', '.join(given)} given but this decode kernel does "
                         "not apply it; use the triton or flex backend for that mask")
    if layout == "bshd" and params.seqlens_k is not None:
        raise InputError("triton_decode: seqlens_k with layout='bshd' is not part of the bshd "
                         "contract (every backend attends to all Sk keys); pass layout='paged' "
                         "with a block_table, or slice k/v per sequence")
