"""What the kit checks around a backend call rather than in its result: that the call leaves
its inputs alone and returns a tensor of its own, and that it returns at all (a per-case time
limit, so that one hanging kernel cannot stall a whole check-plugin run)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch

from ..core.bounded import Stalled, bounded

T = TypeVar("T")


class InputsWritten(Exception):
    """The backend changed a tensor it was given, or returned one that shares its memory."""


def named_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: object
                 ) -> dict[str, torch.Tensor]:
    """q, k, v and every tensor field of ``params`` (cu_seqlens, block_table, slopes...)."""
    out = {"q": q, "k": k, "v": v}
    for f in dataclasses.fields(params):  # type: ignore[arg-type]
        val = getattr(params, f.name)
        if isinstance(val, torch.Tensor):
            out[f"params.{f.name}"] = val
    return out


def snapshot(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in inputs.items()}


def fields_of(params: object) -> dict[str, object]:
    """Every field of ``params`` as it is now (tensors by identity: their values are in the
    snapshot)."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}  # type: ignore


def check_fields(params: object, before: dict[str, object]) -> None:
    """Raise :class:`InputsWritten` when the call reassigned a field of the caller's params."""
    for name, old in before.items():
        new = getattr(params, name)
        same = new is old if isinstance(old, torch.Tensor) or callable(old) else new == old
        if not same:
            raise InputsWritten(f"changed params.{name} ({old!r:.40} -> {new!r:.40}); the "
                                "params belong to the caller (use dataclasses.replace)")


def check_untouched(inputs: dict[str, torch.Tensor], before: dict[str, torch.Tensor],
                    out: torch.Tensor) -> None:
    """Raise :class:`InputsWritten` naming the first input the call wrote into or aliased."""
    for name, t in inputs.items():
        if not torch.equal(t.detach(), before[name]):
            n = int((t.detach() != before[name]).sum())
            raise InputsWritten(f"wrote into its input {name} ({n} values changed); a backend "
                                "must not modify q, k, v or the params' tensors (work on a copy)")
    ptr = out.untyped_storage().data_ptr()
    for name, t in inputs.items():
        if t.numel() and out.numel() and t.untyped_storage().data_ptr() == ptr:
            raise InputsWritten(f"output shares memory with input {name}; return a new tensor")


class Hung(Exception):
    """The call did not return within the per-case limit (it is left running)."""


def within(limit_s: float | None, fn: Callable[[], T]) -> T:
    """``fn()``, or :class:`Hung` after ``limit_s`` seconds (``core.bounded``: the hung call
    keeps running in a daemon thread; the caller must not call the same backend again)."""
    try:
        return bounded(fn, limit_s, name="attnhub-kit-case")
    except Stalled:
        raise Hung(f"no result after {limit_s:g}s (per-case limit): the call may hang; it is "
                   "left running and this backend's remaining cases are not run") from None