"""Review round 9, the paged KV cache: a float32 value past bfloat16's largest finite one was
stored as inf in a bfloat16 cache (the range check skipped float32 into bfloat16 as "one
exponent range"); a state store whose own call a Ctrl-C cut short after it had changed its
state (delivered after the store's last C call) left a ``free`` that could never be retried
(the store refused the id it no longer held) or an ``allocate``/``fork`` whose state leaked
under an id never handed out.

A Ctrl-C is simulated where CPython delivers it: after a C call returns, here the store's
last one (a patched store raises once it has changed its state)."""

from __future__ import annotations

import pytest
import torch

from attnhub.core.kvcache import PagedKVCache
from attnhub.errors import InputError
from attnhub.testing import DictStateStore

H, D = 2, 4


def _cache(dtype: torch.dtype = torch.float32, store: object | None = None) -> PagedKVCache:
    c = PagedKVCache(num_layers=2, num_pages=6, page_size=3, num_kv_heads=H, head_dim=D,
                     dtype=dtype)
    if store is not None:
        c.attach_state([1], store)  # type: ignore[arg-type]
    return c


# -- 1. values the cache's dtype rounds to inf ---------------------------------------------
@pytest.mark.parametrize(("cache_dtype", "src_dtype", "big"), [
    (torch.bfloat16, torch.float32, 3.4e38),  # past bf16's 3.3895e38 (+ half an ulp)
    (torch.bfloat16, torch.float64, 1e39),
    (torch.float16, torch.float32, 65520.0),  # rounds to inf in fp16
    (torch.float16, torch.bfloat16, 1e5),
])
@pytest.mark.parametrize("how", ["append", "step", "write"])
def test_a_finite_value_the_cache_rounds_to_inf_is_refused(
        cache_dtype: torch.dtype, src_dtype: torch.dtype, big: float, how: str) -> None:
    """Before: ``append``, ``step.write`` and ``write`` of a float32 3.4e38 into a bfloat16
    cache stored inf (the check ran only where the source's range was twice the cache's).
    Since review 10 k/v of another dtype than the cache's are refused outright (the range
    check cost a host read per write), naming the tensor and the fix; nothing changed."""
    g = torch.Generator().manual_seed(3)
    c = _cache(cache_dtype)
    a = c.allocate()
    ok = [torch.randn(2, H, D, generator=g).to(cache_dtype) for _ in range(4)]
    c.append(a, ok[:2], ok[2:])
    before = [c.read(layer, a) for layer in range(2)]
    bad = torch.randn(3, H, D, generator=g).to(src_dtype)
    bad[int(torch.randint(3, (1,), generator=g)), 1, 2] = big
    good = torch.randn(3, H, D, generator=g).to(src_dtype)
    with pytest.raises(InputError, match=r"(k|v) is torch\.\w+, the cache stores .*"
                                         r"\.to\(cache\.dtype\)"):
        if how == "append":
            c.append(a, [good, bad], [good, good])
        elif how == "step":
            with c.step([a], 3) as st:
                st.write(0, good[None], bad[None])
        else:
            slots = c.reserve([a], 3)
            c.write(1, slots, good, bad)
    if how == "write":
        c.free(a)
        return
    c.check_invariants()
    assert c.length(a) == 2
    for layer in range(2):
        k, v = c.read(layer, a)
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
    assert all(bool(torch.isfinite(t).all()) for t in (c.k_cache(0), c.v_cache(1)))


@pytest.mark.parametrize(("cache_dtype", "value"), [
    (torch.float16, 65519.0),  # rounds down to 65504: stored, not refused
    (torch.bfloat16, 3.38e38),
])
def test_a_finite_value_that_rounds_to_the_largest_is_kept(cache_dtype: torch.dtype,
                                                           value: float) -> None:
    """A float32 value that fits is refused all the same in a narrower cache (never cast
    there); its explicit cast is stored exactly."""
    c = _cache(cache_dtype)
    a = c.allocate()
    t = torch.full((1, H, D), value)
    with pytest.raises(InputError, match="k is torch.float32"):
        c.append(a, [t, t], [t, t])
    assert c.length(a) == 0 and c.free_pages == c.num_pages
    c.append(a, [t.to(cache_dtype)] * 2, [t.to(cache_dtype)] * 2)
    k = c.read(0, a)[0]
    assert torch.equal(k, t.to(cache_dtype))
    assert bool(torch.isfinite(k).all())


# -- 2. a store's own call cut short after it changed its state ----------------------------
class CutStore(DictStateStore):
    """A store whose ``cut`` method raises KeyboardInterrupt once, after its change (a
    Ctrl-C delivered as its last C call returns)."""

    def __init__(self, cut: str) -> None:
        super().__init__()
        self.cut = cut

    def _maybe_cut(self, what: str) -> None:
        if self.cut == what:
            self.cut = ""
            raise KeyboardInterrupt(f"Ctrl-C after the store's {what}")

    def allocate(self, seq_id: int) -> None:
        super().allocate(seq_id)
        self._maybe_cut("allocate")

    def fork(self, src: int, dst: int) -> None:
        super().fork(src, dst)
        self._maybe_cut("fork")

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        self._maybe_cut("free")


class ContainsStore(CutStore):
    """One that says which ids it holds (the cache asks it, rather than trying a free)."""

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.states


