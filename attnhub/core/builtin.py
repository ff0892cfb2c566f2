"""The core's own backends, registered through the same hook as any third-party plugin."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..hookspecs import hookimpl
from .backend import AttentionOutput, Backend
from .capabilities import ALL_MASKS, Capabilities
from .device import DeviceInfo
from .masking import allowed_mask, alibi_bias, doc_ranges
from .paged import paged_to_varlen
from .reference import _doc_params, reference_attention
from .spec import AttentionSpec, AttnParams

_ANY_LAYOUT = frozenset({"bshd", "thd", "paged"})


def _serve_layouts(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, params: AttnParams,
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttnParams, str], AttentionOutput],
) -> AttentionOutput:
    """Turn a paged call into varlen, then hand bshd or thd to ``run``."""
    if spec.layout == "paged":
        b, sq = q.shape[:2]
        qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, k, v, params.block_table, params.seqlens_k)
        p = replace(params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, block_table=None)
        out, lse = run(qv, kv, vv, p, "thd")
        lse_b = lse.view(lse.shape[0], b, sq).transpose(0, 1) if lse is not None else None
        return AttentionOutput(out.view(b, sq, *out.shape[1:]), lse_b)
    return run(q, k, v, params, spec.layout)


class ReferenceBackend(Backend):
    """Math attention in fp64 (CPU) or fp32 (GPU): slow, exact, every mask kind."""

    name = "reference"
    tier = "reference"
    description = "math attention in fp64/fp32 materialising scores; the tests' oracle"
    capabilities = Capabilities(
        dtypes=frozenset({"fp32", "fp16", "bf16"}), max_head_dim=1024, different_v_dim=True,
        masks=ALL_MASKS, layouts=_ANY_LAYOUT, backward=True, deterministic_backward=True,
        deterministic_forward=True, gqa=True, returns_lse=True, top_left_causal=True,
        lse_second_pass=True,
    )

    def forward(self, q, k, v, spec, params):  # type: ignore[override]
        compute = torch.float64 if q.device.type == "cpu" else torch.float32

        def run(q, k, v, p, layout):
            out, lse = reference_attention(q, k, v, p, layout=layout, compute_dtype=compute)
            return AttentionOutput(out.to(q.dtype), lse if p.return_lse else None)

        return _serve_layouts(q, k, v, spec, params, run)


class TorchSDPABackend(Backend):
    """torch's scaled_dot_product_attention. Causal masks without a materialised tensor where
    SDPA has a native form (no mask for one bottom-right query, ``is_causal``,
    ``causal_lower_right``); explicit masks/biases for the other kinds it can express."""

    name = "torch_sdpa"
    tier = "portable"
    description = "torch.nn.functional.scaled_dot_product_attention (any device)"
    capabilities = Capabilities(
        dtypes=frozenset({"fp32", "fp16", "bf16"}), max_head_dim=1024, different_v_dim=True,
        masks=ALL_MASKS - {"softcap", "score_mod"}, layouts=_ANY_LAYOUT, backward=True,
        deterministic_backward=True, deterministic_forward=True, gqa=True, returns_lse=True,
        top_left_causal=True, lse_second_pass=True,
    )

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        if spec.deterministic and spec.needs_grad and device.vendor != "cpu":
            return ["SDPA's fused GPU backward kernels are not deterministic"]
        return []

    def forward(self, q, k, v, spec, params):  # type: ignore[override]
        if spec.layout == "bshd":  # the common case, without the layout plumbing
            return _sdpa_bshd(q, k, v, params)
        return _serve_layouts(q, k, v, spec, params, self._run)

    @staticmethod
    def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams,
             layout: str) -> AttentionOutput:
        if layout == "bshd":
            return _sdpa_bshd(q, k, v, p)
        outs, lses = [], []
        for i, ((qs, qe), (ks, ke)) in enumerate(zip(doc_ranges(p.cu_seqlens_q),
                                                       doc_ranges(p.cu_seqlens_k))):
            o, l = _sdpa_bshd(q[qs:qe][None], k[ks:ke][None], v[ks:ke][None],
                              _doc_params(p, i, p.alibi_slopes))
            outs.append(o[0])
            lses.append(l[0] if l is not None else None)
        lse = torch.cat(lses, -1) if p.return_lse else None
        return AttentionOutput(torch.cat(outs, 0), lse)


def _sdpa_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               p: AttnParams) -> AttentionOutput:
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if sq == 0 or sk == 0:
        out = q.new_zeros(b, sq, hq, v.shape[-1])
        lse = torch.full((b, hq, sq), float("-inf"), device=q.device) if p.return_lse else None
        return AttentionOutput(out, lse)
    native = _native_causal(p, sq, sk)
    if native is not None and not (p.return_lse and q.device.type == "cpu"):
        is_causal, bias_obj = native
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias_obj, is_causal=is_causal,
                                             scale=p.scale, enable_gqa=hq != hkv)
        lse = _lse(qt, kt, p, _causal_allowed(p, sq, sk, q.device), None, None) \
            if p.return_lse else None
        out, lse = _keep_nan(out, lse, qt, lambda: F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=bias_obj, is_causal=is_causal, scale=p.scale,
            enable_gqa=hq != hkv))
        return AttentionOutput(out.transpose(1, 2), lse)
    allowed = allowed_mask(p, b, hq, sq, sk, q.device, kv_heads=hkv)
    bias = alibi_bias(p.alibi_slopes, sq, sk, p.alignment, q.device) \
        if p.alibi_slopes is not None else None
    row_ok = None
    mask = bias
    if allowed is not None:
        row_ok = allowed.any(dim=-1, keepdim=True)
        allowed = allowed | ~row_ok  # fully masked rows attend everywhere, then are zeroed
        mask = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))
    if p.return_lse and q.device.type == "cpu" and (bias is None or q.dtype == torch.float32):
        out, lse = _cpu_flash_with_lse(qt, kt, vt, mask, p.scale)
        if row_ok is not None:
            lse = lse.masked_fill(~row_ok.squeeze(-1), float("-inf"))
    else:
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=p.scale,
                                             enable_gqa=hq != hkv)
        lse = _lse(qt, kt, p, allowed, row_ok, bias) if p.return_lse else None
    out, lse = _keep_nan(out, lse, qt, lambda: F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=mask if mask is None or mask.dtype == torch.bool
        else mask.to(q.dtype), scale=p.scale, enable_gqa=hq != hkv))
    if row_ok is not None:  # fully masked rows: 0 even where q held NaN
        out = out.masked_fill(~row_ok, 0.0)
    return AttentionOutput(out.transpose(1, 2), lse)


def _keep_nan(out: torch.Tensor, lse: torch.Tensor | None, qt: torch.Tensor,
              math_sdpa: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """NaN in means NaN out (docs/contract.md). SDPA's CPU flash kernel returns a row of
    zeros where every score of a row is NaN (a NaN query, or only NaN keys visible): on the
    CPU, NaN of q is added back (one reduction over q) and, when some output row is exactly
    zero, the call is redone by SDPA's math kernel, which keeps NaN (rare: a zero row)."""
    if qt.device.type != "cpu":
        return out, lse
    poison = qt.sum(-1, keepdim=True) * 0  # 0, or NaN on rows with NaN/inf
    out = out + poison.to(out.dtype)
    if bool((out == 0).all(-1).any()):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            out = math_sdpa() + poison.to(out.dtype)
    if lse is not None:  # a fully masked row keeps its -inf
        lse = torch.where(torch.isneginf(lse), lse, lse + poison.squeeze(-1))
    return out, lse


