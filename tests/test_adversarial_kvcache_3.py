"""The paged KV cache under faults, third round: a model step used after the cache changed
under it (its sequence freed and the page handed on, moved by copy-on-write, forked), a step
left by an interrupt the cache can no longer undo, and random runs of allocate / fork / free
/ steps that fail at a random layer, compared bit for bit with a twin cache that never saw
the failed steps (fp32 and FP8 e4m3 pages with their descales)."""

from __future__ import annotations

import random

import pytest
import torch

from attnhub.core.kvcache import PagedKVCache
from attnhub.errors import CacheFullError, InputError

HKV, D, PAGE, LAYERS = 2, 4, 4, 3
DTYPES = [torch.float32, torch.float8_e4m3fn]


def _cache(dtype: torch.dtype, pages: int = 12) -> PagedKVCache:
    return PagedKVCache(num_layers=LAYERS, num_pages=pages, page_size=PAGE, num_kv_heads=HKV,
                        head_dim=D, dtype=dtype)


def _kv(b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, n, HKV, D) * 3, torch.randn(b, n, HKV, D) * 3


def _fill(c: PagedKVCache, seqs: list[int], n: int) -> None:
    with c.step(seqs, n) as step:
        for layer in range(LAYERS):
            step.write(layer, *_kv(len(seqs), n))


def _reads(c: PagedKVCache, seqs: list[int]) -> list[torch.Tensor]:
    return [t.float().clone() for s in seqs for layer in range(LAYERS) for t in c.read(layer, s)]


# -- a step used after the cache changed under it --------------------------------------------
def _freed_and_reused(c: PagedKVCache, a: int) -> int:
    c.free(a)
    b = c.allocate()
    _fill(c, [b], 2 * PAGE)  # takes the freed pages again
    return b


def _moved_by_copy_on_write(c: PagedKVCache, a: int) -> int:
    f = c.fork(a)  # shares a's partly filled last page
    _fill(c, [a], 1)  # a copies it: the step's slots now lie in the fork's page alone
    return f


def _forked(c: PagedKVCache, a: int) -> int:
    return c.fork(a)  # the fork shares the page the step writes


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "e4m3"])
@pytest.mark.parametrize("change", [_freed_and_reused, _moved_by_copy_on_write, _forked])
def test_a_stale_step_never_writes_into_another_sequence(dtype: torch.dtype, change) -> None:
    """Before: ``CacheStep.write`` wrote its slots unchecked whatever happened since the step,
    so the late layer's keys landed in a page that another sequence (a new owner, a fork)
    reads: silently wrong attention for that sequence."""
    c = _cache(dtype)
    a = c.allocate()
    _fill(c, [a], random.Random(0).randrange(1, PAGE))  # a partly filled last page
    step = c.step([a], 1)
    step.write(0, *_kv(1, 1))
    other = change(c, a)
    before, free = _reads(c, [other]), c.free_pages
    with pytest.raises(InputError, match=r"CacheStep\.write: .*changed") as exc:
        step.write(1, *_kv(1, 1))
    assert "cache.step" in str(exc.value)  # the fix: a new step
    for x, y in zip(_reads(c, [other]), before):
        assert torch.equal(x, y)
    assert c.free_pages == free
    c.check_invariants()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "e4m3"])
def test_a_step_still_writes_after_unrelated_changes(dtype: torch.dtype) -> None:
    """The check above refuses only what would reach another sequence: a step whose pages
    are untouched still writes every layer after other sequences came and went."""
    c = _cache(dtype)
    a, b = c.allocate(), c.allocate()
    _fill(c, [a, b], 3)
    step = c.step([a], 2)
    k, v = _kv(1, 2)
    step.write(0, k, v)
    _fill(c, [b], 2)
    c.free(c.fork(b))
    for layer in range(1, LAYERS):
        step.write(layer, k, v)
    got = c.read(LAYERS - 1, a)[0][-2:].float()
    torch.testing.assert_close(got, k[0], atol=0.1 * k.abs().max().item(), rtol=0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "e4m3"])
def test_a_write_repeating_a_slot_is_refused(dtype: torch.dtype) -> None:
    """Before: ``write`` took slots that repeat (a list of slots concatenated twice): which
    of the two values the token kept was up to the scatter (undefined, and on a GPU
    different from run to run), with no error."""
    c = _cache(dtype)
    a = c.allocate()
    slots = c.reserve([a], random.randint(2, 2 * PAGE))
    dup = torch.cat([slots, slots[torch.randperm(slots.numel())[:1]]])
    k, v = (torch.randn(dup.numel(), HKV, D) for _ in range(2))
    with pytest.raises(InputError, match="repeats"):
        c.write(0, dup, k, v)
    assert c.read(0, a)[0].abs().sum() == 0  # nothing written
    c.write(0, slots, k[: slots.numel()], v[: slots.numel()])


