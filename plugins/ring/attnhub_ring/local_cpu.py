"""``torch_flash_cpu``: torch's CPU FlashAttention kernel as a backend that returns its LSE.

The ring merges every block by its LSE, so its local kernel must return it from the kernel
itself (torch SDPA computes it by a second, materialising pass: ``lse_second_pass``). On GPUs
FA3, cuDNN, FA2 and our Triton kernels do; on the CPU this op does, so a CPU ring (tests, gloo)
resolves its local kernel through the policy like a GPU one. Masks: none and square causal
(plus documents, one call per document; an empty one, without queries or keys, is answered
without the kernel whatever its lengths); GQA native; forward and backward.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from attnhub.plugin import (
    FLOAT_DTYPES,
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    BackendUnavailableError,
    Capabilities,
    DeviceInfo,
    InputError,
    attends_nothing,
    doc_ranges,
    no_keys_lse,
    reference_attention,
)

from .block_kernels import flash_backward, flash_forward_cpu

NAME = "torch_flash_cpu"


def _square_reason(causal: bool, alignment: str, sq: int, sk: int,
                   bucketed: bool = False) -> str | None:
    """Why a bottom-right causal call with Sq != Sk is refused; ``bucketed``: ``sq``/``sk``
    are a spec's length buckets (upper bounds), not the call's lengths."""
    if causal and sq != sk and alignment == "bottom_right":
        lengths = (f"Sq (<= {sq}) != Sk (<= {sk})" if bucketed else f"Sq={sq} != Sk={sk}")
        return (f"bottom-right causal with {lengths} (the CPU flash kernel's causal "
                "is top-left; square blocks only)")
    return None


class _FlashCPU(torch.autograd.Function):
    """bshd (q, k, v) -> (out, lse (B,Hq,S)); the backward is the kernel's own.

    fp16/bf16 calls that need gradients run in fp32, and the backward reads the fp32 output:
    its ``D = rowsum(dO * O)`` from the rounded output cancelled on peaked softmaxes (scale
    1, D=64, a few keys), dq/dk up to 9.7x the FlashAttention bound in bf16."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        half = q.dtype in (torch.float16, torch.bfloat16) and any(ctx.needs_input_grad[:3])
        out, lse = flash_forward_cpu(*((x.float() for x in (q, k, v)) if half else (q, k, v)),
                                     causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        if dlse is not None and bool(dlse.ne(0).any()):
            raise InputError(f"{NAME}: a gradient through the returned LSE is not supported "
                             "(the flash backward takes dO only); use the reference backend")
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            return None, None, None, None, None
        dq, dk, dv = flash_backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


class TorchFlashCPUBackend(Backend):
    """aten::_scaled_dot_product_flash_attention_for_cpu, called for its LSE."""

    name = NAME
    tier = "portable"
    description = ("torch's CPU FlashAttention kernel called directly: LSE from the kernel, "
                   "GQA, forward and backward; none/square-causal/document masks")
    capabilities = Capabilities(
        vendors=frozenset({"cpu"}), dtypes=FLOAT_DTYPES, max_head_dim=1024,
        masks=frozenset({"none", "causal", "document"}),
        layouts=frozenset({"bshd", "bhsd", "thd"}), phases=frozenset({"train", "prefill"}),
        backward=True, deterministic_backward=True, deterministic_forward=True, gqa=True,
        returns_lse=True, top_left_causal=True,
    )

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        # bshd: buckets are powers of two, so different buckets mean Sq != Sk for every call
        # in them. thd: a caller's max_seqlen may be an upper bound (and an empty document
        # needs no alignment), so its buckets prove nothing: ``_dense`` checks each document
        if spec.layout == "thd":
            return []
        reason = _square_reason(spec.mask.causal, spec.mask.alignment, spec.max_seqlen_q,
                                spec.max_seqlen_k, bucketed=True)
        return [reason] if reason else []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        if spec.layout != "thd":
            out, lse = self._dense(q, k, v, params)
            return AttentionOutput(out, lse if params.return_lse else None)
        outs, lses = [], []
        for (qs, qe), (ks, ke) in zip(doc_ranges(params.cu_seqlens_q),
                                      doc_ranges(params.cu_seqlens_k)):
            o, l = self._dense(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], params)
            outs.append(o[0])
            lses.append(l[0])
        out = torch.cat(outs) if outs else attends_nothing(q, k, v)
        lse = torch.cat(lses, -1) if lses else q.new_zeros(q.shape[1], 0, dtype=torch.float32)
        return AttentionOutput(out, lse if params.return_lse else None)

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               params: AttnParams) -> tuple[torch.Tensor, torch.Tensor]:
        b, sq, hq, _ = q.shape
        sk = k.shape[1]
        if sq == 0 or sk == 0:  # an empty document: nothing to align, whatever the lengths
            return (attends_nothing(q, k, v),
                    no_keys_lse((b, hq, sq), q.device))
        reason = _square_reason(params.causal, params.alignment, sq, sk)
        if reason:
            raise BackendUnavailableError(self.name, [reason])
        out, lse = _FlashCPU.apply(q, k, v, params.causal, params.scale)
        return _keep_nan(out, lse, q, k, v, params)


def _keep_nan(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, params: AttnParams) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN in, NaN out (docs/contract.md): the CPU flash kernel gives a row of zeros where
    every score is NaN. A query's NaN is added back (one reduction over q); a row that came
    out exactly zero (rare: all-NaN scores, or a true zero) is recomputed by the reference."""
    # (B, S, H, 1): 0, or NaN on rows with NaN/inf. Not a sum times 0: an fp16 row of large
    # finite values sums to inf, and inf * 0 would turn an exact answer into NaN. fp32, not
    # the default dtype: added to the fp32 LSE, a float64 poison would promote it.
    poison = torch.zeros(q.shape[:-1] + (1,), dtype=torch.float32,
                         device=q.device).masked_fill(~torch.isfinite(q).all(-1, keepdim=True),
                                                      float("nan"))
    out = out + poison.to(out.dtype)
    lse = torch.where(torch.isneginf(lse), lse, lse + poison.squeeze(-1).transpose(1, 2))
    if bool((out == 0).all(-1).any()):
        out, lse = reference_attention(q, k, v, replace(params, return_lse=True),
                                       compute_dtype=torch.float32)
        out = out.to(q.dtype)
    return out, lse
