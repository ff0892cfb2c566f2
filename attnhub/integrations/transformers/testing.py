"""Test helpers for the transformers integration: one set of random weights under two
attention implementations, and tiny-model runs on one intra-op thread."""

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
