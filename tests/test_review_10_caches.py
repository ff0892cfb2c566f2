"""Review 10, the paged KV cache: every mutation all or nothing under a Ctrl-C wherever it lands.

1. ``free`` changed the cache in several steps (tables, state stores, the sequence, pages,
   refcounts, its relatives' fork links): a Ctrl-C between two left the sequence gone with its
   pages neither free nor held, or its relatives' links half-updated. ``write`` could store k
   without v; ``fork`` registered the sequence before its pages' refcounts; an interrupted
   ``step.abort()`` left a half-restored cache until the next operation; ``reserve`` whose
   slots never reached the caller (a Ctrl-C as the lock is released) kept tokens nobody could
   write. Now every mutator plans first and runs its change as one record (``_atomically``):
   rolled back or finished before the exception goes on.
2. A float32 k/v into a bfloat16 cache cost a host read per write (a check for values the
   cast rounds to inf); k/v of another dtype than the cache's are now refused, never cast.
3. numpy/torch integer token counts and layers are taken as sequence ids are.

The interrupt is injected by fault injection where CPython can deliver one (as a C call
returns) and, stricter, at every line of the cache's code (``sys.settrace``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from attnhub.core.kvcache import PagedKVCache
from attnhub.errors import InputError
from attnhub.testing import CtrlCAt, DictStateStore
from tests.test_review_9_decoder_steps import _CutLock

H, D, P = 2, 4, 3
_FILES = ("kvcache.py", "seqstate.py", "kvquant.py", "testing.py")


def _kv(n: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(n, H, D, generator=g).to(dtype) for _ in range(2)],
            [torch.randn(n, H, D, generator=g).to(dtype) for _ in range(2)])


def _setup(seed: int, dtype: torch.dtype = torch.float32) -> tuple[PagedKVCache,
                                                                      DictStateStore, dict]:
    """Sequences sharing pages and fork links: a (4 tokens) and its fork b; c (2) and its fork
    d (3, copied its page); f forked from d through a freed e; slots reserved for d; and a
    step of a and c taken (for its abort)."""
    store = DictStateStore(slots=16)
    c = PagedKVCache(num_layers=2, num_pages=12, page_size=P, num_kv_heads=H, head_dim=D,
                     dtype=dtype)
    c.attach_state([1], store)
    a = c.allocate()
    c.append(a, *_kv(4, seed, dtype))
    b = c.fork(a)
    cc = c.allocate()
    c.append(cc, *_kv(2, seed + 1, dtype))
    d = c.fork(cc)
    c.append(d, *_kv(1, seed + 2, dtype))
    e = c.fork(d)
    f = c.fork(e)
    c.free(e)
    slots = c.reserve([d], 2)
    return c, store, {"a": a, "b": b, "c": cc, "d": d, "f": f, "slots": slots}


def _snapshot(c: PagedKVCache, store: DictStateStore) -> tuple:
    """Read straight from the fields (no locked call, which would finish pending records):
    each sequence's pages, length, fork links, values (and zeros past its end), the free
    pages, refcounts and the store's sequences."""
    seqs = {}
    for sid, s in c._seqs.items():
        idx = torch.tensor(s.pages, dtype=torch.long)
        data = []
        for layer in range(c.num_layers):
            k, v = c._k[layer][idx].flatten(0, 1), c._v[layer][idx].flatten(0, 1)
            data.append((k[:s.length].float().tolist(), v[:s.length].float().tolist(),
                         bool((k[s.length:] == 0).all() and (v[s.length:] == 0).all())))
        seqs[sid] = (tuple(s.pages), s.length, s.shared, dict(s.links), data)
    return seqs, sorted(c._free), list(c._refs), sorted(store.states)


def _step(c: PagedKVCache, ids: dict) -> None:
    mark = c.steps_taken  # as Decoder.decode does
    try:
        with c.step([ids["a"], ids["d"]], 1) as st:
            for layer in range(2):
                k, v = _kv(2, 9)
                st.write(layer, k[0].view(2, 1, H, D), v[0].view(2, 1, H, D))
    except BaseException as exc:
        c.abort_unentered_steps(mark, exc)
        raise


_OPS: dict[str, Callable[[PagedKVCache, dict], Any]] = {
    "allocate": lambda c, ids: c.allocate(),
    "fork": lambda c, ids: c.fork(ids["a"]),
    "free_shared": lambda c, ids: c.free(ids["a"]),
    "free_linked": lambda c, ids: c.free(ids["d"]),
    "reserve": lambda c, ids: c.reserve([ids["a"], ids["c"]], [2, 3]),
    "append_cow": lambda c, ids: c.append(ids["a"], *_kv(3, 5)),
    "append": lambda c, ids: c.append(ids["c"], *_kv(5, 6)),
    "write": lambda c, ids: c.write(1, ids["slots"], _kv(2, 7)[0][0], _kv(2, 7)[1][0]),
    "step": _step,
    "abort": lambda c, ids: ids["st"].abort(),
}
#: the calls whose result the caller needs: interrupted, the cache is as before them
_HANDS_OUT = {"allocate", "fork", "reserve"}


