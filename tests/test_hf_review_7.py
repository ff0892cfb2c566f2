"""Review round 7 of the transformers integration: a second registered name took over the
first name's models; ``bind`` skipped encoder attention without a layer index (ViT, CLIP,
a VLM's vision tower), which then followed the registered hub; tokenizer outputs passed on
to ``forward()`` were refused although eager ignores them; a float64 model's error named no
layer and no fix."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

import attnhub
from attnhub import Hub
from attnhub.errors import DTypeMismatchError

transformers = pytest.importorskip("transformers")
from attnhub.integrations import transformers as hf  # noqa: E402

LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              image_size=16, patch_size=4)


def _counting(hub: Hub, served: Counter, tag: str) -> None:
    real = hub.attention

    def counted(*a, **kw):  # type: ignore[no-untyped-def]
        served[tag] += 1
        return real(*a, **kw)

    hub.attention = counted  # type: ignore[method-assign]


@pytest.fixture
def hubs() -> Iterator[tuple[Hub, Hub, Counter]]:
    before = {n: hf.registered_hub(n) for n in ("attnhub", "attnhub_b")}
    a, b, served = Hub(hardware="cpu"), Hub(hardware="cpu"), Counter()
    _counting(a, served, "a")
    _counting(b, served, "b")
    try:
        yield a, b, served
    finally:
        for name, hub in before.items():
            hf.register(hub, name=name)


def test_each_registered_name_is_served_by_its_own_hub(hubs) -> None:  # type: ignore[no-untyped-def]
    a, b, served = hubs
    hf.register(a, name="attnhub")
    hf.register(b, name="attnhub_b")
    cfg = transformers.LlamaConfig(**LLAMA)
    for name, tag in (("attnhub", "a"), ("attnhub_b", "b")):
        m = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                          attn_implementation=name).eval()
        served.clear()
        with torch.no_grad():
            m(torch.randint(3, 90, (1, 5)))
        assert served == Counter({tag: 2}), (name, served)
    # and bind() takes a model built under the second name
    table = attnhub.bind(m, a, batch=1, prompt_len=5, max_len=8, dtype=torch.float32)
    layers = {p for p, _ in hf.attention_modules(m)}
    assert len(layers) == 2 and {r.module for r in table.rows} == layers


@pytest.mark.parametrize("family", ["vit", "clip"])
def test_bind_pins_encoder_attention_without_a_layer_index(hubs, family: str  # type: ignore[no-untyped-def]
                                                           ) -> None:
    registered, bound, served = hubs
    hf.register(registered)
    if family == "vit":
        cfg, inputs = transformers.ViTConfig(**VISION), {"pixel_values": torch.randn(1, 3, 16, 16)}
    else:
        cfg = transformers.CLIPConfig(text_config=dict(vocab_size=96, hidden_size=32,
                                                       intermediate_size=48, num_hidden_layers=2,
                                                       num_attention_heads=4),
                                      vision_config=VISION, projection_dim=16)
        inputs = {"input_ids": torch.randint(3, 90, (1, 6)),
                  "pixel_values": torch.randn(1, 3, 16, 16)}
    model = transformers.AutoModel.from_config(copy.deepcopy(cfg),
                                               attn_implementation="attnhub").eval()
    table = attnhub.bind(model, bound, batch=1, prompt_len=6, max_len=12, dtype=torch.float32)
    layers = hf.attention_modules(model)
    assert len(layers) == (2 if family == "vit" else 4)
    assert {r.module for r in table.rows} == {p for p, _ in layers}
    served.clear()
    with torch.no_grad():
        model(**inputs)
    assert served == Counter({"b": len(layers)}), served


@pytest.mark.parametrize("key", ["token_type_ids", "special_tokens_mask", "length"])
def test_tokenizer_outputs_passed_to_forward_are_ignored_as_eager_ignores_them(key: str) -> None:
    from attnhub.integrations.transformers.testing import twin_models

    hf.register(hf.registered_hub())
    ours, eager = twin_models(transformers.LlamaConfig(**LLAMA))
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    extra = {key: torch.zeros_like(ids) if key != "length" else torch.tensor([6, 6])}
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids, **extra).logits,
                                   eager(input_ids=ids, **extra).logits, atol=1e-5, rtol=1e-5)


def test_a_float64_model_is_refused_naming_the_layer_and_the_fix() -> None:
    hf.register(hf.registered_hub())
    m = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA),
                                                      attn_implementation="attnhub").double()
    with pytest.raises(DTypeMismatchError, match=r"LlamaAttention \(layer 0\).*model\.float\(\)"):
        with torch.no_grad():
            m(torch.randint(3, 90, (1, 4)))


def test_bind_of_a_model_with_a_config_needs_no_transformers(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    import sys

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = {"hidden": 8}
            self.lin = torch.nn.Linear(8, 8)

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ValueError, match="no attnhub.nn.Attention layers"):
        attnhub.bind(Net())
