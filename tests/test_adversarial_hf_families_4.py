"""attn_implementation="attnhub" against eager where the other transformers tests do not go:
encoder-decoders that transformers leaves unflagged but routes through AttentionInterface
(BART, mBART, Pegasus, Marian, Blenderbot, M2M-100, PLBart, Whisper: padded encoders,
cross-attention, greedy / beam / sampled / static-cache generate()), encoder-decoder
wrappers, encoders (XLM-R, ModernBERT local/global, ViT, DINOv2, SigLIP 2 with patch
padding, CLIP) and multimodal decoders (Qwen2-VL / Qwen2.5-VL M-RoPE, LLaVA), generation
modes over sliding-window caches (beam search, static and hybrid caches, sampling with
several sequences, a cache reused by a second generate(), assisted decoding), training
gradients, implementation switching and bf16 (by the FlashAttention rule). Refused, never
silently wrong: attention weights requested through transformers' output recorder (SigLIP
got an empty ``attentions``), attention dropout in training, T5's position bias, Swin's
window bias (naming the layer), a ``head_mask`` (which eager drops).

Weights are scaled up (``sharpened``) so that attention is far from uniform and a wrong mask
moves the logits well past the tolerance."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnhub import Hub, InputError
from attnhub.integrations import transformers as hf
from attnhub.integrations.transformers.testing import (close, one_intraop_thread, same_generation,
                                                      sharpened, twin_models)
from attnhub.integrations.transformers.testing import padded as padded_ids
from attnhub.policy import load_policy
from attnhub.testing import assert_fa_rule

t = transformers
VOCAB = 96
GQA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              image_size=16, patch_size=4)
SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
               decoder_ffn_dim=48, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
               eos_token_id=2, decoder_start_token_id=2)
ENC_DEC: dict[str, Callable[[], Any]] = {
    "bart": lambda: t.BartConfig(**SEQ2SEQ),
    "mbart": lambda: t.MBartConfig(**SEQ2SEQ),
    "pegasus": lambda: t.PegasusConfig(**SEQ2SEQ),
    "marian": lambda: t.MarianConfig(**SEQ2SEQ),
    "blenderbot": lambda: t.BlenderbotConfig(**SEQ2SEQ),
    "blenderbot-small": lambda: t.BlenderbotSmallConfig(**SEQ2SEQ),
    "m2m-100": lambda: t.M2M100Config(**SEQ2SEQ),
    "plbart": lambda: t.PLBartConfig(**SEQ2SEQ),
}
SLIDING: dict[str, Callable[[], Any]] = {
    "mistral": lambda: t.MistralConfig(**GQA, sliding_window=3),
    "gemma2": lambda: t.Gemma2Config(**GQA, head_dim=8, sliding_window=3,
                                     attn_logit_softcapping=5.0, query_pre_attn_scalar=8,
                                     final_logit_softcapping=None),
    "gemma3": lambda: t.Gemma3TextConfig(**GQA, head_dim=8, sliding_window=3,
                                         query_pre_attn_scalar=8,
                                         layer_types=["sliding_attention", "full_attention"]),
}


def whisper_config(**kw: Any) -> Any:
    return t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=48, decoder_ffn_dim=48, d_model=32,
                           max_source_positions=16, max_target_positions=32, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2, decoder_start_token_id=0,
                           suppress_tokens=None, begin_suppress_tokens=None, **kw)


@pytest.fixture(scope="module", autouse=True)
def hub() -> Iterator[Hub]:
    h = Hub(policy=load_policy())
    hf.register(h)
    with one_intraop_thread():
        yield h


def padded(gen: torch.Generator, lens: tuple[int, ...], side: str = "right"
           ) -> tuple[torch.Tensor, torch.Tensor]:
    return padded_ids(gen, lens, VOCAB, side)


@pytest.mark.parametrize("name", list(ENC_DEC))
def test_encoder_decoders_match_eager(name: str) -> None:
    """Right-padded encoders over successive batches, the decoder's causal self-attention
    and cross-attention over the padded keys, greedy, beam-search (the cache reordered
    between beams) and static-cache generate(). These classes leave
    _supports_attention_backend False and were refused at build."""
    ours, eager = sharpened(ENC_DEC[name](), t.AutoModelForSeq2SeqLM)
    gen = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for lens in ((9, 5, 2), (4, 9)):
            ids, mask = padded(gen, lens)
            dec = torch.randint(3, VOCAB, (len(lens), 6), generator=gen)
            close(ours(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits,
                  eager(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits,
                  f"{name} {lens}")
            for mode in (dict(do_sample=False), dict(num_beams=3, do_sample=False),
                         dict(do_sample=False, cache_implementation="static")):
                same_generation(ours, eager, ids, f"{name} {lens} {mode}",
                                attention_mask=mask, max_new_tokens=4, **mode)


def _wrapper(cls: Any) -> Any:
    """An ``auto`` for ``twin_models`` over a wrapper class without ``from_config``."""
    return type("Auto", (), {"from_config": staticmethod(
        lambda c, **kw: cls._from_config(c, **kw))})


def test_encoder_decoder_wrappers_match_eager_and_check_their_parts() -> None:
    """EncoderDecoderModel (BERT to BERT with cross-attention) and VisionEncoderDecoderModel
    (ViT to GPT-2) hold no attention of their own; a part that bypasses the interface
    (Bloom) is still refused when the wrapper is built."""
    gen = torch.Generator().manual_seed(71)
    bert = dict(GQA, num_key_value_heads=4)
    cfg = t.EncoderDecoderConfig.from_encoder_decoder_configs(
        t.BertConfig(**bert), t.BertConfig(**bert, is_decoder=True, add_cross_attention=True),
        decoder_start_token_id=2, pad_token_id=0)
    ours, eager = sharpened(cfg, _wrapper(t.EncoderDecoderModel), factor=3.0)
    ids, mask = padded(gen, (9, 5, 2))
    dec = torch.randint(3, VOCAB, (3, 6), generator=gen)
    with torch.no_grad():
        close(ours(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits,
              eager(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits,
              "bert2bert")
        same_generation(ours, eager, ids, "bert2bert", attention_mask=mask, max_new_tokens=4,
                        do_sample=False, num_beams=2)
    gpt2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, is_decoder=True,
                add_cross_attention=True)
    cfg = t.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        t.ViTConfig(**VISION), t.GPT2Config(**gpt2), decoder_start_token_id=2, pad_token_id=0)
    ours, eager = sharpened(cfg, _wrapper(t.VisionEncoderDecoderModel), factor=3.0)
    pixels = torch.randn(2, 3, 16, 16, generator=gen)
    with torch.no_grad():
        close(ours(pixel_values=pixels, decoder_input_ids=dec[:2]).logits,
              eager(pixel_values=pixels, decoder_input_ids=dec[:2]).logits, "vit2gpt2")
        same_generation(ours, eager, pixels, "vit2gpt2", max_new_tokens=4, do_sample=False)
    cfg = t.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        t.ViTConfig(**VISION), t.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2,
                                             n_head=4, is_decoder=True, add_cross_attention=True))
    with pytest.raises(InputError, match=r"BloomForCausalLM cannot use attn_implementation"):
        t.VisionEncoderDecoderModel._from_config(cfg, attn_implementation="attnhub")


def test_whisper_generates_as_eager_over_successive_batches() -> None:
    """Whisper: the audio encoder (no mask), the decoder's cross-attention over its cache;
    greedy, beam, sampled generate() with several sequences and beams over a static cache,
    batch 2 then 3."""
    ours, eager = sharpened(whisper_config(), t.AutoModelForSpeechSeq2Seq)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for batch in (2, 3):
            feats = torch.randn(batch, 8, 32, generator=gen)
            dec = torch.randint(3, VOCAB, (batch, 5), generator=gen)
            close(ours(input_features=feats, decoder_input_ids=dec).logits,
                  eager(input_features=feats, decoder_input_ids=dec).logits, f"whisper {batch}")
            for mode in (dict(do_sample=False), dict(num_beams=2, do_sample=False),
                         dict(do_sample=True, num_return_sequences=2, top_k=0),
                         dict(num_beams=2, do_sample=False, cache_implementation="static")):
                same_generation(ours, eager, feats, f"whisper {batch} {mode}",
                                max_new_tokens=4, **mode)


@pytest.mark.parametrize("config", [
    lambda: t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                       num_heads=4, relative_attention_num_buckets=8, pad_token_id=1),
    lambda: t.LongT5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                           num_heads=4, relative_attention_num_buckets=8, pad_token_id=1),
], ids=["t5", "longt5"])
def test_relative_position_bias_models_are_refused_at_build(config: Callable[[], Any]) -> None:
    """T5 adds a learned position bias around the attention function: not vetted, refused
    before any layer exists (and its layers would refuse ``position_bias`` anyway)."""
    with pytest.raises(InputError, match=r"cannot use attn_implementation='attnhub'.*'eager'"):
        t.AutoModelForSeq2SeqLM.from_config(config(), attn_implementation="attnhub")


def test_a_window_bias_passed_as_the_mask_is_refused_naming_the_layer() -> None:
    """Swin hands its relative-position and shifted-window bias over as a float mask."""
    ours, _ = twin_models(t.SwinConfig(image_size=16, patch_size=2, embed_dim=16, depths=[2, 1],
                                       num_heads=[2, 4], window_size=4), t.AutoModel)
    with pytest.raises(InputError, match=r"^SwinAttention: attention_mask carries an additive"):
        with torch.no_grad():
            ours(pixel_values=torch.randn(2, 3, 16, 16))


ENCODERS: dict[str, tuple[Callable[[], Any], Callable[[torch.Generator], dict]]] = {
    "vit": (lambda: t.ViTConfig(**VISION),
            lambda g: dict(pixel_values=torch.randn(2, 3, 16, 16, generator=g))),
    "dinov2": (lambda: t.Dinov2Config(**VISION),
               lambda g: dict(pixel_values=torch.randn(3, 3, 16, 16, generator=g))),
    "siglip2-patch-padding": (
        lambda: t.Siglip2VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, patch_size=4, num_patches=16),
        lambda g: dict(pixel_values=torch.randn(2, 16, 48, generator=g),
                       pixel_attention_mask=torch.arange(16).expand(2, 16).lt(
                           torch.tensor([[16], [10]])).long(),
                       spatial_shapes=torch.tensor([[4, 4], [2, 5]]))),
    "xlm-roberta": (lambda: t.XLMRobertaConfig(**dict(GQA, num_key_value_heads=4),
                                               pad_token_id=1),
                    lambda g: dict(zip(("input_ids", "attention_mask"), padded(g, (9, 5, 2))))),
    "modernbert-local-global": (
        lambda: t.ModernBertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=3, num_attention_heads=4, local_attention=4,
                                   global_attn_every_n_layers=2, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                   sep_token_id=2),
        lambda g: dict(zip(("input_ids", "attention_mask"), padded(g, (11, 6, 2))))),
    "clip": (lambda: t.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                         eos_token_id=2, bos_token_id=1),
        vision_config=VISION),
        lambda g: dict(zip(("input_ids", "attention_mask"), padded(g, (9, 5))),
                       pixel_values=torch.randn(2, 3, 16, 16, generator=g))),
}


@pytest.mark.parametrize("name", list(ENCODERS))
def test_encoders_match_eager(name: str) -> None:
    """Text and vision encoders, padding where they take it (SigLIP 2's patches)."""
    config, inputs = ENCODERS[name]
    ours, eager = sharpened(config(), t.AutoModel, factor=4.0)
    kw = inputs(torch.Generator().manual_seed(len(name)))
    with torch.no_grad():
        got, want = ours(**kw), eager(**kw)
    valid = kw.get("pixel_attention_mask")  # padded positions hold nothing to compare
    if valid is None and "pixel_values" not in kw:
        valid = kw.get("attention_mask")
    for field in ("last_hidden_state", "text_embeds", "image_embeds"):
        if getattr(want, field, None) is not None:
            g, w = got[field], want[field]
            if valid is not None:
                g, w = g[valid.bool()], w[valid.bool()]
            close(g, w, f"{name} {field}")


def _qwen_vl(cls: Any, vision: dict) -> Any:
    text = dict(GQA, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                      "rope_theta": 10000.0})
    base = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, patch_size=2,
                spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    return cls(text_config=text, vision_config=base | vision, image_token_id=90,
               video_token_id=91, vision_start_token_id=92)


