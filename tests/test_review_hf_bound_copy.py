"""Review: a transformers model routed through ``bind_model`` stays an ordinary model: it
deep-copies (an EMA or teacher copy; the copy shares the hub) and saves with
``torch.save(model)`` (a loaded copy is served by the registered hub), and every copy gives
the same logits as eager. Each layer held the ``Hub`` itself, which neither copies nor
pickles (locks, plugin modules)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnhub import Hub
from attnhub.integrations import transformers as hf
from attnhub.integrations.transformers.testing import one_intraop_thread, twin_models


def test_bound_model_deep_copies_and_saves() -> None:
    before = hf.registered_hub()
    hub = Hub()
    hf.register(hub)
    try:
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32)
        ours, eager = twin_models(cfg)
        hf.bind_model(ours, hub, batch=2, prompt_len=8, max_len=16, dtype=torch.float32)
        ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, :3] = 0
        twin = copy.deepcopy(ours)
        buf = io.BytesIO()
        torch.save(ours, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        with one_intraop_thread(), torch.no_grad():
            want = eager(input_ids=ids, attention_mask=mask).logits[mask.bool()]
            for name, m in (("bound", ours), ("deepcopy", twin), ("loaded", loaded)):
                got = m(input_ids=ids, attention_mask=mask).logits[mask.bool()]
                assert torch.allclose(got, want, atol=1e-4), name
        layer = twin.model.layers[0].self_attn
        assert layer.__dict__["_attnhub_hub"].hub is hub  # the copy is still bound
    finally:
        hf.register(before)
