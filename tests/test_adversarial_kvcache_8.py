"""Review round 8, the paged KV cache and its stores under Ctrl-C, threads and misuse: an undo
cut short and then a ``free`` (as the note advised) released a page a fork still held; an
allocate or fork cut short left an orphan counting its pages once too few, or a state slot
nobody frees, or an id handed out twice; a free cut short lost pages, or with a state store
could never be retried; a step's (or ``reserve``'s) later layer written after a fork that
copied the page left the fork zeros; the public ``write`` walked the sequences without the
lock; a profile store kept serving a same-size replace made within the clock's tick.

A Ctrl-C is simulated where CPython runs signal handlers: a Python call's entry or return
(a patched internal raises), or a loop's back edge (a patched list or attribute raises)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import attnhub
from attnhub.core import kvcache
from attnhub.core.device import probe
from attnhub.core.kvcache import PagedKVCache
from attnhub.errors import CacheFullError, InputError
from attnhub.testing import DictStateStore
from attnhub.policy.profile import ProfileStore

H, D = 1, 2


class CutList(list):  # type: ignore[type-arg]
    """A list whose ``cut``-th item assignment is interrupted (a loop's back edge)."""

    def __init__(self, items: list[int], cut: int):
        super().__init__(items)
        self.left = cut

    def __setitem__(self, i, value):  # type: ignore[no-untyped-def]
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt("Ctrl-C in a refcount loop")
        super().__setitem__(i, value)


def _cache(pages: int = 8, page: int = 4, store: DictStateStore | None = None) -> PagedKVCache:
    c = PagedKVCache(num_layers=2, num_pages=pages, page_size=page, num_kv_heads=H, head_dim=D)
    if store is not None:
        c.attach_state([1], store)
    return c


def _fill(c: PagedKVCache, sid: int, n: int, value: float) -> None:
    t = torch.full((n, H, D), value)
    c.append(sid, [t, t], [t, t])


def _keys(c: PagedKVCache, sid: int) -> list[float]:
    return c.read(0, sid)[0].flatten().tolist()


def _consistent(c: PagedKVCache, store: DictStateStore | None) -> None:
    c.check_invariants()
    if store is not None:
        assert set(store.states) == set(c.seq_ids)


# -- 1. an undo cut short, then another operation ----------------------------------------------
@pytest.mark.parametrize("then", ["free", "allocate"])
def test_a_free_after_an_undo_cut_short_never_releases_a_page_a_fork_holds(
        monkeypatch: pytest.MonkeyPatch, then: str) -> None:
    """Before: a Ctrl-C in a step's undo after the sequence was put back on the page it shares
    with a fork, before the refcounts were, and then ``free`` (the note's advice) released
    that page while the fork held it: the next sequence's keys showed in the fork. Now the
    cache finishes an undo cut short before its next operation."""
    c = _cache(pages=4)
    a = c.allocate()
    _fill(c, a, 2, 1.0)
    b = c.fork(a)  # shares page 0
    armed = [False]
    setattr_ = kvcache._Seq.__setattr__

    def cut(seq, name, value):  # type: ignore[no-untyped-def]
        if armed[0] and name == "length":  # the undo put the pages back, not the rest
            armed[0] -= 1  # twice: the abort runs a cut-short undo once more itself
            raise KeyboardInterrupt("Ctrl-C in the undo")
        setattr_(seq, name, value)

    monkeypatch.setattr(kvcache._Seq, "__setattr__", cut)
    with pytest.raises(RuntimeError) as failed:
        with c.step([a], 1):  # a copies page 0 (copy-on-write): refs[0] == 1
            armed[0] = 2
            raise RuntimeError("a layer failed")
    assert armed == [False]
    if then == "allocate":
        c.allocate()
    c.free(a)
    d = c.allocate()
    _fill(c, d, 3, 99.0)
    assert _keys(c, b) == [1.0] * 4  # never d's 99s
    c.check_invariants()
    notes = " ".join(failed.value.__notes__)
    assert "finishes the undo before its next operation" in notes and "abort() again" in notes


def test_an_undo_cut_short_is_finished_by_abort_and_refuses_the_steps_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The step whose undo was cut short is aborted once the undo is finished (by the cache or
    by ``abort()``): a late layer's write is refused, never written past the sequence."""
    c = _cache()
    a = c.allocate()
    _fill(c, a, 2, 1.0)
    real = kvcache.PAGED.revoke

    def cut(t, why):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(kvcache.PAGED, "revoke", real)
        raise KeyboardInterrupt("Ctrl-C in the undo")

    step = c.step([a], 3)  # takes page 1
    monkeypatch.setattr(kvcache.PAGED, "revoke", cut)
    with pytest.raises(KeyboardInterrupt):
        step.abort()
    with pytest.raises(InputError, match="aborted"):
        step.write(1, torch.ones(1, 3, H, D), torch.ones(1, 3, H, D))
    step.abort()  # done already: nothing to do
    assert c.length(a) == 2 and c.pages(a) == (0,) and c.free_pages == 7
    c.check_invariants()


# -- 2 and 5. allocate / fork cut short --------------------------------------------------------
def _interrupt(monkeypatch: pytest.MonkeyPatch, obj: object, name: str,
               after: bool = True) -> None:
    """A Ctrl-C lands as ``obj.name`` returns (``after``) or at its entry, once."""
    real = getattr(obj, name)

    def cut(*args):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(obj, name, real)
        if after:
            real(*args)
        raise KeyboardInterrupt(f"Ctrl-C {'after' if after else 'in'} {name}")

    monkeypatch.setattr(obj, name, cut)


def _interrupt_seq_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next ``_Seq(...)`` is interrupted at its ``__init__``'s entry (once)."""
    real = kvcache._Seq.__init__

    def cut(*args):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(kvcache._Seq, "__init__", real)
        raise KeyboardInterrupt("Ctrl-C as _Seq is built")

    monkeypatch.setattr(kvcache._Seq, "__init__", cut)


@pytest.mark.parametrize("where", ["refcounts", "seq", "states"])
def test_a_fork_cut_short_leaves_no_orphan_and_no_state(monkeypatch: pytest.MonkeyPatch,
                                                        where: str) -> None:
    """Before: a Ctrl-C in the refcount loop left a live fork counting a page once too few
    (freed under another sequence later); one as the fork's ``_Seq`` was built, or right
    after the state stores forked, left a state slot nobody frees and an id handed out
    again (the store then refused every fork). Now a fork is all or nothing."""
    store = DictStateStore()
    c = _cache(pages=6, page=2, store=store)
    a = c.allocate()
    _fill(c, a, 4, 5.0)  # pages 0, 1
    b = c.fork(a)
    if where == "refcounts":
        c._refs = CutList(c._refs, 2)
    elif where == "seq":
        _interrupt_seq_init(monkeypatch)
    else:
        _interrupt(monkeypatch, c.states, "fork")
    try:
        c.fork(a)
    except KeyboardInterrupt:
        assert c.seq_ids == [a, b]
    _consistent(c, store)
    for s in c.seq_ids:
        if s not in (a, b):  # the fork went through (nothing it called was cut)
            c.free(s)
    c.free(a)
    c.free(b)
    d = c.allocate()
    _fill(c, d, 4, 5.0)
    e = c.allocate()
    _fill(c, e, 2, 99.0)
    f = c.fork(d)  # ids and states still work
    assert _keys(c, d) == _keys(c, f) == [5.0] * 8
    _consistent(c, store)


@pytest.mark.parametrize("where", ["seq", "states"])
def test_an_allocate_cut_short_loses_no_state_slot_and_reuses_no_id(
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Before: two allocates interrupted as the ``_Seq`` was built filled a 2-slot store
    with no live sequence (``CacheFullError`` forever); one interrupted right after the store
    allocated reused the id, and every later allocate was refused by the store."""
    store = DictStateStore(slots=2)
    c = _cache(store=store)
    for _ in range(2):
        if where == "seq":
            _interrupt_seq_init(monkeypatch)
        else:
            _interrupt(monkeypatch, c.states, "allocate")
        with pytest.raises(KeyboardInterrupt):
            c.allocate()
        _consistent(c, store)
    a, b = c.allocate(), c.allocate()
    assert a != b
    with pytest.raises(CacheFullError):
        c.allocate()
    _consistent(c, store)


# -- 6. free cut short ---------------------------------------------------------------------------
def test_a_free_cut_short_in_its_refcounts_loses_no_page() -> None:
    """Before: the sequence was gone and its pages neither held nor free."""
    c = _cache(pages=4, page=2)
    a = c.allocate()
    _fill(c, a, 4, 1.0)
    c._refs = CutList(c._refs, 2)
    try:
        c.free(a)
    except KeyboardInterrupt:
        c.free(a)  # the retry finishes it
    assert c.seq_ids == [] and c.free_pages == 4
    c.check_invariants()


@pytest.mark.parametrize("cut", [0, 1])
def test_a_free_cut_short_after_some_stores_freed_is_retried(monkeypatch: pytest.MonkeyPatch,
                                                             cut: int) -> None:
    """Before: a Ctrl-C after one store freed the state (the loop's back edge), before the
    cache dropped the sequence: the retry asked that store again, which refused an id it no
    longer held, so the sequence and its pages could never be freed. Whichever store a free
    reaches second is cut short here (a store's call that raises changes nothing). Since
    review 10 a free cut short is finished before the interrupt goes on (no retry needed)."""
    first, second = DictStateStore(), DictStateStore()
    c = _cache(store=first)
    c.attach_state([0], second)
    a = c.allocate()
    _fill(c, a, 3, 1.0)
    _interrupt(monkeypatch, (first, second)[cut], "free", after=False)
    with pytest.raises(KeyboardInterrupt):
        c.free(a)
    assert c.seq_ids == [] and not first.states and not second.states
    assert c.free_pages == 8
    c.check_invariants()


def test_a_free_cut_short_after_the_stores_freed_is_retried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = DictStateStore()
    c = _cache(store=store)
    a = c.allocate()
    _fill(c, a, 3, 1.0)
    _interrupt(monkeypatch, c.states, "free")
    with pytest.raises(KeyboardInterrupt):
        c.free(a)  # finished before the interrupt goes on (review 10)
    assert c.seq_ids == [] and not store.states and c.free_pages == 8
    c.check_invariants()


# -- 3. a write after a fork that copied the page ------------------------------------------------
def test_a_steps_later_layer_after_a_fork_that_copied_the_page_is_refused() -> None:
    """Before: the step's layer 1, written after a fork that then copied the page (its
    append), was accepted (the page was held alone again); the fork kept zeros for it."""
    c = _cache()
    a = c.allocate()
    _fill(c, a, 2, 1.0)
    step = c.step([a], 1)
    tok = torch.full((1, 1, H, D), 7.0)
    step.write(0, tok, tok)
    b = c.fork(a)
    _fill(c, b, 1, 1.0)  # b copies the page while layer 1 of the token is unwritten
    with pytest.raises(InputError, match="forked since"):
        step.write(1, tok, tok)
    assert c.read(1, a)[0][2].abs().sum() == 0  # nothing written


def test_a_reserved_slot_written_after_a_fork_that_copied_the_page_is_refused() -> None:
    c = _cache()
    a = c.allocate()
    _fill(c, a, 2, 1.0)
    slots = c.reserve([a], 1)
    t = torch.full((1, H, D), 7.0)
    c.write(0, slots, t, t)
    b = c.fork(a)
    _fill(c, b, 1, 1.0)
    with pytest.raises(InputError, match="before its sequence was forked"):
        c.write(1, slots, t, t)
    # the fork copied away: a write to a slot of its own reserved before the fork is refused
    c2 = _cache()
    a2 = c2.allocate()
    _fill(c2, a2, 2, 1.0)
    slots2 = c2.reserve([a2], 1)
    b2 = c2.fork(a2)
    _fill(c2, a2, 1, 1.0)  # a2 copies off: the slot's page is b2's alone now
    with pytest.raises(InputError, match="before its sequence was forked"):
        c2.write(0, slots2, t, t)
    assert c2.read(0, b2)[0][2].abs().sum() == 0


def test_writes_after_a_fork_of_a_finished_step_still_go_through() -> None:
    """The refusal is only for tokens a fork holds: the next step after forking writes."""
    c = _cache()
    a = c.allocate()
    _fill(c, a, 2, 1.0)
    b = c.fork(a)
    for s in (a, b):
        step = c.step([s], 1)
        for layer in range(2):
            step.write(layer, torch.full((1, 1, H, D), 3.0), torch.full((1, 1, H, D), 3.0))
        slots = c.reserve([s], 1)
        for layer in range(2):
            c.write(layer, slots, torch.full((1, H, D), 4.0), torch.full((1, H, D), 4.0))
    assert _keys(c, a) == _keys(c, b) == [1.0] * 4 + [3.0] * 2 + [4.0] * 2
    c.check_invariants()


# -- 4. the public write under the lock ----------------------------------------------------------
def test_the_public_write_checks_slots_under_the_cache_lock() -> None:
    """Before: ``write`` walked the live sequences without the lock: another thread's
    allocate in the middle raised "dictionary changed size during iteration"."""
    c = _cache()
    others = [c.allocate() for _ in range(3)]
    for s in others:
        _fill(c, s, 1, 1.0)
    mine = c.allocate()
    slots = c.reserve([mine], 1)
    go, done, errors = threading.Event(), threading.Event(), []

    class Pause(list):  # type: ignore[type-arg]
        armed = True

        def __iter__(self):  # type: ignore[no-untyped-def]
            if Pause.armed:  # the write's slot check walks this sequence's pages
                Pause.armed = False
                go.set()
                done.wait(0.5)  # the other thread's allocate, unless it waits for the lock
            return super().__iter__()

    c._seqs[others[0]].pages = Pause(c._seqs[others[0]].pages)

    def other() -> None:
        go.wait(5)
        try:
            c.allocate()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    try:
        c.write(0, slots, torch.ones(1, H, D), torch.ones(1, H, D))
    finally:
        go.set()
        t.join(5)
    assert not errors and len(c.seq_ids) == 5
    assert _keys(c, mine) == [1.0, 1.0]


# -- 7. a profile store sees a same-size replace ---------------------------------------------------
def test_a_profile_reader_sees_a_same_size_replace_within_the_clock_tick(tmp_path: Path) -> None:
    """Before: the read cache was keyed on (mtime, size) only; a replace by another writer
    within a coarse clock's tick, of the same length, kept serving the old record."""
    dev = probe("cpu")
    spec = attnhub.AttentionSpec(phase="prefill", dtype="fp32", num_q_heads=4, num_kv_heads=4,
                                 head_dim=64, max_seqlen_q=128, max_seqlen_k=128).bucketed()
    path = tmp_path / "s.json"
    writer, reader = ProfileStore(path), ProfileStore(path)
    writer.record_speed(dev, spec, "x", 0.001)
    assert reader.speed(dev, spec, "x") == 0.001
    st = path.stat()
    writer.record_speed(dev, spec, "x", 0.009)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same tick of a coarse clock
    assert path.stat().st_size == st.st_size
    assert reader.speed(dev, spec, "x") == 0.009


def test_a_second_interrupt_as_reserves_undo_starts_leaves_nothing_reserved(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The undo is pending from before the first change: a Ctrl-C landing at
    ``_rollback``'s entry (self-review 8b) no longer leaves the reservation in place."""
    c = PagedKVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=2)
    s = c.allocate()
    c.append(s, [torch.ones(3, 1, 2)], [torch.ones(3, 1, 2)])
    before = (c.length(s), c.pages(s), c.free_pages)
    real = PagedKVCache._rollback

    def clear(self, pages):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt("first")

    def rollback(self, undo):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(PagedKVCache, "_rollback", real)
        raise KeyboardInterrupt("second, as the undo starts")

    monkeypatch.setattr(PagedKVCache, "_clear", clear)
    monkeypatch.setattr(PagedKVCache, "_rollback", rollback)
    with pytest.raises(KeyboardInterrupt):
        c.reserve([s], 6)
    monkeypatch.undo()
    c.check_invariants()  # the next operation finishes the pending undo
    assert (c.length(s), c.pages(s), c.free_pages) == before and not c._undos


def test_a_write_after_its_fork_was_freed_goes_through_unless_a_relative_lives() -> None:
    c = PagedKVCache(num_layers=2, num_pages=8, page_size=4, num_kv_heads=1, head_dim=2)
    a = c.allocate()
    slots = c.reserve([a], 3)
    c.free(c.fork(a))  # no sequence but a holds those tokens now
    c.write(0, slots, torch.ones(3, 1, 2), torch.ones(3, 1, 2))
    b = c.fork(a)
    grandchild = c.fork(b)
    c.append(grandchild, [torch.ones(1, 1, 2)] * 2, [torch.ones(1, 1, 2)] * 2)  # copies
    c.free(b)  # a and the grandchild stay related through b
    with pytest.raises(InputError, match="reserved before"):
        c.write(1, slots, torch.ones(3, 1, 2), torch.ones(3, 1, 2))
    c.free(grandchild)
    c.write(1, slots, torch.ones(3, 1, 2), torch.ones(3, 1, 2))


def test_a_write_is_refused_only_for_the_tokens_a_live_relative_holds() -> None:
    """A fork made before the reservation holds none of its tokens: freeing the later fork
    lets the write through (review 8c)."""
    c = PagedKVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=2)
    a = c.allocate()
    c.append(a, [torch.ones(4, 1, 2)], [torch.ones(4, 1, 2)])  # page 0 full
    c.fork(a)  # holds tokens 0..3 only
    slots = c.reserve([a], 4)  # tokens 4..7, page 1, a's alone
    c.free(c.fork(a))
    c.write(0, slots, torch.ones(4, 1, 2), torch.ones(4, 1, 2))


def test_a_refused_step_leaves_an_open_step_abortable() -> None:
    c = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2)
    a, b = c.allocate(), c.allocate()
    first = c.step([a], 2)
    with pytest.raises(CacheFullError):
        c.step([b], 100)
    with pytest.raises(CacheFullError):
        c.append(b, [torch.ones(100, 1, 2)], [torch.ones(100, 1, 2)])
    first.abort()
    assert c.length(a) == 0 and c.free_pages == 4
