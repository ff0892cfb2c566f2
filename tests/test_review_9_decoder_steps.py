"""A Ctrl-C between ``cache.step(...)`` returning and its ``with`` block being entered (or as
the block's exit starts) escapes the block's own undo: ``step`` is never bound, so the
contract's ``step.abort()`` cannot be called. The cache records, per thread, the last step it
handed out until a ``with`` block's exit is done with it; ``abort_unentered_steps`` undoes it,
and ``Decoder.prefill``/``decode`` call it on their except path. Before the fix each left one
reserved, all-zero token per sequence (decode) or its pages back in another order (prefill).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from attnhub.core.kvcache import CacheStep, PagedKVCache
from attnhub.errors import CacheFullError
from attnhub.models.decoder import Decoder, DecoderConfig

CFG = DecoderConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8, vocab_size=32)


class _CutLock:
    """The cache's lock, with a Ctrl-C delivered right after its outermost ``__exit__``
    returns once armed (where CPython delivers one: after a C call returns)."""

    def __init__(self) -> None:
        self.real = threading.RLock()
        self.depth = 0
        self.armed = False

    def __enter__(self) -> bool:
        self.real.__enter__()
        self.depth += 1
        return True

    def __exit__(self, *exc: Any) -> None:
        self.depth -= 1
        self.real.__exit__(*exc)
        if self.armed and not self.depth and exc[0] is None:
            self.armed = False
            raise KeyboardInterrupt("Ctrl-C as the cache's lock is released")


def _interrupt(monkeypatch: pytest.MonkeyPatch, cache: PagedKVCache, where: str) -> None:
    """Arm one Ctrl-C for the next step: entering its block, as ``step()`` releases the lock,
    or as the block's exit starts after the body finished."""
    if where == "lock_exit":
        lock, real_step = _CutLock(), cache.step
        monkeypatch.setattr(cache, "_lock", lock)

        def step(*args: Any) -> CacheStep:  # armed for step()'s own lock, not allocate()'s
            monkeypatch.setattr(cache, "step", real_step)
            lock.armed = True
            return real_step(*args)

        monkeypatch.setattr(cache, "step", step)
        return
    name = "__enter__" if where == "enter" else "__exit__"
    real = getattr(CacheStep, name)

    def cut(self: CacheStep, *args: Any) -> Any:
        monkeypatch.setattr(CacheStep, name, real)
        raise KeyboardInterrupt(f"Ctrl-C on entry to CacheStep.{name}")

    monkeypatch.setattr(CacheStep, name, cut)


def _state(c: PagedKVCache) -> tuple:
    """Everything a step changes: sequences, pages, free list (in order), refcounts, values."""
    seqs = {s: (c.length(s), c.pages(s)) for s in c.seq_ids}
    return (seqs, list(c._free), list(c._refs), c._k.clone(), c._v.clone(), c._undos == [])


def _same(a: tuple, b: tuple) -> None:
    assert a[:3] == b[:3] and a[5] == b[5]
    assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])


