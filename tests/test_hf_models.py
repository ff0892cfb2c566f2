"""attn_implementation="attnhub" across real transformers model families (tiny random
configs, no downloads, fp32): logits against an fp64 oracle by the FlashAttention rule, over
several successive batches of one shape with different padding (the stale-cache trap),
packed sequences, generate() with dynamic and static caches, and training gradients."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnhub import Hub
from attnhub.integrations import transformers as hf
from attnhub.integrations.transformers.testing import one_intraop_thread, twin_models
from attnhub.policy import load_policy
from attnhub.testing import assert_fa_rule

VOCAB, SEQ = 96, 12
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64)


def _configs() -> dict[str, Callable[[], object]]:
    t = transformers
    gqa = dict(SMALL, num_key_value_heads=2)
    return {
        "llama": lambda: t.LlamaConfig(**gqa),
        "mistral-sliding": lambda: t.MistralConfig(**gqa, sliding_window=5),
        "qwen2-sliding": lambda: t.Qwen2Config(**gqa, use_sliding_window=True, sliding_window=4,
                                               max_window_layers=1),
        "qwen3": lambda: t.Qwen3Config(**gqa, head_dim=16),
        "gemma2-softcap-sliding": lambda: t.Gemma2Config(
            **gqa, head_dim=16, sliding_window=4, attn_logit_softcapping=5.0,
            final_logit_softcapping=None, query_pre_attn_scalar=16),
        "gemma3-sliding": lambda: t.Gemma3TextConfig(
            **gqa, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"]),
        "phi3-sliding": lambda: t.Phi3Config(**gqa, sliding_window=5, pad_token_id=0),
        "gpt-neox": lambda: t.GPTNeoXConfig(**SMALL),
        "gpt2": lambda: t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=64, bos_token_id=0, eos_token_id=0),
    }


CONFIGS = _configs()
_PAIRS: dict[str, tuple] = {}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    with one_intraop_thread():
        yield


_registered_hub: Hub | None = None


@pytest.fixture(scope="module")
def hub() -> Hub:
    global _registered_hub
    _registered_hub = Hub(policy=load_policy())
    hf.register(_registered_hub)
    return _registered_hub


def pair(name: str, auto: type | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(attnhub model, eager model) with the same random weights, built once per module."""
    if name not in _PAIRS:
        cfg = (CONFIGS | ENCODERS)[name]()
        _PAIRS[name] = twin_models(cfg, auto)
    return _PAIRS[name]


ENCODERS: dict[str, Callable[[], object]] = {
    "bert": lambda: transformers.BertConfig(**SMALL),
    "modernbert-sliding": lambda: transformers.ModernBertConfig(
        **SMALL, local_attention=4, layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0),
}


def _oracle_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      softcap=None, is_causal=None, **kwargs):  # type: ignore[no-untyped-def]
    """Explicit fp64 attention written from the definition: softcap, boolean mask, softmax,
    fully masked rows 0 (transformers' eager makes them NaN in fp64)."""
    q, k, v = query.double(), key.double(), value.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    sq, sk = s.shape[-2:]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    if attention_mask is not None:
        allowed = attention_mask.bool()
    elif causal and sq > 1:
        allowed = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    else:
        allowed = torch.ones(sq, sk, dtype=torch.bool)
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2).contiguous(), None


def oracle(eager: torch.nn.Module) -> torch.nn.Module:
    """The fp64 reference model: the same weights through ``_oracle_attention``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("oracle64", _oracle_attention)
    AttentionMaskInterface.register("oracle64", sdpa_mask)
    m = copy.deepcopy(eager).double()
    m.set_attn_implementation("oracle64")
    return m


def batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three (ids, mask) batches of one shape with different padding: left, right, mixed."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, SEQ), generator=gen)
    out = []
    for side, lens in (("left", (SEQ, 7, 3)), ("right", (5, SEQ, 9)), ("left", (11, 2, SEQ))):
        mask = torch.zeros(3, SEQ, dtype=torch.long)
        for i, n in enumerate(lens):
            if side == "left":
                mask[i, SEQ - n:] = 1
            else:
                mask[i, :n] = 1
        out.append((ids.roll(len(out), dims=1), mask))
    return out


def _outputs(model: torch.nn.Module, **kw: torch.Tensor) -> torch.Tensor:
    res = model(**kw)
    return res.logits if hasattr(res, "logits") else res.last_hidden_state


def _check_batch(ours: torch.nn.Module, eager: torch.nn.Module, ref: torch.nn.Module,
                 what: str, sdpa: torch.nn.Module | None = None, **kw: torch.Tensor) -> None:
    """ours against the fp64 oracle by the FlashAttention rule, measured once with eager and
    (where given) once with sdpa as the same-precision implementation."""
    keep = kw["attention_mask"].bool() if "attention_mask" in kw else ...
    with torch.no_grad():
        got = _outputs(ours, **kw)[keep]
        ref64 = _outputs(ref, **kw)[keep]
        for name, model in (("eager", eager), ("sdpa", sdpa)):
            if model is not None:
                same = _outputs(model, **kw)[keep]
                assert_fa_rule(got, ref64, same, what=f"{what} (vs {name})")


def sdpa_twin(eager: torch.nn.Module) -> torch.nn.Module | None:
    """The same weights under transformers' sdpa, where transformers allows it (no softcap)."""
    if getattr(eager.config, "attn_logit_softcapping", None) is not None:
        return None
    m = copy.deepcopy(eager)
    m.set_attn_implementation("sdpa")
    return m


