"""Calling FlashAttention-convention kernels (FA2, FA3, CK, FlashInfer) from attnhub's data.

These kernels align causal masks and windows bottom-right, mark fully masked rows with LSE
+inf and take ``softmax_scale``/``causal``/``window_size``/``softcap``/``alibi_slopes``. The
conversion of a top-left mask is exact where it exists (``bottom_right_form``) and refused
with a reason where it does not, never approximated. Shared by every plugin that wraps one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import BackendUnavailableError
from .masking import BottomRightForm, bottom_right_form
from .spec import AttentionSpec, AttnParams


def flash_form(backend: str, params: AttnParams, sq: int, sk: int) -> BottomRightForm:
    """The bottom-right form of ``params``' causal/window mask, or a refusal naming why."""
    try:
        form = bottom_right_form(params.causal, params.alignment, params.window, sq, sk)
    except ValueError as exc:
        raise BackendUnavailableError(backend, [str(exc)]) from None
    if form.shift < 0:
        # top-left with Sq > Sk becomes a window whose right edge is Sq - Sk past the
        # diagonal: FlashAttention clamps a window edge >= Sk to "unbounded" (every query
        # would see every key) and FA3 builds without local attention crash on it
        raise BackendUnavailableError(backend, [
            f"top-left alignment with Sq={sq} > Sk={sk} has no exact FlashAttention form; "
            "pass causal_alignment='bottom_right' or use a backend that takes top-left "
            "masks (triton, torch_sdpa)"])
    if form.keys <= form.window[1] < sq - 1:
        # the same clamp on a bottom-right window when Sq > Sk: the first queries sit
        # before key 0 and must not see the keys past their right edge
        raise BackendUnavailableError(backend, [
            f"window {params.window} with Sq={sq} > Sk={sk}: FlashAttention treats a right "
            f"edge >= Sk as unbounded, which would show the first queries keys their window "
            "excludes; use the triton or torch_sdpa backend for this call"])
    if form.shift and params.alibi_slopes is not None:
        raise BackendUnavailableError(backend, [
            f"ALiBi with top-left alignment and Sq={sq} > Sk={sk} moves query positions; "
            "pass causal_alignment='bottom_right' or use the triton backend"])
    return form


def flash_kwargs(params: AttnParams, form: BottomRightForm) -> dict[str, Any]:
    """Keyword arguments for the features in use only, so an interface lacking an unused
    parameter (FA3 has no ``alibi_slopes``) is still called correctly."""
    kw: dict[str, Any] = {"softmax_scale": params.scale, "causal": form.causal}
    if form.window != (-1, -1):
        kw["window_size"] = form.window
    if params.softcap:
        kw["softcap"] = float(params.softcap)
    if params.alibi_slopes is not None:
        # fp32 with a unit last stride, as flash_attn checks (a strided view is refused)
        # a copy where a backward may follow: flash_attn keeps the slopes on its autograd
        # context (not as a saved tensor), and a caller may refill them before backward()
        kw["alibi_slopes"] = params.alibi_slopes.to(torch.float32, copy=torch.is_grad_enabled()
                                                    ).contiguous()
    return kw


