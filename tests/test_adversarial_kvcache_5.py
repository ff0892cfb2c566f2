"""The paged KV cache, fifth round: threads that serve their own sequences of one cache, a
Ctrl-C inside a reservation, an FP8 page whose descale grows a little every step, and
arguments of the wrong kind. Each handed one id to two threads, corrupted a sequence,
drifted a token's value 3x, or raised a raw KeyError/IndexError/TypeError."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import attnhub
from attnhub.core.kvcache import PagedKVCache
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.errors import InputError


@pytest.fixture
def fast_switching():
    """Threads switch every microsecond: a race shows in thousands of calls, not millions."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_threads_never_share_an_id_or_a_page(fast_switching) -> None:
    cache = PagedKVCache(num_layers=1, num_pages=4096, page_size=1, num_kv_heads=1,
                         head_dim=2)
    got: list[list[int]] = [[], []]

    def work(mine: list[int]) -> None:
        for _ in range(1500):
            sid = cache.allocate()
            cache.reserve([sid], 1)
            mine.append(sid)

    threads = [threading.Thread(target=work, args=(g,)) for g in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not set(got[0]) & set(got[1])
    assert len(set(got[0] + got[1])) == 3000
    cache.check_invariants()
    pages = [cache.pages(s)[0] for s in got[0] + got[1]]
    assert len(set(pages)) == 3000


@pytest.mark.parametrize("where", ["arange", "copy"])
def test_ctrl_c_inside_a_reservation_changes_nothing(where: str, monkeypatch) -> None:
    """A KeyboardInterrupt in ``torch.arange`` (the slots) or in a copy-on-write left a
    phantom token that attention read as a key, a page held for 0 tokens and a lost page."""
    cache = PagedKVCache(num_layers=1, num_pages=8, page_size=2, num_kv_heads=1, head_dim=4)
    a = cache.allocate()
    cache.append(a, [torch.ones(1, 1, 4)], [torch.ones(1, 1, 4)])
    fork, b = cache.fork(a), cache.allocate()
    before = ({s: (cache.length(s), cache.pages(s)) for s in cache.seq_ids},
              cache.free_pages, [cache.refcount(p) for p in range(8)])
    target, name = (torch, "arange") if where == "arange" else (cache, "_copy_on_write")
    real = getattr(target, name)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(target, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        with cache.step([a, b], 1):
            pass
    monkeypatch.setattr(target, name, real)
    after = ({s: (cache.length(s), cache.pages(s)) for s in cache.seq_ids},
             cache.free_pages, [cache.refcount(p) for p in range(8)])
    assert after == before
    cache.check_invariants()
    k, _ = cache.read(0, a)
    assert k.shape[0] == 1 and fork in cache.seq_ids
    with cache.step([a, b], 1) as st:  # and the cache works on
        st.write(0, torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4))
    assert cache.length(a) == 2 and cache.length(b) == 1


def test_an_fp8_token_keeps_its_value_while_its_page_grows_a_little_each_step() -> None:
    """Each token 3% larger than the last: requantizing by a ratio near 1 rounded most codes
    back to themselves while the descale grew, and token 0 read back as 3.26 for 1.0."""
    cache = PagedKVCache(num_layers=1, num_pages=1, page_size=64, num_kv_heads=1,
                         head_dim=4, dtype=torch.float8_e4m3fn)
    s = cache.allocate()
    first = torch.tensor([[[1.0, 0.3, -0.7, 0.05]]])
    cache.append(s, [first], [first])
    for i in range(40):
        y = torch.full((1, 1, 4), 1.03 ** (i + 1))
        cache.append(s, [y], [y])
    k, _ = cache.read(0, s)
    # one e4m3 rounding of the first token at the final page descale (3 mantissa bits, and
    # values 4 binades below the page's largest)
    torch.testing.assert_close(k[0], first[0], rtol=0.07, atol=0.02)


def test_threads_writing_a_cache_never_blame_a_reading_backend(fast_switching) -> None:
    """One thread's steps write its own slots of the cache while another reads its own
    sequence through the hub: the cache's version counter moved under the reader, and the
    hub distrusted a correct backend ("wrote into its input k, v")."""
    cache = PagedKVCache(num_layers=1, num_pages=256, page_size=4, num_kv_heads=2,
                         head_dim=8)
    hub = attnhub.Hub(hardware="cpu")
    reader, writer = cache.allocate(), cache.allocate()
    kv = torch.randn(12, 2, 8)
    cache.append(reader, [kv], [kv])
    stop, errors = threading.Event(), []

    def write() -> None:
        while not stop.is_set() and cache.length(writer) < 900:
            with cache.step([writer], 1) as st:
                st.write(0, torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8))

    t = threading.Thread(target=write)
    t.start()
    try:
        q = torch.randn(1, 1, 4, 8)
        want, _ = reference_attention(q.double(), kv[None].double(), kv[None].double(),
                                      AttnParams(scale=8 ** -0.5))
        for _ in range(60):
            try:
                out = hub.attention(q, cache.k_cache(0), cache.v_cache(0), layout="paged",
                                    block_table=cache.block_table([reader]),
                                    seqlens_k=cache.seqlens([reader]), backend="reference")
                torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
            except Exception as e:  # noqa: BLE001 - collected, asserted below
                errors.append(e)
    finally:
        stop.set()
        t.join()
    assert not errors, errors[:2]


@pytest.mark.parametrize("call, match", [
    (lambda c, a, b: c.step([a, b], [1, 2]), "new_tokens=\\[1, 2\\]"),
    (lambda c, a, b: c.step(torch.tensor([a]), 1), "seq_ids=tensor"),
    (lambda c, a, b: c.gather(0, []), "no sequence ids"),
    (lambda c, a, b: c.reserve(None, 1), "seq_ids=None"),
    (lambda c, a, b: c.refcount(100), "page=100"),
    (lambda c, a, b: c.refcount(-1), "page=-1"),
    (lambda c, a, b: c.block_table("ab"), "seq_ids='ab'")])
def test_arguments_of_the_wrong_kind_are_named(call, match: str) -> None:
    cache = PagedKVCache(num_layers=1, num_pages=8, page_size=2, num_kv_heads=1, head_dim=4)
    a, b = cache.allocate(), cache.allocate()
    with pytest.raises(InputError, match=match):
        call(cache, a, b)
    assert cache.length(a) == cache.length(b) == 0 and cache.free_pages == 8