MULTIMODAL: dict[str, tuple[Callable[[], Any], int]] = {
    "qwen2-vl": (lambda: _qwen_vl(t.Qwen2VLConfig, dict(mlp_ratio=2)), 4),
    "qwen2.5-vl": (lambda: _qwen_vl(t.Qwen2_5_VLConfig, dict(
        intermediate_size=48, out_hidden_size=32, fullatt_block_indexes=[0], window_size=8)),
        4),
    "llava": (lambda: t.LlavaConfig(text_config=t.LlamaConfig(**GQA).to_dict(),
                                    vision_config=dict(VISION), image_token_index=90), 16),
}


@pytest.mark.parametrize("name", list(MULTIMODAL))
def test_multimodal_decoders_match_eager(name: str) -> None:
    """Image tokens inside left-padded prompts of 2 rows (M-RoPE positions for Qwen-VL),
    then greedy generate()."""
    config, n_img = MULTIMODAL[name]
    ours, eager = sharpened(config(), t.AutoModelForImageTextToText, factor=3.0)
    gen = torch.Generator().manual_seed(len(name))
    ids = torch.randint(3, 80, (2, n_img + 10), generator=gen)
    ids[:, 3:3 + n_img] = 90
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    if name == "llava":
        kw: dict[str, Any] = dict(pixel_values=torch.randn(2, 3, 16, 16, generator=gen))
    else:  # two 4x4-patch images, merged 2x2 into 4 tokens each
        kw = dict(pixel_values=torch.randn(32, 24, generator=gen),
                  image_grid_thw=torch.tensor([[1, 4, 4]] * 2),
                  mm_token_type_ids=(ids == 90).long())
    with torch.no_grad():
        keep = mask.bool()
        close(ours(input_ids=ids, attention_mask=mask, **kw).logits[keep],
              eager(input_ids=ids, attention_mask=mask, **kw).logits[keep], name)
        same_generation(ours, eager, ids, name, attention_mask=mask, max_new_tokens=3,
                        do_sample=False, pad_token_id=0, **kw)


