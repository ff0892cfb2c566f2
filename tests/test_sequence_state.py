"""Per-sequence state stores beside the paged KV cache (``attnhub.core.seqstate``): the
cache allocates, forks and frees them with its sequences, all or nothing."""

from __future__ import annotations

import pytest
import torch

from attnhub.core.kvcache import PagedKVCache
from attnhub.core.seqstate import LAYER_KEY, SEQ_IDS_KEY, STATE_KEY
from attnhub.errors import CacheFullError, InputError
from attnhub.testing import DictStateStore


def _cache() -> PagedKVCache:
    return PagedKVCache(num_layers=3, num_pages=8, page_size=4, num_kv_heads=1, head_dim=2)


def test_states_follow_the_sequences_and_a_full_store_changes_nothing() -> None:
    cache, roomy, tight = _cache(), DictStateStore(10), DictStateStore(3)
    cache.attach_state([0, 2], roomy)
    cache.attach_state([1], tight)
    a = cache.allocate()
    cache.append(a, [torch.randn(5, 1, 2)] * 3, [torch.randn(5, 1, 2)] * 3)
    b = cache.fork(a)
    assert set(roomy.states) == set(tight.states) == {a, b}
    assert torch.equal(roomy.states[b], roomy.states[a])
    assert roomy.states[b] is not roomy.states[a]  # a copy, never shared
    c = cache.allocate()
    pages, free = cache.pages(a), cache.free_pages
    for make in (cache.allocate, lambda: cache.fork(a)):
        with pytest.raises(CacheFullError):  # ``tight`` is full: ``roomy`` is rolled back
            make()
        assert cache.seq_ids == [a, b, c] and set(roomy.states) == set(tight.states) == {a, b, c}
        assert cache.pages(a) == pages and cache.free_pages == free
        cache.check_invariants()
    cache.free(b)
    assert cache.seq_ids == [a, c] and set(roomy.states) == set(tight.states) == {a, c}
    d = cache.fork(a)  # a freed slot is usable again, under a new id
    assert d not in (a, b, c) and set(tight.states) == {a, c, d}
    extra = cache.states.extra(2, [a, d])
    assert extra == {STATE_KEY: roomy, SEQ_IDS_KEY: (a, d), LAYER_KEY: 2}
    assert cache.states.extra(1, [a])[STATE_KEY] is tight  # type: ignore[index]


def test_attach_refuses_live_sequences_and_a_layer_twice() -> None:
    cache = _cache()
    cache.attach_state([0], DictStateStore(2))
    with pytest.raises(InputError, match="already have a state store"):
        cache.attach_state([0, 1], DictStateStore(2))
    with pytest.raises(InputError, match="not a SequenceStore"):
        cache.attach_state([1], object())  # type: ignore[arg-type]
    cache.allocate()
    with pytest.raises(InputError, match="before allocating"):
        cache.attach_state([1], DictStateStore(2))
