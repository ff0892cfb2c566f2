"""Calling FlashAttention-convention kernels (FA2, FA3, CK, FlashInfer) from attnhub's data.

These kernels align causal masks and windows bottom-right, mark fully masked rows with LSE
+inf and take ``softmax_scale``/``causal``/``window_size``/``softcap``/``alibi_slopes``. The
conversion of a top-left mask is exact where it exists (``bottom_right_form``) and refused
with a reason where it does not, never approximated. Shared by every plugin that wraps one.
"""

from __future__ import annotations

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
        kw["alibi_slopes"] = params.alibi_slopes.to(torch.float32)
    return kw


def top_left_reason(spec: AttentionSpec) -> list[str]:
    """Packed and paged calls carry per-sequence lengths the spec cannot see, so a top-left
    mask is only converted for ``bshd``."""
    m = spec.mask
    if m.alignment == "top_left" and (m.causal or m.window is not None) \
            and spec.layout != "bshd":
        return [f"top-left alignment is converted only for bshd, not {spec.layout} "
                "(for packed sequences with equal q/k lengths bottom_right is identical)"]
    return []


def natural_lse(lse: torch.Tensor) -> torch.Tensor:
    """FlashAttention marks fully masked rows with LSE +inf; attnhub's contract is -inf."""
    return lse.masked_fill(lse == float("inf"), float("-inf"))
