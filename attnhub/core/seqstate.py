"""Per-sequence state that some backends keep between calls, beside the paged KV cache.

A linear layer (gla, linear, retention) can decode in O(1) per token only if it keeps a
fixed-size state per (sequence, layer) from one call to the next; without it, every decode
step recomputes that state from the whole context in the KV cache (correct, O(context)).
The core knows nothing about what such a state holds; the contract is:

* a backend that keeps state sets ``Backend.keeps_sequence_state = True`` and implements
  ``Backend.new_sequence_store(StateGeometry)``, returning a store with the
  ``SequenceStore`` methods (allocate / fork / free by sequence id);
* ``attnhub.bind`` marks a layer stateful when its prefill and every decode bucket bind one
  such backend (the state must see every token of a sequence, in order, through it);
* the model attaches one store per such backend to its ``PagedKVCache``
  (``attnhub.nn.attach_sequence_states``), which from then on allocates, forks and frees the
  state together with each sequence (all or nothing: a full store changes nothing);
* ``attnhub.nn.Attention`` passes the store to the backend in ``AttnParams.extra`` under
  ``STATE_KEY``, with the batch's sequence ids (``SEQ_IDS_KEY``, the KV cache's ids) and the
  layer (``LAYER_KEY``); the backend reads and writes the states through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import InputError

#: ``AttnParams.extra`` keys of a stateful call: the store, the batch's sequence ids, the layer.
STATE_KEY = "recurrent_state"
SEQ_IDS_KEY = "seq_ids"
LAYER_KEY = "layer"


@runtime_checkable
class SequenceStore(Protocol):
    """What the KV cache needs from a backend's state store: the sequence lifecycle. Each
    method raises (``CacheFullError`` when full) without changing anything on failure."""

    def allocate(self, seq_id: int) -> None: ...

    def fork(self, src: int, dst: int) -> None: ...

    def free(self, seq_id: int) -> None: ...


@dataclass(frozen=True)
class StateGeometry:
    """What a backend needs to size a store: the layers it serves and their attention shape,
    how many sequences may live at once, and where the KV cache lives."""

    layers: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    max_seqs: int
    device: torch.device
    dtype: torch.dtype


class SequenceStates:
    """The stores attached to one KV cache, by layer; mirrors its sequences' lifecycle."""

    def __init__(self) -> None:
        self._by_layer: dict[int, SequenceStore] = {}
        self._stores: list[SequenceStore] = []
        #: per sequence id, how many stores (the first ones) hold its state, counted right
        #: after each store's call: what a free, or the undo of an allocate or fork, releases
        #: (exactly, after a Ctrl-C too: a store's call that raises changes nothing)
        self._held: dict[int, int] = {}
        #: per sequence id, the store whose call for it was cut short (a Ctrl-C delivered
        #: after the store's last C call, once it had changed its state: the call raised,
        #: yet freed the id): asked again on the retry only if it still holds the id
        self._cut: dict[int, SequenceStore] = {}

    def __bool__(self) -> bool:
        return bool(self._stores)

    def attach(self, layers: Iterable[int], store: SequenceStore) -> None:
        """``store`` holds the state of ``layers`` from now on."""
        layers = list(layers)
        if not isinstance(store, SequenceStore):
            raise InputError(f"attach: {type(store).__name__} is not a SequenceStore (it needs "
                             "allocate, fork and free)")
        taken = sorted(set(layers) & set(self._by_layer))
        if taken:
            raise InputError(f"attach: layers {taken} already have a state store; one store "
                             "per layer")
        by_layer = {**self._by_layer, **dict.fromkeys(layers, store)}
        # one statement, no call: a Ctrl-C never leaves a store listed without its layers
        self._stores, self._by_layer = [*self._stores, store], by_layer

    def store(self, layer: int) -> SequenceStore | None:
        return self._by_layer.get(layer)

    def extra(self, layer: int, seq_ids: Sequence[int]) -> dict[str, Any] | None:
        """The ``AttnParams.extra`` entries of a call of ``layer`` for these sequences, or
        None when no store holds that layer."""
        store = self._by_layer.get(layer)
        if store is None:
            return None
        return {STATE_KEY: store, SEQ_IDS_KEY: tuple(seq_ids), LAYER_KEY: layer}

    def allocate(self, seq_id: int) -> None:
        self._all_or_nothing(lambda s: s.allocate(seq_id), seq_id)

    def fork(self, src: int, dst: int) -> None:
        self._all_or_nothing(lambda s: s.fork(src, dst), dst)

    def free(self, seq_id: int) -> None:
        """Free ``seq_id``'s state in the stores holding it, last first. Retryable: a free
        cut short (Ctrl-C) leaves the count of those still holding it, so the retry neither
        frees a store twice (it would raise, and the sequence could never be freed) nor
        skips one; a store whose own free was cut short after it let go of the id (a Ctrl-C
        after its last C call) is asked again only if it still holds it."""
        held = self._held
        while held.get(seq_id):
            store = self._stores[held[seq_id] - 1]
            if self._cut.get(seq_id) is not store or self._must_free(store, seq_id):
                self._cut[seq_id] = store
                store.free(seq_id)
            held[seq_id] -= 1
            self._cut.pop(seq_id, None)
        held.pop(seq_id, None)
        self._cut.pop(seq_id, None)

    def _all_or_nothing(self, op: Callable[[SequenceStore], None], new_id: int) -> None:
        """Run ``op`` on every store; if one fails (or a Ctrl-C lands), free ``new_id``
        where it succeeded, and in the store whose call failed if it holds the id all the
        same (a Ctrl-C after that store's last C call: its state would leak, under an id
        never handed out)."""
        failed: SequenceStore | None = None
        try:
            for i, s in enumerate(self._stores):
                failed = s
                op(s)
                self._held[new_id] = i + 1
            failed = None
        except BaseException:
            self.free(new_id)
            if failed is not None and self._must_free(failed, new_id):
                failed.free(new_id)
            raise

    @staticmethod
    def _must_free(store: SequenceStore, seq_id: int) -> bool:
        """Whether ``store``, whose call for ``seq_id`` was cut short, still holds it and
        must free it: its ``__contains__`` says so where it has one; else it is asked to
        free it here (False either way: freed now, or refused, the id unknown to it, which
        under the protocol changes nothing)."""
        if hasattr(type(store), "__contains__"):
            return seq_id in store  # type: ignore[operator]
        try:
            store.free(seq_id)
        except Exception:  # noqa: BLE001 - it does not hold the id
            pass
        return False
