"""attn_implementation="attnhub" on families and situations the other transformers tests leave
out, against eager on random inputs: MoE, MLA (qk head dim != v head dim), chunked attention,
alternating sliding layers, encoders, T5Gemma's cross-attention, Gemma 3's image blocks;
successive left-padded batches, batch 1 without a mask, greedy generate() with dynamic and
static caches, caches continued by chunks, packed rows, training gradients, autocast and
model.to(bf16) after bind. Refused, never ignored: keywords that eager folds into the mask or
scores (DeepSeek-V3.2's sparse ``indices``, position biases) and padding-free ``cu_seq_lens``
whose documents the mask does not keep apart. A module without ``is_causal`` (Mllama's
cross-attention) attends as eager does; bind resolves what generate() then calls. (gpt-oss's
sinks, refused here once, are applied now: tests/test_hf_sinks.py.)"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnhub import Hub, InputError
from attnhub.integrations import transformers as hf
from attnhub.integrations.transformers.testing import close, one_intraop_thread, twin_models
from attnhub.integrations.transformers.testing import padded as padded_ids
from attnhub.policy import load_policy

t = transformers
VOCAB = 96
GQA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
MHA = {**GQA, "num_key_value_heads": 4}
ALTERNATE = dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"])
# multi-head latent attention: q/k head dim 12, v head dim 6
MLA = dict(MHA, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8,
           v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           first_k_dense_replace=1, n_group=1, topk_group=1)
FAMILIES: dict[str, Callable[[], object]] = {
    "mixtral-sliding": lambda: t.MixtralConfig(**GQA, num_local_experts=4,
                                               num_experts_per_tok=2, sliding_window=3),
    "qwen3-moe": lambda: t.Qwen3MoeConfig(**GQA, head_dim=8, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=16),
    "phi": lambda: t.PhiConfig(**MHA),
    "gptj": lambda: t.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                 n_positions=64, rotary_dim=4, bos_token_id=0, eos_token_id=0),
    "granite": lambda: t.GraniteConfig(**GQA, attention_multiplier=0.3),
    "olmo2": lambda: t.Olmo2Config(**GQA, pad_token_id=0, eos_token_id=0),
    "deepseek-v3-mla": lambda: t.DeepseekV3Config(**MLA),
    "deepseek-v2-mla": lambda: t.DeepseekV2Config(**{**MLA, "q_lora_rank": None}),
    "cohere2-alternating": lambda: t.Cohere2Config(**GQA, **ALTERNATE, pad_token_id=0,
                                                   bos_token_id=1, eos_token_id=0),
    "exaone4-alternating": lambda: t.Exaone4Config(**GQA, **ALTERNATE),
    "llama4-chunked": lambda: t.Llama4TextConfig(
        **GQA, head_dim=8, attention_chunk_size=4, num_local_experts=2,
        intermediate_size_mlp=48, no_rope_layers=[1, 0],
        layer_types=["chunked_attention", "full_attention"]),
    "gemma2-softcap": lambda: t.Gemma2Config(**GQA, head_dim=8, sliding_window=3,
                                             attn_logit_softcapping=5.0, query_pre_attn_scalar=8,
                                             final_logit_softcapping=None),
}
ENCODERS: dict[str, Callable[[], object]] = {
    "roberta": lambda: t.RobertaConfig(**MHA, pad_token_id=1),
    "distilbert": lambda: t.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4,
                                             hidden_dim=48, max_position_embeddings=64),
    "esm-rotary": lambda: t.EsmConfig(**MHA, pad_token_id=1,
                                      position_embedding_type="rotary"),
    "gemma3-bidirectional-sliding": lambda: t.Gemma3TextConfig(
        **GQA, **ALTERNATE, head_dim=8, query_pre_attn_scalar=8,
        use_bidirectional_attention=True),
}
_PAIRS: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}


@pytest.fixture(scope="module", autouse=True)
def hub() -> Iterator[Hub]:
    h = Hub(policy=load_policy())
    hf.register(h)
    with one_intraop_thread():
        yield h


def pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    if name not in _PAIRS:
        if name in ENCODERS:
            _PAIRS[name] = twin_models(ENCODERS[name](), t.AutoModel)
        else:
            _PAIRS[name] = twin_models(FAMILIES[name]())
    return _PAIRS[name]


def padded(gen: torch.Generator, lens: tuple[int, ...], side: str = "left"
           ) -> tuple[torch.Tensor, torch.Tensor]:
    return padded_ids(gen, lens, VOCAB, side)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_successive_batches_and_generate_match_eager(name: str) -> None:
    """Left-padded batches of 3, 1 and 2 rows, batch 1 without a mask, then greedy generate()
    on a dynamic and a static cache: tokens equal, every step's logits close."""
    ours, eager = pair(name)
    gen = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for lens in ((9, 5, 2), (7,), (4, 9)):
            ids, mask = padded(gen, lens)
            keep = mask.bool()
            close(ours(input_ids=ids, attention_mask=mask).logits[keep],
                  eager(input_ids=ids, attention_mask=mask).logits[keep], f"{name} {lens}")
        ids = torch.randint(2, VOCAB, (1, 10), generator=gen)
        close(ours(input_ids=ids).logits, eager(input_ids=ids).logits, f"{name} no mask")
        ids, mask = padded(gen, (8, 3, 6))
        for cache in ("dynamic", "static"):
            kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                      output_logits=True, return_dict_in_generate=True,
                      cache_implementation=cache)
            got, want = ours.generate(ids, **kw), eager.generate(ids, **kw)
            assert torch.equal(got.sequences, want.sequences), (name, cache)
            for step, (a, b) in enumerate(zip(got.logits, want.logits)):
                close(a, b, f"{name} {cache} step {step}")