def _prepared(seed: int, op: str) -> tuple[PagedKVCache, DictStateStore, dict]:
    c, store, ids = _setup(seed)
    if op == "abort":
        ids["st"] = c.step([ids["a"], ids["c"]], 2)
    return c, store, ids


@pytest.mark.parametrize("mode", ["c", "line"])
@pytest.mark.parametrize("op", sorted(_OPS))
def test_a_ctrl_c_anywhere_in_a_mutation_leaves_the_cache_as_before_or_after(
        op: str, mode: str) -> None:
    """Before: free (cut between its steps: a page lost, links half-updated), write (k
    without v), fork (refcounts behind its pages) and abort (half-restored until the next
    operation) left a cache neither as before nor as after the call."""
    seed = {"c": 11, "line": 12}[mode]
    c, store, ids = _prepared(seed, op)
    before = _snapshot(c, store)
    _OPS[op](c, ids)
    after = _snapshot(c, store)
    assert before != after
    points = 0
    while True:
        points += 1
        c, store, ids = _prepared(seed, op)
        cut = CtrlCAt(points, mode, _FILES)
        cut.run(lambda: _OPS[op](c, ids))  # noqa: B023 - run at once
        if not cut.fired:
            break
        got = _snapshot(c, store)
        where = f"{op}, interrupted at point {points} ({mode})"
        assert got == before or (got == after and op not in _HANDS_OUT), where
        assert not c._undos, where  # nothing left for the next operation to finish
        c.check_invariants()
        for sid in c.seq_ids:  # and it goes on: every sequence grows, then all are freed
            c.append(sid, *_kv(1, 13))
        c.check_invariants()
        for sid in c.seq_ids:
            c.free(sid)
        assert c.free_pages == c.num_pages and not store.states, where
    assert points > 5


@pytest.mark.parametrize("op", ["reserve", "append", "free", "write"])
def test_a_ctrl_c_as_the_lock_is_released_leaves_no_reservation_nobody_got(op: str) -> None:
    """Before: ``reserve`` interrupted as it released the lock kept its tokens, at slots the
    caller never got (the sequence grew by unwritten zeros). Now it is taken back, as
    ``allocate``/``fork`` take back their sequence; the others are complete (as after)."""
    c, store, ids = _setup(21)
    before = _snapshot(c, store)
    twin, twin_store, twin_ids = _setup(21)
    calls = {
        "reserve": lambda x, i: x.reserve([i["a"], i["c"]], [2, 1]),
        "append": lambda x, i: x.append(i["c"], *_kv(2, 22)),
        "free": lambda x, i: x.free(i["a"]),
        "write": lambda x, i: x.write(0, i["slots"], _kv(2, 23)[0][0], _kv(2, 23)[1][0]),
    }
    calls[op](twin, twin_ids)
    after = _snapshot(twin, twin_store)
    lock = _CutLock()
    c._lock = lock  # type: ignore[assignment]
    lock.armed = True
    with pytest.raises(KeyboardInterrupt, match="lock is released"):
        calls[op](c, ids)
    assert not lock.armed
    assert _snapshot(c, store) == (before if op == "reserve" else after)
    c.check_invariants()


# -- 2. k/v of another dtype -----------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype,kv_dtype", [
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
    (torch.float32, torch.float64), (torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.float16),
])
@pytest.mark.parametrize("how", ["append", "write", "step"])
def test_kv_of_another_dtype_is_refused_naming_the_fix_and_nothing_changes(
        monkeypatch: pytest.MonkeyPatch, cache_dtype: torch.dtype, kv_dtype: torch.dtype,
        how: str) -> None:
    """Before: cast, with a host read (``bool(...)``, a device sync) per write where the
    cast could round to inf."""
    c = PagedKVCache(num_layers=2, num_pages=6, page_size=P, num_kv_heads=H, head_dim=D,
                     dtype=cache_dtype)
    a = c.allocate()
    c.append(a, *_kv(2, 41, cache_dtype))
    before = [c.read(layer, a) for layer in range(2)]
    reads = []
    real = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or real(t))
    ks, vs = _kv(2, 42, kv_dtype)
    ks[1] = ks[1].to(cache_dtype)  # only v of layer 1 and k of layer 0 are of another dtype
    with pytest.raises(InputError, match=rf"[kv] is {kv_dtype}, the cache stores "
                                         rf"{cache_dtype}; pass [kv]\.to\(cache\.dtype\)"):
        if how == "append":
            c.append(a, ks, vs)
        elif how == "write":
            c.write(0, c.reserve([a], 2), ks[0], vs[0])
        else:
            with c.step([a], 2) as st:
                st.write(0, ks[0][None], vs[0][None])
    assert not reads  # refused without a host read
    monkeypatch.undo()
    assert c.length(a) == (4 if how == "write" else 2)  # write: its reservation stands
    for layer in range(2):
        k, v = c.read(layer, a)
        assert torch.equal(k[:2], before[layer][0]) and torch.equal(v[:2], before[layer][1])
    c.check_invariants()


