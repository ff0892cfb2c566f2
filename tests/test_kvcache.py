"""Paged KV cache: random allocate/append/fork/free programs against a plain-list model."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from attnhub import AttnParams
from attnhub.core.kvcache import PagedKVCache
from attnhub.core.paged import paged_to_varlen
from attnhub.core.reference import reference_attention
from attnhub.errors import CacheFullError, InputError

LAYERS, HKV, D = 2, 2, 3


class CacheMachine(RuleBasedStateMachine):
    """Drives a small cache; ``model`` holds what each sequence must read back, per layer."""

    @initialize(pages=st.integers(3, 10), page_size=st.sampled_from([1, 2, 4]))
    def setup(self, pages: int, page_size: int) -> None:
        self.cache = PagedKVCache(num_layers=LAYERS, num_pages=pages, page_size=page_size,
                                  num_kv_heads=HKV, head_dim=D)
        self.model: dict[int, list[list[torch.Tensor]]] = {}
        self.gen = torch.Generator().manual_seed(pages * 31 + page_size)

    @rule()
    def allocate(self) -> None:
        sid = self.cache.allocate()
        self.model[sid] = [[] for _ in range(LAYERS)]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(0, 6))
    def append(self, data: st.DataObject, n: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        ks = [torch.randn(n, HKV, D, generator=self.gen) for _ in range(LAYERS)]
        vs = [torch.randn(n, HKV, D, generator=self.gen) for _ in range(LAYERS)]
        before = {s: self.cache.length(s) for s in self.model}
        free = self.cache.free_pages
        try:
            self.cache.append(sid, ks, vs)
        except CacheFullError as exc:
            assert "No sequence was changed" in str(exc)
            assert self.cache.free_pages == free
            assert {s: self.cache.length(s) for s in self.model} == before
            return
        for layer in range(LAYERS):
            self.model[sid][layer] += [torch.stack([k, v]) for k, v in zip(ks[layer], vs[layer])]
        if n:  # the page just written belongs to this sequence alone
            assert self.cache.refcount(self.cache.pages(sid)[-1]) == 1

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 3))
    def step_many(self, data: st.DataObject, n: int) -> None:
        """One batched step over several sequences (forks of each other included)."""
        sids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        before = {s: self.cache.length(s) for s in self.model}
        try:
            step = self.cache.step(sids, n)
        except CacheFullError:
            assert {s: self.cache.length(s) for s in self.model} == before
            return
        for layer in range(LAYERS):
            k = torch.randn(len(sids), n, HKV, D, generator=self.gen)
            v = torch.randn(len(sids), n, HKV, D, generator=self.gen)
            step.write(layer, k, v)
            for i, s in enumerate(sids):
                self.model[s][layer] += [torch.stack([k[i, j], v[i, j]]) for j in range(n)]
        assert step.seqlens.tolist() == [before[s] + n for s in sids]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        child = self.cache.fork(sid)
        self.model[child] = [list(rows) for rows in self.model[sid]]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free(sid)
        del self.model[sid]

    # -- invalid operations: each must raise InputError and change nothing ---------------
    def _snapshot(self) -> tuple:
        seqs = {s: (self.cache.length(s), self.cache.pages(s),
                    [self.cache.read(layer, s) for layer in range(LAYERS)]) for s in self.model}
        storage = [(self.cache.k_cache(layer).clone(), self.cache.v_cache(layer).clone())
                   for layer in range(LAYERS)]
        refs = [self.cache.refcount(p) for p in range(self.cache.num_pages)]
        return seqs, storage, refs, self.cache.free_pages

    def _assert_unchanged(self, before: tuple) -> None:
        seqs, storage, refs, free = before
        now = self._snapshot()
        assert now[3] == free and now[2] == refs
        assert now[0].keys() == seqs.keys()
        for s, (length, pages, reads) in seqs.items():
            assert now[0][s][:2] == (length, pages)
            for (k0, v0), (k1, v1) in zip(reads, now[0][s][2]):
                assert torch.equal(k0, k1) and torch.equal(v0, v1)
        for (k0, v0), (k1, v1) in zip(storage, now[1]):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)

    def _rejected(self, op) -> None:  # type: ignore[no-untyped-def]
        before = self._snapshot()
        with pytest.raises(InputError):
            op()
        self._assert_unchanged(before)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 5),
          how=st.sampled_from(["head_dim", "heads", "int", "layer_count", "k_vs_v", "layers",
                               "rank", "not_tensor", "unknown_id", "device"]))
    def bad_append(self, data: st.DataObject, n: int, how: str) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        bad = data.draw(st.integers(0, LAYERS - 1))
        ks = [torch.randn(n, HKV, D, generator=self.gen) for _ in range(LAYERS)]
        vs = [torch.randn(n, HKV, D, generator=self.gen) for _ in range(LAYERS)]
        wrong = {"head_dim": lambda t: torch.randn(n, HKV, D + 1),
                 "heads": lambda t: torch.randn(n, HKV + 1, D),
                 "int": lambda t: (t * 10).to(torch.int32),
                 "layer_count": lambda t: torch.randn(n + 1, HKV, D),
                 "rank": lambda t: t[None],
                 "not_tensor": lambda t: t.tolist(),
                 "device": lambda t: t.to("meta")}
        if how in wrong:
            target = data.draw(st.sampled_from([ks, vs]))
            target[bad] = wrong[how](target[bad])
        elif how == "k_vs_v":
            vs[bad] = vs[bad][:-1]
        elif how == "layers":
            ks = ks[:-1]
        else:
            sid = max(self.cache.seq_ids, default=-1) + 100
        self._rejected(lambda: self.cache.append(sid, ks, vs))

    @precondition(lambda self: self.model)
    @rule(data=st.data(),
          how=st.sampled_from(["layer_-1", "layer_past", "layer_bool", "slots_int32",
                               "slots_range", "count", "int_kv"]))
    def bad_write(self, data: st.DataObject, how: str) -> None:
        n = 2
        slots = torch.arange(n, dtype=torch.int64)
        k, v = torch.randn(n, HKV, D), torch.randn(n, HKV, D)
        layer: object = 0
        if how == "layer_-1":
            layer = -1
        elif how == "layer_past":
            layer = LAYERS
        elif how == "layer_bool":
            layer = True
        elif how == "slots_int32":
            slots = slots.to(torch.int32)
        elif how == "slots_range":
            slots = slots + self.cache.num_pages * self.cache.page_size
        elif how == "count":
            v = v[:1]
        else:
            k = k.to(torch.int64)
        self._rejected(lambda: self.cache.write(layer, slots, k, v))  # type: ignore[arg-type]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), how=st.sampled_from(["negative", "repeat", "float", "unknown"]))
    def bad_reserve(self, data: st.DataObject, how: str) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        args = {"negative": ([sid], -1), "repeat": ([sid, sid], 1), "float": ([sid], 1.5),
                "unknown": ([sid, max(self.model) + 100], 1)}[how]
        self._rejected(lambda: self.cache.reserve(*args))

    @invariant()
    def reads_back_what_was_written(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        for sid, layers in self.model.items():
            for layer, rows in enumerate(layers):
                k, v = self.cache.read(layer, sid)
                assert k.shape[0] == len(rows)
                if rows:
                    want = torch.stack(rows)
                    assert torch.equal(k, want[:, 0]) and torch.equal(v, want[:, 1])


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_full_cache_error_names_the_fix_and_keeps_others() -> None:
    cache = PagedKVCache(num_layers=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=2)
    a, b = cache.allocate(), cache.allocate()
    ka = torch.randn(3, 1, 2)
    cache.append(a, [ka], [ka + 1])
    with pytest.raises(CacheFullError, match="num_pages"):
        cache.append(b, [torch.randn(2, 1, 2)], [torch.randn(2, 1, 2)])
    assert cache.length(b) == 0
    assert torch.equal(cache.read(0, a)[0], ka)
    cache.free(a)
    cache.append(b, [torch.randn(4, 1, 2)], [torch.randn(4, 1, 2)])  # now it fits
    cache.check_invariants()


def test_fork_copies_only_the_partial_last_page() -> None:
    cache = PagedKVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=2)
    a = cache.allocate()
    x = torch.randn(6, 1, 2)
    cache.append(a, [x], [x])
    b = cache.fork(a)
    assert cache.pages(a) == cache.pages(b)
    cache.append(b, [torch.randn(1, 1, 2)], [torch.randn(1, 1, 2)])
    pa, pb = cache.pages(a), cache.pages(b)
    assert pa[0] == pb[0] and pa[1] != pb[1]  # full page shared, partial page copied
    assert torch.equal(cache.read(0, b)[0][:6], x) and torch.equal(cache.read(0, a)[0], x)


def test_bad_ids_and_counts_are_input_errors() -> None:
    cache = PagedKVCache(num_layers=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=2)
    a = cache.allocate()
    with pytest.raises(InputError, match="repeat"):
        cache.reserve([a, a], 1)
    cache.free(a)
    with pytest.raises(InputError, match="already freed"):
        cache.length(a)


def test_tables_read_as_the_paged_layout() -> None:
    """block_table/seqlens + k/v caches give the same attention as contiguous tensors."""
    torch.manual_seed(0)
    cache = PagedKVCache(num_layers=1, num_pages=32, page_size=4, num_kv_heads=2, head_dim=8,
                         dtype=torch.float64)
    lens = [5, 9, 3]
    sids, data = [], []
    for n in lens:
        s = cache.allocate()
        k, v = torch.randn(n, 2, 8, dtype=torch.float64), torch.randn(n, 2, 8, dtype=torch.float64)
        cache.append(s, [k], [v])
        sids.append(s)
        data.append((k, v))
    sids.append(cache.fork(sids[1]))  # a forked sequence reads its parent's pages
    data.append(data[1])
    bt, sl = cache.block_table(sids), cache.seqlens(sids)
    assert bt.dtype == torch.int32 and sl.dtype == torch.int32 and sl.tolist() == lens + [9]
    q = torch.randn(len(sids), 1, 4, 8, dtype=torch.float64)
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, cache.k_cache(0), cache.v_cache(0), bt, sl)
    params = AttnParams(scale=1 / math.sqrt(8), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, _ = reference_attention(qv, kv, vv, params, layout="thd")
    for i, (k, v) in enumerate(data):
        want, _ = reference_attention(q[i:i + 1], k[None], v[None],
                                      AttnParams(scale=1 / math.sqrt(8)))
        assert torch.allclose(out[i], want[0, 0])
