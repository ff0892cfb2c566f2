"""Dense masks and biases: the one place where the mask vocabulary gets its meaning.

Every backend that materialises a mask (the reference, torch SDPA, tests of the kernels) builds
it here, so the semantics of causal alignment, windows, prefix-LM and column-sparse ranges are
written once. Convention (FlashAttention's): query ``i`` sits at key position
``i + Sk - Sq`` under bottom-right alignment and at ``i`` under top-left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..errors import InputError
from .spec import AttnParams


def query_offset(sq: int, sk: int, alignment: str) -> int:
    """Key position of query 0: ``Sk - Sq`` bottom-right, 0 top-left."""
    return sk - sq if alignment == "bottom_right" else 0


def window_within(window: tuple[int, int] | None, bound: int) -> tuple[int, int] | None:
    """``window`` with each edge >= ``bound`` made -1 (unbounded); ``bound`` is at least the
    longer of Sq and Sk (or of every sequence's, for packed or paged calls).

    Exact: a query's position lies in [min(0, Sk - Sq), max(Sq, Sk) - 1] under either
    alignment, so such an edge reaches past every key. Kernels then do their index
    arithmetic on small numbers: an edge of 2**31 - 1 (an "unbounded" sentinel) overflowed
    the Triton kernels' int32 ``pos + right + 1`` and masked every row; ``sys.maxsize``
    wrapped the reference's int64 index grids; 2**64 raised OverflowError inside backends."""
    if window is None:
        return None
    left, right = window
    return (-1 if left >= bound else left, -1 if right >= bound else right)


def allowed_mask(
    params: AttnParams, batch: int, heads: int, sq: int, sk: int, device: torch.device,
    kv_heads: int | None = None,
) -> torch.Tensor | None:
    """Boolean (B|1, H|1, Sq, Sk) of visible (query, key) pairs, or None when all are visible.

    ``kv_heads`` maps per-KV-head column-sparse ranges onto query heads (GQA).
    """
    if not (params.causal or params.window is not None or params.prefix_lens is not None
            or params.colmask_start is not None or params.mask_mod is not None):
        return None
    qi = torch.arange(sq, device=device).view(sq, 1) + query_offset(sq, sk, params.alignment)
    kj = torch.arange(sk, device=device).view(1, sk)
    m: torch.Tensor | None = None

    def both(x: torch.Tensor) -> torch.Tensor:
        return x if m is None else m & x

    if params.causal:
        causal = kj <= qi
        if params.prefix_lens is not None:
            prefix = params.prefix_lens.to(device).view(-1, 1, 1, 1)
            causal = causal.view(1, 1, sq, sk) | (kj.view(1, 1, 1, sk) < prefix)
        m = both(causal if causal.dim() == 4 else causal.view(1, 1, sq, sk))
    elif params.prefix_lens is not None:
        raise ValueError("prefix_lens needs causal=True: prefix-LM is causal after the prefix")
    if params.window is not None:
        left, right = window_within(params.window, max(sq, sk))  # type: ignore[misc]
        w = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if left >= 0:
            w &= kj >= qi - left
        if right >= 0:
            w &= kj <= qi + right
        m = both(w.view(1, 1, sq, sk))
    if params.colmask_start is not None:
        m = both(_column_sparse(params, heads, kv_heads, sq, sk, device))
    if params.mask_mod is not None:
        b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
        h = torch.arange(heads, device=device).view(1, heads, 1, 1)
        q_idx = torch.arange(sq, device=device).view(1, 1, sq, 1)
        kv_idx = torch.arange(sk, device=device).view(1, 1, 1, sk)
        mm = call_user_mod("mask_mod", params.mask_mod, (b, h, q_idx, kv_idx),
                           (batch, heads, sq, sk), lambda t: not t.is_complex(),
                           "a bool tensor such as q_idx >= kv_idx")
        m = both(torch.broadcast_to(mm.to(torch.bool), (batch, heads, sq, sk)))
    return m


def call_user_mod(slot: str, fn: Callable[..., Any], args: tuple[torch.Tensor, ...],
                  shape: tuple[int, ...], kind_ok: Callable[[torch.Tensor], bool],
                  want: str) -> torch.Tensor:
    """The caller's ``score_mod``/``mask_mod`` over index grids that broadcast to ``shape``:
    its exception, or a result that is not a tensor of the right kind and shape, is the
    caller's ``InputError`` naming it, never a backend failure retried on fallbacks (a
    captured tensor shorter than the sequence raised IndexError from inside a backend)."""
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        got = fn(*args)
    except Exception as exc:
        raise InputError(f"{slot} {name!r} raised {type(exc).__name__} on index grids of "
                         f"shape {shape}: {exc} (a tensor it captures must cover every "
                         "position, on q's device)") from exc
    if isinstance(got, torch.Tensor) and kind_ok(got):
        try:
            return torch.broadcast_to(got, shape)
        except RuntimeError:
            pass
    what = (f"a {type(got).__name__}" if not isinstance(got, torch.Tensor)
            else f"a {got.dtype} tensor of shape {tuple(got.shape)}")
    raise InputError(f"{slot} {name!r} returned {what}; it must return {want}, broadcasting "
                     f"to {shape}")


def _column_sparse(params: AttnParams, heads: int, kv_heads: int | None, sq: int, sk: int,
                   device: torch.device) -> torch.Tensor:
    start = params.colmask_start.to(device)
    end = params.colmask_end.to(device) if params.colmask_end is not None else torch.full_like(
        start, sq)
    if start.dim() != 3 or start.shape[-1] != sk:
        raise ValueError(
            f"colmask_start must be (B, H, Sk={sk}), got {tuple(start.shape)}")
    hs = start.shape[1]
    if hs not in (1, heads):
        group = heads // (kv_heads or hs)
        start = start.repeat_interleave(group, dim=1)
        end = end.repeat_interleave(group, dim=1)
    rows = torch.arange(sq, device=device).view(1, 1, sq, 1)
    masked = (rows >= start.unsqueeze(2)) & (rows < end.unsqueeze(2))
    return ~masked


class BottomRightForm(NamedTuple):
    """A mask in FlashAttention's terms: bottom-right ``causal`` and ``window`` (-1 unbounded)
    over the first ``keys`` keys; ``shift`` is how far query positions moved (an ALiBi bias,
    which depends on positions, is only preserved when it is 0)."""

    causal: bool
    window: tuple[int, int]
    keys: int
    shift: int


def bottom_right_form(causal: bool, alignment: str, window: tuple[int, int] | None,
                      sq: int, sk: int) -> BottomRightForm:
    """Express a causal/window mask with bottom-right alignment, as FA2/FA3/FlashInfer take it.

    Top-left masks are converted exactly: keys no query can see are cut off (``keys``), and
    the rest becomes a window measured from the bottom-right position. Raises ValueError when
    no such form exists (a top-left window whose left edge lies right of the diagonal).
    """
    window = window_within(window, max(sq, sk))  # FlashAttention's C++ ints take no 2**31
    left, right = window if window is not None else (-1, -1)
    if (not causal and window is None) or alignment == "bottom_right" or sq == sk:
        return BottomRightForm(causal, (left, right), sk, 0)
    reach = 0 if causal else right  # last visible key, relative to the query's own index
    keys = sk if reach < 0 else min(sk, sq + reach)
    shift = keys - sq  # bottom-right alignment places query i at key i + shift
    if shift == 0:
        return BottomRightForm(causal, (left, right), keys, 0)
    if left >= 0 and left + shift < 0:
        raise ValueError(
            f"top-left window {window} with Sq={sq} > Sk={sk} has no bottom-right form "
            "(its left edge would lie right of the diagonal); use a backend that takes "
            "top-left masks, such as triton or torch_sdpa")
    new_left = -1 if left < 0 else left + shift
    new_right = -1 if reach < 0 else reach - shift
    return BottomRightForm(False, (new_left, new_right), keys, shift)


def alibi_bias(slopes: torch.Tensor, sq: int, sk: int, alignment: str,
               device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B|1, H, Sq, Sk) bias ``-slope * |i_aligned - j|`` (FlashAttention's ALiBi) in
    ``dtype``: fp32 for kernels, the compute dtype for the fp64 reference (an fp32 product
    at distance 1e4 is off by ~1e-4, which the oracle would share with every fp32 kernel)."""
    qi = torch.arange(sq, device=device).view(sq, 1) + query_offset(sq, sk, alignment)
    kj = torch.arange(sk, device=device).view(1, sk)
    dist = (qi - kj).abs().to(dtype)
    s = slopes.to(device=device, dtype=dtype)
    s = s.view(1, -1, 1, 1) if s.dim() == 1 else s.view(s.shape[0], s.shape[1], 1, 1)
    return -s * dist


def doc_ranges(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` per sequence from cumulative lengths (host sync: slow path only)."""
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def attends_nothing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The zero output ``q.shape[:-1] + (Dv,)`` of a call in which no query sees a key, in
    the autograd graph of q, k and v (zero gradients, as the maths gives; a bare
    ``new_zeros`` would cut a training step's graph). Sums over empty slices: exactly 0,
    even where an input holds NaN or inf."""
    zero = q[..., :0].sum(-1, keepdim=True) + k[..., :0].sum() + v[..., :0].sum()
    return zero.expand(*q.shape[:-1], v.shape[-1]).contiguous()


def no_keys_lse(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The LSE of rows that see no key: -inf, fp32 as docs/contract.md says. The dtype is
    explicit: ``torch.full`` would take ``torch.get_default_dtype()`` (float64 for a caller
    who set it so), which the hub's output check refuses."""
    return torch.full(shape, float("-inf"), dtype=torch.float32, device=device)


def learned_slopes(params: AttnParams) -> str | None:
    """Why a kernel whose backward gives ALiBi slopes no gradient cannot serve this call
    (None: it can): the slopes require one (learned per head) and grad mode is on. Without
    the refusal the slopes would silently stay untrained; the caller raises it as a
    ``BackendUnavailableError`` so the rule's next candidate serves (torch_sdpa and the
    reference differentiate them)."""
    s = params.alibi_slopes
    if s is None or not s.requires_grad or not torch.is_grad_enabled():
        return None
    return ("learned ALiBi slopes (alibi_slopes.requires_grad): this kernel's backward gives "
            "the slopes no gradient; torch_sdpa and reference differentiate them")
