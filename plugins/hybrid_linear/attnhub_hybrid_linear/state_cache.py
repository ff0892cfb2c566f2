"""Recurrent state per sequence for linear layers (gla, linear, retention), kept beside the
paged KV cache with the same guarantees.

A linear layer's decode needs one fixed-size state per (sequence, layer): (H, K, V) fp32. The
cache holds them in a preallocated pool of ``max_seqs`` slots. Sequence ids are the KV cache's
ids (``PagedKVCache.allocate``/``fork`` hand them out), so one id names a sequence in both.

Guarantees:
  * allocated per sequence, zeroed on allocation (a slot never leaks a former owner's state);
  * freed on finish (``free``), after which the id is unknown and any use raises;
  * never shared: ``fork`` copies the parent's state into a slot of its own, ``read`` returns
    a copy, ``write`` refuses repeated ids in one call;
  * a full pool raises :class:`attnhub.plugin.CacheFullError` and changes nothing;
  * every change is all or nothing, under a Ctrl-C too (delivered as a call returns): a slot
    is filled while still free, then handed over by one statement with no call in it; a
    write lands its states and positions together (``_to_the_end``).
Each (sequence, layer) also records how many tokens its state has consumed, so a backend can
refuse a state that does not match the context it is given (a stale or skipped step).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from attnhub.plugin import CacheFullError, InputError


def whole(value: Any, what: str) -> int:
    """``value`` as an int when it is one (a Python or numpy int, a one-element int tensor);
    ``int()`` turned a layer 0.7 into layer 0 and True into 1, silently. A float, a bool,
    text or anything else is an :class:`InputError` naming ``what``."""
    if not isinstance(value, (bool, str, bytes)) and not (
            isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise InputError(f"{what}={shown} ({type(value).__name__}); expected an int (a float or "
                     "bool is never rounded into one)")


def _to_the_end(apply: Callable[[], None]) -> None:
    """Run ``apply`` (idempotent); if anything cuts it short (a Ctrl-C after one of its C
    calls), run it once more before the exception goes on: never a state written without
    its position, or the reverse."""
    try:
        apply()
    except BaseException:
        apply()
        raise


class RecurrentStateCache:
    """Pool of per-sequence recurrent states for the linear layers of one model."""

    def __init__(self, *, layers: int | Iterable[int], num_heads: int, key_dim: int,
                 value_dim: int | None = None, max_seqs: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        if isinstance(layers, (bool, str, bytes)) or not isinstance(layers, (int, Iterable)):
            raise InputError(f"RecurrentStateCache: layers={layers!r}; pass a count or the "
                             "layer ids")
        ids = (list(range(layers)) if isinstance(layers, int)
               else [whole(x, "RecurrentStateCache: layer id") for x in layers])
        sizes = {"num_heads": num_heads, "key_dim": key_dim, "max_seqs": max_seqs,
                 "value_dim": key_dim if value_dim is None else value_dim}
        sizes = {k: whole(n, f"RecurrentStateCache: {k}") for k, n in sizes.items()}
        if not ids or min(sizes.values()) <= 0:
            raise InputError(f"RecurrentStateCache: layers={layers!r}, {sizes}; layers, "
                             "num_heads, key_dim, value_dim and max_seqs must all be positive")
        num_heads, key_dim, max_seqs = sizes["num_heads"], sizes["key_dim"], sizes["max_seqs"]
        if len(set(ids)) != len(ids):
            raise InputError(f"RecurrentStateCache: layer ids repeat in {ids}")
        self._row = {layer: i for i, layer in enumerate(ids)}
        self.max_seqs = max_seqs
        self.device = torch.device(device)
        self._pool = torch.zeros(max_seqs, len(ids), num_heads, key_dim, sizes["value_dim"],
                                 dtype=dtype,
                                 device=self.device)
        #: a state's (H, K, V) and the pool's device, as the checks of every write compare them
        self._shape, self._device = tuple(self._pool.shape[2:]), self._pool.device
        self._pos = [[0] * len(ids) for _ in range(max_seqs)]
        self._free: list[int] = list(range(max_seqs - 1, -1, -1))
        self._slot: dict[int, int] = {}
        self._index: tuple[tuple[int, ...], torch.Tensor] = ((), torch.empty(0))

    # -- sequences --------------------------------------------------------------------------
    @property
    def seq_ids(self) -> list[int]:
        return list(self._slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def layers(self) -> list[int]:
        return list(self._row)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._slot

    def allocate(self, seq_id: int) -> None:
        """A zero state (position 0 in every layer) for a new sequence."""
        seq_id = whole(seq_id, "RecurrentStateCache.allocate: seq_id")
        if seq_id in self._slot:
            raise InputError(f"RecurrentStateCache.allocate: sequence {seq_id} already has a "
                             "state; free it first, or fork it to get a separate copy")
        slot = self._take(f"allocate sequence {seq_id}")
        self._pool[slot].zero_()
        self._pos[slot] = [0] * len(self._row)
        self._own(seq_id, slot)

    def fork(self, src: int, dst: int) -> None:
        """``dst`` starts as a copy of ``src`` (state and positions); later writes diverge."""
        s = self._slot_of(src)
        dst = whole(dst, "RecurrentStateCache.fork: dst")
        if dst in self._slot:
            raise InputError(f"RecurrentStateCache.fork: target sequence {dst} already has a "
                             "state; fork into a fresh id (PagedKVCache.fork returns one)")
        slot = self._take(f"fork sequence {src} into {dst}")
        self._pool[slot].copy_(self._pool[s])
        self._pos[slot] = list(self._pos[s])
        self._own(dst, slot)

    def free(self, seq_id: int) -> None:
        """Release a finished sequence's slot; the id is unknown afterwards. All or nothing:
        a Ctrl-C as ``dict.pop`` returned lost the slot (neither owned nor free)."""
        owned = dict(self._slot)
        slot = owned.pop(self._check(seq_id))
        self._slot, self._free = owned, [*self._free, slot]  # no call: never half-done

    def _own(self, seq_id: int, slot: int) -> None:
        """Hand ``slot`` (the last free one, ``_take``, filled while still free) to
        ``seq_id`` in one statement with no call in it: a Ctrl-C lands before or after,
        never with the slot both free and owned, or neither."""
        owned = {**self._slot, seq_id: slot}
        self._slot, self._free = owned, self._free[:-1]

    # -- states -----------------------------------------------------------------------------
    def position(self, seq_id: int, layer: int) -> int:
        """Tokens the state of ``seq_id`` in ``layer`` has consumed."""
        return self._pos[self._slot_of(seq_id)][self._layer_row(layer)]

    def read(self, seq_ids: Sequence[int], layer: int) -> tuple[torch.Tensor, list[int]]:
        """A copy of the states (B, H, K, V) and their positions, in ``seq_ids`` order."""
        slots = self._slots(seq_ids, "read")
        row = self._layer_row(layer)
        return (self._pool[:, row].index_select(0, self._slot_index(slots)),
                [self._pos[s][row] for s in slots])

    def write(self, seq_ids: Sequence[int], layer: int, states: torch.Tensor,
              advance: int | Sequence[int]) -> None:
        """Store new states (B, H, K, V) and advance each position by the tokens consumed."""
        slots = self._slots(seq_ids, "write")
        row = self._layer_row(layer)
        self._check_state("write", states, (len(slots), *self._shape))
        positions = self._pos
        if type(advance) is int and advance >= 0:  # one count for all: a decode step's
            pos = [positions[s][row] + advance for s in slots]
        else:
            try:
                steps = [advance] * len(slots) if isinstance(advance, int) else list(advance)
            except TypeError:  # one count of another type (0.7, a 0-d tensor): whole() judges
                steps = [advance] * len(slots)
            if len(steps) != len(slots):
                raise InputError(f"RecurrentStateCache.write: {len(slots)} sequences but "
                                 f"{len(steps)} token counts")
            # every count judged before anything is written (a refused one changed the states)
            steps = [whole(n, "RecurrentStateCache.write: advance") for n in steps]
            if min(steps, default=0) < 0:
                raise InputError(f"RecurrentStateCache.write: advance={steps}; pass the tokens "
                                 "each state consumed, >= 0 (restore() sets a position back)")
            pos = [positions[s][row] + n for s, n in zip(slots, steps)]
        # values only: a state carrying a training call's graph would pull the pool into it
        # (the next call's backward went through it twice; decode grew it a node per step)
        new, index = states.detach().to(self._pool.dtype), self._slot_index(slots)
        pool = self._pool[:, row]
        # states and positions land together: a Ctrl-C (or any exception) cutting the two
        # short runs both again (idempotent) before it goes on (``_to_the_end``, inlined: this
        # runs for every linear layer of every decode step)
        try:
            pool.index_copy_(0, index, new)
            for s, p in zip(slots, pos):
                positions[s][row] = p
        except BaseException:
            pool.index_copy_(0, index, new)
            for s, p in zip(slots, pos):
                positions[s][row] = p
            raise

    def restore(self, seq_id: int, layer: int, state: torch.Tensor, position: int) -> None:
        """Set one sequence's state in ``layer`` and the tokens it has consumed, absolutely:
        a state rebuilt from the KV cache's context after a step was aborted or skipped."""
        slot, row = self._slot_of(seq_id), self._layer_row(layer)
        position = whole(position, "RecurrentStateCache.restore: position")
        self._check_state("restore", state, self._shape)
        if position < 0:
            raise InputError(f"RecurrentStateCache.restore: position={position}; pass the "
                             "tokens the state has consumed, >= 0")

        def land() -> None:
            self._pool[slot, row].copy_(state.detach())
            self._pos[slot][row] = position

        _to_the_end(land)

    def _check_state(self, where: str, states: Any, want: tuple[int, ...]) -> None:
        """A floating tensor of shape ``want`` on the pool's device: anything else was cast
        (an integer state truncated), moved or half-written before it failed."""
        dims = "B, H, K, V" if len(want) == 4 else "H, K, V"
        if not isinstance(states, torch.Tensor) or not states.is_floating_point():
            got = states.dtype if isinstance(states, torch.Tensor) else type(states).__name__
            raise InputError(f"RecurrentStateCache.{where}: states are {got}; pass a floating "
                             f"point tensor {want} ({dims}) of this cache's states")
        if tuple(states.shape) != want:
            raise InputError(f"RecurrentStateCache.{where}: states have shape "
                             f"{tuple(states.shape)}, expected {want} ({dims})")
        if states.device != self._device:
            raise InputError(f"RecurrentStateCache.{where}: states are on {states.device}, "
                             f"the cache on {self._pool.device}; move them "
                             "(states.to(cache.device))")

    def check_invariants(self) -> None:
        """Every slot is either free or owned by exactly one sequence."""
        owned = list(self._slot.values())
        assert len(owned) == len(set(owned)), "a state slot is owned twice"
        assert not set(owned) & set(self._free), "a slot is both free and owned"
        assert set(owned) | set(self._free) == set(range(self.max_seqs)), "a slot is lost"

    # -- helpers ----------------------------------------------------------------------------
    def _slot_index(self, slots: list[int]) -> torch.Tensor:
        """The slots as a device tensor, kept for the next call: every layer of a decode step
        reads and writes the same batch, and a host-to-device copy per call would stall."""
        key = tuple(slots)
        if self._index[0] != key:
            self._index = (key, torch.tensor(slots, device=self.device))
        return self._index[1]

    def _take(self, what: str) -> int:
        """The free slot ``_own`` hands out next, left on the free list meanwhile."""
        if not self._free:
            raise CacheFullError(
                f"RecurrentStateCache: cannot {what}: all {self.max_seqs} state slots are in "
                "use. No sequence was changed; free finished sequences or build the cache "
                "with a larger max_seqs")
        return self._free[-1]

    def _check(self, seq_id: int) -> int:
        seq_id = whole(seq_id, "RecurrentStateCache: sequence id")
        if seq_id not in self._slot:
            raise InputError(f"RecurrentStateCache: unknown sequence id {seq_id} (live: "
                             f"{sorted(self._slot)}); it was never allocated or was freed")
        return seq_id

    def _slot_of(self, seq_id: int) -> int:
        return self._slot[self._check(seq_id)]

    def _slots(self, seq_ids: Sequence[int], what: str) -> list[int]:
        ids = [whole(s, f"RecurrentStateCache.{what}: sequence id") for s in seq_ids]
        if len(set(ids)) != len(ids):
            raise InputError(f"RecurrentStateCache.{what}: sequence ids repeat in {ids}; each "
                             "sequence has one state (fork to get a second)")
        return [self._slot_of(s) for s in ids]

    def _layer_row(self, layer: int) -> int:
        try:  # a float key finds the int layer it equals (1.0 -> 1): refused first
            return self._row[whole(layer, "RecurrentStateCache: layer")]
        except KeyError:
            raise InputError(f"RecurrentStateCache: layer {layer} has no state here (layers: "
                             f"{self.layers}); build the cache with that layer") from None
