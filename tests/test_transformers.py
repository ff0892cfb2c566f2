"""attn_implementation="attnhub" in transformers: tiny random models from configs only."""

from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnhub import AttnParams, Hub
from attnhub.core.reference import reference_attention
from attnhub.integrations import transformers as hf
from attnhub.integrations.transformers.testing import twin_models
from attnhub.policy import load_policy
from attnhub.testing import assert_fa_rule

VOCAB = 96


def _llama() -> object:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _gpt2() -> object:
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                   n_positions=128, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def hub() -> Hub:
    h = Hub(policy=load_policy())
    hf.register(h)
    return h


def _pair(cfg: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same random weights under attnhub and under eager."""
    return twin_models(cfg)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 14), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama-gqa", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_match_eager_by_the_flashattention_rule(hub: Hub, make, dtype) -> None:  # type: ignore[no-untyped-def]
    ours, eager = _pair(make())
    ids, mask = _batch()
    keep = mask.bool()
    oracle = copy.deepcopy(eager).double()
    oracle.config._attn_implementation = "sdpa"  # eager in fp64 turns padded rows into NaN
    with torch.no_grad():
        ref64 = oracle(ids, attention_mask=mask).logits[keep]
        same = eager.to(dtype)(ids, attention_mask=mask).logits[keep]
        got = ours.to(dtype)(ids, attention_mask=mask).logits[keep]
    assert_fa_rule(got, ref64, same, what=f"{make.__name__} {dtype} logits")
    ctx = {(r.decision.context.model, r.decision.context.layer) for r in hub.bound()}
    assert {(ours.config.model_type, 0), (ours.config.model_type, 1)} <= ctx


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama-gqa", "gpt2"])
def test_generate_with_kv_cache_matches_eager(hub: Hub, make) -> None:  # type: ignore[no-untyped-def]
    ours, eager = _pair(make())
    ids, mask = _batch()
    kw = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))
    phases = {r.decision.spec.phase for r in hub.bound()
              if r.decision.context.model == ours.config.model_type}
    assert {"prefill", "decode"} <= phases  # phase inferred from the call


def test_arbitrary_mask_goes_through_as_a_dense_mask_mod(hub: Hub) -> None:
    """A mask that is not causal + window + padding keeps its exact pattern."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, n, 8, generator=gen) for n in (5, 7, 7))
    k, v = k[:, :2], v[:, :2]  # GQA 4:2
    allowed = torch.rand(2, 1, 5, 7, generator=gen) < 0.6
    allowed[..., 0] = True
    module = torch.nn.Module()
    module.is_causal, module.layer_idx = True, 0
    out, _ = hf.attention_forward(module, q, k, v, allowed, scaling=0.3)
    params = AttnParams(scale=0.3, mask_mod=hf.DenseMask(allowed))
    ref, _ = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), params)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_padding_becomes_column_ranges_with_the_same_meaning() -> None:
    b, sq, sk = 2, 3, 6
    rows = torch.arange(sq).view(sq, 1) + (sk - sq)
    keep = torch.ones(b, sk, dtype=torch.bool)
    keep[1, :2] = False
    mask = ((torch.arange(sk).view(1, sk) <= rows) & keep.view(b, 1, 1, sk)).view(b, 1, sq, sk)
    args = hf.mask_args(mask, True, None, b, sq, sk)
    assert args["causal"] and "mask_mod" not in args
    from attnhub.core.masking import allowed_mask

    params = AttnParams(scale=1.0, **args)
    assert torch.equal(allowed_mask(params, b, 1, sq, sk, mask.device), mask)


def test_unsupported_features_are_refused_with_the_fix() -> None:
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="eager"):
        hf.attention_forward(torch.nn.Module(), q, q, q, None, output_attentions=True)
    assert math.isfinite(float(hf.attention_forward(torch.nn.Module(), q, q, q, None)[0].sum()))



def test_bind_resolves_a_transformers_model_up_front(hub: Hub) -> None:
    """hub.bind on a transformers model: every layer and phase resolved before any call,
    and generate() (no padding) then causes no resolution."""
    pol, calls = load_policy(), []

    class Counted:
        name = pol.name
        resolve = staticmethod(lambda *a: calls.append(a) or pol.resolve(*a))

    bound = Hub(policy=Counted())
    ours, eager = _pair(_llama())
    ids = _batch()[0]
    table = bound.bind(ours, batch=3, prompt_len=ids.shape[1], max_len=ids.shape[1] + 6)
    assert {(r.layer, r.phase) for r in table} == {(i, p) for i in (0, 1)
                                                    for p in ("prefill", "decode")}
    assert not table.unbound() and len(calls) == len(table)
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))
    assert len(calls) == len(table), "generate() resolved the policy on the call path"


def test_a_query_cutting_hook_attnhub_cannot_read_is_refused(monkeypatch) -> None:
    """A model whose ``_maybe_slice_kv_shared_inputs`` takes other parameters than attnhub
    reads (a future transformers) is refused under attnhub, not run with unplaced queries;
    other implementations call it untouched."""
    import sys
    import types

    from attnhub.errors import InputError
    from attnhub.integrations.transformers.kv_sharing import keep_whole_sequences

    class Model:
        def __init__(self, impl: str) -> None:
            self.config = types.SimpleNamespace(_attn_implementation=impl)

        def _maybe_slice_kv_shared_inputs(self, hidden, masks):  # type: ignore[no-untyped-def]
            return hidden[:, -1:], masks

    mod = types.ModuleType("transformers.models.attnhub_fake")
    mod.Model = Model  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    keep_whole_sequences({"attnhub"})
    keep_whole_sequences({"attnhub"})  # wrapped once
    hidden = torch.zeros(1, 4, 2)
    assert Model("eager")._maybe_slice_kv_shared_inputs(hidden, {})[0].shape == (1, 1, 2)
    with pytest.raises(InputError, match="keep the whole sequence"):
        Model("attnhub")._maybe_slice_kv_shared_inputs(hidden, {})
