"""Review round 7, caches: a call must never get another call's data.

- a PagedKVCache table padded its short rows with page 0, another sequence's page, which a
  length that grew past the row then read;
- copy-on-write left the tables naming the page a sequence moved off, which its fork writes;
- the dense Triton backward read the caller's slopes / prefix buffer as refilled after the
  forward;
- flex kept a BlockMask built for a module's or class's attribute after it changed;
- a rebind (``forced_backend``) while another thread resolved left that thread's binding in
  the tables.
"""

from __future__ import annotations

import threading

import pytest
import torch

import attnhub
from attnhub.core.kvcache import PagedKVCache
from attnhub.errors import SeqlensError

P, H, D = 4, 1, 8


def _kv(n: int, value: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.full((n, H, D), value)], [torch.full((n, H, D), value)]


def _paged(hub: attnhub.Hub, cache: PagedKVCache, table: torch.Tensor, lens: torch.Tensor,
           backend: str) -> torch.Tensor:
    q = torch.ones(table.shape[0], 1, H, D)
    return hub.attention(q, cache.k_cache(0), cache.v_cache(0), layout="paged",
                         block_table=table, seqlens_k=lens, backend=backend)


@pytest.mark.parametrize("backend", ["reference", "torch_sdpa", "triton_decode"])
def test_a_table_kept_past_a_rows_pages_is_refused_not_read_from_page_0(backend: str) -> None:
    cache = PagedKVCache(num_layers=1, num_pages=16, page_size=P, num_kv_heads=H, head_dim=D)
    owner, a, b = (cache.allocate() for _ in range(3))
    cache.append(owner, *_kv(4, 1000.0))  # page 0: another sequence's keys
    cache.append(a, *_kv(4, 1.0))
    cache.append(b, *_kv(8, 2.0))
    table = cache.block_table([a, b])
    assert table[0].tolist() == [cache.pages(a)[0], -1]
    hub = attnhub.Hub(hardware="cpu")
    torch.testing.assert_close(_paged(hub, cache, table, cache.seqlens([a, b]), backend)[0],
                               torch.ones(1, H, D))
    cache.append(a, *_kv(1, 1.0))  # a grows into a new page; the kept table does not know
    with pytest.raises(SeqlensError, match="build the tables again"):
        _paged(hub, cache, table, cache.seqlens([a, b]), backend)
    fresh = _paged(hub, cache, cache.block_table([a, b]), cache.seqlens([a, b]), backend)
    torch.testing.assert_close(fresh[0], torch.ones(1, H, D))


@pytest.mark.parametrize("backend", ["reference", "triton_decode"])
def test_copy_on_write_revokes_the_moved_sequences_tables_not_the_forks(backend: str) -> None:
    cache = PagedKVCache(num_layers=1, num_pages=8, page_size=8, num_kv_heads=H, head_dim=D)
    a = cache.allocate()
    cache.append(a, *_kv(3, 1.0))
    kept = cache.block_table([a])
    f = cache.fork(a)
    fork_table = cache.block_table([f])
    cache.append(a, *_kv(1, 1.0))  # a moves onto a copy of the shared page
    cache.append(f, [torch.full((1, H, D), 5.0)], [torch.full((1, H, D), -500.0)])
    hub = attnhub.Hub(hardware="cpu")
    with pytest.raises(SeqlensError, match="copy-on-write"):
        _paged(hub, cache, kept, cache.seqlens([a]), backend)
    torch.testing.assert_close(
        _paged(hub, cache, cache.block_table([a]), cache.seqlens([a]), backend)[0],
        torch.ones(1, H, D))
    # the fork still owns the old page: its own table stays good (it has 3 + 1 tokens)
    out = _paged(hub, cache, fork_table, cache.seqlens([f]), backend)
    assert float(out.min()) < 0  # reads its own -500 value


