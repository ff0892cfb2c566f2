"""Test helpers for the transformers integration: one set of random weights under two
attention implementations (optionally sharpened), padded batches, generate() under both, and
tiny-model runs on one intra-op thread."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch


def twin_models(cfg: Any, auto: Any = None, other: str = "eager",
                seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(model with ``attn_implementation="attnhub"``, the same weights under ``other``), both
    in eval mode. Configs are copied: ``from_config`` keeps the object it is given."""
    if auto is None:
        from transformers import AutoModelForCausalLM as auto
    torch.manual_seed(seed)
    ours = auto.from_config(copy.deepcopy(cfg), attn_implementation="attnhub").eval()
    twin = auto.from_config(copy.deepcopy(cfg), attn_implementation=other).eval()
    twin.load_state_dict(ours.state_dict())
    return ours, twin


@contextlib.contextmanager
def one_intraop_thread() -> Iterator[None]:
    """Tiny models on a busy CPU: a second intra-op thread only spins (0.8 s vs 5 ms for a
    2-layer forward measured on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sharpened(cfg: Any, auto: Any = None, factor: float = 8.0
              ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``twin_models`` with every matrix scaled by ``factor``: tiny random models attend
    almost uniformly, where a lost mask or key hardly moves the output."""
    ours, twin = twin_models(cfg, auto)
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() >= 2:
                p.mul_(factor)
    twin.load_state_dict(ours.state_dict())
    return ours, twin


def padded(gen: torch.Generator, lens: tuple[int, ...], vocab: int, side: str = "right"
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids from 3 up, 0/1 attention mask) for rows of ``lens`` real tokens."""
    width = max(lens)
    ids = torch.randint(3, vocab, (len(lens), width), generator=gen)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        mask[i, width - n:] = 1
    return ids, (mask if side == "left" else mask.flip(1))


def same_generation(ours: torch.nn.Module, other: torch.nn.Module, inputs: Any, what: str,
                    atol: float = 2e-4, **kw: Any) -> None:
    """generate() under both with one seed: the same tokens and every step's logits close."""
    outs = []
    for model in (ours, other):
        torch.manual_seed(5)
        outs.append(model.generate(inputs, output_logits=True, return_dict_in_generate=True,
                                   **kw))
    got, want = outs
    assert torch.equal(got.sequences, want.sequences), what
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=1e-4,
                                   msg=f"{what} step {step}")


def close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 2e-4) -> None:
    """Logits or hidden states of attnhub's model against eager's, compared in fp32."""
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=1e-4, msg=what)


#: What ``tiny_config`` sets wherever a config has the field: 2 layers, 4/2 heads of 8, a
#: small vocabulary and MoE, a window of 6.
TINY = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            head_dim=8, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            num_experts=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=6,
            tie_word_embeddings=False)


def tiny_config(model_type: str) -> Any:
    """A random 2-layer config of transformers' ``model_type`` (``TINY``), or None where this
    transformers lacks it; hybrid models keep one linear or recurrent layer and one
    full-attention layer."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return None
    cfg = CONFIG_MAPPING[model_type]()
    for name, value in TINY.items():
        if hasattr(cfg, name):
            # a read-only property (Falcon's head_dim, hidden_size / heads) follows the
            # sizes set beside it: setting it raised, and the family could not be built
            with contextlib.suppress(AttributeError):
                setattr(cfg, name, value)
    kinds = getattr(cfg, "layer_types", None)
    if isinstance(kinds, list) and any("linear" in k or "mamba" in k for k in kinds):
        with contextlib.suppress(AttributeError):  # read-only in some configs (Bamba)
            cfg.layer_types = ([k for k in kinds if "linear" in k or "mamba" in k][:1]
                               + [k for k in kinds if "attention" in k and "linear" not in k][:1])
    return cfg


def matches_eager(ours: torch.nn.Module, other: torch.nn.Module, vocab: int, what: str,
                  atol: float = 2e-4) -> None:
    """A causal LM under attnhub against the same weights under ``other``: logits of a
    left-padded batch (valid positions), greedy generate() from it, and every parameter's
    gradient of a loss over a right-padded batch (labels -100 at the pads: left padding's
    fully masked rows are 0 here and an average in eager, docs/transformers.md)."""
    ids, mask = padded(torch.Generator().manual_seed(0), (9, 6), vocab, side="left")
    keep = mask.bool()
    with torch.no_grad():
        close(ours(input_ids=ids, attention_mask=mask).logits[keep],
              other(input_ids=ids, attention_mask=mask).logits[keep], f"{what} logits", atol)
    same_generation(ours, other, ids, f"{what} generate", atol=atol, attention_mask=mask,
                    max_new_tokens=5, do_sample=False, pad_token_id=0)
    ids, mask = padded(torch.Generator().manual_seed(2), (9, 6), vocab, side="right")
    labels = ids.masked_fill(~mask.bool(), -100)
    for model in (ours, other):
        model.train()
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        model.eval()
    for (name, p), (_, p2) in zip(ours.named_parameters(), other.named_parameters()):
        if p2.grad is not None:
            close(p.grad, p2.grad, f"{what} grad {name}", atol=atol / 2)
