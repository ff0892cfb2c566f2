"""Review 10, the recurrent state cache: every change all or nothing under a Ctrl-C.

1. ``free`` was ``self._free.append(self._slot.pop(...))``: a Ctrl-C as ``dict.pop`` returned
   (where CPython delivers one) lost the slot, neither owned nor free; ``allocate``/``fork``
   popped a slot from the free list before handing it over (lost the same way); ``write``
   stored the states, then advanced the positions one sequence at a time (some advanced,
   some not), and ``restore`` the state without its position.
2. ``write`` judged ``advance`` after storing the states: a float or negative count was
   refused with the states already changed (a negative one was not refused at all); a
   non-tensor, integer or other-device state was cast, moved or failed half-way; the sizes
   took floats and bools.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnhub.plugin import InputError
from attnhub.testing import CtrlCAt
from attnhub_hybrid_linear.state_cache import RecurrentStateCache

LAYERS, H, K, V = [2, 5], 2, 3, 4


def _cache(seed: int) -> RecurrentStateCache:
    """Sequences 0, 1 (a fork of 0, advanced) and 7, with random states; room for two more."""
    g = torch.Generator().manual_seed(seed)
    c = RecurrentStateCache(layers=LAYERS, num_heads=H, key_dim=K, value_dim=V, max_seqs=5)
    c.allocate(0)
    c.write([0], 5, torch.randn(1, H, K, V, generator=g), 3)
    c.fork(0, 1)
    c.allocate(7)
    c.write([1, 7], 2, torch.randn(2, H, K, V, generator=g), [2, 4])
    return c


def _snapshot(c: RecurrentStateCache) -> tuple:
    """Each sequence's states and positions (by id, not slot), and the free slots."""
    seqs = {s: (c._pool[slot].tolist(), list(c._pos[slot])) for s, slot in c._slot.items()}
    return seqs, sorted(c._free)


_G = torch.Generator().manual_seed(99)
_NEW = torch.randn(3, H, K, V, generator=_G)
_OPS: dict[str, Callable[[RecurrentStateCache], Any]] = {
    "allocate": lambda c: c.allocate(9),
    "fork": lambda c: c.fork(1, 9),
    "free": lambda c: c.free(0),
    "write": lambda c: c.write([7, 0, 1], 5, _NEW, [1, 2, 3]),
    "restore": lambda c: c.restore(1, 2, _NEW[0], 11),
}


@pytest.mark.parametrize("mode", ["c", "line"])
@pytest.mark.parametrize("op", sorted(_OPS))
def test_a_ctrl_c_anywhere_leaves_the_state_cache_as_before_or_after(op: str,
                                                                      mode: str) -> None:
    """Before: free and allocate lost a slot, write advanced some positions and not
    others, restore set the state without its position."""
    c = _cache(3)
    before = _snapshot(c)
    _OPS[op](c)
    after = _snapshot(c)
    assert before != after
    points = 0
    while True:
        points += 1
        c = _cache(3)
        cut = CtrlCAt(points, mode, ("state_cache.py",))
        cut.run(lambda: _OPS[op](c))  # noqa: B023 - run at once
        if not cut.fired:
            break
        got = _snapshot(c)
        assert got in (before, after), f"{op} interrupted at point {points} ({mode})"
        c.check_invariants()
        for s in c.seq_ids:  # and it goes on: every sequence freed, the pool whole again
            c.free(s)
        assert c.free_slots == c.max_seqs
    assert points > 2


def test_a_free_cut_as_its_pop_returns_loses_no_slot() -> None:
    """The exact delivery point of the bug: after ``dict.pop`` returned the slot."""
    c = _cache(4)
    fired = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_return" and getattr(arg, "__name__", "") == "pop" and not fired:
            fired.append(1)
            raise KeyboardInterrupt("Ctrl-C as dict.pop returns")

    sys.setprofile(profile)
    try:
        c.free(7)
    except KeyboardInterrupt:
        pass
    finally:
        sys.setprofile(None)
    assert fired
    c.check_invariants()  # before: "a slot is lost"
    assert c.free_slots + len(c.seq_ids) == c.max_seqs


@pytest.mark.parametrize("advance,match", [
    (1.5, "advance=1.5"), ([1, -1], "advance=.*>= 0"), ([True, 1], "advance=True"),
])
def test_a_refused_advance_changes_no_state(advance: Any, match: str) -> None:
    """Before: the states were stored, then the count refused (or a negative one taken)."""
    c = _cache(5)
    before = _snapshot(c)
    with pytest.raises(InputError, match=match):
        c.write([0, 7], 5, torch.randn(2, H, K, V), advance)
    assert _snapshot(c) == before


@pytest.mark.parametrize("states,match", [
    ([[0.0]], "states are list"),
    (torch.ones(2, H, K, V, dtype=torch.int64), "states are torch.int64"),
    (torch.ones(2, H, K, V, device="meta"), "on meta.*states.to\\(cache.device\\)"),
    (torch.ones(2, H, K, V + 1), "expected \\(2, 2, 3, 4\\)"),
])
def test_bad_states_are_refused_naming_the_fix(states: Any, match: str) -> None:
    c = _cache(6)
    before = _snapshot(c)
    with pytest.raises(InputError, match=match):
        c.write([0, 7], 5, states, 1)
    with pytest.raises(InputError, match=match.replace("(2, ", "(")
                       if "expected" in match else match):
        c.restore(0, 5, states[0] if isinstance(states, torch.Tensor) else states, 1)
    assert _snapshot(c) == before


@pytest.mark.parametrize("name", ["num_heads", "key_dim", "value_dim", "max_seqs"])
@pytest.mark.parametrize("bad", [2.5, True, 0, -1, "2"])
def test_sizes_must_be_positive_ints(name: str, bad: Any) -> None:
    sizes = {"num_heads": 2, "key_dim": 3, "value_dim": 4, "max_seqs": 2, name: bad}
    with pytest.raises(InputError, match=name if bad not in (0, -1) else "positive"):
        RecurrentStateCache(layers=1, **sizes)
    with pytest.raises(InputError, match="layers=True"):
        RecurrentStateCache(layers=True, num_heads=2, key_dim=3, max_seqs=2)
