"""Review 10b, a second pass over review 10's all-or-nothing caches (commit 6fc684f).

1. ``_hands_out``'s take-back record (a closure over the cache) stayed in the thread's
   record after the call returned, until the thread's next ``allocate``/``fork``/``reserve``:
   a cache the caller let go of after any of those (``step`` and ``append`` reserve too)
   stayed alive, pages and all (GPU memory), until the garbage collector found the cycle.
   The record is plain data now (``("free", id)``, ``("rollback", undo, version)``), which
   holds no cache (dropping it as the call returns would leave a line where a Ctrl-C loses
   the result with nothing to take it back).
2. ``free`` revoked the sequence's block tables before asking the state stores to free it:
   a store that refused (an ordinary exception) left the sequence live, as promised, but its
   tables revoked for good, so the step in flight could no longer be read. The stores are
   asked first now; the tables are still revoked before any page goes back.
3. ``RecurrentStateCache.write`` (every linear layer, every decode step) built a closure and
   judged one int count per sequence through ``whole()``: +12% for a read+write of four
   layers at batch 1 on this CPU box, +19% for the write alone. A single int count is taken
   as it is, and the states and positions land together through an inlined re-run.

Also here, with no fix needed: threads reserving, writing, forking and freeing their own
sequences of one cache concurrently never share a page, nor see another's values.
"""

from __future__ import annotations

import gc
import random
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnhub.core.kvcache import PagedKVCache
from attnhub.core.tables import PAGED
from attnhub.errors import CacheFullError, SeqlensError
from attnhub.testing import CtrlCAt, DictStateStore
from attnhub_hybrid_linear.state_cache import RecurrentStateCache

H, D, P = 1, 2, 2


def _cache(**kw: Any) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_pages=kw.pop("num_pages", 8), page_size=P,
                        num_kv_heads=H, head_dim=D, **kw)


def _kv(n: int, value: float = 1.0) -> list[torch.Tensor]:
    return [torch.full((n, H, D), value) for _ in range(2)]


# -- 1. a dropped cache is freed at once -----------------------------------------------------
_USES: dict[str, Callable[[PagedKVCache], Any]] = {
    "allocate": lambda c: c.allocate(),
    "fork": lambda c: c.fork(c.allocate()),
    "reserve": lambda c: c.reserve([c.allocate()], 3),
    "append": lambda c: c.append(c.allocate(), _kv(3), _kv(3)),
    "step": lambda c: _one_step(c, c.allocate()),
}


def _one_step(c: PagedKVCache, sid: int) -> None:
    with c.step([sid], 1) as st:
        for layer in range(2):
            st.write(layer, torch.ones(1, 1, H, D), torch.ones(1, 1, H, D))


@pytest.mark.parametrize("use", sorted(_USES))
def test_a_cache_let_go_of_is_freed_without_the_garbage_collector(use: str) -> None:
    """Before: the thread's take-back record (a closure over the cache) kept it alive."""
    c = _cache()
    _USES[use](c)
    gone = weakref.ref(c)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del c
        assert gone() is None, f"the cache outlived its last reference after {use}"
    finally:
        if enabled:
            gc.enable()


def test_a_reserve_interrupted_as_it_returns_is_still_taken_back() -> None:
    """A Ctrl-C as the lock is released still takes the reservation back through the plain
    record (review 10's guarantee, kept)."""
    from tests.test_review_9_decoder_steps import _CutLock

    c = _cache()
    a = c.allocate()
    lock = _CutLock()
    c._lock = lock  # type: ignore[assignment]
    lock.armed = True
    with pytest.raises(KeyboardInterrupt):
        c.reserve([a], 3)
    assert c.length(a) == 0 and c.free_pages == c.num_pages
    c.check_invariants()


# -- 2. a store refusing its free leaves the sequence's tables valid ---------------------------
class _RefusingStore(DictStateStore):
    refuse = False

    def free(self, seq_id: int) -> None:
        if self.refuse:
            raise RuntimeError("state store: cannot free now")
        super().free(seq_id)


