"""attn_implementation="attnhub" over successive batches on families the other transformers
tests leave out: greedy generate() three times in a row with other batch sizes and left
padding (the token ids and every step's logits against eager), then a chunked continuation
over a reused DynamicCache with left padding, one model after another on one hub."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnhub import Hub
from attnhub.integrations import transformers as hf
from attnhub.integrations.transformers.testing import one_intraop_thread, twin_models
from attnhub.policy import load_policy

VOCAB = 96
GQA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
FAMILIES: dict[str, Callable[[], object]] = {
    "qwen2": lambda: transformers.Qwen2Config(**GQA),
    "gemma3-sliding": lambda: transformers.Gemma3TextConfig(
        **GQA, head_dim=8, sliding_window=3, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"]),
    "phi3-sliding": lambda: transformers.Phi3Config(**GQA, sliding_window=4, pad_token_id=0),
    "starcoder2-sliding": lambda: transformers.Starcoder2Config(**GQA, sliding_window=4),
    "cohere": lambda: transformers.CohereConfig(**GQA),
    "gpt-bigcode-mqa": lambda: transformers.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True),
    # passes its config's window with a plain causal mask: eager applies no window
    "olmoe-window-in-config": lambda: transformers.OlmoeConfig(
        **GQA, num_experts=4, num_experts_per_tok=2, sliding_window=3),
    # .view()s the attention output: it must come back contiguous
    "jetmoe": lambda: transformers.JetMoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2,
        kv_channels=8, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64),
}


@pytest.fixture(scope="module")
def hub() -> Hub:
    h = Hub(policy=load_policy())
    hf.register(h)
    return h


def _left_padded(gen: torch.Generator, lens: tuple[int, ...], width: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (len(lens), width), generator=gen)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        mask[i, width - n:] = 1
    return ids, mask


@pytest.mark.parametrize("name", list(FAMILIES))
def test_successive_generates_and_a_reused_cache_match_eager(hub: Hub, name: str) -> None:
    ours, eager = twin_models(FAMILIES[name]())
    gen = torch.Generator().manual_seed(len(name))
    with one_intraop_thread(), torch.no_grad():
        for lens in ((9, 5, 2), (7,), (4, 9)):  # batch 3, then 1, then 2: same layers
            ids, mask = _left_padded(gen, lens, max(lens))
            kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                      output_logits=True, return_dict_in_generate=True)
            got, want = ours.generate(ids, **kw), eager.generate(ids, **kw)
            assert torch.equal(got.sequences, want.sequences), (name, lens)
            for step, (a, b) in enumerate(zip(got.logits, want.logits)):
                torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4,
                                           msg=f"{name} batch {lens} step {step}")
        ids, mask = _left_padded(gen, (10, 6, 4), 10)
        outs = []
        for model in (ours, eager):  # prefix, then a 3-token chunk over the reused cache
            cache = transformers.DynamicCache(config=model.config)
            first = model(input_ids=ids[:, :7], attention_mask=mask[:, :7],
                          past_key_values=cache, use_cache=True)
            second = model(input_ids=ids[:, 7:], attention_mask=mask,
                           past_key_values=first.past_key_values, use_cache=True)
            outs.append((first.logits[mask[:, :7].bool()], second.logits))
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=f"{name} chunked")


@pytest.mark.parametrize("name", ["qwen2", "gemma3-sliding"])
def test_under_autocast_the_model_matches_eager(hub: Hub, name: str) -> None:
    """Under CPU autocast q and k leave the rotary embedding in fp32 while v is bf16; eager
    casts all three, and so must the integration (it refused the mixed dtypes before)."""
    ours, eager = twin_models(FAMILIES[name]())
    ids, mask = _left_padded(torch.Generator().manual_seed(3), (9, 6), 9)
    with one_intraop_thread(), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = ours(input_ids=ids, attention_mask=mask).logits
        want = eager(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == want.dtype == torch.bfloat16
    keep = mask.bool()
    torch.testing.assert_close(got[keep].float(), want[keep].float(), atol=2e-2, rtol=2e-2)
