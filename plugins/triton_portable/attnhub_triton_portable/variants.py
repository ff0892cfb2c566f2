"""Named score/mask variants (FlexAttention-style callables) for YAML and ``attention(...)``.

Each variant is a factory with parameters plus a few named defaults registered through the
``attnhub_register_variants`` hook:

=================  =============================================  ==========================
name               meaning (q, kv = query / key index)            factory
=================  =============================================  ==========================
softcap30, 50      ``cap * tanh(score / cap)``                    ``softcap(cap)``
alibi8..64         ``score - slope_h * |q - kv|``, the ALiBi       ``alibi(num_heads)``
                   slopes of a model with that many heads
window1024, 4096   causal, and ``q - kv <= size``                 ``sliding_window(size)``
prefix_lm128, 512  ``kv <= q`` or ``kv < prefix``                 ``prefix_lm(prefix)``
(none: data)       same document: ``doc[q] == doc[kv]``           ``document(doc_ids)``
=================  =============================================  ==========================

How to use them:

* Python: ``attnhub.attention(q, k, v, score_mod="softcap30")`` or
  ``mask_mod="window4096"``; a factory gives other parameters:
  ``mask_mod=variants.sliding_window(2048)``.
* YAML: the callable's ``__name__`` is its variant name, so a call with a variant carries
  that name in its spec and a rule selects it with ``when: {variant: [softcap30]}``
  (``variant: [window4096, prefix_lm512]`` matches either). Factory results are named
  after their parameters too (``sliding_window(2048)`` is ``window2048``).

Indices are the raw ones FlexAttention passes (``q_idx``, ``kv_idx``), i.e. top-left: with
Sq != Sk, prefer the built-in arguments (``causal=True, window=...``, ``alibi_slopes=``,
``softcap=``), which follow the call's alignment and run on fused kernels, not only on flex.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from attnhub.plugin import InputError

Mod = Callable[..., torch.Tensor]


def _named(fn: Mod, name: str, doc: str) -> Mod:
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


def softcap(cap: float) -> Mod:
    """score_mod ``cap * tanh(score / cap)`` (Gemma 2 uses 50 in attention)."""
    if not 0 < cap < math.inf:  # inf (read as "no cap") made every score 0 * inf: NaN
        raise ValueError(f"softcap({cap}): the cap must be finite and > 0 (for no cap pass "
                         "no score_mod)")

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return _named(score_mod, f"softcap{cap:g}", f"score -> {cap:g} * tanh(score / {cap:g})")


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi slopes of Press et al.: ``2^(-8(h+1)/n)`` for n a power of two; otherwise
    those of the next lower power of two, then every other slope of twice that."""
    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    low = 1 << (num_heads.bit_length() - 1)
    slopes = powers(low)
    if low != num_heads:
        slopes += powers(2 * low)[0::2][: num_heads - low]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(num_heads: int) -> Mod:
    """score_mod ``score - slope_h * |q - kv|`` with the standard slopes for ``num_heads``."""
    if num_heads < 1:
        raise ValueError(f"alibi({num_heads}): needs at least one head")
    slopes = alibi_slopes(num_heads)

    def score_mod(score, b, h, q_idx, kv_idx):
        if h.dim() == 4 and int(h.max()) + 1 != num_heads:  # dense (1, H, 1, 1): all heads
            raise InputError(heads_mismatch(score_mod, int(h.max()) + 1))
        return score - slopes.to(score.device)[h] * (q_idx - kv_idx).abs()

    fn = _named(score_mod, f"alibi{num_heads}",
                f"ALiBi bias of a {num_heads}-head model: -slope_h * |q - kv|")
    fn.num_heads = num_heads  # type: ignore[attr-defined]
    return fn


def heads_mismatch(fn: Mod, heads: int) -> str | None:
    """Why a variant made for a number of query heads (``fn.num_heads``) cannot serve a call
    with ``heads``: other slopes than the model's (fewer heads), or a read past the slopes
    (more; compiled flex does not bound-check it). None when it fits."""
    want = getattr(fn, "num_heads", None)
    if want is None or want == heads:
        return None
    return (f"score_mod {fn.__name__!r} holds the ALiBi slopes of a {want}-head model, but "
            f"this call has {heads} query heads; pass score_mod=variants.alibi({heads}), or "
            "the model's slopes for these heads as alibi_slopes=")


def sliding_window(size: int) -> Mod:
    """mask_mod: causal, and at most ``size`` keys back (attnhub's ``window=(size, 0)``)."""
    if size < 0:
        raise ValueError(f"sliding_window({size}): the size must be >= 0")

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= size)

    return _named(mask_mod, f"window{size}", f"causal, keys within {size} of the query")


def prefix_lm(prefix: int) -> Mod:
    """mask_mod: the first ``prefix`` keys are visible to every query, the rest causally."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    return _named(mask_mod, f"prefix_lm{prefix}",
                  f"bidirectional over the first {prefix} keys, causal after")


def document(doc_ids: torch.Tensor, causal: bool = False) -> Mod:
    """mask_mod for sequences packed into one row: a query sees keys of its own document
    (``doc_ids`` (S,) int, one id per position), causally if asked. Data, so no named
    default; packed varlen input is better served by ``layout='thd'`` with cu_seqlens."""
    ids = doc_ids

    def mask_mod(b, h, q_idx, kv_idx):
        same = ids[q_idx] == ids[kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    fn = _named(mask_mod, "causal_document" if causal else "document",
                "same document" + (", causal" if causal else ""))
    fn.positions = int(doc_ids.shape[0])  # type: ignore[attr-defined]
    return fn


def positions_mismatch(fn: Mod, q_len: int, k_len: int) -> str | None:
    """Why a variant holding one entry per position (``fn.positions``: ``document``'s ids)
    cannot serve indices up to ``q_len``/``k_len``: compiled flex reads past the tensor
    without a bound check (eager flex and the reference raise IndexError). None when it
    fits."""
    have = getattr(fn, "positions", None)
    if have is None or have >= max(q_len, k_len):
        return None
    return (f"mask_mod {fn.__name__!r} holds ids for {have} positions, but this call "
            f"indexes {q_len} queries and {k_len} keys; pass one id per position "
            f"(variants.document(ids) with len(ids) >= {max(q_len, k_len)})")


#: The named defaults registered for YAML and string lookup, by slot (the registry checks
#: each one's arity against its slot).
SCORE_DEFAULTS: tuple[Mod, ...] = (
    softcap(30.0), softcap(50.0), alibi(8), alibi(16), alibi(32), alibi(64))
MASK_DEFAULTS: tuple[Mod, ...] = (
    sliding_window(1024), sliding_window(4096), prefix_lm(128), prefix_lm(512))
DEFAULTS: tuple[Mod, ...] = SCORE_DEFAULTS + MASK_DEFAULTS


def register_variants(register: Callable[..., None]) -> None:
    """Register every named default in its slot."""
    for fn in SCORE_DEFAULTS:
        register(fn.__name__, score_mod=fn, doc=fn.__doc__ or "")
    for fn in MASK_DEFAULTS:
        register(fn.__name__, mask_mod=fn, doc=fn.__doc__ or "")