def _native_causal(p: AttnParams, sq: int, sk: int) -> tuple[bool, object] | None:
    """``(is_causal, attn_mask)`` for SDPA when the mask needs no materialised tensor, else
    None. No mask at all: not causal, or one bottom-right query (it sees every key, the decode
    step of every KV-cache generate loop). SDPA's own ``is_causal`` (top-left): Sq == Sk or a
    top-left mask. ``causal_lower_right``: bottom-right with 1 < Sq < Sk (chunked prefill,
    speculative decode), which SDPA runs with flash/mem-efficient kernels on a GPU. Sq > Sk
    bottom-right has rows that see no key (0 out, -inf LSE) and keeps the explicit mask."""
    if (p.window is not None or p.prefix_lens is not None or p.colmask_start is not None
            or p.mask_mod is not None or p.alibi_slopes is not None):
        return None
    if not p.causal or (sq == 1 and p.alignment == "bottom_right"):
        return False, None
    if sq == sk or (p.alignment == "top_left" and sq <= sk):
        return True, None
    if sq < sk:
        return False, causal_lower_right(sq, sk)
    return None


def _causal_allowed(p: AttnParams, sq: int, sk: int,
                    device: torch.device) -> torch.Tensor | None:
    """The (1, 1, Sq, Sk) causal mask for the LSE pass, None when every key is visible."""
    if not p.causal or (sq == 1 and p.alignment == "bottom_right"):
        return None
    return allowed_mask(p, 1, 1, sq, sk, device)


def _cpu_flash_with_lse(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor,
                        mask: torch.Tensor | None,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and natural-log LSE in one pass: the CPU flash kernel SDPA runs returns both
    (GQA native); it takes an additive mask of the query's dtype, not a boolean one, so a
    float bias (ALiBi) takes this path only in fp32, where the cast loses nothing."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=qt.dtype, device=qt.device).masked_fill(
            ~mask, float("-inf"))
    elif mask is not None:
        mask = mask.to(qt.dtype)
    if mask is not None:
        mask = mask.expand(qt.shape[0], qt.shape[1], qt.shape[2], kt.shape[2])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qt, kt, vt, 0.0, False, attn_mask=mask, scale=scale)
    return out, lse


def _lse(qt: torch.Tensor, kt: torch.Tensor, p: AttnParams, allowed: torch.Tensor | None,
         row_ok: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """LSE by a second pass over the scores, in query chunks: on a GPU SDPA's fused kernels
    do not return it (on the CPU ``_cpu_flash_with_lse`` gets it in the same pass)."""
    sq, sk = qt.shape[2], kt.shape[2]
    kt = kt.float().repeat_interleave(qt.shape[1] // kt.shape[1], dim=1)
    chunks = []
    for s0 in range(0, sq, 1024):
        s = torch.matmul(qt[:, :, s0:s0 + 1024].float(), kt.transpose(-1, -2)) * p.scale
        if bias is not None:
            s = s + bias[..., s0:s0 + 1024, :]
        if allowed is not None:
            s = s.masked_fill(~allowed[..., s0:s0 + 1024, :], float("-inf"))
        chunks.append(torch.logsumexp(s, dim=-1))
    lse = torch.cat(chunks, dim=-1)
    if row_ok is not None:
        lse = lse.masked_fill(~row_ok.squeeze(-1), float("-inf"))
    return lse


@hookimpl
def attnhub_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(ReferenceBackend())
    register(TorchSDPABackend())
