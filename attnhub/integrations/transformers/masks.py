"""transformers' 4-D attention masks turned back into attnhub's mask vocabulary.

transformers hands an attention function one mask tensor per call: boolean from ``sdpa_mask``,
or whatever a user passed as a custom 4-D mask (bool, int 0/1, or float 0 / large negative).
``mask_args`` says what that tensor means in attnhub's terms, so the policy sees the real mask
kind and any backend can serve it:

* causal and/or the layer's sliding window, exactly: ``causal`` / ``window``;
* the same plus key padding (columns no query sees): ``colmask_start`` / ``colmask_end``
  ranges covering every query row of a padded column (column-sparse kind);
* anything else (packed documents, prefix-LM, custom block masks): a ``DenseMask``
  ``mask_mod`` that reads the tensor itself.

Caching is keyed on proof of content, never on identity alone: the translation of a mask is
memoised on the mask tensor (so the layers of one forward pay for it once) together with its
version counter and data pointer, and is recomputed when either changed or when a layer asks
a second time (the next forward: the only way to see an edit through ``.data``, which does
not bump the version). A ``DenseMask`` equals another only while both read the same live
tensor at the same version, so no cache can hand one call another call's mask.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ...errors import InputError

#: Additive values at or below this are "masked": exp(-1e4) is 0 even in float64, so adding
#: them to any finite score removes the key exactly as a boolean False does.
MASKED_BELOW = -1.0e4

_MEMO_ATTR = "_attnhub_mask_memo"
_ATTEND_ALL = "_attnhub_attend_all"


def sdpa_mask_marked(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' boolean ``sdpa_mask``, except that a skipped *bidirectional* mask comes
    back as an all-True mask (``attend_all``) instead of None.

    ``sdpa_mask`` returns None for two different skips: a causal mask without padding (SDPA's
    ``is_causal`` does it) and a bidirectional one without padding (nothing to do). The
    attention function cannot tell them apart and reads the module's ``is_causal``, which
    some encoders set although their mask is bidirectional (Phi-4-multimodal's vision tower:
    eager attends to every patch, SDPA and attnhub cut to causal). A bidirectional skip is
    the one where the caller forbade the causal skip (``create_bidirectional_mask`` and its
    sliding variant pass ``allow_is_causal_skip=False``).

    Every version's signature is read: the query count is ``q_length`` (newer versions) or
    ``cache_position``'s length (older ones, which had ``allow_is_bidirectional_skip``
    already), the device ``device`` or ``cache_position``'s, and positional arguments are
    bound to ``sdpa_mask``'s names. A call this cannot size is returned as ``sdpa_mask``
    made it (never an error in the model's forward)."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if mask is not None:
        return mask
    call = kwargs if not args else _bound(sdpa_mask, args, kwargs)
    if call is None or call.get("allow_is_causal_skip", True) or not call.get(
            "allow_is_bidirectional_skip", False):
        return mask
    sizes = _skipped_sizes(call)
    return mask if sizes is None else attend_all(*sizes)


def _bound(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``fn``'s arguments by name for a call with positional ones (None if unreadable)."""
    import inspect

    try:
        sig = inspect.signature(fn)
        bound = sig.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    out: dict[str, Any] = {}
    for name, value in bound.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _skipped_sizes(call: dict[str, Any]) -> tuple[int, int, int, Any] | None:
    """(batch, queries, keys, device) of a skipped mask's call, in any version's names."""
    position = call.get("cache_position")
    sq = call.get("q_length")
    if sq is None and isinstance(position, torch.Tensor):
        sq = position.shape[0]
    device = call.get("device")
    if device is None:
        device = position.device if isinstance(position, torch.Tensor) else "cpu"
    batch, sk = call.get("batch_size"), call.get("kv_length")
    if not all(isinstance(n, (int, torch.SymInt)) for n in (batch, sq, sk)):
        return None
    return batch, sq, sk, device