@pytest.mark.parametrize("name", ["gemma2-softcap", "llama4-chunked", "deepseek-v3-mla",
                                  "cohere2-alternating"])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_a_reused_cache_continued_by_chunks(name: str, cache: str) -> None:
    """One cache fed chunks of 4, 3, 1 and 2 tokens (left padding, then batch 1 without a
    mask): windows, chunks and softcap across chunk borders, static slots past the end."""
    ours, eager = pair(name)
    gen = torch.Generator().manual_seed(7)
    ids, mask = padded(gen, (10, 6, 4))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    for rows, with_mask in ((slice(None), True), (slice(0, 1), False)):
        outs = []
        for model in (ours, eager):
            kv = (t.StaticCache(config=model.config, max_cache_len=16) if cache == "static"
                  else t.DynamicCache(config=model.config))
            got = []
            with torch.no_grad():
                for s, e in ((0, 4), (4, 7), (7, 8), (8, 10)):
                    kw = (dict(attention_mask=mask[rows, :e], position_ids=pos[rows, s:e])
                          if with_mask else {})
                    logits = model(input_ids=ids[rows, s:e], cache=kv,
                                   use_cache=True, **kw).logits
                    got.append(logits[mask[rows, s:e].bool()] if with_mask else logits[0])
            outs.append(torch.cat(got))
        close(*outs, f"{name} {cache} mask={with_mask}")


@pytest.mark.parametrize("name", ["mixtral-sliding", "gemma2-softcap", "llama4-chunked"])
def test_packed_sequences_through_position_ids(name: str) -> None:
    """Padding-free rows (position_ids restart per document): windows and chunks must not
    cross document borders."""
    ours, eager = pair(name)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(2, VOCAB, (3, 10), generator=gen)
    docs = ((5, 3, 2), (7, 3), (10,))
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    with torch.no_grad():
        close(ours(input_ids=ids, position_ids=pos).logits,
              eager(input_ids=ids, position_ids=pos).logits, f"{name} packed")


