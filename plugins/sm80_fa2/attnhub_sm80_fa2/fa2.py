"""``fa2``: the ``flash_attn`` package (FlashAttention-2), dense, varlen and paged KV cache.

Which features are declared is read from the installed interface (``probe.flash_attn_build``).
The paged path goes through ``flash_attn_with_kvcache``, whose C++ check requires the page
size to be a multiple of 256 (``csrc/flash_attn/flash_api.cpp``) and which has no backward.
"""

from __future__ import annotations

import functools

import torch

from attnhub.plugin import (
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    BackendUnavailableError,
    Capabilities,
    DeviceInfo,
    HALF_DTYPES,
    causal_alibi_lse,
    flash_causal,
    flash_dense_form,
    flash_kwargs,
    flash_output_kwargs,
    flash_paged_form,
    flash_varlen,
    flash_varlen_form,
    learned_slopes,
    moved_alibi,
    natural_lse,
    top_left_alibi_reason,
    top_left_reason,
)

from .probe import FlashAttnBuild, flash_attn_build

FA2_PAGE_MULTIPLE = 256
INSTALL_FLASH_ATTN = "pip install 'attnhub-sm80-fa2[flash-attn]'"


def fa2_capabilities(build: FlashAttnBuild) -> Capabilities:
    """What a flash_attn build serves, from the parameters its entry points accept."""
    masks = {"causal"}
    layouts = {"bshd", "bhsd"}
    if build.window:
        masks.add("sliding_window")
    if build.softcap:
        masks.add("softcap")
    if build.alibi:
        masks.add("alibi")
    if build.varlen_ok:
        layouts.add("thd")
        masks.add("document")
    if build.paged:
        layouts.add("paged")
    return Capabilities(
        vendors=frozenset({"cuda"}), min_capability=(8, 0), dtypes=HALF_DTYPES,
        max_head_dim=256, head_dim_multiple=8, masks=frozenset(masks),
        layouts=frozenset(layouts), backward=True, deterministic_backward=build.deterministic,
        page_size_multiple=FA2_PAGE_MULTIPLE, deterministic_forward=True, gqa=True,
        returns_lse=True, top_left_causal=True, dropout=build.dropout,
    )


def dropout_reasons(spec: AttentionSpec) -> list[str]:
    """Dropout calls flash_attn cannot serve as asked (``flash_api.cpp``, ``flash_attn_func``)."""
    if not spec.dropout:
        return []
    r = []
    if spec.layout == "paged":
        r.append("the paged path (flash_attn_with_kvcache) has no dropout")
    if spec.mask.softcap:
        r.append("flash_attn refuses softcap with dropout ('Softcapping does not support "
                 "dropout')")
    if spec.return_lse:
        r.append("with dropout flash_attn returns the LSE only beside the whole dropped "
                 "Sq x Sk probability matrix (return_attn_probs); call without return_lse")
    return r


class FlashAttn2Backend(Backend):
    """FlashAttention-2 from the ``flash_attn`` package."""

    name = "fa2"
    tier = "vendor"
    description = ("FlashAttention-2 (flash_attn): dense, varlen, paged KV cache (page % 256), "
                   "window, softcap, ALiBi, dropout, deterministic backward")
    requires = {"flash_attn": INSTALL_FLASH_ATTN}

    @functools.cached_property
    def build(self) -> FlashAttnBuild:
        return flash_attn_build()

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return fa2_capabilities(self.build)

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        r = top_left_reason(spec) + top_left_alibi_reason(spec)
        if spec.layout == "paged" and spec.needs_grad:
            r.append("the paged path (flash_attn_with_kvcache) has no backward")
        return r + dropout_reasons(spec)

    def _load(self) -> None:
        from flash_attn import flash_attn_interface

        self._fa = flash_attn_interface

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        if params.alibi_slopes is not None and (why := learned_slopes(params)):
            raise BackendUnavailableError(self.name, [why])  # its backward gives them none
        if spec.layout == "paged":
            return self._paged(q, k, v, params)
        out_kw = flash_output_kwargs(params)
        if params.dropout_p:  # drawn from the CUDA generator's Philox state, saved for backward
            out_kw["dropout_p"] = params.dropout_p
        if spec.layout == "thd":
            form, seqlen_k = flash_varlen_form(self.name, params), params.max_seqlen_k or 0
            res = flash_varlen(self._fa.flash_attn_varlen_func, self.name, q, k, v, params,
                               **out_kw)
        else:
            form, k, v = flash_dense_form(self.name, params, q, k, v)
            moved = moved_alibi(params, q.shape[1], form.keys)
            if moved:
                raise BackendUnavailableError(self.name, [moved])
            seqlen_k = form.keys
            res = self._fa.flash_attn_func(q, k, v, **flash_kwargs(params, form), **out_kw)
        if not params.return_lse:
            return AttentionOutput(res)
        out, lse = res[0], res[1]
        expect = 2 if spec.layout == "thd" else 3
        if lse.dim() != expect:
            raise BackendUnavailableError(self.name, [
                f"this flash_attn build returned LSE of shape {tuple(lse.shape)}; attnhub "
                "needs (Hq, total_q) for thd: call without return_lse or use fa2_torch"])
        lse = natural_lse(lse)
        if params.alibi_slopes is not None and flash_causal(form.window, form.causal, seqlen_k):
            cu = (params.cu_seqlens_q, params.cu_seqlens_k) if spec.layout == "thd" else None
            lse = causal_alibi_lse(lse, params.alibi_slopes, seqlen_k, cu=cu)
        return AttentionOutput(out, lse)

    def _paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               params: AttnParams) -> AttentionOutput:
        if k.shape[1] % FA2_PAGE_MULTIPLE:
            raise BackendUnavailableError(self.name, [
                f"page size {k.shape[1]} is not a multiple of {FA2_PAGE_MULTIPLE} "
                "(flash_attn_with_kvcache); use flashinfer_decode or fa3 for small pages"])
        form = flash_paged_form(self.name, params, q, k)  # bottom-right only (checked)
        out, lse = self._fa.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=params.seqlens_k, block_table=params.block_table,
            return_softmax_lse=True, **flash_kwargs(params, form))
        if not params.return_lse:
            return AttentionOutput(out, None)
        capacity = params.block_table.shape[1] * k.shape[1]  # what mha_fwd_kvcache clamps by
        lse = natural_lse(lse)
        if params.alibi_slopes is not None and flash_causal(form.window, form.causal, capacity):
            lse = causal_alibi_lse(lse, params.alibi_slopes, capacity, seqlens_k=params.seqlens_k)
        return AttentionOutput(out, lse)