@pytest.mark.parametrize("bad", [
    {"head_dim_v": 0}, {"num_pages": True}, {"num_layers": 1.5}, {"page_size": "4"},
    {"head_dim_v": -3}, {"dtype": torch.complex64}, {"dtype": torch.int32},
    {"dtype": torch.float8_e5m2}, {"dtype": "float16"},
])
def test_a_cache_it_could_not_use_is_refused_when_built(bad: dict) -> None:
    """Before: ``head_dim_v=0`` silently became D (``0 or D``), ``num_pages=True`` one page,
    a complex64 cache stored complex keys; an int or e5m2 cache, a float or str size failed
    later as TypeError / NotImplementedError / RuntimeError, mid-append."""
    kw = {"num_layers": 1, "num_pages": 2, "page_size": PAGE, "num_kv_heads": HKV,
          "head_dim": D, **bad}
    with pytest.raises(InputError, match=rf"PagedKVCache: {next(iter(bad))}="):
        PagedKVCache(**kw)


# -- an interrupt the step can no longer undo ------------------------------------------------
@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError, RuntimeError])
def test_an_interrupted_step_keeps_its_exception_when_it_cannot_be_undone(exc: type) -> None:
    """Before: leaving ``with cache.step(...)`` by Ctrl-C after the cache changed replaced
    the KeyboardInterrupt by the InputError of the refused abort (an ``except ValueError``
    then swallowed the interrupt). The caller's exception goes on, with a note that names
    the step it could not undo and the fix."""
    c = _cache(torch.float32)
    a = c.allocate()
    with pytest.raises(exc) as info:
        with c.step([a], 3) as step:
            step.write(0, *_kv(1, 3))
            c.allocate()  # the cache changed: this step can no longer be rolled back
            raise exc("interrupted at layer 1")
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "could not be undone" in notes and "free" in notes
    c.check_invariants()


# -- random runs with failing steps against a twin that never saw them -----------------------
def _same_cache(a: PagedKVCache, b: PagedKVCache) -> None:
    a.check_invariants()
    assert a.seq_ids == b.seq_ids and a._free == b._free and a._refs == b._refs
    held = sorted({p for s in a.seq_ids for p in a.pages(s)})
    for s in a.seq_ids:
        assert a.pages(s) == b.pages(s) and a.length(s) == b.length(s)
    idx = torch.tensor(held, dtype=torch.int64)
    for x, y in ((a._k, b._k), (a._v, b._v)):  # whole pages: tails past the end too
        assert torch.equal(x[:, idx].view(torch.uint8), y[:, idx].view(torch.uint8))
    if a.scales is not None:
        assert torch.equal(a.scales.k[:, idx], b.scales.k[:, idx])
        assert torch.equal(a.scales.v[:, idx], b.scales.v[:, idx])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "e4m3"])
@pytest.mark.parametrize("seed", range(3))
def test_steps_failing_at_a_random_layer_leave_no_trace(dtype: torch.dtype, seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    faulty, twin = _cache(dtype), _cache(dtype)
    for _ in range(60):
        live = faulty.seq_ids
        op = rng.choice(["alloc", "fork", "free", "step", "step", "step", "fail", "fail"])
        if op == "alloc" or not live:
            assert faulty.allocate() == twin.allocate()
        elif op == "fork":
            s = rng.choice(live)
            assert faulty.fork(s) == twin.fork(s)
        elif op == "free":
            s = rng.choice(live)
            faulty.free(s)
            twin.free(s)
        else:
            seqs = rng.sample(live, rng.randint(1, len(live)))
            n = rng.randint(1, PAGE + 2)
            kvs = [_kv(len(seqs), n) for _ in range(LAYERS)]
            fails_at = rng.randrange(LAYERS + 1) if op == "fail" else None
            try:
                with faulty.step(seqs, n) as step:
                    for layer in range(LAYERS):
                        if layer == fails_at:
                            raise rng.choice([RuntimeError, MemoryError, KeyboardInterrupt])()
                        step.write(layer, *kvs[layer])
                    if fails_at == LAYERS:  # after every layer wrote: the attention failed
                        raise RuntimeError("CUDA out of memory")
            except CacheFullError:
                pass
            except (RuntimeError, MemoryError, KeyboardInterrupt):
                assert fails_at is not None
            else:
                with twin.step(seqs, n) as step:
                    for layer in range(LAYERS):
                        step.write(layer, *kvs[layer])
        _same_cache(faulty, twin)
