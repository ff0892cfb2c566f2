"""Review 9b (KV cache state, transformers masks).

1. A Ctrl-C delivered as ``allocate``/``fork`` releases the cache's lock (after that C call
   returns: CPython's delivery point, simulated as in ``test_review_9_decoder_steps``) left a
   live sequence, and its state-store slot, under an id the caller never got: no orphan
   sequence, the contract says. ``Decoder.prefill`` and ``generate.decode`` leaked one
   sequence (and a linear layer's state slot) per such Ctrl-C. Now the call frees it.
2. ``sdpa_mask_marked`` (registered as the attnhub names' mask function) read
   ``kwargs["q_length"]``: transformers versions whose ``sdpa_mask`` already had
   ``allow_is_bidirectional_skip`` but still took ``cache_position`` (no ``q_length``, no
   ``device``) raised KeyError in every unpadded encoder forward; a positional call was
   returned unmarked (read as causal by an ``is_causal = True`` module).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnhub.core.kvcache import PagedKVCache
from attnhub.testing import DictStateStore
from tests.test_review_9_decoder_steps import _CutLock

H, D = 2, 4


def _arm(cache: PagedKVCache) -> _CutLock:
    lock = _CutLock()
    cache._lock = lock  # type: ignore[assignment]
    lock.armed = True
    return lock


@pytest.mark.parametrize("what", ["allocate", "fork"])
def test_a_ctrl_c_as_allocate_or_fork_releases_the_lock_leaves_no_orphan(what: str) -> None:
    store = DictStateStore()
    c = PagedKVCache(num_layers=2, num_pages=6, page_size=3, num_kv_heads=H, head_dim=D)
    c.attach_state([1], store)
    a = c.allocate()
    t = torch.randn(4, H, D)
    c.append(a, [t, t], [t, t])
    refs, free = list(c._refs), list(c._free)
    lock = _arm(c)
    with pytest.raises(KeyboardInterrupt, match="lock is released"):
        c.allocate() if what == "allocate" else c.fork(a)
    assert not lock.armed  # the interrupt landed where it was meant to
    assert c.seq_ids == [a] and set(store.states) == {a}  # before: [a, 1], {a, 1}
    assert c._refs == refs and c._free == free
    c.check_invariants()
    b = c.fork(a)  # ids are never reused
    assert b == 2 and set(store.states) == {a, b}
    c.free(a)
    c.free(b)
    assert not store.states and c.free_pages == c.num_pages


def test_decoder_prefill_and_generate_forks_leak_nothing_on_that_ctrl_c() -> None:
    from attnhub.models import generate
    from attnhub.models.decoder import Decoder, DecoderConfig

    cfg = DecoderConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8,
                        vocab_size=32)
    model = Decoder(cfg)
    cache = model.new_cache(batch=2, max_len=16, page_size=4, spare_pages=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    _arm(cache)  # the first lock released is the first allocate()'s
    with pytest.raises(KeyboardInterrupt):
        model.prefill(cache, ids)
    assert cache.seq_ids == [] and cache.free_pages == cache.num_pages  # before: [0]
    seqs, logits = model.prefill(cache, ids)
    _arm(cache)  # the first lock released is the first fork()'s
    with pytest.raises(KeyboardInterrupt):
        generate.decode(model, cache, seqs, logits.argmax(-1), 2)
    assert cache.seq_ids == seqs  # before: the fork stayed, its pages shared for good
    cache.check_invariants()
    d = generate.decode(model, cache, seqs, logits.argmax(-1), 2)
    assert d.tokens.shape == (2, 2) and cache.seq_ids == seqs


# -- 2. sdpa_mask of transformers versions with cache_position -------------------------------
def _old_sdpa_mask(batch_size: int, cache_position: torch.Tensor, kv_length: int,
                   kv_offset: int = 0, mask_function: Any = None,
                   attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                   allow_is_causal_skip: bool = True, allow_is_bidirectional_skip: bool = False,
                   allow_torch_fix: bool = True, use_vmap: bool = False,
                   **kwargs: Any) -> torch.Tensor | None:
    """The signature of transformers' ``sdpa_mask`` before ``q_length`` (cache_position,
    no device), skipping as it did: None when nothing is padded."""
    if allow_is_causal_skip or allow_is_bidirectional_skip:
        return None
    return torch.ones(batch_size, 1, cache_position.shape[0], kv_length, dtype=torch.bool)


@pytest.mark.parametrize("positional", [False, True])
def test_sdpa_mask_marked_reads_every_versions_signature(
        monkeypatch: pytest.MonkeyPatch, positional: bool) -> None:
    masking_utils = pytest.importorskip("transformers.masking_utils")
    from attnhub.integrations.transformers.masks import is_attend_all, sdpa_mask_marked

    monkeypatch.setattr(masking_utils, "sdpa_mask", _old_sdpa_mask)
    pos = torch.arange(5)
    skip = {"allow_is_causal_skip": False, "allow_is_bidirectional_skip": True}
    if positional:  # before: returned None unmarked (a causal module cut it to causal)
        mask = sdpa_mask_marked(2, pos, 7, **skip)
    else:  # before: KeyError 'q_length' in the model's forward
        mask = sdpa_mask_marked(batch_size=2, cache_position=pos, kv_length=7, **skip)
    assert mask is not None and is_attend_all(mask)
    assert mask.shape == (2, 1, 5, 7) and bool(mask.all())
    # a skipped causal mask stays None (SDPA's is_causal serves it), a built one as built
    assert sdpa_mask_marked(batch_size=2, cache_position=pos, kv_length=7) is None
    built = sdpa_mask_marked(batch_size=2, cache_position=pos, kv_length=7,
                             allow_is_causal_skip=False)
    assert built is not None and not is_attend_all(built)


def test_sdpa_mask_marked_on_the_installed_version_marks_a_bidirectional_skip() -> None:
    pytest.importorskip("transformers.masking_utils")
    from attnhub.integrations.transformers.masks import is_attend_all, sdpa_mask_marked

    mask = sdpa_mask_marked(batch_size=1, q_length=3, kv_length=3, allow_is_causal_skip=False,
                            allow_is_bidirectional_skip=True)
    assert mask is not None and is_attend_all(mask) and mask.shape == (1, 1, 3, 3)
    assert sdpa_mask_marked(batch_size=1, q_length=3, kv_length=3) is None