def attend_all(batch: int, sq: int, sk: int, device: Any) -> torch.Tensor:
    """A (batch, 1, sq, sk) all-True mask that takes no memory (one element, expanded),
    marked so that ``is_attend_all`` knows it without reading it; a copy or a slice that
    loses the mark is still an all-True mask, translated as one."""
    base = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
    mask = base.expand(batch, 1, sq, sk)
    if not torch.compiler.is_compiling():
        setattr(base, _ATTEND_ALL, True)
        setattr(mask, _ATTEND_ALL, True)
    return mask


def is_attend_all(mask: Any) -> bool:
    """Whether ``mask`` is (a view of) an ``attend_all`` mask: every query sees every key."""
    return (getattr(mask, _ATTEND_ALL, False)
            or getattr(getattr(mask, "_base", None), _ATTEND_ALL, False))


class DenseMask:
    """A boolean (B|1, H|1, Sq|1, Sk) mask as a FlexAttention-style ``mask_mod``.

    Equality is identity: each translation of a mask builds a new instance, so a cache keyed
    on a ``DenseMask`` (the hub's bindings, flex's BlockMasks) can never serve another mask.
    It holds the tensor by weak reference, because those caches keep ``mask_mod`` objects in
    their keys and must not pin one mask per call in memory; the caller keeps the tensor
    alive while it calls (transformers keeps its mask for the whole forward). Build a new
    instance after changing the tensor.
    """

    __name__ = "dense_mask"

    def __init__(self, allowed: torch.Tensor):
        if allowed.dtype != torch.bool or allowed.dim() != 4:
            raise InputError(f"DenseMask takes a boolean 4-D (B, H, Sq, Sk) mask, got "
                             f"{allowed.dtype} of shape {tuple(allowed.shape)}")
        self._ref = weakref.ref(allowed)
        self.shape = tuple(allowed.shape)
        self._bcast = tuple(n > 1 for n in allowed.shape[:3])
        #: the ``cu_seq_lens`` found kept apart by this mask (``guards.check_documents``)
        self.documents: tuple[int, Any] | None = None

    @property
    def allowed(self) -> torch.Tensor:
        t = self._ref()
        if t is None:
            raise InputError("this DenseMask's mask tensor was freed: a DenseMask reads the "
                             "caller's tensor and must be built per call from a live mask")
        return t

    def __call__(self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        t = self.allowed
        bb, hb, qb = self._bcast
        return t[b if bb else b * 0, h if hb else h * 0, q_idx if qb else q_idx * 0, kv_idx]

    def __repr__(self) -> str:
        return f"DenseMask(shape={self.shape}, alive={self._ref() is not None})"


def mask_args(mask: torch.Tensor | None, causal: bool, window: tuple[int, int] | None,
              batch: int, sq: int, sk: int, caller: object = None,
              heads: int | None = None,
              other_windows: tuple[tuple[int, int] | None, ...] = (),
              reach: int | None = None) -> dict[str, Any]:
    """attnhub mask arguments with the same meaning as transformers' ``mask`` for this call.

    ``causal``/``window`` are the layer's own form (used as is when there is no mask);
    ``other_windows`` are further window forms to recognise (models disagree on whether
    ``sliding_window`` counts the query itself). ``caller`` (the attention module) marks
    forward passes: one module asking twice about the same mask tensor means a new forward,
    so the translation is recomputed from the data. ``reach``: a causal sliding layer's
    window (each query sees keys at most ``reach`` before it), for a custom mask over more
    keys than its cache kept (``kept_keys``).
    """
    if mask is None:
        return {"causal": causal, "window": window}
    if not isinstance(mask, torch.Tensor):
        raise InputError(f"attention_mask of type {type(mask).__name__}: attnhub takes the "
                         "tensor masks transformers builds for it (a BlockMask belongs to "
                         "attn_implementation='flex_attention')")
    cut = reach is not None and mask.dim() == 4 and mask.shape[3] > sk
    _check_shape(mask[..., mask.shape[3] - sk:] if cut else mask, batch, sq, sk, heads)
    key = (causal, window, other_windows, batch, sq, sk, cut and reach)
    stamp = proof(mask)
    memo = getattr(mask, _MEMO_ATTR, None)
    if memo is None or memo["proof"] != stamp:
        memo = {"proof": stamp}
        try:
            setattr(mask, _MEMO_ATTR, memo)
        except (AttributeError, RuntimeError):  # a tensor subclass without a __dict__
            _fallback_owner[:] = [memo]
    entry = memo.get(key)
    if entry is not None and id(caller) not in entry[0]:
        entry[0].add(id(caller))  # another layer of the same forward
        return entry[1]
    allowed, owned = as_bool(mask)
    if cut:
        allowed = owned = kept_keys(allowed, sq, sk, reach)  # type: ignore[arg-type]
    forms = [(causal, window)] + [(causal, w) for w in other_windows]
    out = _translate(allowed, forms, batch, sq, sk)
    # the memo owns a converted copy, so it lives exactly as long as the caller's mask
    memo[key] = ({id(caller)}, out, owned)
    return out


_fallback_owner: list[Any] = []


def proof(mask: torch.Tensor) -> tuple[Any, int]:
    """(version, data pointer) of a mask; an inference tensor (``torch.inference_mode``)
    keeps no version counter, so only its data pointer and the second-ask rule (a new
    forward) stand for it, as for an edit through ``.data``."""
    try:
        return mask._version, mask.data_ptr()
    except RuntimeError:
        return None, mask.data_ptr()


def kept_keys(allowed: torch.Tensor, sq: int, sk: int, reach: int) -> torch.Tensor:
    """A custom mask over the whole sequence cut to the ``sk`` keys a sliding layer's cache
    handed this call, with the layer's window applied.

    transformers applies a custom 4-D mask as given (eager and sdpa fail when its columns
    outnumber the keys): a sliding cache (``DynamicSlidingWindowLayer``) keeps the last
    ``window - 1`` keys before the new ones, the last ``sk`` of the sequence the mask covers
    when that sequence ends at the last query, as a mask for past and new tokens does. Read
    so, the first query sees exactly its window in the cache, and the window cuts the later
    queries' oldest keys: the answer of the layer's own sliding mask and of eager over every
    key with the custom mask and the window. (Where the cache dropped no key the mask has a
    column per key and is applied as given, without the window, as eager and sdpa apply it.)
    A mask whose last columns are not the queries' own (a query that sees some key but not
    its own column there: a static cache's unwritten slots, a mask for other keys) cannot be
    placed, and is refused. A query that sees no key at all (a padding query: a row
    left-padded past the window) says nothing about the placement, and stays empty."""
    cols = torch.arange(sk, device=allowed.device)
    rows = torch.arange(sq, device=allowed.device) + (sk - sq)  # bottom-right: the queries
    cut = allowed[..., allowed.shape[3] - sk:].expand(*allowed.shape[:2], sq, sk)
    own = cut[..., torch.arange(sq, device=allowed.device), rows]  # (B|1, H|1, Sq)
    if not bool((own | ~allowed.any(dim=3).expand(own.shape)).all()):
        raise InputError(
            f"attention_mask has {allowed.shape[3]} key columns but this sliding-window layer "
            f"was handed {sk} keys: its cache keeps only the last window - 1 keys before the "
            f"{sq} new ones, and attnhub places them under the mask's last {sk} columns only "
            "where each query that sees a key sees its own column there (a mask over past "
            "and new tokens, ending at the last query), which this mask does not (a static "
            "cache's mask covers unwritten slots); pass a 2-D (B, Sk) padding mask and let "
            "transformers build each layer's mask, or use a cache that keeps every key "
            "(DynamicCache() without the model's config)")
    return cut & (cols.view(1, sk) >= rows.view(sq, 1) - reach)


def _check_shape(mask: torch.Tensor, batch: int, sq: int, sk: int, heads: int | None) -> None:
    ok = (mask.dim() == 4 and mask.shape[0] in (1, batch) and mask.shape[2] in (1, sq)
          and mask.shape[3] == sk and (heads is None or mask.shape[1] in (1, heads)))
    if ok:
        return
    if mask.dim() == 4 and mask.shape[3] == 1:
        # built for another layer's cache (MiniMax's decode masks come from its linear
        # layers'): broadcast, it masks a whole row or nothing, never the padding
        raise InputError(f"attention_mask of shape {tuple(mask.shape)} has one key column for "
                         f"a call with {sk} keys: transformers built it for another cache "
                         "than this layer's (a hybrid model's linear layers, or a sliding "
                         "window of 1 key), and broadcast it would mask a whole row or "
                         "nothing, not the padding; generate without padding (batch 1, or "
                         "equal lengths) with a window of at least 2, or use "
                         "attn_implementation='eager'")
    raise InputError(f"attention_mask of shape {tuple(mask.shape)} does not fit this call "
                     f"(batch {batch}, {heads or 'H'} heads, {sq} queries, {sk} keys): "
                     f"pass a 4-D (B|1, 1|H, Sq|1, {sk}) mask, or a 2-D (B, Sk) padding "
                     "mask and let transformers build the 4-D one")


def as_bool(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(boolean mask, the converted copy or None when ``mask`` is already boolean).

    int masks must hold 0/1 (1 = attend); float masks 0 (attend) and values <= -1e4 or -inf
    (masked): both are boolean in meaning. Anything else is an additive bias: refused.
    """
    if mask.dtype == torch.bool:
        return mask, None
    if not (mask.dtype.is_floating_point or mask.dtype.is_complex):
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise InputError("an integer attention_mask must hold only 0 (masked) and 1 "
                             "(attend); pass a boolean mask (True = attend) instead")
        out = mask != 0
        return out, out
    if mask.dtype.is_complex or not bool(((mask == 0) | (mask <= MASKED_BELOW)).all()):
        raise InputError(
            "attention_mask carries an additive bias (values other than 0 and <= -1e4/-inf, "
            "e.g. ALiBi or relative-position terms); attnhub takes masks, not biases: pass a "
            "boolean mask (True = attend), give ALiBi as alibi_slopes / a score_mod through "
            "attnhub.attention, or use attn_implementation='eager' or 'sdpa' for this model")
    out = mask == 0
    return out, out


def _translate(allowed: torch.Tensor, forms: list[tuple[bool, tuple[int, int] | None]],
               batch: int, sq: int, sk: int) -> dict[str, Any]:
    """The narrowest attnhub form of a boolean mask: the first of ``forms`` (causal, window)
    or plain padding that it equals exactly, plus key padding; else dense."""
    full = allowed.expand(batch, allowed.shape[1], sq, sk)
    if allowed.shape[1] == 1:
        keep = full[:, 0].any(dim=1)  # (B, Sk): key columns some query sees
        rows = torch.arange(sq, device=allowed.device).view(sq, 1) + (sk - sq)
        cols = torch.arange(sk, device=allowed.device).view(1, sk)
        # the mask is authoritative (sdpa ignores is_causal when given one): try the
        # layer's own forms first, then plain padding
        for c, w in dict.fromkeys([*forms, (False, None)]):
            shape = keep.view(batch, 1, 1, sk)
            if c:
                shape = shape & (cols <= rows)
            if w is not None and w[0] >= 0:
                shape = shape & (cols >= rows - w[0])
            if w is not None and w[1] >= 0:
                shape = shape & (cols <= rows + w[1])
            if torch.equal(shape.expand(batch, 1, sq, sk), full):
                out: dict[str, Any] = {"causal": c, "window": w}
                if not bool(keep.all()):  # key padding: every query row of a padded column
                    pad = (~keep).to(torch.int32).view(batch, 1, sk)
                    out.update(colmask_start=torch.zeros_like(pad), colmask_end=pad * sq)
                return out
    return {"mask_mod": DenseMask(allowed)}
