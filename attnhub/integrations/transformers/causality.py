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
both kinds of mask, as BERT does by ``is_decoder``, source that cannot be read), the module's
flag stands, as in the call. The code read is each class's methods as the class resolves
them (an override hides its base's), from transformers' model packages and from classes of
no library (remote code, a user's subclass), one function at a time, cached per class and
per function: a model's bind reads each of its classes once.
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


#: Where a class's methods are library machinery, not model code: torch's ``nn.Module``,
#: transformers' ``PreTrainedModel`` and ``GenerationMixin`` (which calls a causal builder
#: for every model), Python's own classes.
_MACHINERY = frozenset({"torch", "transformers", "builtins", "abc", "typing"})


def _model_code(k: type) -> bool:
    """Whether ``k``'s methods are a model's code: transformers' model packages, or a class
    of no library (a model's remote code, a user's subclass)."""
    module = getattr(k, "__module__", None) or ""
    return module.startswith("transformers.models.") or module.split(".")[0] not in _MACHINERY


def _methods(cls: type) -> list[object]:
    """The functions ``cls`` runs from model code, each as the class resolves its name: an
    override hides the method it replaces (a subclass's ``forward`` building another mask)."""
    out = []
    for name in dict.fromkeys(n for k in cls.__mro__ if _model_code(k) for n in vars(k)):
        try:
            f = inspect.getattr_static(cls, name)
        except AttributeError:
            continue
        f = getattr(f, "__func__", f)  # staticmethod, classmethod
        if inspect.isfunction(f):
            out.append(f)
    return out


def _tree(fn: object) -> ast.AST | None:
    """``fn``'s syntax tree, or None where its source cannot be read: defined in a REPL or by
    ``exec``, compiled, or a file edited since the import (``inspect`` then raises what it
    meets: ``OSError``, ``TypeError``, ``tokenize.TokenError``, ``SyntaxError``, ...)."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))  # type: ignore[arg-type]
    except Exception:  # the plan reads what the code says; unreadable code says nothing
        return None


@functools.cache
def _named_builders(fn: object) -> frozenset[str]:
    """The mask builders ``fn`` names: called, or chosen first and called through a variable
    (``mask_function = create_causal_mask if ... else create_bidirectional_mask``)."""
    tree = _tree(fn)
    names = set()
    for n in ast.walk(tree) if tree else ():
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
    return frozenset(names & (BIDIRECTIONAL | CAUSAL))


@functools.cache
def _builders(cls: type) -> frozenset[str]:
    """The ``masking_utils`` mask builders the methods ``cls`` runs name (``_methods``)."""
    return frozenset().union(*map(_named_builders, _methods(cls)))


@functools.cache
def _literal_is_causal(cls: type) -> bool | None:
    """The ``is_causal=True/False`` keyword ``cls.forward`` passes on, when it passes one
    constant (None: none, or several that depend on the call)."""
    forward = getattr(cls, "forward", None)
    tree = _tree(forward) if inspect.isfunction(forward) else None
    said = {kw.value.value for call in (ast.walk(tree) if tree else ())
            if isinstance(call, ast.Call) for kw in call.keywords
            if kw.arg == "is_causal" and isinstance(kw.value, ast.Constant)
            and isinstance(kw.value.value, bool)}
    return said.pop() if len(said) == 1 else None