GENERATE_MODES = {
    "beam3": dict(num_beams=3, do_sample=False, max_new_tokens=6),
    "sample-2-sequences": dict(do_sample=True, num_return_sequences=2, top_k=0,
                               max_new_tokens=6),
    "beam-static": dict(num_beams=2, do_sample=False, max_new_tokens=6,
                        cache_implementation="static"),
    "hybrid": dict(do_sample=False, max_new_tokens=6, cache_implementation="hybrid"),
}


@pytest.mark.parametrize("name", list(SLIDING))
def test_generation_modes_over_sliding_caches(name: str) -> None:
    """Windows of 3 over prompts of 2 to 8 tokens and 6 new ones (past the window), left
    padding, batch 3 then 2; beam search reorders the cache, static and hybrid caches'
    sliding layers wrap."""
    ours, eager = sharpened(SLIDING[name](), factor=3.0)
    gen = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for lens in ((8, 3, 6), (7, 2)):
            ids, mask = padded(gen, lens, side="left")
            for mode, kw in GENERATE_MODES.items():
                same_generation(ours, eager, ids, f"{name} {lens} {mode}", attention_mask=mask,
                                pad_token_id=0, **kw)


def test_a_cache_reused_by_a_second_generate_and_assisted_decoding() -> None:
    ours, eager = sharpened(SLIDING["gemma3"](), factor=3.0)
    gen = torch.Generator().manual_seed(9)
    ids, more = (torch.randint(3, VOCAB, (1, n), generator=gen) for n in (6, 4))
    kw = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    with torch.no_grad():
        outs = []
        for model in (ours, eager):
            first = model.generate(ids, max_new_tokens=3, **kw)
            outs.append(model.generate(torch.cat([first.sequences, more], 1),
                                       cache=first.past_key_values, max_new_tokens=4,
                                       output_logits=True, **kw))
        assert torch.equal(outs[0].sequences, outs[1].sequences)
        for a, b in zip(outs[0].logits, outs[1].logits, strict=True):
            close(a, b, "second generate")
        draft_ours, draft_eager = twin_models(SLIDING["gemma3"](), seed=3)
        same_generation(ours, eager, ids, "assisted", max_new_tokens=5, do_sample=False,
                        pad_token_id=0, assistant_model=draft_ours)
        assert torch.equal(ours.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                         assistant_model=draft_eager),
                           eager.generate(ids, max_new_tokens=5, do_sample=False,
                                          pad_token_id=0))