@pytest.mark.parametrize("name", ["deepseek-v3-mla", "gemma2-softcap", "exaone4-alternating"])
def test_training_gradients_match_eager(name: str) -> None:
    """fp32 gradients of every weight, right padding (a left pad's last row is read by the
    shifted loss, where eager's average of all values and attnhub's/sdpa's 0 differ)."""
    ours, eager = pair(name)
    ids, mask = padded(torch.Generator().manual_seed(13), (9, 6, 3), side="right")
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (ours, eager):
        model = copy.deepcopy(model).train()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("attn" in n for n in grads[0])
    for n, g in grads[0].items():
        close(g, grads[1][n], f"{name} grad {n}", atol=1e-5)


@pytest.mark.parametrize("name", ["deepseek-v3-mla", "gemma2-softcap"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_and_a_model_moved_to_half_after_binding(hub: Hub, name: str,
                                                          dtype: torch.dtype) -> None:
    ours, eager = pair(name)
    ids, mask = padded(torch.Generator().manual_seed(17), (9, 4))
    keep, tol = mask.bool(), 2e-2 if dtype == torch.bfloat16 else 3e-3
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        close(ours(input_ids=ids, attention_mask=mask).logits[keep],
              eager(input_ids=ids, attention_mask=mask).logits[keep], f"{name} autocast",
              atol=tol)
    ours, eager = copy.deepcopy(ours), copy.deepcopy(eager).to(dtype)
    hub.bind(ours, batch=2, prompt_len=9, max_len=16, dtype=torch.float32)
    ours.to(dtype)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        close(ours(input_ids=ids, attention_mask=mask).logits[keep],
              eager(input_ids=ids, attention_mask=mask).logits[keep], f"{name} .to", atol=tol)
        assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))


@pytest.mark.parametrize("name", list(ENCODERS))
def test_encoders_with_right_padding_and_without_a_mask(name: str) -> None:
    ours, eager = pair(name)
    gen = torch.Generator().manual_seed(19)
    with torch.no_grad():
        for lens in ((9, 5, 2), (4, 9)):
            ids, mask = padded(gen, lens, side="right")
            keep = mask.bool()
            close(ours(input_ids=ids, attention_mask=mask).last_hidden_state[keep],
                  eager(input_ids=ids, attention_mask=mask).last_hidden_state[keep],
                  f"{name} {lens}")
        ids = torch.randint(2, VOCAB, (1, 10), generator=gen)
        close(ours(input_ids=ids).last_hidden_state, eager(input_ids=ids).last_hidden_state,
              f"{name} no mask")


@pytest.mark.parametrize("config", [
    lambda: t.DeepseekV32Config(**MLA, index_topk=3, index_head_dim=8, index_n_heads=2),
    lambda: t.GlmMoeDsaConfig(**MLA, index_topk=3, index_head_dim=8, index_n_heads=2),
], ids=["deepseek-v3.2", "glm-moe-dsa"])
def test_sparse_indices_are_refused_not_ignored(config: Callable[[], object]) -> None:
    """DSA models fold their top-k key selection into the mask for eager/sdpa only and hand
    other implementations ``indices``: ignoring them attended to every key."""
    ours, _ = twin_models(config())
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(23))
    with pytest.raises(InputError, match=r"Attention \(layer 0\) passes 'indices'.*'eager'"):
        with torch.no_grad():
            ours(input_ids=ids)


def test_unknown_attention_arguments_are_refused_and_bookkeeping_is_not() -> None:
    """Any keyword with a value that the integration does not know (biases, sparse
    selections a model may add) is refused; transformers' bookkeeping keywords change
    nothing."""
    gen = torch.Generator().manual_seed(29)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=gen) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    plain = hf.attention_forward(module, q, k, v, None)[0]
    book = hf.attention_forward(module, q, k, v, None, position_ids=torch.arange(5)[None],
                                use_cache=True, output_attentions=False, cu_seq_lens_q=None,
                                output_hidden_states=True, sinks=None)[0]
    assert torch.equal(plain, book)
    for name, value in (("position_bias", torch.randn(2, 4, 5, 5, generator=gen)),
                        ("block_indices", torch.zeros(2, 5, 2, dtype=torch.int32)),
                        ("window_size", (2, 0))):
        with pytest.raises(InputError, match=f"passes '{name}'"):
            hf.attention_forward(module, q, k, v, None, **{name: value})


