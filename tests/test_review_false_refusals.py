"""Legitimate use that this session's hardening refused or broke (false refusals): each case
is what a real library or caller does, and must load or run as before."""

from __future__ import annotations

import random
import sys
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch

from attnhub import Hub
from attnhub.core.kvcache import PagedKVCache
from attnhub.core.registry import Registry
from tests.test_adversarial_plugins_3 import _module, site  # noqa: F401 (fixture)


def test_a_raised_recursion_limit_is_kept_and_not_blamed(site: Path) -> None:
    """torch.compile (inductor) raises the recursion limit to 2000 while compiling, and a
    parser library raises it at import because it recurses deeply later: a plugin that did
    either was blamed, and the limit lowered again under the library (a RecursionError)."""
    limit = sys.getrecursionlimit()
    raised = limit + random.randrange(500, 4000)
    body = (f"import sys\nsys.setrecursionlimit({raised})\n"
            "@hookimpl\ndef attnhub_register_backends(register):\n    register(Good())\n")
    try:
        mod = _module(site, "deep", body)
        reg = Registry.load(modules=[mod], entry_points=False)
        assert reg.plugins[mod].errors == []
        assert sys.getrecursionlimit() == raised
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.parametrize("backend", ["linear", "lsh", "torch_sdpa"])
def test_autocast_every_call_computes_like_the_first(backend: str, monkeypatch) -> None:
    """The slow lane (a binding's first call) runs backends with autocast off, the hot path
    ran them under it: from the second call on, linear/lsh computed in bf16 and cast back
    (errors 0.2 to 1.5 where the first call was exact), and torch_sdpa ran twice per call (a
    bf16 answer for fp32 queries, redone by the slow lane)."""
    g = torch.Generator().manual_seed(zlib.crc32(backend.encode()))
    q, k, v = (torch.randn(2, 48, 4, 32, generator=g) for _ in range(3))
    hub = Hub(hardware="cpu")
    exact = hub.attention(q, k, v, causal=True, backend=backend)
    runs = Counter()
    forward = hub.registry.get(backend).forward

    def counted(*a: object, **kw: object) -> object:
        runs[0] += 1
        return forward(*a, **kw)

    monkeypatch.setattr(hub.registry.get(backend), "forward", counted)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [hub.attention(q, k, v, causal=True, backend=backend) for _ in range(3)]
    for out in outs:
        assert out.dtype == torch.float32 and torch.equal(out, exact)
    assert runs[0] == 3 and not hub.fallback_counts


def test_python_caches_on_attnhub_classes_are_not_a_monkeypatch(site: Path, monkeypatch) -> None:
    """``isinstance(x, SequenceStore)`` (a Protocol) creates the class's ``__annotations__``
    and ``copy.copy``/``pickle`` of an ``AttnParams`` its ``__slotnames__``: Python's own
    caches, which a plugin's load reported as monkeypatching attnhub (and deleted)."""
    from attnhub.core.seqstate import SequenceStore
    from attnhub.core.spec import AttnParams
    monkeypatch.delattr(SequenceStore, "__annotations__", raising=False)
    monkeypatch.delattr(AttnParams, "__slotnames__", raising=False)
    body = ("import copy, pickle\nfrom attnhub.core.seqstate import SequenceStore\n"
            "from attnhub.core.spec import AttnParams\n"
            "@hookimpl\ndef attnhub_register_backends(register):\n"
            f"    p = copy.copy(AttnParams(scale={random.uniform(0.1, 2)!r}))\n"
            "    pickle.dumps(p)\n    isinstance(p, SequenceStore)\n    register(Good())\n")
    mod = _module(site, "caches", body)
    reg = Registry.load(modules=[mod], entry_points=False)
    assert reg.plugins[mod].errors == []
    assert "caches_good" in reg.backends
def test_a_revoked_table_refreshed_in_place_is_checked_not_refused() -> None:
    g = torch.Generator().manual_seed(zlib.crc32(b"static"))
    h, d, page = 2, 16, 4
    cache = PagedKVCache(num_layers=1, num_pages=32, page_size=page, num_kv_heads=h, head_dim=d)
    seqs = [cache.allocate() for _ in range(2)]
    n = int(torch.randint(3, 9, (), generator=g))
    with cache.step(seqs, n) as st:
        st.write(0, torch.randn(2, n, h, d, generator=g), torch.randn(2, n, h, d, generator=g))
    buf, lens = cache.block_table(seqs), cache.seqlens(seqs).clone()
    cache.free(seqs[1])
    seqs[1] = cache.fork(seqs[0])
    buf.copy_(cache.block_table(seqs))
    lens.copy_(cache.seqlens(seqs))
    q = torch.randn(2, 1, h, d, generator=g)
    hub = Hub(hardware="cpu")
    out = hub.attention(q, cache.k_cache(0), cache.v_cache(0), layout="paged",
                        block_table=buf, seqlens_k=lens)
    k, v = cache.gather(0, seqs)
    ref = hub.attention(q, k, v, backend="reference")
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("extra", [{"dropout_p": 0.0}, {"dropout": 0}, {"k_descale": None},
                                   {"k_descale": None, "v_descale": None}], ids=str)
def test_extra_keys_that_change_nothing_pass(extra: dict) -> None:
    """A dropout of 0 and descales of None are what every backend does anyway: refusing them
    broke callers that always pass the key (a training loop's dropout_p at eval)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(extra).encode()))
    q, k, v = (torch.randn(1, 5, 2, 8, generator=g) for _ in range(3))
    hub = Hub(hardware="cpu")
    for backend in ("torch_sdpa", "reference"):
        out = hub.attention(q, k, v, causal=True, extra=dict(extra), backend=backend)
        ref = hub.attention(q, k, v, causal=True, backend=backend)
        assert torch.equal(out, ref)
    with pytest.raises(Exception, match="dropout"):  # a real dropout is still refused
        hub.attention(q, k, v, extra={"dropout_p": 0.1})