TRAINED: dict[str, tuple[Callable[[], Any], Any, Callable[[torch.Generator], dict]]] = {
    "bert": (lambda: t.BertConfig(**dict(GQA, num_key_value_heads=4),
                                  attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0),
             t.AutoModelForMaskedLM,
             lambda g: dict(zip(("input_ids", "attention_mask"), padded(g, (9, 5, 2))))),
    "vit": (lambda: t.ViTConfig(**VISION), t.AutoModel,
            lambda g: dict(pixel_values=torch.randn(2, 3, 16, 16, generator=g))),
    "bart": (lambda: t.BartConfig(**SEQ2SEQ, dropout=0.0, attention_dropout=0.0),
             t.AutoModelForSeq2SeqLM,
             lambda g: dict(zip(("input_ids", "attention_mask"), padded(g, (9, 5, 2))),
                            labels=torch.randint(3, VOCAB, (3, 6), generator=g))),
    "whisper": (lambda: whisper_config(dropout=0.0, attention_dropout=0.0),
                t.AutoModelForSpeechSeq2Seq,
                lambda g: dict(input_features=torch.randn(2, 8, 32, generator=g),
                               labels=torch.randint(3, VOCAB, (2, 5), generator=g))),
}


def _loss(out: Any, kw: dict) -> torch.Tensor:
    if getattr(out, "loss", None) is not None:
        return out.loss
    hidden = getattr(out, "logits", None)
    hidden = out.last_hidden_state if hidden is None else hidden
    if "attention_mask" in kw:
        hidden = hidden * kw["attention_mask"][..., None]
    return hidden.square().mean()


