"""Review round 8 of the transformers integration: a ``bind`` that raised had already
pinned its first layers to the new hub; ``register`` took transformers' own implementation
names (``sdpa``: every model asking for SDPA went through attnhub) and non-strings."""

from __future__ import annotations

import pytest
import torch

from attnhub import Hub
from attnhub.errors import InputError

transformers = pytest.importorskip("transformers")
from attnhub.integrations import transformers as hf  # noqa: E402

LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_a_bind_that_raises_leaves_every_layer_as_it_was() -> None:
    hf.register()
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**LLAMA), attn_implementation="attnhub").eval()
    hub_a, hub_b = Hub(hardware="cpu"), Hub(hardware="cpu")
    hub_a.bind(model, batch=1, prompt_len=8, max_len=16, dtype=torch.float32)
    with pytest.raises(Exception, match="float64"):
        hub_b.bind(model, batch=1, prompt_len=8, max_len=16, dtype=torch.float64)
    layers = [m for _, m in hf.attention_modules(model)]
    assert len(layers) == 2 and all(m._attnhub_hub.hub is hub_a for m in layers)


@pytest.mark.parametrize("name", ["eager", "sdpa", "flash_attention_2", "", 3])
def test_register_refuses_transformers_own_names_and_non_strings(name: object) -> None:
    with pytest.raises(InputError, match="pick a name of your own"):
        hf.register(name=name)  # type: ignore[arg-type]
    assert hf.register() == "attnhub"  # attnhub's own name can be registered again
