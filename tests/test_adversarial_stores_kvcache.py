"""Fault injection on the paged KV cache: a failed append leaves the cache exactly as it was,
values the cache cannot hold are refused (never stored as inf/NaN), a write can only land on
tokens a live sequence reserved and owns alone, a page taken from the free list never hands
its previous owner's keys to the next one, and ``paged_to_varlen`` refuses tables that would
gather another sequence's pages."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnhub.core.kvcache import PagedKVCache
from attnhub.core.paged import paged_to_varlen
from attnhub.errors import InputError, SeqlensError

HKV, D, PAGE = 2, 4, 4


def _cache(dtype: torch.dtype = torch.float32, pages: int = 6) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_pages=pages, page_size=PAGE, num_kv_heads=HKV,
                        head_dim=D, dtype=dtype)


def _kv(n: int, dtype: torch.dtype = torch.float32, fill: float | None = None) -> torch.Tensor:
    t = torch.randn(n, HKV, D).to(dtype)
    return t.fill_(fill) if fill is not None else t


def _state(c: PagedKVCache) -> tuple[Any, ...]:
    """Everything a reader can observe (raw bytes of the storage included)."""
    seqs = {s: (c.pages(s), c.length(s)) for s in c.seq_ids}
    raw = [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone()
           for t in (c._k, c._v)]
    scales = None if c.scales is None else (c.scales.k.clone(), c.scales.v.clone())
    return seqs, list(c._free), [c.refcount(p) for p in range(c.num_pages)], raw, scales


def test_a_cache_built_in_inference_mode_appends_outside_it() -> None:
    """The storage was an inference tensor: the write outside inference mode raised after the
    pages were reserved, leaving the sequence 3 tokens longer with nothing written."""
    with torch.inference_mode():
        c = _cache()
    s = c.allocate()
    k, v = _kv(3), _kv(3)
    c.append(s, [k, k], [v, v])
    assert c.length(s) == 3 and torch.equal(c.read(1, s)[0], k)
    with torch.inference_mode():
        c.append(s, [k[:1], k[:1]], [v[:1], v[:1]])
    assert c.length(s) == 4
    c.check_invariants()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("forked", [False, True])
def test_a_write_failing_mid_append_changes_nothing(monkeypatch: pytest.MonkeyPatch,
                                                    dtype: torch.dtype, forked: bool) -> None:
    """Layer 1's write raises (out of memory, say) after layer 0 wrote: the reservation
    (new pages, a copy-on-write of a shared last page) and FP8 requantization are undone."""
    c = _cache(dtype)
    s = c.allocate()
    c.append(s, [_kv(5)] * 2, [_kv(5)] * 2)
    if forked:
        c.fork(s)
    before = _state(c)
    reads = {(layer, sid): c.read(layer, sid) for layer in range(2) for sid in c.seq_ids}
    real = PagedKVCache._write

    def flaky(self: PagedKVCache, layer: int, *a: Any, **kw: Any) -> None:
        if layer == 1:
            raise MemoryError("injected")
        real(self, layer, *a, **kw)

    monkeypatch.setattr(PagedKVCache, "_write", flaky)
    big = [_kv(6) * 100] * 2  # grows the FP8 descale of the partly filled last page
    with pytest.raises(MemoryError):
        c.append(s, big, big)
    monkeypatch.undo()
    c.check_invariants()
    after = _state(c)
    assert after[:3] == before[:3]
    for (layer, sid), (k, v) in reads.items():  # free pages' raw bytes may differ
        got = c.read(layer, sid)
        assert torch.equal(got[0], k) and torch.equal(got[1], v)
    if dtype == torch.float8_e4m3fn:  # the requantized page and its descales are restored
        held = [p for p in range(c.num_pages) if c.refcount(p)]
        for x, y in zip(after[3] + list(after[4]), before[3] + list(before[4])):
            assert torch.equal(x[:, held], y[:, held])


@pytest.mark.parametrize("cache_dtype,kv_dtype,value", [
    (torch.float8_e4m3fn, torch.float64, 1e300),  # finite in float64, inf in float32
    (torch.float32, torch.float64, 1e300),
    (torch.float16, torch.float32, 1e6),
])
def test_values_the_cache_cannot_hold_are_refused(cache_dtype: torch.dtype,
                                                  kv_dtype: torch.dtype, value: float) -> None:
    """They were cast to inf (the FP8 cache: NaN, after dividing by an inf descale, and the
    page's earlier tokens requantized to 0)."""
    c = _cache(cache_dtype)
    s = c.allocate()
    ok = torch.float32 if cache_dtype == torch.float8_e4m3fn else cache_dtype
    c.append(s, [_kv(2, ok)] * 2, [_kv(2, ok)] * 2)
    before = c.read(0, s)
    bad = _kv(1, kv_dtype)
    bad[0, 0, 0] = value
    with pytest.raises(InputError, match="append layer 0: k"):
        c.append(s, [bad, bad], [_kv(1, kv_dtype)] * 2)
    slots = c.reserve([s], 1)
    with pytest.raises(InputError, match="write: k"):
        c.write(0, slots, bad, _kv(1, kv_dtype))
    assert c.length(s) == 3  # the reserved slot, unwritten: zeros
    k, v = c.read(0, s)
    assert torch.equal(k[:2], before[0]) and torch.equal(v[:2], before[1])
    assert torch.isfinite(k).all()


def test_a_float32_cache_takes_infinite_float32_values_and_refuses_float64_ones() -> None:
    """k/v of another dtype are refused, never cast (review 10: the range check of a cast
    cost a host read per write), even where every value fits."""
    c = _cache(torch.float32)
    s = c.allocate()
    k = _kv(2, torch.float32)
    k[0, 0, 0] = float("inf")  # its own dtype: inf stays inf (the cache does not check NaN)
    with pytest.raises(InputError, match="v is torch.float64, the cache stores torch.float32"):
        c.append(s, [k, k], [_kv(2, torch.float64)] * 2)
    c.append(s, [k, k], [_kv(2, torch.float32)] * 2)
    assert torch.isinf(c.read(0, s)[0][0, 0, 0])


def test_writes_only_land_on_tokens_a_live_sequence_reserved_and_owns_alone() -> None:
    """Stale slots (from before a free), a free page and a page a fork shares were written
    silently: into nobody's page, or into the fork's tokens too."""
    c = _cache()
    a = c.allocate()
    slots = c.reserve([a], 3)
    c.write(0, slots, _kv(3), _kv(3))  # the ordinary use
    b = c.fork(a)
    before = _state(c)
    with pytest.raises(InputError, match="2 sequences share.*write before forking"):
        c.write(0, slots, _kv(3), _kv(3))
    c.free(b)
    past_end = slots + 1  # slot 3 is past a's 3 tokens
    with pytest.raises(InputError, match="no token a live sequence reserved"):
        c.write(0, past_end, _kv(3), _kv(3))
    c.free(a)
    with pytest.raises(InputError, match="no token a live sequence reserved"):
        c.write(0, slots, _kv(3), _kv(3))
    with pytest.raises(InputError, match="outside 0..23"):
        c.write(0, torch.tensor([-1]), _kv(1), _kv(1))
    assert torch.equal(_state(c)[3][0], before[3][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_a_reused_page_never_shows_its_previous_owner(dtype: torch.dtype) -> None:
    """A step whose layer write fails keeps its reservation (the model raised mid-step): the
    new sequence then read the freed sequence's keys from the reused page."""
    c = _cache(dtype, pages=2)
    a = c.allocate()
    secret = _kv(PAGE, fill=7.0)
    c.append(a, [secret] * 2, [secret] * 2)
    c.free(a)
    b = c.allocate()
    step = c.step([b], 2)
    with pytest.raises(InputError, match="CacheStep.write"):
        step.write(0, torch.zeros(1, 3, HKV, D), torch.zeros(1, 3, HKV, D))
    for layer in range(2):
        k, v = c.read(layer, b)
        assert k.shape[0] == 2 and not (k == 7).any() and not (v == 7).any()


def test_sequence_ids_must_be_the_ints_allocate_returned() -> None:
    """``True`` hashed like 1 and freed sequence 1; a list raised TypeError."""
    c = _cache()
    c.allocate()
    c.allocate()
    for bad in (True, 1.0, [1], "1"):
        with pytest.raises(InputError, match="pass the int allocate"):
            c.free(bad)  # type: ignore[arg-type]
        with pytest.raises(InputError, match="pass the int allocate"):
            c.reserve([bad], 1)  # type: ignore[list-item]
    assert c.seq_ids == [0, 1]
    c.free(torch.tensor(1))  # an integer that indexes: the same id
    assert c.seq_ids == [0]


@pytest.mark.parametrize("table,lens,match", [
    ([[0, -1], [2, 3]], [5, 4], "outside 0..3"),  # -1 wrapped around to page 3 (row 1's)
    ([[0, 1], [2, 3]], [9, 4], "exceeds block_table capacity"),  # k had fewer rows than cu_k
    ([[0, 1], [2, 3]], [-1, 4], "negative length"),
    ([[0, 7], [2, 3]], [5, 4], "outside 0..3"),  # IndexError before
    ([[0, 1]], [5, 4], r"must be \(B=2, pages\)"),
])
def test_paged_to_varlen_refuses_tables_that_read_other_pages(table: list[list[int]],
                                                              lens: list[int],
                                                              match: str) -> None:
    kc, vc, q = torch.randn(4, PAGE, 1, D), torch.randn(4, PAGE, 1, D), torch.randn(2, 1, 1, D)
    with pytest.raises(SeqlensError, match="paged_to_varlen: .*" + match):
        paged_to_varlen(q, kc, vc, torch.tensor(table, dtype=torch.int32),
                        torch.tensor(lens, dtype=torch.int32))
    # an unused padding entry may hold anything: only entries within the lengths are read
    out = paged_to_varlen(q, kc, vc, torch.tensor([[0, -1], [2, 3]], dtype=torch.int32),
                          torch.tensor([4, 8], dtype=torch.int32))
    assert out[1].shape[0] == 12 and out[4].tolist() == [0, 4, 12]