@pytest.mark.parametrize("name", list(TRAINED))
def test_training_gradients_match_eager_with_and_without_dropout(name: str) -> None:
    """fp32 gradients of every weight in train mode equal eager's: without dropout, and with
    the config's attention dropout at 0.25 under one seed (on the CPU SDPA draws its dropout
    as eager does, one Bernoulli per probability of the same (B, H, Sq, Sk) tensor, so the
    same seed drops the same probabilities). Before, dropout was refused in training."""
    config, auto, inputs = TRAINED[name]
    kw = inputs(torch.Generator().manual_seed(len(name)))
    drop = config()
    for key in ("attention_probs_dropout_prob", "attention_dropout"):
        if hasattr(drop, key):
            setattr(drop, key, 0.25)
    for cfg in (config(), drop):
        ours, eager = sharpened(cfg, auto, factor=3.0)
        grads, outs = [], []
        for model in (ours, eager):
            model = copy.deepcopy(model).train()
            torch.manual_seed(7)
            loss = _loss(model(**kw), kw)
            loss.backward()
            outs.append(loss.detach())
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys() and any("q_proj" in n or "query" in n
                                                          for n in grads[0])
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=0)
        top = max(g.abs().max().item() for g in grads[1].values())  # fp32 noise: ~2e-7 of it
        for n, g in grads[0].items():
            torch.testing.assert_close(g, grads[1][n], atol=5e-6 * top, rtol=1e-5,
                                       msg=f"{name} grad {n}")
    eager = copy.deepcopy(eager).train()
    torch.manual_seed(8)  # and the dropout is real: another seed, other gradients
    _loss(eager(**kw), kw).backward()
    assert any(not torch.allclose(p.grad, grads[1][n], rtol=1e-3, atol=1e-3 * top)
               for n, p in eager.named_parameters() if n in grads[1])


