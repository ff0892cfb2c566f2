"""A block table the cache handed out is taken back once a page it names is freed: passed to
the hub afterwards it raises, instead of reading the page's next owner's tokens."""

from __future__ import annotations

import math

import pytest
import torch

import attnhub
from attnhub import AttnParams
from attnhub.core.kvcache import PagedKVCache
from attnhub.core.reference import reference_attention
from attnhub.errors import SeqlensError

HKV, D = 2, 8


def _cache() -> PagedKVCache:
    return PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=HKV, head_dim=D)


def _fill(cache: PagedKVCache, n: int, gen: torch.Generator) -> tuple[int, torch.Tensor,
                                                                      torch.Tensor]:
    s = cache.allocate()
    k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
    cache.append(s, [k], [v])
    return s, k, v


def _paged(hub: attnhub.Hub, cache: PagedKVCache, q: torch.Tensor, bt: torch.Tensor,
           sl: torch.Tensor, backend: str | None) -> torch.Tensor:
    return hub.attention(q, cache.k_cache(0), cache.v_cache(0), layout="paged",
                         block_table=bt, seqlens_k=sl, backend=backend)


def _want(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    ref, _ = reference_attention(q, k[None], v[None], AttnParams(scale=1 / math.sqrt(D)))
    return ref.to(q.dtype)


@pytest.mark.parametrize("backend", [None, "reference", "torch_sdpa", "triton_decode"])
@pytest.mark.parametrize("used_before", [False, True])
def test_freed_sequence_table_is_refused_not_read(backend: str | None,
                                                  used_before: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    hub, cache = attnhub.Hub(hardware="cpu"), _cache()
    s, k, v = _fill(cache, 6, gen)
    q = torch.randn(1, 1, 2 * HKV, D, generator=gen)
    step_bt, step_sl = cache.block_table([s]), cache.seqlens([s])
    if used_before:  # the memo and the hub's per-layer shortcut hold the tables now
        for _ in range(2):
            got = _paged(hub, cache, q, step_bt, step_sl, backend)
            assert torch.allclose(got, _want(q, k, v), atol=1e-5)
    cache.free(s)
    other, k2, v2 = _fill(cache, 6, gen)  # takes the freed pages
    assert set(cache.pages(other)) & set(step_bt[0].tolist())
    with pytest.raises(SeqlensError, match=f"sequence {s} was freed"):
        _paged(hub, cache, q, step_bt, step_sl, backend)
    fresh = _paged(hub, cache, q, cache.block_table([other]), cache.seqlens([other]), backend)
    assert torch.allclose(fresh, _want(q, k2, v2), atol=1e-5)


def test_an_aborted_step_takes_its_tables_back() -> None:
    gen = torch.Generator().manual_seed(3)
    hub, cache = attnhub.Hub(hardware="cpu"), _cache()
    s = cache.allocate()
    step = cache.step([s], 5)
    step.abort()
    q = torch.randn(1, 1, 2 * HKV, D, generator=gen)
    with pytest.raises(SeqlensError, match="aborted"):
        _paged(hub, cache, q, step.block_table, step.seqlens, None)


def test_tables_of_live_sequences_stay_good() -> None:
    """Freeing one sequence revokes only tables naming its released pages: a fork's table
    (its pages still held) and another sequence's table go on answering right."""
    gen = torch.Generator().manual_seed(5)
    hub, cache = attnhub.Hub(hardware="cpu"), PagedKVCache(
        num_layers=1, num_pages=8, page_size=4, num_kv_heads=HKV, head_dim=D)
    a, ka, va = _fill(cache, 7, gen)
    b, kb, vb = _fill(cache, 5, gen)
    fork = cache.fork(a)
    q = torch.randn(2, 1, 2 * HKV, D, generator=gen)
    bt, sl = cache.block_table([fork, b]), cache.seqlens([fork, b])
    cache.free(a)  # its pages are still the fork's
    got = _paged(hub, cache, q, bt, sl, None)
    assert torch.allclose(got[:1], _want(q[:1], ka, va), atol=1e-5)
    assert torch.allclose(got[1:], _want(q[1:], kb, vb), atol=1e-5)
