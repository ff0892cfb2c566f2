"""Review: calls made under ``torch.inference_mode()`` (how servers and many eval loops run).
Tensors created there keep no version counter (``t._version`` raises), and they can be
edited in place there without any stamp moving, so every memo that proves "unchanged" by a
stamp (the paged/thd table memos, a KV cache's vouched tables, the transformers mask memo)
must take another proof for them: the contents. Each case: the answer against the fp64
reference, then an in-place edit inside inference mode that must be seen."""

from __future__ import annotations

import math

import pytest
import torch

from attnhub import Hub
from attnhub.core.kvcache import PagedKVCache
from attnhub.core.paged import paged_to_varlen
from attnhub.core.spec import AttnParams
from attnhub.errors import SeqlensError
from attnhub.testing import assert_fa_rule, fa_references


@pytest.fixture(scope="module")
def hub() -> Hub:
    return Hub()


def _check_paged(out: torch.Tensor, q, kc, vc, table, lens) -> None:
    b, sq, hq, d = q.shape
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, kc, vc, table, lens)
    p = AttnParams(scale=1 / math.sqrt(d), causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref64, _, same = fa_references(qv, kv, vv, p, layout="thd")
    assert_fa_rule(out.reshape(b * sq, hq, -1), ref64, same)


def test_paged_tables_made_in_inference_mode(hub: Hub) -> None:
    torch.manual_seed(0)
    with torch.inference_mode():
        kc, vc = torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16)
        q = torch.randn(2, 1, 4, 16)
        table = torch.tensor([[3, 5, 0, 0], [7, 1, 2, 6]], dtype=torch.int32)
        lens = torch.tensor([6, 13], dtype=torch.int32)
        for _ in range(2):  # the second call: the memo's hit
            out = hub.attention(q, kc, vc, layout="paged", block_table=table, seqlens_k=lens,
                                causal=True)
            _check_paged(out, q, kc, vc, table, lens)
        table[1, 0] = 4  # an in-place edit no version counter records
        out = hub.attention(q, kc, vc, layout="paged", block_table=table, seqlens_k=lens,
                            causal=True)
        _check_paged(out, q, kc, vc, table, lens)
        table[0, 1] = 8  # a page id past the cache, in a used entry: rejected
        with pytest.raises(SeqlensError, match="block_table"):
            hub.attention(q, kc, vc, layout="paged", block_table=table, seqlens_k=lens,
                          causal=True)


def _filled_cache(lens: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """(block_table, seqlens, k cache, v cache) of a one-layer cache holding random keys for
    sequences of ``lens`` tokens, its tables as the cache builds them."""
    cache = PagedKVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8)
    seqs = [cache.allocate() for _ in lens]
    for s, n in zip(seqs, lens):
        kv = torch.randn(n, 2, 8)
        cache.write(0, cache.reserve([s], n), kv, torch.randn_like(kv))
    return cache.block_table(seqs), cache.seqlens(seqs), cache.k_cache(0), cache.v_cache(0)


def test_kv_cache_tables_in_inference_mode(hub: Hub) -> None:
    torch.manual_seed(1)
    with torch.inference_mode():
        bt, sl, kc, vc = _filled_cache((5, 9))
        q = torch.randn(2, 1, 4, 8)
        out = hub.attention(q, kc, vc, layout="paged", block_table=bt, seqlens_k=sl,
                            causal=True)
        _check_paged(out, q, kc, vc, bt, sl)
        sl[1] = 3  # edited after the cache vouched for it: the hub must read the new value
        out = hub.attention(q, kc, vc, layout="paged", block_table=bt, seqlens_k=sl,
                            causal=True)
        _check_paged(out, q, kc, vc, bt, sl)


