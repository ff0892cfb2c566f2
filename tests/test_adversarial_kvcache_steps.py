"""A model step over the paged KV cache is a transaction: a layer failing half-way undoes the
step's reservation (no token that some layers wrote and others would read as zeros), and the
cache stores values, never autograd history."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from attnhub.core.kvcache import PagedKVCache
from attnhub.errors import InputError

HKV, D, PAGE = 2, 4, 4


@pytest.fixture(params=[torch.float32, torch.float8_e4m3fn], ids=["fp32", "e4m3"])
def cache(request: pytest.FixtureRequest) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_pages=8, page_size=PAGE, num_kv_heads=HKV,
                        head_dim=D, dtype=request.param)


def _kv(b: int, n: int) -> torch.Tensor:
    return torch.randn(b, n, HKV, D)


def _snapshot(c: PagedKVCache, seqs: list[int]) -> tuple:
    return ([c.length(s) for s in seqs], [c.pages(s) for s in seqs], c.free_pages,
            [c.read(layer, s) for layer in range(c.num_layers) for s in seqs])


def _same(a: tuple, b: tuple) -> None:
    assert a[:3] == b[:3]
    for (k1, v1), (k2, v2) in zip(a[3], b[3]):
        assert torch.equal(k1.float(), k2.float()) and torch.equal(v1.float(), v2.float())


def test_a_layer_failing_inside_a_step_undoes_it(cache: PagedKVCache) -> None:
    seqs = [cache.allocate(), cache.allocate()]
    with cache.step(seqs, 3) as step:  # a partly filled last page each
        for layer in range(2):
            step.write(layer, _kv(2, 3), _kv(2, 3))
    before = _snapshot(cache, seqs)
    with pytest.raises(RuntimeError, match="layer 1 failed"):
        with cache.step(seqs, 6) as step:  # crosses into new pages
            step.write(0, _kv(2, 6), _kv(2, 6))
            raise RuntimeError("layer 1 failed")
    _same(_snapshot(cache, seqs), before)
    cache.check_invariants()
    with pytest.raises(InputError, match="aborted"):
        step.write(1, _kv(2, 6), _kv(2, 6))
    # the slots past each sequence's end that the aborted step wrote are zeros again
    if cache.scales is None:
        for s in seqs:
            last = cache.pages(s)[-1]
            assert cache.k_cache(0)[last, 3:].abs().sum() == 0
            assert cache.v_cache(0)[last, 3:].abs().sum() == 0
    # and the next step appends where the aborted one would have
    with cache.step(seqs, 1) as step:
        k, v = _kv(2, 1), _kv(2, 1)
        for layer in range(2):
            step.write(layer, k, v)
    assert [cache.length(s) for s in seqs] == [4, 4]
    got = cache.read(1, seqs[1])[0][-1].float()
    assert torch.allclose(got, k[1, 0], atol=0.2 * k.abs().max().item())


def test_abort_refuses_once_the_cache_changed_and_is_idempotent(cache: PagedKVCache) -> None:
    a, b = cache.allocate(), cache.allocate()
    step = cache.step([a], 2)
    cache.step([b], 1)
    with pytest.raises(InputError, match="changed after this step"):
        step.abort()
    step2 = cache.step([a], 1)
    step2.abort()
    step2.abort()
    assert cache.length(a) == 2 and cache.length(b) == 1
    cache.check_invariants()


def test_a_step_with_a_shared_last_page_aborts_to_the_shared_page() -> None:
    c = PagedKVCache(num_layers=1, num_pages=6, page_size=PAGE, num_kv_heads=HKV, head_dim=D)
    a = c.allocate()
    c.append(a, [_kv(1, 2)[0]], [_kv(1, 2)[0]])
    b = c.fork(a)
    step = c.step([b], 1)  # copy-on-write of the shared last page
    assert c.pages(b) != c.pages(a)
    step.abort()
    assert c.pages(b) == c.pages(a) and c.refcount(c.pages(a)[0]) == 2
    c.check_invariants()


def test_the_cache_stores_values_not_autograd_history() -> None:
    c = PagedKVCache(num_layers=1, num_pages=4, page_size=PAGE, num_kv_heads=HKV, head_dim=D)
    s = c.allocate()
    w = torch.randn(D, D, requires_grad=True)
    x = torch.randn(3, HKV, D)
    k = x @ w
    ref = weakref.ref(k)
    c.append(s, [k], [x @ w])
    assert not c.k_cache(0).requires_grad and c.k_cache(0).grad_fn is None
    with c.step([s], 1) as step:
        step.write(0, (x[:1] @ w).unsqueeze(0), (x[:1] @ w).unsqueeze(0))
    assert not c.k_cache(0).requires_grad
    torch.testing.assert_close(c.read(0, s)[0][:3], k.detach())
    del k
    gc.collect()
    assert ref() is None  # nothing (the cache's graph) holds on to the appended tensor


def test_a_failing_prefill_leaves_no_sequence_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnhub.models.decoder import Decoder, DecoderConfig

    model = Decoder(DecoderConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8,
                                  vocab_size=32))
    cache = model.new_cache(batch=2, max_len=16, page_size=4)
    free = cache.free_pages
    calls = {"n": 0}
    real = type(model.layers[1].attn).forward

    def boom(self, *a, **kw):  # type: ignore[no-untyped-def]
        if self is model.layers[1].attn:
            calls["n"] += 1
            raise RuntimeError("out of memory in layer 1")
        return real(self, *a, **kw)

    monkeypatch.setattr(type(model.layers[1].attn), "forward", boom)
    ids = torch.randint(0, 32, (2, 5))
    with pytest.raises(RuntimeError, match="layer 1"):
        model.prefill(cache, ids)
    assert calls["n"] == 1 and cache.free_pages == free and cache.seq_ids == []
    cache.check_invariants()
