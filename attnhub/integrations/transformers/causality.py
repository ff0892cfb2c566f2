"""Whether a transformers attention layer's calls are causal, read before any call.

``bind_model`` plans each layer ahead of its calls, and the attention function decides
causality from what the call brings (``attention_forward``): a bidirectional mask (explicit,
or the all-True one ``sdpa_mask_marked`` returns for a skipped one) means every key, else the
call's ``is_causal`` keyword, else the module's ``is_causal``. The module's flag alone is not
the truth: Phi-4-multimodal's vision attention says True under a bidirectional mask builder,
CLIP's text attention says False and is called with ``is_causal=True``. So the plan reads the
same three sources from the code that will make the call: the mask builders of the model
owning the layer, and literal ``is_causal=`` keywords in the forwards between that model and
the layer. Where the code does not say (a keyword computed at run time, a model that builds
both kinds of mask, as BERT does by ``is_decoder``), the module's flag stands, as in the call.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch

#: ``masking_utils`` builders whose masks let every query see every (unpadded) key.
BIDIRECTIONAL = frozenset({"create_bidirectional_mask", "create_bidirectional_sliding_window_mask"})
#: Those whose masks are causal: a model calling one of these decides per call, not per model.
CAUSAL = frozenset({"create_causal_mask", "create_sliding_window_causal_mask",
                    "create_chunked_causal_mask", "create_masks_for_generate"})


def call_causal(model: torch.nn.Module, path: str, module: torch.nn.Module) -> bool:
    """Whether the attention function computes causal attention for ``module`` (at ``path``
    in ``model``) on an unpadded call, as ``attention_forward`` will decide it."""
    chain = _owners(model, path)  # the layer, then its enclosing modules up to its model
    builder = next((b for b in map(_builders, (type(m) for m in chain)) if b), None)
    if builder is not None and builder <= BIDIRECTIONAL:
        return False
    for m in chain:
        said = _literal_is_causal(type(m))
        if said is not None:
            return said
    return bool(getattr(module, "is_causal", False))


def _owners(model: torch.nn.Module, path: str) -> list[torch.nn.Module]:
    """``path``'s module and its ancestors, nearest first, up to the nearest transformers
    ``PreTrainedModel`` (the sub-model whose forward builds the layer's masks)."""
    from transformers import PreTrainedModel

    parts = path.split(".") if path else []
    chain = [model.get_submodule(".".join(parts[:n])) for n in range(len(parts), -1, -1)]
    for i, m in enumerate(chain[1:], 1):
        if isinstance(m, PreTrainedModel):
            return chain[:i + 1]
    return chain


def _calls(fn: object) -> list[ast.Call]:
    """Every call in ``fn``'s source (a class or a function); none where it has no source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return []
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


@functools.cache
def _builders(cls: type) -> frozenset[str]:
    """The ``masking_utils`` mask builders the methods of ``cls`` and of the transformers
    model classes it derives from call."""
    names = set()
    mine = [k for k in cls.__mro__ if k.__module__.startswith("transformers.models.")]
    for call in (c for k in mine or [cls] for c in _calls(k)):
        f = call.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in BIDIRECTIONAL | CAUSAL:
            names.add(name)
    return frozenset(names)


@functools.cache
def _literal_is_causal(cls: type) -> bool | None:
    """The ``is_causal=True/False`` keyword ``cls.forward`` passes on, when it passes one
    constant (None: none, or several that depend on the call)."""
    forward = getattr(cls, "forward", None)
    said = {kw.value.value for call in (_calls(forward) if forward else [])
            for kw in call.keywords
            if kw.arg == "is_causal" and isinstance(kw.value, ast.Constant)
            and isinstance(kw.value.value, bool)}
    return said.pop() if len(said) == 1 else None