def test_a_module_without_is_causal_attends_as_eager() -> None:
    """Mllama's cross-attention has no ``is_causal`` and gets no mask without a
    ``cross_attention_mask``: eager attends to every vision key; reading it as causal (sdpa's
    default) cut the keys to the query count and masked them causally."""
    cfg = t.MllamaTextConfig(**GQA, cross_attention_layers=[1], pad_token_id=0,
                             bos_token_id=1, eos_token_id=2)
    auto = type("Auto", (), {"from_config": staticmethod(
        lambda c, **kw: t.MllamaForCausalLM._from_config(c, **kw))})
    ours, eager = twin_models(cfg, auto)
    gen = torch.Generator().manual_seed(31)
    with torch.no_grad():
        for model in (ours, eager):  # the gates start at 0: open them, identically
            for n, p in model.named_parameters():
                if "gate" in n:
                    p.copy_(torch.linspace(0.5, 1.5, p.numel()).view_as(p))
        cross = torch.randn(2, 12, 32, generator=gen)
        for n in (5, 12, 20):  # fewer, as many and more queries than vision keys
            ids = torch.randint(2, VOCAB, (2, n), generator=gen)
            close(ours(input_ids=ids, cross_attention_states=cross).logits,
                  eager(input_ids=ids, cross_attention_states=cross).logits, f"mllama {n}")


@pytest.mark.parametrize("name", ["deepseek-v3-mla", "gemma2-softcap", "cohere2-alternating",
                                  "mixtral-sliding", "exaone4-alternating", "mistral-window-12"])
def test_bind_resolves_what_generate_then_calls(name: str) -> None:
    """hub.bind resolves every call of generate() up front: MLA's key and value head dims,
    sliding layers' decode over a cache that holds the window (without it while the keys fit:
    a window of 12 over an 8-token prompt), and the layer kind from the window transformers
    passes (Mixtral passes its config's window on layers that hold none; Exaone 4's full
    layers hold one they never pass)."""
    pol, calls = load_policy(), []

    class Counted:
        name = pol.name
        resolve = staticmethod(lambda *a: calls.append(a) or pol.resolve(*a))

    config = (t.MistralConfig(**GQA, sliding_window=12) if name == "mistral-window-12"
              else FAMILIES[name]())
    ours, eager = twin_models(config)
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(37))
    table = Hub(policy=Counted()).bind(ours, batch=2, prompt_len=8, max_len=14)
    assert not table.unbound() and len(calls) == len(table)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))
    assert len(calls) == len(table), [(a[0].head_dim, a[0].head_dim_v, a[0].mask.kinds,
                                       a[0].max_seqlen_k, a[1]) for a in calls[len(table):]]


def test_a_window_the_mask_does_not_hold_stays_structured(hub: Hub) -> None:
    """OLMoE passes its config's window with a plain causal mask (eager applies none): with
    padding that mask is causal + key padding, not a dense mask_mod (Flex on CUDA, compiled
    per shape)."""
    ours, eager = twin_models(t.OlmoeConfig(**GQA, num_experts=4, num_experts_per_tok=2,
                                            sliding_window=3))
    ids, mask = padded(torch.Generator().manual_seed(41), (9, 5))
    with torch.no_grad():
        close(ours(input_ids=ids, attention_mask=mask).logits[mask.bool()],
              eager(input_ids=ids, attention_mask=mask).logits[mask.bool()], "olmoe")
    kinds = {r.decision.spec.mask.kinds for r in hub.bound()
             if r.decision.context.model == "olmoe"}
    assert kinds and not any("mask_mod" in k for k in kinds), kinds


