"""Second review of round 10 of the transformers integration (commit 2bc84e4).

* A custom 4-D mask over a sliding cache is placed under the kept keys only where each query
  sees its own column; a padding query sees no key at all, so a batch with one row padded
  past the window (its padding reaching a chunk after the cache filled) was refused.
* ``bind_model``'s causality reader (``causality.call_causal``) read the mask builders of a
  class from its transformers bases only, and only where called by name: a subclass's
  ``forward`` that builds another mask (an embedding model made bidirectional) was planned
  by its base's builder, and a model choosing its builder by config
  (``mask_function = create_causal_mask if ... else create_bidirectional_mask``) that also
  builds a bidirectional cross-attention mask was planned bidirectional.
* The reader raised from ``bind`` where ``inspect`` could not read a class (a file edited
  since the import raises ``tokenize.TokenError``; a class whose ``__module__`` is None).
"""

from __future__ import annotations

import importlib.util
import linecache
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnhub import Hub  # noqa: E402
from attnhub.integrations import transformers as hf  # noqa: E402
from attnhub.integrations.transformers.testing import (  # noqa: E402
    close, one_intraop_thread, tiny_config, twin_models)

from transformers.masking_utils import (  # noqa: E402
    create_bidirectional_mask, create_causal_mask)
from transformers.models.llama import modeling_llama  # noqa: E402

from tests.test_review_10_hf import _windowed_eager  # noqa: E402

VOCAB = 99
TOKENS = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.fixture()
def own() -> Iterator[Hub]:
    h = Hub(hardware="cpu")
    hf.register(h)
    yield h
    hf.register()


def test_padding_queries_in_a_chunk_over_a_sliding_cache_are_served(own: Hub) -> None:
    """Row 1 is left-padded over its first 10 tokens, past the window of 6: the chunk at 8
    holds two padding queries, which see no key. The row's real queries match eager over
    every key with the mask and the window."""
    name = "windowed_eager_10b"
    transformers.AttentionInterface.register(
        name, _windowed_eager(transformers.models.mistral.modeling_mistral.eager_attention_forward))
    transformers.masking_utils.AttentionMaskInterface.register(
        name, transformers.masking_utils.eager_mask)
    ours, ref = twin_models(tiny_config("mistral"), other=name)
    ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    real = torch.ones(2, 17, dtype=torch.bool)
    real[1, :10] = False
    with one_intraop_thread(), torch.no_grad():
        sliding = transformers.DynamicCache(config=ours.config)  # keeps window - 1 keys
        every = transformers.DynamicCache()
        ours(input_ids=ids[:, :8], attention_mask=real[:, :8].long(), past_key_values=sliding)
        ref(input_ids=ids[:, :8], attention_mask=real[:, :8].long(), past_key_values=every)
        for past, sq in ((8, 4), (12, 4), (16, 1)):
            sk = past + sq
            causal = torch.arange(sk).view(1, sk) <= torch.arange(sq).view(sq, 1) + past
            allowed = (causal & real[:, None, None, :sk]).view(2, 1, sq, sk)
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
            got = ours(input_ids=ids[:, past:sk], attention_mask=mask,
                       past_key_values=sliding).logits
            want = ref(input_ids=ids[:, past:sk], attention_mask=mask,
                       past_key_values=every).logits
            keep = real[:, past:sk]
            close(got[keep], want[keep], f"chunk at {past}", atol=1e-5)


