"""What one call of the attention function may carry besides q, k, v and the mask: keyword
arguments that would change the answer are refused (never ignored), and packed documents
(``cu_seq_lens``) must be kept apart by the mask, which is all attnhub reads."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import InputError
from .masks import DenseMask, proof


def where(module: torch.nn.Module) -> str:
    """The layer named in an error: its class and index (encoders' layers often have none)."""
    idx = getattr(module, "layer_idx", None)
    return type(module).__name__ + ("" if idx is None else f" (layer {idx})")


#: Keyword arguments that never change what attention computes: bookkeeping that transformers
#: threads through every layer (``TransformersKwargs``) and flash-only hints (padding-free
#: ``cu_seq_lens_*``: ``check_documents`` makes sure the mask keeps those documents apart).
#: Anything else with a value is refused: models hand implementations other than eager/sdpa
#: what those two fold into the mask or the scores (DeepSeek-V3.2's sparse ``indices``,
#: ``position_bias``), and ignoring it would be a silent wrong answer. (Sinks, ``s_aux`` or
#: ``sinks``, are taken out before this check and applied.) ``logits_to_keep`` is
#: generate()'s, leaked into the layers by some models (GOT-OCR2).
HARMLESS = frozenset({
    "position_ids", "use_cache", "output_hidden_states", "output_router_logits",
    "num_items_in_batch", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    "seq_idx", "deterministic", "return_dict", "cache_position", "logits_to_keep",
    # the causal-LM loss's options and an extra output (Gemma 4's shared K/V for an
    # assistant model): carried down to every layer in **kwargs, read by none of them
    "ignore_index", "shift_labels", "return_shared_kv_states",
    # tokenizer outputs a caller may pass on to forward(); the decoder layers hand them to
    # the attention function, which eager and sdpa ignore (masks are built from
    # attention_mask, and token types, where a model uses them, before any layer)
    "token_type_ids", "special_tokens_mask", "length", "offset_mapping",
    "overflow_to_sample_mapping"})

#: What the refused keywords known to models mean, for the error.
_MEANING = {"position_bias": "a learned position bias",
            "indices": "sparse attention indices (DSA)",
            "block_indices": "sparse attention block indices",
            "head_mask": "a per-head mask"}

#: Where eager and sdpa would drop the keyword silently too, pointing at them is no fix.
_FIX = {"head_mask": "transformers 5 no longer applies head_mask (eager and sdpa ignore it): "
                     "drop it, or zero those heads' columns of the output projection"}


def _weights_collector() -> Any:
    """transformers' output recorder (5.x, ``utils.output_capturing``): ``output_attentions``
    is read by ``@capture_outputs`` and recorded by a hook on each attention module's second
    output, which skips ``None``; models such as SigLIP never pass the flag down, so the
    attention function would not see it and the caller got an empty ``attentions`` tuple."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # older transformers pass output_attentions to the function
        return None
    return _active_collector


_COLLECTOR = _weights_collector()


def weights_requested() -> bool:
    """Whether the forward running now records attention weights (``output_attentions`` or
    the config's, for self- or cross-attention). Under torch.compile, which cannot trace
    ``ContextVar.get``, the collector transformers keeps in a plain attribute while compiling
    (none when the recording forward itself is not compiled)."""
    c = _COLLECTOR
    if c is None:
        return False
    if torch.compiler.is_compiling():
        wanted = getattr(c, "global_var", None) if getattr(c, "compiling", False) else None
    else:
        wanted = c.get()
    return bool(wanted) and any("attentions" in key for key in wanted)


def refuse_unsupported(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise for attention weights requested (the keyword or transformers' recorder) or any
    keyword with a value outside ``HARMLESS``; called only when the fast test failed."""
    at = where(module)
    if kwargs.get("output_attentions") or weights_requested():
        raise InputError(f"{at}: attnhub does not return attention weights; use "
                         "attn_implementation='eager' for output_attentions=True")
    for name, value in kwargs.items():
        if name in HARMLESS or name == "output_attentions" or value is None:
            continue
        what = _MEANING.get(name, "an argument attnhub does not know")
        fix = _FIX.get(name, "use attn_implementation='eager' or 'sdpa' for this model")
        raise InputError(f"{at} passes {name!r} ({what}) to its attention function; "
                         f"attnhub's transformers integration would ignore it and compute "
                         f"another attention: {fix}")


def check_documents(module: torch.nn.Module, cu_seqlens: Any, dense: Any, sq: int,
                     sk: int) -> None:
    """Padding-free batches (``DataCollatorWithFlattening``) hand every layer ``cu_seq_lens``;
    attnhub, like eager and sdpa, reads the documents from the mask alone, which transformers
    builds from ``position_ids`` restarting per document, and only without a cache. Refuse
    several documents unless the mask keeps every pair of them apart (checked once per mask
    and offsets: the layers of a forward share both)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.numel() <= 2:
        return
    stamp = (id(cu_seqlens), proof(cu_seqlens))
    if isinstance(dense, DenseMask) and dense.documents == stamp:
        return
    docs, at = cu_seqlens.numel() - 1, where(module)
    fix = ("pass position_ids restarting at 0 per document and use_cache=False (transformers "
           "builds the packed mask only without a cache), or run the documents as a padded "
           "batch; if you did, this model's forward does not hand position_ids to its mask "
           "builder (GPT-OSS in transformers 5.25: eager then attends across the documents "
           "too), so run them as a padded batch")
    if not isinstance(dense, DenseMask):
        raise InputError(f"{at}: cu_seq_lens_q holds {docs} packed documents but the mask "
                         f"transformers built does not separate them (attnhub, like eager "
                         f"and sdpa, reads the mask, not cu_seq_lens): {fix}")
    cu = cu_seqlens.to(device=dense.allowed.device, dtype=torch.long)
    if sq != sk or int(cu[-1]) != sq:
        raise InputError(f"{at}: cu_seq_lens_q covers {int(cu[-1])} tokens but the call has "
                         f"{sq} queries and {sk} keys: padding-free offsets fit one row "
                         "without a cache")
    doc = torch.repeat_interleave(torch.arange(docs, device=cu.device), cu.diff())
    if bool((dense.allowed & (doc.view(-1, 1) != doc.view(1, -1))).any()):
        raise InputError(f"{at}: cu_seq_lens_q holds {docs} packed documents but the mask "
                         f"lets them attend to each other: {fix}")
    dense.documents = stamp
