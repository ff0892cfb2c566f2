"""Review round 8, caches and stores: an interrupt inside a step's rollback between putting
its pages back on the free list and revoking the tables naming them left a table that a
retried ``abort()`` no longer saw; the page's next owner's keys were read through it."""

from __future__ import annotations

import pytest
import torch

import attnhub
from attnhub.core import kvcache
from attnhub.core.kvcache import PagedKVCache
from attnhub.errors import SeqlensError

P, H, D = 4, 1, 8


def test_an_interrupted_rollback_retried_still_revokes_the_steps_tables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=P, num_kv_heads=H, head_dim=D)
    a = cache.allocate()
    cache.append(a, [torch.ones(P, H, D)], [torch.ones(P, H, D)])  # page 0 full
    real = kvcache.PAGED.revoke

    def interrupted(t, why):  # type: ignore[no-untyped-def]
        if "aborted" in why:  # a second Ctrl-C inside the undo, once
            monkeypatch.setattr(kvcache.PAGED, "revoke", real)
            raise KeyboardInterrupt
        return real(t, why)

    monkeypatch.setattr(kvcache.PAGED, "revoke", interrupted)
    with pytest.raises(RuntimeError) as failed:
        with cache.step([a], 2) as step:  # takes a second page for tokens 4..5
            step.write(0, torch.ones(1, 2, H, D), torch.ones(1, 2, H, D))
            raise RuntimeError("a layer failed")
    # since review 10 the abort runs an undo cut short once more itself: done
    assert any("was undone, though KeyboardInterrupt" in n for n in failed.value.__notes__)
    step.abort()  # a no-op now
    assert cache.pages(a) == (0,) and cache.length(a) == P
    b = cache.allocate()  # takes the page the step had
    cache.append(b, [torch.full((P, H, D), 1000.0)], [torch.full((P, H, D), 1000.0)])
    with pytest.raises(SeqlensError, match="aborted"):
        attnhub.Hub(hardware="cpu").attention(
            torch.ones(1, 1, H, D), cache.k_cache(0), cache.v_cache(0), layout="paged",
            block_table=step.block_table, seqlens_k=step.seqlens)
