"""The FlexAttention signatures of ``score_mod`` / ``mask_mod`` callables.

A callable of the wrong arity is the caller's (or a plugin's) mistake: it is refused where it
enters (a call's slow path, a plugin's variant registration), naming it and the signature,
never left to raise a TypeError inside a backend (a backend failure, retried on fallbacks).
Any callable counts: functions, lambdas with defaults or ``*args``, ``functools.partial``,
bound methods, objects with ``__call__``. ``shape_key`` is what decides that check, cheaply,
so the hub's exact-shape table never lets a callable skip it behind another of one name.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Hashable
from typing import Any

#: slot -> (positional arguments, the signature a message shows)
SIGNATURES = {"score_mod": (5, "(score, b, h, q_idx, kv_idx) -> score"),
              "mask_mod": (4, "(b, h, q_idx, kv_idx) -> bool")}

_VARARGS = inspect.CO_VARARGS


def describe(fn: Any) -> str:
    """A callable's name for messages: ``partial(f)``, ``Obj.method``, ``<lambda>``."""
    if isinstance(fn, functools.partial):
        return f"partial({describe(fn.func)})"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) else f"{type(fn).__name__} object"


def arity_error(slot: str, fn: Any, variant: str | None = None) -> str | None:
    """Why ``fn`` cannot serve as ``slot`` (its positional arity), or None. A callable whose
    signature cannot be read (a builtin) runs as given."""
    if fn is None:
        return None
    n, form = SIGNATURES[slot]
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*range(n))
        return None
    except TypeError:
        pass
    other = "mask_mod" if slot == "score_mod" else "score_mod"
    what = f"variant {variant!r} ({slot} {describe(fn)})" if variant else \
        f"{slot}={describe(fn)!r}"
    hint = (f"; if it is a {other}, pass it as {other}="
            if _binds(sig, SIGNATURES[other][0]) else "")
    return (f"{what} takes {sig}, not the {n} positional arguments of a {slot} {form}"
            f"{hint}")


def _binds(sig: inspect.Signature, n: int) -> bool:
    try:
        sig.bind(*range(n))
        return True
    except TypeError:
        return False


def shape_key(fn: Any) -> Hashable:
    """What ``arity_error`` depends on, read without ``inspect`` (per call on the hot path):
    equal keys give equal verdicts. Code counts for functions (methods and partials around
    them), the class for objects with a Python ``__call__``, the object itself otherwise."""
    t = fn.__class__
    if t is types.FunctionType:
        code = fn.__code__
        return (code.co_argcount, code.co_flags & _VARARGS, len(fn.__defaults__ or ()),
                code.co_kwonlyargcount - len(fn.__kwdefaults__ or ()))
    if t is types.MethodType:
        return ("method", shape_key(fn.__func__))
    if t is functools.partial:
        inner = fn.func
        names = inner.__code__.co_varnames if inner.__class__ is types.FunctionType else None
        return ("partial", shape_key(inner), names, len(fn.args), tuple(fn.keywords))
    if isinstance(getattr(t, "__call__", None), types.FunctionType):
        return ("object", t)
    try:
        hash(fn)
    except TypeError:
        return ("unkeyed", object())  # never equal: every call takes the slow path's check
    return ("callable", fn)