class BidirectionalLlama(modeling_llama.LlamaModel):
    """An embedding model made of a decoder (LLM2Vec-style): the subclass's forward builds a
    bidirectional mask and leaves the layers' ``is_causal`` True; eager and attnhub then
    attend to every token (the mask decides)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        position_ids = torch.arange(x.shape[1]).unsqueeze(0)
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=x,
                                         attention_mask=attention_mask)
        position_embeddings = self.rotary_emb(x, position_ids=position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_embeddings=position_embeddings,
                      position_ids=position_ids)
        return self.norm(x)


class RemoteDecoder(transformers.PreTrainedModel):
    """A model of its own (as trust_remote_code loads one: no transformers model class among
    its bases) that picks its self-attention mask builder by ``is_decoder``, as BERT-likes do,
    and builds its cross-attention mask bidirectional; its layers' flags follow
    ``is_decoder``."""

    config_class = transformers.LlamaConfig
    _supports_attention_backend = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(modeling_llama.LlamaDecoderLayer(config, i)
                                          for i in range(config.num_hidden_layers))
        for layer in self.layers:
            layer.self_attn.is_causal = bool(config.is_decoder)
        self.rotary_emb = modeling_llama.LlamaRotaryEmbedding(config)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        position_ids = torch.arange(x.shape[1]).unsqueeze(0)
        mask_function = create_causal_mask if self.config.is_decoder else create_bidirectional_mask
        mask = mask_function(config=self.config, inputs_embeds=x, attention_mask=attention_mask,
                             cache=None, position_ids=position_ids)
        if encoder_hidden_states is not None:  # for cross-attention layers (none here)
            encoder_attention_mask = create_bidirectional_mask(
                config=self.config, inputs_embeds=x, attention_mask=encoder_attention_mask,
                encoder_hidden_states=encoder_hidden_states)
        position_embeddings = self.rotary_emb(x, position_ids=position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_embeddings=position_embeddings,
                      position_ids=position_ids)
        return x


def _built(cls: type, impl: str, **changes: Any) -> torch.nn.Module:
    cfg = tiny_config("llama")
    for k, v in changes.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return cls._from_config(cfg, attn_implementation=impl).eval()


@pytest.mark.parametrize("cls, changes", [
    (BidirectionalLlama, {}),
    (RemoteDecoder, {"is_decoder": True}),
    (RemoteDecoder, {"is_decoder": False}),
], ids=["subclass-bidirectional", "remote-decoder", "remote-encoder"])
def test_the_plan_reads_the_methods_the_model_runs(own: Hub, cls: type,
                                                   changes: dict[str, Any]) -> None:
    model = _built(cls, "attnhub", **changes)
    table = own.bind(model, batch=2, prompt_len=7, max_len=14, dtype=torch.float32)
    planned = {(r.decision.spec, r.decision.context) for r in table}
    twin = _built(cls, "eager", **changes)
    twin.load_state_dict(model.state_dict())
    with one_intraop_thread(), torch.no_grad():
        close(model(input_ids=TOKENS[:, :7]), twin(input_ids=TOKENS[:, :7]), cls.__name__,
              atol=1e-5)
    ran = [(r.decision.spec, r.decision.context) for r in own.bound()]
    assert ran and all(key in planned for key in ran), (ran, planned)


def test_a_layer_class_the_reader_cannot_read_still_binds(own: Hub, tmp_path: Path) -> None:
    """A layer class whose file was edited since the import (``inspect`` raises
    ``tokenize.TokenError`` on what it finds at the old lines) and a container class whose
    ``__module__`` is None: the code says nothing, so the flag decides, as in the call."""
    path = tmp_path / "edited_attention.py"
    path.write_text("from transformers.models.llama.modeling_llama import LlamaAttention\n\n\n"
                    "class EditedAttention(LlamaAttention):\n"
                    "    def forward(self, *args, **kwargs):\n"
                    "        return super().forward(*args, **kwargs)\n")
    spec = importlib.util.spec_from_file_location("edited_attention", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    # the forward's line (5) now opens a bracket that runs to the end of the file
    path.write_text("# edited since the import\n" * 4 + "def forward(\n    self,\n")
    linecache.checkcache(str(path))
    blocks = type("Blocks", (torch.nn.ModuleList,), {"__module__": None})

    model = _built(transformers.LlamaForCausalLM, "attnhub")
    model.model.layers.__class__ = blocks
    for layer in model.model.layers:
        layer.self_attn.__class__ = module.EditedAttention
    table = own.bind(model, batch=2, prompt_len=7, max_len=14, dtype=torch.float32)
    assert {r.phase for r in table} == {"prefill", "decode"}
    with one_intraop_thread(), torch.no_grad():
        model(input_ids=TOKENS[:, :7])
    planned = {(r.decision.spec, r.decision.context) for r in table}
    assert all((r.decision.spec, r.decision.context) in planned for r in own.bound())