def _check_table(c: PagedKVCache, table: torch.Tensor, lens: torch.Tensor) -> None:
    q = torch.zeros(table.shape[0], 1, H, D)
    PAGED.check(q, c.k_cache(0), table, lens)


def test_a_store_refusing_its_free_leaves_the_live_sequences_tables_valid() -> None:
    """Before: the tables were revoked first, the store then refused: the sequence stayed
    live (as promised) but every table of its step was refused by the hub for good."""
    store = _RefusingStore()
    c = _cache()
    c.attach_state([1], store)
    a = c.allocate()
    c.append(a, _kv(3), _kv(3))
    table, lens = c.block_table([a]), c.seqlens([a])
    _check_table(c, table, lens)
    store.refuse = True
    with pytest.raises(RuntimeError, match="cannot free now"):
        c.free(a)
    assert a in c.seq_ids and c.length(a) == 3 and a in store.states
    _check_table(c, table, lens)  # before: SeqlensError, "taken back a page it names"
    c.check_invariants()
    store.refuse = False
    c.free(a)  # the retry frees it, and then its tables are revoked
    assert c.free_pages == c.num_pages and not store.states
    with pytest.raises(SeqlensError, match="taken back a page"):
        _check_table(c, table, lens)


# -- 3. the state cache's write on the decode path ---------------------------------------------
def _calls_in_write(c: RecurrentStateCache, *args: Any) -> list[tuple[str, Any]]:
    """The Python functions of state_cache.py that ``c.write(*args)`` enters, with whole()'s
    ``what``."""
    seen: list[tuple[str, Any]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.endswith("state_cache.py"):
            seen.append((frame.f_code.co_name, frame.f_locals.get("what")))

    sys.setprofile(profile)
    try:
        c.write(*args)
    finally:
        sys.setprofile(None)
    return seen


def test_a_decode_steps_state_write_builds_no_closure_nor_judges_each_count() -> None:
    """Before: a closure and ``_to_the_end`` per call, and whole() per sequence for the one
    int count every decode step passes."""
    c = RecurrentStateCache(layers=[0, 3], num_heads=2, key_dim=3, value_dim=4, max_seqs=8)
    for s in range(4):
        c.allocate(s)
    calls = _calls_in_write(c, [0, 1, 2, 3], 3, torch.randn(4, 2, 3, 4), 1)
    names = [name for name, _ in calls]
    assert "_to_the_end" not in names and "land" not in names, names
    assert not [w for n, w in calls if n == "whole" and "advance" in str(w)], calls
    assert [c.position(s, 3) for s in range(4)] == [1] * 4


def _states(c: RecurrentStateCache) -> tuple:
    return ({s: (c._pool[slot].tolist(), list(c._pos[slot])) for s, slot in c._slot.items()},
            sorted(c._free))


def _state_cache() -> RecurrentStateCache:
    g = torch.Generator().manual_seed(7)
    c = RecurrentStateCache(layers=[2, 5], num_heads=2, key_dim=3, value_dim=4, max_seqs=4)
    for s in (0, 4, 9):
        c.allocate(s)
    c.write([0, 4, 9], 5, torch.randn(3, 2, 3, 4, generator=g), [1, 2, 3])
    return c


_NEW = torch.randn(3, 2, 3, 4, generator=torch.Generator().manual_seed(8))


@pytest.mark.parametrize("mode", ["c", "line"])
def test_a_ctrl_c_anywhere_in_a_one_count_write_lands_states_and_positions_together(
        mode: str) -> None:
    """The inlined re-run keeps review 10's guarantee on the one-count path."""
    c = _state_cache()
    before = _states(c)
    c.write([9, 0, 4], 5, _NEW, 1)
    after = _states(c)
    assert before != after
    points = 0
    while True:
        points += 1
        c = _state_cache()
        cut = CtrlCAt(points, mode, ("state_cache.py",))
        cut.run(lambda: c.write([9, 0, 4], 5, _NEW, 1))  # noqa: B023 - run at once
        if not cut.fired:
            break
        assert _states(c) in (before, after), f"interrupted at point {points} ({mode})"
        c.check_invariants()
    assert points > 2


@pytest.mark.parametrize("advance", [-1, True, 1.0])
def test_a_refused_single_count_changes_no_state(advance: Any) -> None:
    c = _state_cache()
    before = _states(c)
    with pytest.raises(Exception, match="advance"):
        c.write([0, 4, 9], 5, _NEW, advance)
    assert _states(c) == before


# -- threads: no page to two sequences ---------------------------------------------------------
def _worker(c: PagedKVCache, tid: int, ops: int, errors: list) -> None:
    """Random operations on this thread's own sequences; each token's value is unique
    (thread, counter), and every sequence is read back after each operation."""
    rng = random.Random(tid)
    mine: dict[int, list[float]] = {}
    code = [float(tid * 1_000_000)]

    def values(n: int) -> list[float]:
        out = []
        for _ in range(n):
            code[0] += 1
            out.append(code[0])
        return out

    def tokens(vals: list[float], *lead: int) -> torch.Tensor:
        t = torch.tensor(vals, dtype=torch.float32)
        return t.view(*(lead or (-1,)), *([1] * 2)).expand(*t.view(*(lead or (-1,))).shape,
                                                            H, D).contiguous()

    try:
        for i in range(ops):
            op = rng.random()
            try:
                if op < 0.15 or not mine:
                    mine[c.allocate()] = []
                elif op < 0.3:
                    s = rng.choice(list(mine))
                    mine[c.fork(s)] = list(mine[s])
                elif op < 0.45:
                    s = rng.choice(list(mine))
                    c.free(s)
                    del mine[s]
                elif op < 0.65:
                    ss = rng.sample(list(mine), min(len(mine), rng.randint(1, 3)))
                    n = rng.randint(0, 3)
                    slots = c.reserve(ss, n)
                    vals = values(n * len(ss))
                    for layer in range(2):
                        c.write(layer, slots, tokens(vals), tokens(vals))
                    for j, s in enumerate(ss):
                        mine[s] += vals[j * n:(j + 1) * n]
                elif op < 0.8:
                    s = rng.choice(list(mine))
                    vals = values(rng.randint(1, 3))
                    c.append(s, [tokens(vals)] * 2, [tokens(vals)] * 2)
                    mine[s] += vals
                else:
                    ss = rng.sample(list(mine), min(len(mine), rng.randint(1, 3)))
                    vals = values(len(ss))
                    with c.step(ss, 1) as st:
                        for layer in range(2):
                            st.write(layer, tokens(vals, len(ss), 1), tokens(vals, len(ss), 1))
                    for s, v in zip(ss, vals):
                        mine[s].append(v)
            except CacheFullError:
                if mine and rng.random() < 0.5:
                    s = rng.choice(list(mine))
                    c.free(s)
                    del mine[s]
            for s, vals in mine.items():
                for layer in range(2):
                    k, v = c.read(layer, s)
                    if k[:, 0, 0].tolist() != vals or v[:, 0, 0].tolist() != vals:
                        errors.append(f"thread {tid}, op {i}: sequence {s} layer {layer} "
                                      f"holds {k[:, 0, 0].tolist()}, wrote {vals}")
                        return
        for s in mine:
            c.free(s)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(f"thread {tid}: {type(exc).__name__}: {exc}")


def test_threads_on_their_own_sequences_never_share_a_page() -> None:
    c = _cache(num_pages=24)
    c.attach_state([1], DictStateStore(slots=10**6))
    errors: list[str] = []
    stop = threading.Event()

    def check() -> None:
        while not stop.is_set():
            try:
                c.check_invariants()
            except AssertionError as exc:
                errors.append(f"invariants: {exc}")
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        checker = threading.Thread(target=check)
        workers = [threading.Thread(target=_worker, args=(c, t, 300, errors)) for t in range(4)]
        checker.start()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        stop.set()
        checker.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    c.check_invariants()
    assert c.free_pages == c.num_pages and not c.seq_ids and not c._undos