@pytest.mark.parametrize("cache_dtype,kv_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.float64, torch.float32), (torch.float64, torch.bfloat16),
])
@pytest.mark.parametrize("how", ["append", "write", "step"])
def test_kv_the_cache_widens_exactly_is_written_as_is_without_a_host_read(
        monkeypatch: pytest.MonkeyPatch, cache_dtype: torch.dtype, kv_dtype: torch.dtype,
        how: str) -> None:
    """A prefill under autocast (bf16 k/v) into an fp32 cache: every value fits exactly, so
    it is taken, with no check to make: no host read beyond the same write's at the cache's
    own dtype (``write`` reads its slots once)."""
    c = PagedKVCache(num_layers=2, num_pages=6, page_size=P, num_kv_heads=H, head_dim=D,
                     dtype=cache_dtype)
    reads: list[int] = []
    real = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or real(t))

    def put(seq: int, ks: list, vs: list) -> int:
        reads.clear()
        if how == "append":
            c.append(seq, ks, vs)
        elif how == "write":
            slots = c.reserve([seq], 2)
            for layer in range(2):
                c.write(layer, slots, ks[layer], vs[layer])
        else:
            with c.step([seq], 2) as st:
                for layer in range(2):
                    st.write(layer, ks[layer][None], vs[layer][None])
        return len(reads)

    own = put(c.allocate(), *_kv(2, 44, cache_dtype))
    a = c.allocate()
    ks, vs = _kv(2, 43, kv_dtype)
    assert put(a, ks, vs) == own
    monkeypatch.undo()
    for layer in range(2):
        k, v = c.read(layer, a)
        assert k.dtype == cache_dtype
        assert torch.equal(k[:2], ks[layer].to(cache_dtype))
        assert torch.equal(v[:2], vs[layer].to(cache_dtype))
    c.check_invariants()


def test_a_step_write_of_the_caches_dtype_reads_nothing_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = PagedKVCache(num_layers=1, num_pages=4, page_size=P, num_kv_heads=H, head_dim=D,
                     dtype=torch.bfloat16)
    a = c.allocate()
    reads = []
    real = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or real(t))
    k = torch.randn(1, 4, H, D).to(torch.bfloat16)
    with c.step([a], 4) as st:
        st.write(0, k, k)
    assert not reads
    monkeypatch.undo()
    assert torch.equal(c.read(0, a)[0], k[0])


# -- 3. integer arguments ---------------------------------------------------------------------
def test_numpy_and_torch_integers_are_counts_and_layers_bools_and_floats_are_refused() -> None:
    c = PagedKVCache(num_layers=2, num_pages=6, page_size=P, num_kv_heads=H, head_dim=D)
    a = c.allocate()
    slots = c.reserve([np.int64(a)], np.int64(2))
    c.write(np.int32(1), slots, *[t[0] for t in _kv(2, 51)])
    with c.step([a], torch.tensor(1)) as st:
        for layer in range(2):
            st.write(layer, torch.zeros(1, 1, H, D), torch.zeros(1, 1, H, D))
    assert c.length(a) == 3 and c.refcount(np.int64(0)) == 1
    assert torch.equal(c.read(1, a)[0][:2], _kv(2, 51)[0][0])
    for bad in (True, 1.0, "1", torch.tensor([1]), None):
        with pytest.raises(InputError, match="reserve: "):
            c.reserve([a], bad)  # type: ignore[arg-type]
        with pytest.raises(InputError, match="step: new_tokens"):
            c.step([a], bad)  # type: ignore[arg-type]
        with pytest.raises(InputError, match="layer="):
            c.k_cache(bad)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="reserve: negative"):
        c.reserve([a], [np.int64(-1)])
    assert c.length(a) == 3
    c.check_invariants()
