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