@pytest.mark.parametrize("name", ["mixtral-sliding", "gemma2-softcap"])
def test_padding_free_documents_attend_apart_or_are_refused(name: str) -> None:
    """A padding-free row (``DataCollatorWithFlattening``: ``cu_seq_lens_*`` and position_ids
    restarting per document) equals the documents run one by one; ``cu_seq_lens`` without a
    mask separating the documents (no position_ids, or a cache, under which transformers
    builds none) is refused, never attended across the borders."""
    ours, eager = pair(name)
    gen = torch.Generator().manual_seed(43)
    lens = (5, 4, 3)
    ids = torch.randint(2, VOCAB, (1, sum(lens)), generator=gen)
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    flash = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    with torch.no_grad():
        apart = torch.cat([eager(input_ids=ids[:, a:b], use_cache=False).logits
                           for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
        close(ours(input_ids=ids, position_ids=pos, use_cache=False, **flash).logits, apart,
              f"{name} padding-free")
        for kw in (dict(use_cache=False), dict(position_ids=pos, use_cache=True)):
            with pytest.raises(InputError, match=r"cu_seq_lens_q holds 3 packed documents"):
                ours(input_ids=ids, **kw, **flash)


def test_encoder_decoder_cross_attention_with_padding() -> None:
    """T5Gemma: padded encoder (bidirectional, alternating sliding layers, softcap), decoder
    cross-attention over the padded encoder keys, greedy generate() over successive batches."""
    module = dict(**GQA, **ALTERNATE, head_dim=8, query_pre_attn_scalar=8,
                  attn_logit_softcapping=5.0, final_logit_softcapping=None)
    cfg = t.T5GemmaConfig(encoder=t.T5GemmaModuleConfig(**module),
                          decoder=t.T5GemmaModuleConfig(**module), vocab_size=VOCAB)
    ours, eager = twin_models(cfg, t.AutoModelForSeq2SeqLM)
    gen = torch.Generator().manual_seed(47)
    with torch.no_grad():
        for lens in ((9, 5, 2), (4, 9)):
            ids, mask = padded(gen, lens, side="right")
            dec = torch.randint(3, VOCAB, (len(lens), 6), generator=gen)
            close(ours(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits,
                  eager(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits,
                  f"t5gemma {lens}")
            kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
            got, want = ours.generate(ids, **kw), eager.generate(ids, **kw)
            assert torch.equal(got.sequences, want.sequences), lens
            for step, (a, b) in enumerate(zip(got.logits, want.logits)):
                close(a, b, f"t5gemma {lens} step {step}")


def test_gemma3_image_tokens_attend_bidirectionally_in_their_block() -> None:
    """Gemma 3 with images: image tokens see their whole block (token_type_ids), a dense
    mask on top of causal + sliding + padding; then greedy generate()."""
    text = t.Gemma3TextConfig(**GQA, **ALTERNATE, head_dim=8, query_pre_attn_scalar=8)
    vision = t.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=4, image_size=16, patch_size=4)
    cfg = t.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                         image_token_index=90, boi_token_index=91, eoi_token_index=92)
    ours, eager = twin_models(cfg, t.AutoModelForImageTextToText)
    gen = torch.Generator().manual_seed(53)
    ids = torch.randint(3, 80, (2, 12), generator=gen)
    ids[0, 2:6], ids[1, 5:9] = 90, 90
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kw = dict(attention_mask=mask, pixel_values=torch.randn(2, 3, 16, 16, generator=gen),
              token_type_ids=(ids == 90).long())
    with torch.no_grad():
        close(ours(input_ids=ids, **kw).logits[mask.bool()],
              eager(input_ids=ids, **kw).logits[mask.bool()], "gemma3 images")
        kw.update(max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))
