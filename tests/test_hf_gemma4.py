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


def _kv_shared() -> tuple:
    cfg = transformers.Gemma4TextConfig(
        vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        sliding_window=6, vocab_size_per_layer_input=99, hidden_size_per_layer_input=8,
        tie_word_embeddings=False, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    hf.register(attnhub.Hub(hardware="cpu"))
    return sharpened(cfg, transformers.AutoModelForCausalLM, 4.0)


def test_kv_shared_layers_keep_their_queries_placed_without_a_mask() -> None:
    """Gemma 4 cuts the KV-shared layers' queries to the last ``logits_to_keep`` after the
    masks are built; with no padding the mask was skipped, so the cut queries came with
    none: attnhub kept the first keys (0.71 off eager at logits_to_keep=2) or, in a static
    cache, read its unwritten slots (0.22 off, other greedy tokens). Now it keeps the whole
    sequence there, as transformers does for sdpa."""
    ids = torch.tensor([[47, 18, 56, 3, 70]])
    with one_intraop_thread(), torch.no_grad():
        ours, twin = _kv_shared()
        for keep in (1, 2, 3):
            torch.testing.assert_close(ours(input_ids=ids, logits_to_keep=keep).logits,
                                       twin(input_ids=ids, logits_to_keep=keep).logits,
                                       rtol=1e-4, atol=1e-4)
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True, cache_implementation="static")
        a, b = (m.generate(input_ids=ids, **kw) for m in (ours, twin))
        assert torch.equal(a.sequences, b.sequences)
        torch.testing.assert_close(a.logits[0], b.logits[0], rtol=1e-4, atol=1e-4)


def test_outputs_and_loss_options_that_layers_receive_are_not_refused() -> None:
    """``return_shared_kv_states`` (an assistant model's input) and the loss's
    ``shift_labels``/``ignore_index`` reach every layer's kwargs and change no attention."""
    ids = torch.tensor([[47, 18, 56, 3, 70]])
    with one_intraop_thread(), torch.no_grad():
        ours, twin = _kv_shared()
        got, want = (m(input_ids=ids, return_shared_kv_states=True) for m in (ours, twin))
        assert got.shared_kv_states is not None
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        labels = torch.tensor([[18, 56, 3, 70, -100]])
        losses = [m(input_ids=ids, labels=ids, shift_labels=labels, ignore_index=-100).loss
                  for m in (ours, twin)]
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not hasattr(transformers, "Gemma4UnifiedTextConfig"),
                    reason="no Gemma 4 unified in this transformers")
@pytest.mark.parametrize("keep", [0, 2])
def test_gemma4_unified_kv_shared_layers_match_eager(keep: int) -> None:
    """Gemma 4 unified's cutting hook takes other parameters than Gemma 4's (no per-layer
    inputs) and returns three values: it is read by the parameters attnhub needs only."""
    cfg = transformers.Gemma4UnifiedTextConfig(
        vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        sliding_window=6, num_kv_shared_layers=2, global_head_dim=8,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0)
    hf.register(attnhub.Hub(hardware="cpu"))
    ids = torch.tensor([[47, 18, 56, 3, 70]])
    with one_intraop_thread(), torch.no_grad():
        ours, twin = sharpened(cfg, transformers.AutoModelForCausalLM, 4.0)
        torch.testing.assert_close(ours(input_ids=ids, logits_to_keep=keep).logits,
                                   twin(input_ids=ids, logits_to_keep=keep).logits,
                                   rtol=1e-4, atol=1e-4)