ATTENTION_WEIGHTS: dict[str, tuple[Callable[[], Any], Callable[[], dict]]] = {
    "siglip-vision": (lambda: t.SiglipVisionConfig(**VISION),
                      lambda: dict(pixel_values=torch.randn(2, 3, 16, 16))),
    "clip-vision": (lambda: t.CLIPVisionConfig(**VISION),
                    lambda: dict(pixel_values=torch.randn(2, 3, 16, 16))),
    "vit": (lambda: t.ViTConfig(**VISION), lambda: dict(pixel_values=torch.randn(2, 3, 16, 16))),
    "bart": (lambda: t.BartConfig(**SEQ2SEQ),
             lambda: dict(input_ids=torch.randint(3, VOCAB, (2, 5)),
                          decoder_input_ids=torch.randint(3, VOCAB, (2, 4)))),
    "llama": (lambda: t.LlamaConfig(**GQA),
              lambda: dict(input_ids=torch.randint(3, VOCAB, (2, 5)))),
}


@pytest.mark.parametrize("name", list(ATTENTION_WEIGHTS))
def test_attention_weights_requested_are_refused_never_left_out(name: str) -> None:
    """transformers 5 records attention weights with a hook on each attention module's
    second output and skips None; SigLIP never passes ``output_attentions`` down, so the
    caller got ``attentions=()`` without a word (the others pass it: the same refusal).
    Eager returns one tensor per layer."""
    config, inputs = ATTENTION_WEIGHTS[name]
    ours, eager = twin_models(config(), t.AutoModel)
    kw = inputs()
    with torch.no_grad():
        want = eager(**kw, output_attentions=True)
        weights = getattr(want, "attentions", None) or want.encoder_attentions
        assert len(weights) == 2 and all(w is not None for w in weights)
        with pytest.raises(InputError, match=r"does not return attention weights.*'eager'"):
            ours(**kw, output_attentions=True)
        ours(**kw, output_hidden_states=True)  # other recorded outputs stay served


def test_the_weights_check_traces_under_torch_compile() -> None:
    """Every layer call asks whether weights are recorded; dynamo cannot trace
    ``ContextVar.get``, which broke fullgraph compiles (a graph break per layer otherwise)."""
    from attnhub.integrations.transformers.guards import weights_requested

    step = torch.compile(lambda x: x * 2 + int(weights_requested()), fullgraph=True,
                         backend="eager")
    x = torch.randn(3)
    assert torch.equal(step(x), x * 2)


