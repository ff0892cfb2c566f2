"""The keys this plugin reads from ``AttnParams.extra`` (``attention(..., extra={...})``).

Linear layers (gla, linear, retention):
  ``gla_gate``        gla only: log-decay (<= 0), (B, Sk, H, K) per key channel or (B, Sk, H)
                      per head, H = query or KV heads; Sk may be Sq (the new tokens only) when
                      a state cache supplies the prefix. thd/paged: packed like k,
                      (total_k, H, K|-). Absent: derived from k, see ``gates.default_gate``.
  ``recurrent_state`` a :class:`RecurrentStateCache`; with it, each call continues the
                      sequences' states and stores the new ones (decode in O(1) per token).
  ``seq_ids``         the sequence ids (B,) of this batch in that cache (KV-cache ids).
  ``layer``           this layer's id in that cache.
Without ``recurrent_state`` a call with Sq < Sk recomputes the prefix state from k/v (the
keys and values are all in the KV cache), O(Sk) per call: correct, but slower for decode.

Longformer: ``longformer_global`` key positions (G,) int, shared by the batch (default: 0).
LSH: ``lsh_buckets`` (1 or even, default 8), ``lsh_rounds`` (default 4), ``lsh_seed``
(default 0), ``lsh_block`` (queries per block, default 64).
Sparse blocks: ``block`` queries per block for sliding_window/longformer (default 128).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnhub.plugin import LAYER_KEY, SEQ_IDS_KEY, STATE_KEY, InputError

from .state_cache import RecurrentStateCache, whole

GATE = "gla_gate"
# the core's keys: attnhub.nn.Attention passes a bound layer's state store under them
STATE = STATE_KEY
SEQ_IDS = SEQ_IDS_KEY
LAYER = LAYER_KEY
GLOBAL = "longformer_global"
LSH_BUCKETS = "lsh_buckets"
LSH_ROUNDS = "lsh_rounds"
LSH_SEED = "lsh_seed"
LSH_BLOCK = "lsh_block"
BLOCK = "block"


@dataclass(frozen=True)
class StateRef:
    """Where a linear layer's recurrent states live for this call."""

    cache: RecurrentStateCache
    seq_ids: tuple[int, ...]
    layer: int

    def subset(self, i: int) -> StateRef:
        return StateRef(self.cache, (self.seq_ids[i],), self.layer)


def state_ref(extra: dict[str, Any], batch: int, who: str,
              geometry: tuple[int, int, int] | None = None) -> StateRef | None:
    """The state cache reference in ``extra``, validated; None when absent. ``geometry``:
    the call's (query heads, key dim, value dim), which the cache's states must have."""
    cache = extra.get(STATE)
    if cache is None:
        return None
    if not isinstance(cache, RecurrentStateCache):
        raise InputError(f"{who}: extra[{STATE!r}] must be a RecurrentStateCache, got "
                         f"{type(cache).__name__}")
    ids = extra.get(SEQ_IDS)
    layer = extra.get(LAYER)
    if ids is None or layer is None:
        raise InputError(f"{who}: extra[{STATE!r}] needs extra[{SEQ_IDS!r}] (the batch's "
                         f"sequence ids) and extra[{LAYER!r}] (this layer's id in the cache)")
    ids = _seq_ids(ids, who)
    layer = whole(layer, f"{who}: extra[{LAYER!r}]")
    if len(ids) != batch:
        raise InputError(f"{who}: extra[{SEQ_IDS!r}] has {len(ids)} ids for a batch of {batch}")
    held = tuple(cache._pool.shape[2:])
    if geometry is not None and held != tuple(geometry):
        raise InputError(f"{who}: extra[{STATE!r}] holds states of (heads, key dim, value "
                         f"dim) {held}, but this call's are {tuple(geometry)}: build the "
                         "RecurrentStateCache with num_heads = the query heads, key_dim and "
                         "value_dim = this layer's head dims")
    return StateRef(cache, ids, layer)


def _seq_ids(ids: Any, who: str) -> tuple[int, ...]:
    """``extra["seq_ids"]``: ints, or an int tensor of one dimension (``int()`` read a float
    id 0.7 as sequence 0, another sequence's state)."""
    what = f"{who}: extra[{SEQ_IDS!r}]"
    if isinstance(ids, torch.Tensor):
        if ids.dim() > 1 or ids.is_floating_point() or ids.is_complex() or \
                ids.dtype == torch.bool:
            raise InputError(f"{what} is a {ids.dtype} tensor of shape {tuple(ids.shape)}; "
                             "expected the batch's sequence ids as ints (an int tensor (B,))")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
        raise InputError(f"{what}={ids!r} ({type(ids).__name__}); expected the batch's "
                         "sequence ids, a sequence of ints")
    return tuple(whole(s, f"{what}[{i}]") for i, s in enumerate(ids))


def int_option(extra: dict[str, Any], key: str, default: int, who: str) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{who}: extra[{key!r}]={value!r}; expected an int")
    return value


def global_positions(extra: dict[str, Any], sk: int, device: torch.device,
                     who: str) -> torch.Tensor:
    """Sorted unique global key positions inside [0, Sk) (default: position 0)."""
    raw = extra.get(GLOBAL, (0,))
    pos = torch.as_tensor(raw, dtype=torch.long, device=device).flatten()
    if pos.numel() and (int(pos.min()) < 0):
        raise InputError(f"{who}: extra[{GLOBAL!r}] has negative positions; give key "
                         "positions in [0, Sk)")
    return torch.unique(pos[pos < sk])
