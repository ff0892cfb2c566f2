"""Models that cut their queries after building the masks: Gemma 4's KV-shared layers keep
only the last ``logits_to_keep`` queries (``_maybe_slice_kv_shared_inputs``).

A mask that ``sdpa_mask`` skipped (no padding: SDPA's ``is_causal`` does it) stays skipped
when the queries are cut, so the cut queries reach attention with no mask and nothing says
where they sit: after the first keys (a dynamic cache), or before unwritten slots (a static
cache, whose length the keys do not show). transformers keeps the whole sequence for sdpa in
exactly those cases (``logits_to_keep > 1`` or a static cache, with a skipped mask); the
attnhub names get the same, found by the parameters the hook takes. Where it cannot be read
(another signature), the call is refused rather than answered wrong.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Collection
from typing import Any

from ...errors import InputError

HOOK = "_maybe_slice_kv_shared_inputs"
#: The hook's parameters attnhub reads, as transformers 5 names them (Gemma 4 and Gemma 4
#: unified; the other parameters and the returned tuple differ between them).
PARAMS = ("causal_mask_mapping", "logits_to_keep", "cache")


def keep_whole_sequences(names: Collection[str]) -> None:
    """Wrap the hook of every loaded transformers model class that defines it (once)."""
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("transformers.models.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            hook = obj.__dict__.get(HOOK) if isinstance(obj, type) else None
            if callable(hook) and not getattr(hook, "_attnhub", False):
                setattr(obj, HOOK, _as_for_sdpa(hook, names))


def _as_for_sdpa(original: Callable[..., Any], names: Collection[str]) -> Callable[..., Any]:
    sig = inspect.signature(original)
    readable = all(p in sig.parameters for p in PARAMS)

    @functools.wraps(original)
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(getattr(self, "config", None), "_attn_implementation", None) not in names:
            return original(self, *args, **kwargs)
        if not readable:
            raise InputError(
                f"{type(self).__name__}.{HOOK} has parameters {list(sig.parameters)}, without "
                f"the {list(PARAMS)} attnhub reads to keep the whole sequence where a skipped "
                "mask would leave the cut queries unplaced; use attn_implementation='sdpa' "
                "or a transformers release attnhub supports")
        bound = sig.bind(self, *args, **kwargs)
        a = bound.arguments
        keep, masks = a["logits_to_keep"], a["causal_mask_mapping"]
        if (isinstance(keep, int) and (keep > 1 or getattr(a["cache"], "is_compileable", False))
                and isinstance(masks, dict) and any(m is None for m in masks.values())):
            a["logits_to_keep"] = 0  # the hook's own "keep all": slice(-0, None)
        return original(*bound.args, **bound.kwargs)

    hook._attnhub = True  # type: ignore[attr-defined]
    return hook