def _store(cut: str, contains: bool) -> CutStore:
    return ContainsStore(cut) if contains else CutStore(cut)


@pytest.mark.parametrize("contains", [False, True])
@pytest.mark.parametrize("first", [False, True])
def test_a_free_whose_store_was_cut_after_freeing_is_retried(contains: bool,
                                                            first: bool) -> None:
    """Before: the retry of the cache's ``free`` called the store's free again, which
    refused the id it had already freed: the sequence could never be freed, its pages
    never returned. Now the retry skips a store that no longer holds the id."""
    cut = _store("free", contains)
    other = DictStateStore()
    c = _cache()
    c.attach_state([0], other if first else cut)
    c.attach_state([1], cut if first else other)
    a = c.allocate()
    b = c.allocate()
    t = torch.randn(4, H, D)
    c.append(a, [t, t], [t, t])
    with pytest.raises(KeyboardInterrupt):
        c.free(a)
    assert a not in c.seq_ids  # cut short: finished before the interrupt goes on (review 10)
    c.check_invariants()
    assert c.seq_ids == [b] and c.free_pages == c.num_pages
    assert set(cut.states) == set(other.states) == {b}
    c.free(b)
    assert not cut.states and not other.states


@pytest.mark.parametrize("contains", [False, True])
@pytest.mark.parametrize("what", ["allocate", "fork"])
def test_an_allocate_or_fork_whose_store_was_cut_after_its_change_leaks_no_state(
        contains: bool, what: str) -> None:
    """Before: the store held a state for the id the interrupted ``allocate``/``fork``
    never returned, which nobody could free (a slot lost per Ctrl-C, a full store at
    last). Now the failed store frees it too."""
    cut = _store("", contains)
    c = _cache(store=cut)
    a = c.allocate()
    t = torch.randn(4, H, D)
    c.append(a, [t, t], [t, t])
    cut.cut = what
    with pytest.raises(KeyboardInterrupt):
        c.allocate() if what == "allocate" else c.fork(a)
    c.check_invariants()
    assert c.seq_ids == [a]
    assert set(cut.states) == {a}
    b = c.fork(a)
    assert set(cut.states) == {a, b}
    c.free(a)
    c.free(b)
    assert not cut.states and c.free_pages == c.num_pages


# -- 3. FlashInfer: k and v caches of different layouts -----------------------------------
def test_flashinfer_refuses_k_and_v_caches_of_different_strides() -> None:
    """Before: the layout (NHD/HND) was detected from k alone and both caches handed to
    FlashInfer, which checks ``k_strides == v_strides`` in its kernel (a RuntimeError
    charged to the backend at run time; a build without that check reads v with k's
    layout). Now refused before planning, with the reason."""
    from attnhub_sm80_fa2.flashinfer_paged import FlashInferDecodeBackend

    from attnhub.errors import BackendUnavailableError
    from attnhub.plugin import AttnParams

    g = torch.Generator().manual_seed(5)
    pages, page = 5, 4
    k = torch.randn(pages, page, H, D, generator=g)  # NHD
    v = torch.randn(pages, H, page, D, generator=g).transpose(1, 2)  # a view of HND storage
    table = torch.randperm(pages, generator=g)[:4].view(2, 2).to(torch.int32)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    q = torch.randn(2, 1, 2 * H, D, generator=g)
    params = AttnParams(scale=0.5, block_table=table, seqlens_k=lens, max_seqlen_k=8)
    backend = FlashInferDecodeBackend()
    backend.plan = None  # type: ignore[assignment, method-assign] # never reached
    with pytest.raises(BackendUnavailableError, match="different strides"):
        backend.forward(q, k, v, None, params)  # type: ignore[arg-type]


# -- 4. paged_to_varlen (the plugins' gather) with float or bool tables --------------------
@pytest.mark.parametrize("bad", ["float_table", "bool_table", "float_lens", "v_pages"])
def test_paged_to_varlen_refuses_tables_it_would_truncate(bad: str) -> None:
    """Before: a float block table was truncated (page 1.7 gathered as page 1), float
    lengths too (2.9 keys as 2), a bool table read as pages 0/1, and a v cache of fewer
    pages than k raised an IndexError mid-gather. Now each is a ``SeqlensError``."""
    from attnhub.core.paged import paged_to_varlen
    from attnhub.errors import SeqlensError

    g = torch.Generator().manual_seed(9)
    kc = torch.randn(4, 2, H, D, generator=g)
    vc = torch.randn(4, 2, H, D, generator=g)
    q = torch.randn(1, 1, H, D, generator=g)
    table = torch.tensor([[3, 2]], dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    if bad == "float_table":
        table = table.float() - 0.3
    elif bad == "bool_table":
        table = table.bool()
    elif bad == "float_lens":
        lens = lens.float() - 0.1
    else:
        vc = vc[:2]
    with pytest.raises(SeqlensError):
        paged_to_varlen(q, kc, vc, table, lens)
    _, k, v, _, cu_k = paged_to_varlen(q, kc, kc, torch.tensor([[3, 2]], dtype=torch.int32),
                                       torch.tensor([3], dtype=torch.int32))
    assert torch.equal(k, torch.cat([kc[3], kc[2][:1]])) and cu_k.tolist() == [0, 3]
