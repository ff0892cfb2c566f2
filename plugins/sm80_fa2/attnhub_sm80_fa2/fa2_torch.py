"""``fa2_torch``: the FlashAttention-2 that torch ships, for machines without ``flash_attn``.

Plain calls go through ``scaled_dot_product_attention`` restricted to SDPA's FLASH_ATTENTION
backend (so it errors instead of quietly running another kernel). Windows, packed sequences,
bottom-right causal with Sq != Sk and LSE go through the op that backend dispatches to,
``aten::_flash_attention_forward`` (differentiable, takes cu_seqlens). Its capabilities are
read from that op's schema: no softcap, no ALiBi slopes declared, no paged KV.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from attnhub.plugin import (
    HALF_DTYPES,
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    BottomRightForm,
    Capabilities,
    DeviceInfo,
    flash_dense_form,
    flipping_sdpa_switches,
    flash_varlen_form,
    natural_lse,
    top_left_reason,
    unit_head_stride,
    varlen_max_q,
)

from .probe import torch_flash_schema


def torch_flash_capabilities(schema: frozenset[str]) -> Capabilities:
    """Declared from the op's schema: windows only when it takes window sizes."""
    masks = {"causal", "document"}
    if "window_size_left" in schema:
        masks.add("sliding_window")
    return Capabilities(
        vendors=frozenset({"cuda"}), min_capability=(8, 0), dtypes=HALF_DTYPES,
        max_head_dim=256, head_dim_multiple=8, masks=frozenset(masks),
        layouts=frozenset({"bshd", "bhsd", "thd"}), backward=True, deterministic_forward=True,
        gqa=True, returns_lse=True, top_left_causal=True,
    )


class TorchFlashBackend(Backend):
    """torch's vendored FlashAttention-2 (SDPA flash backend and its varlen op)."""

    name = "fa2_torch"
    tier = "vendor"
    description = ("FlashAttention-2 shipped in torch: SDPA FLASH_ATTENTION backend, varlen op "
                   "for windows/packed sequences/LSE; no softcap, ALiBi or paged KV")

    @functools.cached_property
    def schema(self) -> frozenset[str]:
        return torch_flash_schema()

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return torch_flash_capabilities(self.schema)

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        r = top_left_reason(spec)
        if not self.schema:
            r.append("this torch has no aten::_flash_attention_forward; install a CUDA build")
        if not device.simulated and device.vendor == "cuda" \
                and not torch.backends.cuda.is_flash_attention_available():
            r.append("this torch build was compiled without FlashAttention")
        return r

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        q, k, v = unit_head_stride(q, k, v)  # the flash op refuses another head-dim stride
        if spec.layout == "thd":
            form = flash_varlen_form(self.name, params)  # bottom-right only (checked)
            docs = params.cu_seqlens_q.shape[0] - 1
            return self._op(q, k, v, params, form, params.cu_seqlens_q, params.cu_seqlens_k,
                            varlen_max_q(params.max_seqlen_q or 0, q.shape[0], docs),
                            params.max_seqlen_k or 0)
        sq = q.shape[1]
        form, k, v = flash_dense_form(self.name, params, q, k, v)
        square_or_full = not form.causal or sq == form.keys
        if form.window == (-1, -1) and square_or_full and not params.return_lse:
            return AttentionOutput(_sdpa_flash(q, k, v, params.scale, form.causal))
        return self._op(q, k, v, params, form, None, None, sq, form.keys)

    def _op(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttnParams,
            form: BottomRightForm, cu_q: torch.Tensor | None, cu_k: torch.Tensor | None,
            max_q: int, max_k: int) -> AttentionOutput:
        kw: dict[str, Any] = {"scale": params.scale}
        if form.window != (-1, -1):
            kw["window_size_left"], kw["window_size_right"] = form.window
        out, lse = flash_op(q, k, v, cu_q, cu_k, max_q, max_k, form.causal, **kw)
        return AttentionOutput(out, natural_lse(lse) if params.return_lse else None)


def flash_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor | None,
             cu_k: torch.Tensor | None, max_q: int, max_k: int, causal: bool,
             **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) from ``aten::_flash_attention_forward`` (no dropout, no debug mask)."""
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, **kw)
    return res[0], res[1]


def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                causal: bool) -> torch.Tensor:
    """SDPA restricted to its flash backend (top-left causal equals bottom-right here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with flipping_sdpa_switches(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