def flash_dense_form(backend: str, params: AttnParams, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> tuple[BottomRightForm, torch.Tensor, torch.Tensor]:
    """``flash_form`` of a bshd call, with k/v cut to the keys the form keeps (a top-left
    causal mask with Sq < Sk never reaches the keys past Sq)."""
    form = flash_form(backend, params, q.shape[1], k.shape[1])
    if form.keys < k.shape[1]:
        k, v = k[:, :form.keys], v[:, :form.keys]
    return form, k, v


def flash_varlen_form(backend: str, params: AttnParams) -> BottomRightForm:
    """``flash_form`` of a packed (thd) call, checked at the max lengths: FlashAttention's
    varlen entry clamps window edges against them for every document."""
    return flash_form(backend, params, params.max_seqlen_q or 1, params.max_seqlen_k or 1)


def flash_paged_form(backend: str, params: AttnParams, q: torch.Tensor,
                     k_cache: torch.Tensor) -> BottomRightForm:
    """``flash_form`` of a paged call, checked at q's length and the tables' capacity
    (pages per row x page size): ``flash_attn_with_kvcache`` clamps window edges against
    that capacity, which a call with more queries than the capacity could expose."""
    capacity = params.block_table.shape[1] * k_cache.shape[1]
    return flash_form(backend, params, q.shape[1], max(capacity, 1))


def varlen_max_q(max_q: int, total_q: int, docs: int) -> int:
    """``max_seqlen_q`` for a FlashAttention varlen call of ``docs`` documents holding
    ``total_q`` queries: FlashAttention's one-query GQA fast path (max_seqlen_q 1) reshapes q
    as one token per document, which throws (or misreads) when some document holds none;
    max_seqlen_q is an upper bound, so 2 is exact there."""
    return 2 if max_q == 1 and total_q != docs else max_q


def flash_varlen(fn: Callable[..., Any], backend: str, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, params: AttnParams, **kw: Any) -> Any:
    """Call a ``flash_attn_varlen_func`` on packed (thd) sequences. Only bottom-right masks
    arrive here (``top_left_reason`` refuses the others for thd); ``kw`` is passed on."""
    form = flash_varlen_form(backend, params)
    docs = params.cu_seqlens_q.shape[0] - 1
    return fn(q, k, v, params.cu_seqlens_q, params.cu_seqlens_k,
              varlen_max_q(params.max_seqlen_q, q.shape[0], docs), params.max_seqlen_k,
              **flash_kwargs(params, form), **kw)


def flash_output_kwargs(params: AttnParams) -> dict[str, Any]:
    """``return_attn_probs`` (which returns the LSE) and ``deterministic`` for FA's dense and
    varlen entry points, each only when asked for."""
    kw: dict[str, Any] = {"return_attn_probs": True} if params.return_lse else {}
    if params.deterministic:
        kw["deterministic"] = True
    return kw


def top_left_reason(spec: AttentionSpec) -> list[str]:
    """Packed and paged calls carry per-sequence lengths the spec cannot see, so a top-left
    mask is only converted for ``bshd``."""
    m = spec.mask
    if m.alignment != "top_left" or not (m.causal or m.window is not None):
        return []
    if spec.layout != "bshd":
        return [f"top-left alignment is converted only for bshd, not {spec.layout} "
                "(for packed sequences with equal q/k lengths bottom_right is identical)"]
    if spec.max_seqlen_q > spec.max_seqlen_k:  # buckets: Sq > Sk for sure (else: forward)
        return ["top-left alignment with Sq > Sk has no exact FlashAttention form (the "
                "kernels clamp the window it needs); use bottom_right or triton/torch_sdpa"]
    return []


def natural_lse(lse: torch.Tensor) -> torch.Tensor:
    """FlashAttention marks fully masked rows with LSE +inf; attnhub's contract is -inf."""
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def flash_causal(window: tuple[int, int], causal: bool, seqlen_k: int) -> bool:
    """Whether a FlashAttention-convention library runs a call as its causal kernel: window
    edges >= ``seqlen_k`` (the length its C++ entry clamps against) count as unbounded, and
    causal sets the right edge to 0 (FA2 ``mha_fwd``, CK ``mha_*fwd.cpp``)."""
    left, right = window
    left = -1 if left >= seqlen_k else left
    right = 0 if causal else (-1 if right >= seqlen_k else right)
    return left < 0 and right == 0


def causal_alibi_lse(lse: torch.Tensor, slopes: torch.Tensor, seqlen_k: int, *,
                     cu: tuple[torch.Tensor, torch.Tensor] | None = None,
                     seqlens_k: torch.Tensor | None = None) -> torch.Tensor:
    """attnhub's natural-log LSE from the one a causal kernel returns with ALiBi.

    Under the causal kernel FA2 (``csrc/flash_attn/src/mask.h``) and CK (ck_tile's
    ``AlibiMode::VERTICAL``, ``block_position_encoding.hpp``) add ``+slope * key`` to the
    scores instead of ``-slope * |query_pos - key|``: the softmax is the same, the LSE is
    higher by ``slope * query_pos`` (``i + Sk - Sq`` per sequence), taken off here. Layouts:
    (B, Hq, Sq) with ``seqlen_k`` keys, or each sequence's ``seqlens_k`` (paged); (Hq, Tq)
    with ``cu`` = (cu_seqlens_q, cu_seqlens_k) (thd: each token's document by
    ``searchsorted``, no host sync). Call it only when :func:`flash_causal` holds."""
    s = slopes.to(lse.device, torch.float32)
    if cu is not None:
        cq, ck = (c.to(lse.device, torch.int64) for c in cu)
        t = torch.arange(lse.shape[1], device=lse.device)
        doc = torch.searchsorted(cq[1:], t, right=True).clamp_max(cq.numel() - 2)
        pos = t - cq[doc] + (ck[1:] - ck[:-1])[doc] - (cq[1:] - cq[:-1])[doc]
        per_token = s.view(-1, 1) if s.dim() == 1 else s[doc].transpose(0, 1)
        return lse - per_token * pos.to(torch.float32)
    sq = lse.shape[-1]
    rows = torch.arange(sq, device=lse.device).view(1, sq)
    keys = (seqlens_k.to(lse.device, torch.int64).view(-1, 1) if seqlens_k is not None
            else seqlen_k)
    pos = (rows + keys - sq).to(torch.float32).unsqueeze(1)  # (1|B, 1, Sq)
    return lse - (s.view(1, -1, 1) if s.dim() == 1 else s.view(lse.shape[0], -1, 1)) * pos


def top_left_alibi_reason(spec: AttentionSpec) -> list[str]:
    """ALiBi with top-left alignment and no mask to cut keys: the kernels place their bias
    bottom-right, so it is refused wherever Sq may differ from Sk."""
    m = spec.mask
    if not m.alibi or m.alignment != "top_left" or m.causal or m.window is not None:
        return []
    if spec.layout in ("thd", "paged") or spec.max_seqlen_q != spec.max_seqlen_k:
        return [f"ALiBi with top-left alignment ({spec.layout}, Sq != Sk): FlashAttention "
                "places its bias bottom-right; pass causal_alignment='bottom_right' or use "
                "triton"]
    return []


def moved_alibi(params: AttnParams, sq: int, keys: int) -> str | None:
    """Why a dense call's top-left ALiBi cannot run (the kept keys are not Sq), or None."""
    if params.alibi_slopes is not None and params.alignment == "top_left" and keys != sq:
        return (f"ALiBi with top-left alignment and Sq={sq} != Sk={keys}: FlashAttention "
                "places its bias bottom-right; pass causal_alignment='bottom_right' or use "
                "triton")
    return None
