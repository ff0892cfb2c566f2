"""Gemma 4's text model through attn_implementation="attnhub" against eager: alternating
sliding and full layers, KV shared across layers (``num_kv_shared_layers``), keys reused as
values (``attention_k_eq_v``) and a final logit softcap; logits of a left-padded batch,
generate() and training gradients (the sweep of benchmarks/hf_family_sweep.py could not
shrink its per-layer default config, so it is checked here with one written out)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnhub
from attnhub.integrations import transformers as hf
from attnhub.integrations.transformers.testing import matches_eager, one_intraop_thread, sharpened

if not hasattr(transformers, "Gemma4TextConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no Gemma 4",
                allow_module_level=True)


@pytest.mark.parametrize("extra", [{}, {"num_kv_shared_layers": 2, "num_hidden_layers": 4},
                                   {"attention_k_eq_v": True},
                                   {"final_logit_softcapping": 30.0}],
                         ids=["plain", "kv-shared", "k-eq-v", "softcap"])
def test_gemma4_text_matches_eager(extra: dict) -> None:
    kw = {**dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 max_position_embeddings=128, sliding_window=6, vocab_size_per_layer_input=99,
                 hidden_size_per_layer_input=8, tie_word_embeddings=False), **extra}
    n = kw["num_hidden_layers"]
    cfg = transformers.Gemma4TextConfig(
        **kw, layer_types=(["sliding_attention", "full_attention"] * n)[:n])
    hf.register(attnhub.Hub(hardware="cpu"))
    with one_intraop_thread():
        ours, twin = sharpened(cfg, transformers.AutoModelForCausalLM, 4.0)
        matches_eager(ours, twin, 99, f"gemma4 {extra}")