@pytest.mark.parametrize("kind", ["alibi", "prefix_lens"])
def test_triton_gradients_use_the_side_tensors_of_their_call(kind: str) -> None:
    hub = attnhub.Hub(hardware="cpu")

    def grads(backend: str) -> list[torch.Tensor]:
        torch.manual_seed(1)
        q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
        buf = (torch.tensor([0.5, 0.25]) if kind == "alibi"
               else torch.tensor([2], dtype=torch.int32))
        kw = {"causal": True, ("alibi_slopes" if kind == "alibi" else kind): buf}
        out = hub.attention(q, k, v, backend=backend, **kw)
        buf.copy_(torch.tensor([4.0, 3.0]) if kind == "alibi" else torch.tensor([7]))
        hub.attention(q.detach(), k.detach(), v.detach(), backend=backend, **kw)  # next layer
        out.square().sum().backward()
        return [q.grad, k.grad, v.grad]  # type: ignore[list-item]

    for got, want in zip(grads("triton"), grads("reference")):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


class _Limits:
    limit = 3

    def __call__(self, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return kv_idx < type(self).limit


def test_flex_rebuilds_its_block_mask_when_a_class_attribute_it_reads_changes() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 256, 1, 16) for _ in range(3))
    hub = attnhub.Hub(hardware="cpu")
    flex = hub.registry.get("flex")
    mask = _Limits()
    try:
        hub.attention(q, k, v, mask_mod=mask, backend="flex")
        builds = flex.mask_builds
        hub.attention(q, k, v, mask_mod=mask, backend="flex")
        assert flex.mask_builds == builds  # unchanged state: the cached mask serves
        _Limits.limit = 200  # the second key block is visible now
        got = hub.attention(q, k, v, mask_mod=mask, backend="flex")
        assert flex.mask_builds == builds + 1
        torch.testing.assert_close(got, hub.attention(q, k, v, mask_mod=mask,
                                                      backend="reference"))
    finally:
        _Limits.limit = 3


def test_a_binding_resolved_across_a_rebind_stays_out_of_the_tables() -> None:
    hub = attnhub.Hub(hardware="cpu")
    resolving, rebound = threading.Event(), threading.Event()
    resolve = hub.runner_for

    def slow(*a, **kw):  # type: ignore[no-untyped-def]
        run = resolve(*a, **kw)  # resolved under the old settings
        if threading.current_thread().name == "A":
            resolving.set()
            rebound.wait(5)
        return run

    hub.runner_for = slow  # type: ignore[method-assign]
    q = torch.randn(1, 16, 2, 8)
    t = threading.Thread(target=lambda: hub.attention(q, q, q), name="A")
    t.start()
    assert resolving.wait(5)
    hub.forced_backend = "reference"
    rebound.set()
    t.join(10)
    ran: list[str] = []
    for name in ("torch_sdpa", "reference"):
        b = hub.registry.get(name)
        f = b.forward
        b.forward = (lambda f=f, n=name: lambda *a, **kw: (ran.append(n), f(*a, **kw))[1])()
    hub.attention(q, q, q)
    assert ran == ["reference"]


def test_an_aborted_step_takes_back_its_copy_on_write_revocations() -> None:
    """The step copied-on-write, then aborted: the sequence is back on the page its earlier
    table names, so that table serves again (it was refused before the fix)."""
    cache = PagedKVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=8)
    p = cache.allocate()
    step = cache.step([p], 5)
    step.write(0, torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 8))
    cache.fork(p)
    bt, sl = cache.block_table([p]), cache.seqlens([p])
    pages = cache.pages(p)
    cache.step([p], 1).abort()  # p's last page is shared with the fork: copy-on-write
    assert cache.pages(p) == pages
    q = torch.randn(1, 1, 1, 8)
    got = attnhub.Hub(hardware="cpu").attention(q, cache.k_cache(0), cache.v_cache(0),
                                                layout="paged", block_table=bt, seqlens_k=sl)
    assert got.shape == (1, 1, 1, 8)
