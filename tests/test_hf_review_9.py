"""Review round 9 of the transformers integration: a bidirectional mask that transformers
skipped (no padding) reached the attention function as None, where attnhub (like SDPA) read
the module's ``is_causal``; Phi-4-multimodal's vision attention says True, so attnhub cut
every patch to the patches before it while eager attends to all of them."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnhub.integrations import transformers as hf  # noqa: E402
from attnhub.integrations.transformers.masks import attend_all, is_attend_all  # noqa: E402
from attnhub.integrations.transformers.testing import close, one_intraop_thread  # noqa: E402

VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              image_size=16, patch_size=4)


def _vision_twins(impl: str = "eager") -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers.models.phi4_multimodal import modeling_phi4_multimodal as phi4

    cfg = transformers.Phi4MultimodalVisionConfig(**VISION)
    torch.manual_seed(0)
    models = []
    for name in ("attnhub", impl):
        m = phi4.Phi4MultimodalVisionModel(copy.deepcopy(cfg)).eval()
        m.set_attn_implementation(name)
        models.append(m)
    with torch.no_grad():
        for p in models[0].parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    models[1].load_state_dict(models[0].state_dict())
    return models[0], models[1]


@pytest.mark.parametrize("padded", [False, True])
def test_a_skipped_bidirectional_mask_attends_every_key_whatever_is_causal_says(
        padded: bool) -> None:
    hf.register()
    ours, eager = _vision_twins()
    assert all(m.is_causal for _, m in hf.attention_modules(ours))  # the trap
    px = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    kw = {}
    if padded:  # with padding transformers builds the mask, and the mask decides
        pm = torch.ones(2, 4, 4, dtype=torch.bool)
        pm[1, :, 3] = False
        kw["patch_attention_mask"] = pm
    with one_intraop_thread(), torch.no_grad():
        got = ours(pixel_values=px, **kw).last_hidden_state
        want = eager(pixel_values=px, **kw).last_hidden_state
    rows = slice(0, 1) if padded else slice(None)  # row 1's padded patches: padding
    close(got[rows], want[rows], f"phi4 vision, padded={padded}", atol=1e-4)


def test_the_mask_function_marks_only_the_bidirectional_skip() -> None:
    hf.register()
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    fn = ALL_MASK_ATTENTION_FUNCTIONS["attnhub"]
    common = dict(batch_size=2, q_length=3, kv_length=5, device="cpu")
    # a causal skip stays None (SDPA-style: is_causal decides), a bidirectional one is marked
    assert fn(**common, allow_is_causal_skip=True) is None
    bidi = fn(**common, allow_is_causal_skip=False, allow_is_bidirectional_skip=True,
              mask_function=lambda b, h, q, kv: q >= 0)
    assert bidi is not None and is_attend_all(bidi) and bool(bidi.all())
    assert bidi.shape == (2, 1, 3, 5) and bidi.untyped_storage().nbytes() == 1
    assert is_attend_all(bidi[:, :, :, :4])  # a view keeps the mark
    padded = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    real = fn(**common, allow_is_causal_skip=False, allow_is_bidirectional_skip=True,
              mask_function=lambda b, h, q, kv: q >= 0, attention_mask=padded.bool())
    assert real is not None and not is_attend_all(real) and not bool(real[0, 0, 0, 4])


def test_an_all_true_mask_that_lost_its_mark_is_still_read_as_every_key() -> None:
    """A copy (another device, a dtype change) drops the mark: the data says the same."""
    hf.register()
    q = torch.randn(1, 4, 3, 8)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    module = torch.nn.Module()
    module.is_causal = True  # type: ignore[assignment]
    marked = attend_all(1, 3, 5, "cpu")
    copied = marked.clone()
    assert is_attend_all(marked) and not is_attend_all(copied)
    a, _ = hf.attention_forward(module, q, k, v, marked, scaling=0.3)
    b, _ = hf.attention_forward(module, q, k, v, copied, scaling=0.3)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = torch.softmax(q @ kk.transpose(-1, -2) * 0.3, -1) @ vv
    close(a, want.transpose(1, 2), "marked")
    close(b, want.transpose(1, 2), "copied")


def test_bind_pins_attention_modules_without_a_causal_flag_to_its_hub() -> None:
    """Mllama's cross-attention has no ``is_causal``, so ``attention_modules`` does not list
    it; a model bound to one hub had that layer served by the registered hub's policy."""
    from attnhub import Hub

    registered, bound = Hub(hardware="cpu"), Hub(hardware="cpu")
    hf.register(registered)
    try:
        cfg = transformers.MllamaTextConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            cross_attention_layers=[1], pad_token_id=0, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        model = transformers.MllamaForCausalLM._from_config(
            cfg, attn_implementation="attnhub").eval()
        assert [n for n, _ in hf.attention_modules(model)] == ["model.layers.0.self_attn"]
        bound.bind(model, batch=2, prompt_len=5, max_len=8, dtype=torch.float32)
        with one_intraop_thread(), torch.no_grad():
            model(input_ids=torch.randint(2, 96, (2, 5)),
                  cross_attention_states=torch.randn(2, 12, 32))
        assert len(registered.bound()) == 0 and len(bound.bound()) == 2
        copy.deepcopy(model)  # the pins copy, sharing the hub
    finally:
        hf.register()
