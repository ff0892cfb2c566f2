"""Review round 10 of the transformers integration.

* A sliding layer handed a custom 4-D mask over the whole sequence on a cached step of
  several queries (chunked prefill): its cache kept only the last window - 1 keys, so the
  mask had more columns than the call had keys, and the call was refused with a hint to pass
  a mask that fits those keys (no fix for a model mixing sliding and full layers, which
  share one mask). Now the mask's last columns are read as the kept keys, with the window.
* ``bind_model`` planned each layer by its module's ``is_causal`` flag, which some modules
  carry against what their calls compute (Phi-4-multimodal's vision attention says True
  under a bidirectional mask, CLIP's text attention says False and is called with
  ``is_causal=True``): those layers resolved again on their first call, and the plan and
  ``explain`` showed what never ran.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnhub import Hub  # noqa: E402
from attnhub.errors import InputError  # noqa: E402
from attnhub.integrations import transformers as hf  # noqa: E402
from attnhub.integrations.transformers.testing import (  # noqa: E402
    close, one_intraop_thread, tiny_config, twin_models)

VOCAB = 99


@pytest.fixture(scope="module")
def hub() -> Iterator[Hub]:
    h = Hub(hardware="cpu")
    hf.register(h)
    yield h
    hf.register()


def _windowed_eager(eager: Callable[..., Any]) -> Callable[..., Any]:
    """The model's eager attention over every key with a custom mask and, on sliding layers,
    the window: the answer a sliding cache's chunked step must give."""

    def forward(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None, sliding_window: int | None = None,
                **kw: Any) -> Any:
        if sliding_window and mask is not None:
            sq, sk = q.shape[2], k.shape[2]
            rows = torch.arange(sq).view(sq, 1) + (sk - sq)
            far = torch.arange(sk).view(1, sk) < rows - (sliding_window - 1)
            mask = mask.masked_fill(far, torch.finfo(mask.dtype).min)
        return eager(module, q, k, v, mask, **kw)

    return forward


def _chunk_mask(past: int, sq: int, batch: int) -> torch.Tensor:
    """A custom additive (B, 1, sq, past + sq) mask: causal, and row 1 also blind to two of
    the new tokens (a tree of drafts, say)."""
    sk = past + sq
    allowed = torch.ones(sq, sk, dtype=torch.bool).tril(past).expand(batch, 1, sq, sk).clone()
    allowed[1, 0, 2:, past:past + 2] = sq < 3
    allowed[1, 0, torch.arange(sq), past + torch.arange(sq)] = True
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("model_type", ["mistral", "gemma2"])  # all sliding; mixed + softcap
def test_a_custom_mask_on_a_chunked_sliding_step_is_served_with_the_window(
        hub: Hub, model_type: str) -> None:
    module = {"mistral": transformers.models.mistral.modeling_mistral,
              "gemma2": transformers.models.gemma2.modeling_gemma2}[model_type]
    name = f"windowed_eager_{model_type}"
    transformers.AttentionInterface.register(name, _windowed_eager(module.eager_attention_forward))
    # a name without a mask function gets no mask at all: eager's
    transformers.masking_utils.AttentionMaskInterface.register(
        name, transformers.masking_utils.eager_mask)
    cfg = tiny_config(model_type)
    ours, ref = twin_models(cfg, other=name)
    ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with one_intraop_thread(), torch.no_grad():
        sliding = transformers.DynamicCache(config=ours.config)  # keeps window - 1 keys
        every = transformers.DynamicCache()  # keeps every key: the reference's
        ours(input_ids=ids[:, :8], past_key_values=sliding)
        ref(input_ids=ids[:, :8], past_key_values=every)
        for past, sq in ((8, 5), (13, 1), (14, 3)):  # a chunk, a decode step, a chunk
            mask = _chunk_mask(past, sq, 2)
            got = ours(input_ids=ids[:, past:past + sq], attention_mask=mask,
                       past_key_values=sliding).logits
            want = ref(input_ids=ids[:, past:past + sq], attention_mask=mask,
                       past_key_values=every).logits
            close(got, want, f"{model_type} chunk at {past}", atol=1e-5)


def test_a_custom_mask_that_cannot_be_placed_over_a_sliding_cache_names_the_reason(
        hub: Hub) -> None:
    """A static cache's mask covers its unwritten slots: the mask's last columns are not the
    queries', so the kept keys cannot be found under it."""
    ours, _ = twin_models(tiny_config("mistral"))
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with one_intraop_thread(), torch.no_grad():
        cache = transformers.DynamicCache(config=ours.config)
        ours(input_ids=ids[:, :8], past_key_values=cache)
        mask = torch.ones(1, 1, 4, 16, dtype=torch.bool).tril(8)  # 4 unwritten slots after
        with pytest.raises(InputError, match=r"(?s)keeps only the last window - 1 keys.*"
                                             r"2-D \(B, Sk\) padding mask"):
            ours(input_ids=ids[:, 8:], attention_mask=mask, past_key_values=cache)


def _clip_text() -> torch.nn.Module:
    cfg = transformers.CLIPTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      max_position_embeddings=64, bos_token_id=1,
                                      eos_token_id=2)
    return transformers.CLIPTextModel._from_config(cfg, attn_implementation="attnhub")


def _phi4_vision() -> torch.nn.Module:
    from transformers.models.phi4_multimodal import modeling_phi4_multimodal as phi4

    cfg = transformers.Phi4MultimodalVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        image_size=16, patch_size=4)
    model = phi4.Phi4MultimodalVisionModel(cfg)
    model.set_attn_implementation("attnhub")
    return model


def _auto(model_type: str, **changes: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        cfg = tiny_config(model_type)
        for k, v in changes.items():
            setattr(cfg, k, v)
        return transformers.AutoModel.from_config(cfg, attn_implementation="attnhub")

    return build


TOKENS = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
#: name -> (model builder, tokens per call, the call): flags against calls, both ways
PLANNED: dict[str, tuple[Callable[[], torch.nn.Module], int, Callable[..., Any]]] = {
    "phi4-vision (is_causal True, bidirectional)": (
        _phi4_vision, 16, lambda m, n: m(pixel_values=torch.randn(2, 3, 16, 16))),
    "clip-text (is_causal False, called causal)": (
        _clip_text, 7, lambda m, n: m(input_ids=TOKENS[:, :n])),
    "modernbert (bidirectional window, short)": (
        _auto("modernbert", local_attention=4, global_attn_every_n_layers=2), 3,
        lambda m, n: m(input_ids=TOKENS[:, :n])),
    "modernbert (bidirectional window)": (
        _auto("modernbert", local_attention=4, global_attn_every_n_layers=2), 9,
        lambda m, n: m(input_ids=TOKENS[:, :n])),
    "bert": (_auto("bert"), 7, lambda m, n: m(input_ids=TOKENS[:, :n])),
    "llama": (_auto("llama"), 7, lambda m, n: m(input_ids=TOKENS[:, :n])),
}


@pytest.mark.parametrize("name", list(PLANNED))
def test_the_plan_holds_every_decision_the_calls_make(name: str) -> None:
    build, n, call = PLANNED[name]
    own = Hub(hardware="cpu")
    hf.register(own)
    try:
        model = build().eval()
        table = own.bind(model, batch=2, prompt_len=n, max_len=2 * n, dtype=torch.float32)
        planned = {(r.decision.spec, r.decision.context) for r in table}
        with one_intraop_thread(), torch.no_grad():
            call(model, n)
        ran = [(r.decision.spec, r.decision.context) for r in own.bound()]
        assert ran and all(key in planned for key in ran), (name, ran, planned)
    finally:
        hf.register()