def test_a_head_mask_is_refused_with_a_fix_that_applies_it() -> None:
    """transformers 5 threads an unknown ``head_mask`` down to the attention function, where
    eager and sdpa drop it: pointing at them would be no fix."""
    ours, _ = twin_models(t.BertConfig(**dict(GQA, num_key_value_heads=4)), t.AutoModel)
    heads = torch.ones(2, 4)
    heads[0, 1] = 0
    with pytest.raises(InputError, match=r"BertSelfAttention \(layer 0\) passes 'head_mask'.*"
                                         r"eager and sdpa ignore it.*output projection"):
        with torch.no_grad():
            ours(input_ids=torch.randint(3, VOCAB, (2, 5)), head_mask=heads)


@pytest.mark.parametrize("config,auto,inputs", [
    (lambda: t.LlamaConfig(**GQA), None, lambda g: padded(g, (7, 4), side="left")),
    (lambda: t.BartConfig(**SEQ2SEQ), t.AutoModelForSeq2SeqLM, lambda g: padded(g, (7, 4))),
], ids=["llama", "bart"])
def test_switching_the_implementation_back_and_forth(hub: Hub, config: Callable[[], Any],
                                                     auto: Any, inputs: Callable) -> None:
    """One model switched attnhub -> eager -> attnhub -> sdpa -> attnhub: every attnhub
    forward is served by the hub again (counted) and equals eager."""
    ours, eager = sharpened(config(), auto, factor=3.0)
    ids, mask = inputs(torch.Generator().manual_seed(61))
    kw: dict[str, Any] = dict(input_ids=ids, attention_mask=mask)
    if auto is not None:
        kw["decoder_input_ids"] = ids[:, :4]
    keep = mask.bool() if auto is None else slice(None)
    served = []
    real = hub.attention

    def counted(*a: Any, **k: Any) -> torch.Tensor:
        served.append(1)
        return real(*a, **k)

    with torch.no_grad():
        want = eager(**kw).logits[keep]
        try:
            hub.attention = counted  # type: ignore[method-assign]
            for impl in ("attnhub", "eager", "attnhub", "sdpa", "attnhub"):
                ours.set_attn_implementation(impl)
                before = len(served)
                close(ours(**kw).logits[keep], want, impl)
                assert (len(served) > before) == (impl == "attnhub"), impl
        finally:
            del hub.attention


@pytest.mark.parametrize("name", ["bart", "whisper", "gemma3"])
def test_bf16_models_match_eager_by_the_flash_attention_rule(name: str) -> None:
    """model.to(bf16): attnhub's logits are as close to fp32 eager's as bf16 eager's are
    (the FlashAttention rule, 3x, on the valid positions)."""
    gen = torch.Generator().manual_seed(67)
    if name == "gemma3":
        ours, eager = sharpened(SLIDING[name](), factor=3.0)
        ids, mask = padded(gen, (8, 3, 6), side="left")
        kw: dict[str, Any] = dict(input_ids=ids, attention_mask=mask)
    elif name == "whisper":
        ours, eager = sharpened(whisper_config(), t.AutoModelForSpeechSeq2Seq, factor=3.0)
        kw = dict(input_features=torch.randn(2, 8, 32, generator=gen),
                  decoder_input_ids=torch.randint(3, VOCAB, (2, 5), generator=gen))
    else:
        ours, eager = sharpened(ENC_DEC[name](), t.AutoModelForSeq2SeqLM, factor=3.0)
        ids, mask = padded(gen, (9, 5, 2))
        kw = dict(input_ids=ids, attention_mask=mask,
                  decoder_input_ids=torch.randint(3, VOCAB, (3, 6), generator=gen))
    keep = mask.bool() if name == "gemma3" else slice(None)
    half = {k: v.bfloat16() if v.is_floating_point() else v for k, v in kw.items()}
    with torch.no_grad():
        ref = eager(**kw).logits[keep].double()
        low = eager.to(torch.bfloat16)(**half).logits[keep]
        got = ours.to(torch.bfloat16)(**half).logits[keep]
    assert got.dtype == torch.bfloat16
    assert_fa_rule(got.double(), ref, low.double(), mult=3.0, atol=2e-3, what=f"{name} bf16")