@pytest.mark.parametrize("name", list(CONFIGS))
def test_successive_padded_batches_match_the_fp64_oracle(hub: Hub, name: str) -> None:
    ours, eager = pair(name)
    ref, sdpa = oracle(eager), sdpa_twin(eager)
    for i, (ids, mask) in enumerate(batches(seed=len(name))):
        _check_batch(ours, eager, ref, f"{name} batch {i}", sdpa, input_ids=ids,
                     attention_mask=mask)


@pytest.mark.parametrize("name,structured", [
    ("bert", {"column_sparse"}),
    ("modernbert-sliding", {"column_sparse", "sliding_window"}),  # |q - kv| <= w windows
])
def test_encoders_with_padding_over_successive_batches(hub: Hub, name: str,
                                                       structured: set[str]) -> None:
    """An encoder's key padding (and bidirectional window) is structured (column ranges,
    window), never a stale dense mask."""
    ours, eager = pair(name, transformers.AutoModel)
    ref, sdpa = oracle(eager), sdpa_twin(eager)
    for i, (ids, mask) in enumerate(batches(seed=5)):
        _check_batch(ours, eager, ref, f"{name} batch {i}", sdpa, input_ids=ids,
                     attention_mask=mask)
    kinds = {r.decision.spec.mask.kinds for r in hub.bound()
             if r.decision.context.model == ours.config.model_type}
    assert structured in kinds, kinds
    assert not any("mask_mod" in k for k in kinds), kinds


def test_packed_sequences_through_position_ids(hub: Hub) -> None:
    """Documents packed in one row (position_ids restart, no attention_mask): two packings of
    the same shape in a row, each exact."""
    ours, eager = pair("llama")
    ref, sdpa = oracle(eager), sdpa_twin(eager)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=gen)
    for docs in ([[5, 4, 3], [SEQ]], [[2, 10], [6, 6]]):
        pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
        _check_batch(ours, eager, ref, f"packed {docs}", sdpa, input_ids=ids, position_ids=pos)


@pytest.mark.parametrize("name", ["llama", "mistral-sliding", "gemma2-softcap-sliding", "gpt2"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_gives_the_same_tokens(hub: Hub, name: str, cache: str) -> None:
    """Two left-padded batches of one shape in a row (other padding, same shapes)."""
    ours, eager = pair(name)
    for ids, mask in batches(seed=7)[0::2]:
        kw = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False,
              "pad_token_id": 0}
        if cache == "static":
            kw["cache_implementation"] = "static"
        assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))


def test_training_gradients_match(hub: Hub) -> None:
    """Gradients of every weight through attnhub against the fp64 oracle (3x rule)."""
    ours, eager = pair("mistral-sliding")
    ids, mask = batches(seed=9)[1]
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (ours, copy.deepcopy(eager), oracle(eager)):
        model = copy.deepcopy(model).train()
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    got, same, ref64 = grads
    assert got.keys() == ref64.keys() and any("self_attn" in n for n in got)
    for n in got:
        assert_fa_rule(got[n], ref64[n], same[n], mult=3.0, what=f"grad {n}")


@pytest.mark.parametrize("cls,cfg", [
    ("BloomForCausalLM", lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64,
                                                         n_layer=2, n_head=4)),
    ("FalconForCausalLM", lambda: transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        alibi=True, new_decoder_architecture=False)),
])
def test_models_that_bypass_the_attention_interface_are_refused_at_build(
        hub: Hub, cls: str, cfg: Callable[[], object]) -> None:
    from attnhub import InputError

    with pytest.raises(InputError, match=f"{cls}.*AttentionInterface.*'sdpa' or 'eager'"):
        transformers.AutoModelForCausalLM.from_config(cfg(), attn_implementation="attnhub")
    ok = transformers.AutoModelForCausalLM.from_config(cfg(), attn_implementation="eager")
    try:  # switching later: refused by attnhub or by transformers itself, never applied
        ok.set_attn_implementation("attnhub")
    except InputError as exc:
        assert cls in str(exc)
    assert ok.config._attn_implementation == "eager"


def test_policy_binds_per_model_and_layer_through_register(hub: Hub, tmp_path: Path) -> None:
    """A policy rule naming the model and a layer index decides that layer only."""
    path = tmp_path / "per-layer.yaml"
    path.write_text("name: per-layer\nversion: 1\nextends: default\nrules:\n"
                    "  - name: llama-layer-1\n"
                    "    when: {model: 'llama*', layer: {index: {ge: 1}}}\n"
                    "    use: [reference]\n")
    per_layer = Hub(policy=str(path))
    ours, eager = pair("llama")
    ids, mask = batches(seed=11)[0]
    hf.register(per_layer)
    try:
        _check_batch(ours, eager, oracle(eager), "per-layer policy", input_ids=ids,
                     attention_mask=mask)
    finally:
        hf.register(_registered_hub)
    chosen = {r.decision.context.layer: r.decision.backend for r in per_layer.bound()}
    assert chosen[1] == "reference" and chosen[0] != "reference", chosen
