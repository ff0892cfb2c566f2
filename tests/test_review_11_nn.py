"""Review 11: attnhub.nn.Attention checks its arguments at construction, refuses calls of
sizes it was not built (and bound) for, and says when a cast model outgrew its binding."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnhub import Hub
from attnhub.models.decoder import Decoder, DecoderConfig, random_prompts
from attnhub.nn import Attention
from attnhub.policy import load_policy
from tests.test_nn_bind import Counting

CFG = DecoderConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, vocab_size=64,
                    seed=3)


@pytest.mark.parametrize("kw", [
    {"window": (-5, 0)}, {"window": (4,)}, {"window": "x"}, {"softcap": -1.0},
    {"softcap": 0.0}, {"softcap": float("nan")}, {"scale": float("nan")}, {"scale": -1.0},
    {"scale": "x"}, {"causal": None}, {"causal": "yes"}, {"num_q_heads": 4.0},
    {"num_kv_heads": 2.0}, {"num_q_heads": True, "num_kv_heads": True}])
def test_bad_arguments_are_refused_at_construction(kw: dict) -> None:
    args = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16, **kw}
    with pytest.raises(ValueError, match="^Attention: "):
        Attention(args.pop("num_q_heads"), args.pop("num_kv_heads"), args.pop("head_dim"),
                  **args)


def test_good_arguments_still_build_and_match_sdpa() -> None:
    a = Attention(4, 2, 16, window=(3, 0), scale=0.5)
    q, k, v = torch.randn(2, 7, 4, 16), torch.randn(2, 7, 2, 16), torch.randn(2, 7, 2, 16)
    i = torch.arange(7)
    mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= 3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1),
        v.transpose(1, 2).repeat_interleave(2, 1), attn_mask=mask, scale=0.5).transpose(1, 2)
    torch.testing.assert_close(a(q, k, v), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(8, 2, 16), (4, 4, 16), (4, 2, 32)])
def test_calls_of_other_sizes_than_built_are_refused(shape: tuple[int, int, int]) -> None:
    hq, hkv, d = shape
    a = Attention(4, 2, 16, layer_idx=0)
    with pytest.raises(ValueError, match="was built for 4:2 heads of dim 16"):
        a(torch.randn(1, 5, hq, d), torch.randn(1, 5, hkv, d), torch.randn(1, 5, hkv, d))


def _generate(model: Decoder, steps: int = 4) -> None:
    prompts = random_prompts(model.cfg, 2, 20)
    cache = model.new_cache(2, 20 + steps, page_size=4)
    seqs, logits = model.prefill(cache, prompts)
    tok = logits.argmax(-1)
    for _ in range(steps):
        tok = model.decode(cache, seqs, tok).argmax(-1)


def test_a_model_cast_after_bind_warns_once_and_a_rebind_is_quiet_again() -> None:
    policy = Counting(load_policy())
    hub = Hub(policy=policy)
    model = Decoder(CFG)
    hub.bind(model, batch=2, prompt_len=20, max_len=30, page_size=4)
    policy.calls = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _generate(model)  # bound as it runs: quiet, no resolutions
    assert policy.calls == 0
    model.to(torch.bfloat16)
    with pytest.warns(UserWarning, match="bound for fp32 but is called with bf16") as rec:
        _generate(model)
        _generate(model)
    assert len([w for w in rec if "bound for" in str(w.message)]) == CFG.num_layers
    hub.bind(model, batch=2, prompt_len=20, max_len=30, page_size=4)
    policy.calls = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _generate(model)
    assert policy.calls == 0
