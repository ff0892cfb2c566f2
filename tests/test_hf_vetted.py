"""Model families transformers leaves unflagged (``_supports_attention_backend`` False) that
attnhub serves after checking them here (``VETTED`` / ``VETTED_CLASSES``): hybrids whose
full-attention layers go through ``AttentionInterface`` while their linear or Mamba layers
hold no attention (Qwen3-Next, Qwen3.5 text and MoE text, OLMo-hybrid, Falcon-H1,
Nemotron-H, Lara-mini) and StableLM. Tiny random models, one linear and one attention layer
each, against eager: logits on a left-padded batch, generate(), training gradients.
Families still unflagged stay refused when built."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnhub
from attnhub import InputError
from attnhub.integrations import transformers as hf
from attnhub.integrations.transformers.testing import (matches_eager, one_intraop_thread,
                                                      sharpened, tiny_config)

FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "falcon_h1",
            "nemotron_h", "lara_mini", "stablelm")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_vetted_family_matches_eager(model_type: str) -> None:
    cfg = tiny_config(model_type)
    if cfg is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    hf.register(attnhub.Hub(hardware="cpu"))
    with one_intraop_thread():
        ours, twin = sharpened(cfg, transformers.AutoModelForCausalLM, 4.0)
        kinds = getattr(cfg, "layer_types", None) or ["full_attention"]
        # an attention layer to serve (Falcon-H1's "hybrid" layers run both side by side)
        assert any(("attention" in k and "linear" not in k) or k == "hybrid"
                   for k in kinds), kinds
        matches_eager(ours, twin, 99, model_type)


@pytest.mark.parametrize("model_type", ("gpt_neo", "bloom", "xglm"))
def test_an_unvetted_unflagged_family_is_still_refused(model_type: str) -> None:
    cfg = tiny_config(model_type)
    if cfg is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    hf.register(attnhub.Hub(hardware="cpu"))
    with pytest.raises(InputError, match="cannot use attn_implementation='attnhub'"):
        transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="attnhub")