def test_thd_offsets_made_in_inference_mode(hub: Hub) -> None:
    torch.manual_seed(2)
    with torch.inference_mode():
        q, k, v = torch.randn(7, 4, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16)
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        for edit in (None, 5):
            if edit is not None:
                cu[1] = edit  # other documents, same tensor, no version bump
            out = hub.attention(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu,
                                causal=True)
            p = AttnParams(scale=0.25, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
            ref64, _, same = fa_references(q, k, v, p, layout="thd")
            assert_fa_rule(out, ref64, same)


def test_transformers_under_inference_mode() -> None:
    """A padded batch and generate() under inference_mode, as eager gives them."""
    transformers = pytest.importorskip("transformers")
    from attnhub.integrations import transformers as hf
    from attnhub.integrations.transformers.testing import one_intraop_thread, twin_models

    before = hf.registered_hub()
    hf.register(Hub())
    try:
        _generate_under_inference_mode(transformers, twin_models, one_intraop_thread)
    finally:
        hf.register(before)  # the other modules' registered hub


def _generate_under_inference_mode(transformers, twin_models, one_intraop_thread) -> None:  # type: ignore[no-untyped-def]
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    ours, eager = twin_models(cfg)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (2, 8), generator=gen)
    with one_intraop_thread(), torch.inference_mode():
        for pad in (3, 5):  # two batches of one shape, other padding
            mask = torch.ones(2, 8, dtype=torch.long)
            mask[0, :pad] = 0
            got = ours(input_ids=ids, attention_mask=mask).logits[mask.bool()]
            want = eager(input_ids=ids, attention_mask=mask).logits[mask.bool()]
            assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
            kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
            assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))


def test_kv_cache_tables_keep_their_proof_in_inference_mode(hub: Hub, monkeypatch) -> None:
    """A cache's tables made under inference_mode are still vouched for: the hub reads
    nothing back (no host sync per step on an accelerator), and an edit is still seen."""
    from attnhub.core import tables

    reads = []
    real = tables._check_paged_contents
    monkeypatch.setattr(tables, "_check_paged_contents",
                        lambda *a: reads.append(1) or real(*a))
    with torch.inference_mode():
        bt, sl, kc, vc = _filled_cache((3, 6))
        q = torch.randn(2, 1, 4, 8)
        out = hub.attention(q, kc, vc, layout="paged", block_table=bt, seqlens_k=sl)
        _check_paged(out, q, kc, vc, bt, sl)
        assert reads == []
        sl[0] = 1  # an edit inside inference mode: the tables are checked again
        out = hub.attention(q, kc, vc, layout="paged", block_table=bt, seqlens_k=sl)
        _check_paged(out, q, kc, vc, bt, sl)
        assert reads == [1]


def test_backends_get_tables_with_a_version_counter() -> None:
    """The snapshots a backend reads keep a version counter under inference_mode: backends
    stamp their plans with it (FlashInfer's plan cache, the CSR tables of the sm80 plugin),
    which raised on inference tensors."""
    import attnhub
    from attnhub.core.backend import AttentionOutput, Backend
    from attnhub.core.capabilities import ALL_MASKS, Capabilities
    from attnhub.core.registry import Registry

    stamps: list[tuple[int, ...]] = []

    class Stamping(Backend):
        name = "stamping"
        tier = "portable"
        capabilities = Capabilities(dtypes=frozenset({"fp32"}), max_head_dim=256, gqa=True,
                                    layouts=frozenset({"thd", "paged"}), masks=ALL_MASKS)

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
            tables = (params.block_table, params.seqlens_k) if spec.layout == "paged" else (
                params.cu_seqlens_q, params.cu_seqlens_k)
            stamps.append(tuple(t._version for t in tables))
            return AttentionOutput(q.new_zeros(*q.shape[:-1], v.shape[-1]), None)

    hub = attnhub.Hub(registry=Registry.of(Stamping(), plugin="stamping"), hardware="cpu")
    with torch.inference_mode():
        kc = torch.randn(4, 4, 2, 8)
        hub.attention(torch.randn(2, 1, 4, 8), kc, kc, layout="paged", backend="stamping",
                      block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                      seqlens_k=torch.tensor([3, 8], dtype=torch.int32))
        cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        hub.attention(torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8),
                      layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, backend="stamping")
    assert len(stamps) == 2

