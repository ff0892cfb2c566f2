"""What a caller's score_mod / mask_mod returns, checked once per BlockMask build.

FlexAttention calls the callables per element (under ``vmap``) and casts what comes back,
so a result of the wrong kind ran silently: a bool or integer score_mod (``score > 0``:
a mask passed as a score) gave scores of 0/1 or truncated ones, a reduction
(``score.sum(-1)``) or a constant was taken per element, where the fp64 reference (which
calls them on whole broadcast tensors) raised. A probe call on two elements at position 0
(a position every call has) finds these before flex runs, as an ``InputError`` naming the
callable, what it returned and the signature it must follow; a callable that raises on it
(a captured tensor on another device) is named the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnhub.plugin import AttnParams, InputError

_FORMS = {"score_mod": "(score, b, h, q_idx, kv_idx) -> a floating tensor of score's shape",
          "mask_mod": "(b, h, q_idx, kv_idx) -> a bool tensor (nonzero: visible) of the "
                        "indices' shape"}


def check_user_mods(params: AttnParams, device: torch.device) -> None:
    """Probe the caller's score_mod and mask_mod (``InputError`` when one breaks its form)."""
    idx = torch.zeros(2, dtype=torch.int64, device=device)
    if params.score_mod is not None:
        score = torch.tensor([0.5, -1.25], dtype=torch.float32, device=device)
        got = _probe("score_mod", params.score_mod, (score, idx, idx, idx, idx))
        _check("score_mod", params.score_mod, got, device, ((2,),),
               lambda t: t.is_floating_point(),
               "a bool result is a mask: pass it as mask_mod=" if _is_bool(got) else
               "return floating scores (score + bias, torch.where(keep, score, -inf))")
    if params.mask_mod is not None:
        got = _probe("mask_mod", params.mask_mod, (idx, idx, idx, idx))
        _check("mask_mod", params.mask_mod, got, device, ((), (2,)),
               lambda t: not t.is_complex(), "return a tensor such as q_idx >= kv_idx")


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool)


def _probe(slot: str, fn: Callable[..., Any], args: tuple[torch.Tensor, ...]) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # the caller's code: its error, named, never a backend failure
        raise InputError(
            f"flex: {slot} {_name(fn)!r} raised {type(exc).__name__} when called as "
            f"{_FORMS[slot]} on 1-d tensors of 2 elements at position 0 on {args[-1].device}: "
            f"{exc} (a tensor it captures must be on that device too)") from exc


def _check(slot: str, fn: Callable[..., Any], got: Any, device: torch.device,
           shapes: tuple[tuple[int, ...], ...], dtype_ok: Callable[[torch.Tensor], bool],
           hint: str) -> None:
    if isinstance(got, torch.Tensor) and tuple(got.shape) in shapes and dtype_ok(got) and \
            got.device == device:
        return
    what = (f"a {type(got).__name__}" if not isinstance(got, torch.Tensor) else
            f"a {got.dtype} tensor of shape {tuple(got.shape)} on {got.device}")
    if isinstance(got, torch.Tensor) and got.dim() > 1:  # doc[b][q_idx] keeps a whole row
        hint += ("; index a captured tensor in one subscript (doc[b, q_idx], not "
                 "doc[b][q_idx], which selects whole rows)")
    raise InputError(f"flex: {slot} {_name(fn)!r} returned {what} for inputs of shape (2,) "
                     f"on {device}; a {slot} is elementwise: {_FORMS[slot]}; {hint}")