def _prefilled() -> tuple[Decoder, PagedKVCache, list[int], torch.Tensor]:
    model = Decoder(CFG)
    cache = model.new_cache(batch=2, max_len=16, page_size=4)
    ids = torch.randint(0, CFG.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    seqs, logits = model.prefill(cache, ids)  # 6 tokens: page 1 of each is partly filled
    return model, cache, seqs, logits.argmax(-1)


@pytest.mark.parametrize("where", ["enter", "lock_exit", "exit_start"])
def test_a_ctrl_c_around_the_decode_steps_block_leaves_the_cache_as_before(
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    model, cache, seqs, tok = _prefilled()
    _, twin, twin_seqs, _ = _prefilled()
    want = [model.decode(twin, twin_seqs, tok)]
    want.append(model.decode(twin, twin_seqs, want[-1].argmax(-1)))
    before = _state(cache)
    taken = cache.steps_taken
    _interrupt(monkeypatch, cache, where)
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C"):
        model.decode(cache, seqs, tok)
    assert cache.steps_taken == taken + 1  # the step was reserved, then undone
    _same(_state(cache), before)  # lengths 6, no page taken, the tail slot zero again
    cache.check_invariants()
    assert not cache.abort_unentered_steps()  # nothing left to abort
    got = model.decode(cache, seqs, tok)  # the same decode, now uninterrupted
    got2 = model.decode(cache, seqs, got.argmax(-1))
    torch.testing.assert_close(got, want[0], rtol=0, atol=0)
    torch.testing.assert_close(got2, want[1], rtol=0, atol=0)
    assert [cache.length(s) for s in seqs] == [8, 8]
    cache.check_invariants()


@pytest.mark.parametrize("where", ["enter", "lock_exit"])
def test_a_ctrl_c_entering_the_prefill_step_puts_every_page_back_in_order(
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    model = Decoder(CFG)
    cache = model.new_cache(batch=2, max_len=16, page_size=4)
    ids = torch.randint(0, CFG.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    before = _state(cache)
    _interrupt(monkeypatch, cache, where)
    with pytest.raises(KeyboardInterrupt):
        model.prefill(cache, ids)
    _same(_state(cache), before)  # no sequence, the free list as it was (order included)
    cache.check_invariants()
    _, twin, _, want = _prefilled()
    seqs, logits = model.prefill(cache, ids)
    assert torch.equal(logits.argmax(-1), want) and cache.pages(seqs[0]) == twin.pages(0)


def _cache(pages: int = 8) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_pages=pages, page_size=4, num_kv_heads=2, head_dim=4)


def test_abort_unentered_steps_undoes_a_step_whose_name_was_never_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = _cache()
    a = c.allocate()
    c.append(a, [torch.ones(3, 2, 4)] * 2, [torch.ones(3, 2, 4)] * 2)
    before = _state(c)
    mark = c.steps_taken
    _interrupt(monkeypatch, c, "lock_exit")
    with pytest.raises(KeyboardInterrupt):
        with c.step([a], 2) as step:  # noqa: F841 - never bound
            raise AssertionError("not reached")
    assert c.length(a) == 5  # reserved, and nothing to call abort() on
    assert c.abort_unentered_steps(mark)
    _same(_state(c), before)
    c.check_invariants()
    assert not c.abort_unentered_steps(mark)
    with c.step([a], 2) as step:
        step.write(0, torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
        step.write(1, torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
    assert c.length(a) == 5 and not c.abort_unentered_steps()  # a finished block: forgotten


def test_since_keeps_an_older_step_in_use_and_threads_keep_their_own() -> None:
    c = _cache(pages=2)
    a, b = c.allocate(), c.allocate()
    kept = c.step([a], 4)  # taken without ``with``, written, still in use
    for layer in range(2):
        kept.write(layer, torch.ones(1, 4, 2, 4), torch.ones(1, 4, 2, 4))
    mark = c.steps_taken
    with pytest.raises(CacheFullError):
        c.step([a, b], 8)  # refused before any change: the older step stays abortable
    assert not c.abort_unentered_steps(mark) and c.length(a) == 4
    other: list[bool] = []
    t = threading.Thread(target=lambda: other.append(c.abort_unentered_steps()))
    t.start()
    t.join()
    assert other == [False] and c.length(a) == 4  # another thread's record is its own
    c.check_invariants()


def test_a_refused_abort_is_a_note_on_the_exception_being_handled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = _cache()
    a = c.allocate()
    mark = c.steps_taken
    _interrupt(monkeypatch, c, "enter")
    with pytest.raises(KeyboardInterrupt) as caught:
        with c.step([a], 2):
            raise AssertionError("not reached")
    c.allocate()  # the cache changed since: the step can no longer be undone
    assert c.abort_unentered_steps(mark, caught.value)
    assert any("could not be undone" in n for n in caught.value.__notes__)
    assert not c.abort_unentered_steps(mark)  # refused for good: forgotten
