"""The ring's handshake: before the first hop every rank learns what every other rank holds.

Point-to-point hops only work when both sides agree on every message: a rank with another
batch, head count, head dim or dtype sends a message of another size (gloo aborts the
process, NCCL hangs) or of the same size and another meaning (fp16 read as bf16: a silently
wrong answer), and a rank that builds no backward leaves the others waiting in theirs. So
each call starts with one small all-gather of a fixed-size header (the shard lengths the ring
needs anyway, plus the call's geometry and flags) and every rank checks it the same way:

- a rank that cannot run the call (its inputs or local kernel were refused) says so in its
  header, the ranks exchange the reasons and *every* rank raises, naming that rank;
- headers that differ raise on every rank, naming the field and each rank's value;
- otherwise the shard lengths rebuild the global layout (varlen: a second all-gather of the
  per-document lengths once their count agrees).

It is the all-gather the ring made before for the lengths alone (same cost; ``thd`` with
several documents pays a second tiny one). With ``global_seqlens`` the ring runs it only when
a call differs from the last one of its geometry that the ranks agreed on (ring.py: repeats
need no handshake; each pass still ends with its status check). The price: a rank whose
inputs change alone, while the others repeat that call, waits in a handshake they skip, and
both sides fail only at the process group's timeout (with a RingError that says why, and on
that rank, what it changed).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Protocol

import torch

from .block_kernels import BLOCK_BACKWARDS
from .comm import RingError
from .sharding import SHARDINGS

#: What every rank must pass alike (only its shard of the sequence differs), header order.
FIELDS = ("layout", "batch", "query heads", "key/value heads", "head dim", "value head dim",
          "q dtype", "k dtype", "v dtype", "device type", "causal", "softcap", "scale",
          "gradients", "global_seqlens", "sharding", "block backward")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_DEVICES = ("cpu", "cuda")
_LAYOUTS = ("bshd", "thd")
#: ``block_backward`` choices: alike on every rank (a forced kernel raises where it cannot
#: serve; a rank that ran another kernel meanwhile would wait in its hops)
BLOCK_CHOICES = ("auto", *BLOCK_BACKWARDS)
#: bytes of a refusal's reason passed to the other ranks (longer ones are cut)
REASON_BYTES = 1024


class Gatherer(Protocol):
    """The collective side of a transport (:class:`attnhub_ring.comm.Ring`)."""

    rank: int
    world: int

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...


def fields(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, thd: bool, causal: bool,
           scale: float, softcap: float | None,
           global_seqlens: tuple[int, ...] | None = None, sharding: str = "zigzag",
           block_backward: str = "auto") -> list[int]:
    """This rank's header values, in :data:`FIELDS` order (all int64); ``global_seqlens``
    (when the caller gave them) enter as a checksum."""
    def code(x: object, known: Sequence[object]) -> int:
        return known.index(x) if x in known else len(known)

    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return [code("thd" if thd else "bshd", _LAYOUTS), 0 if thd else q.shape[0], q.shape[-2],
            k.shape[-2], q.shape[-1], v.shape[-1], code(q.dtype, _DTYPES),
            code(k.dtype, _DTYPES), code(v.dtype, _DTYPES), code(q.device.type, _DEVICES),
            int(bool(causal)), _bits(softcap or 0.0), _bits(scale), int(grad),
            0 if global_seqlens is None else zlib.crc32(repr(global_seqlens).encode()) + 1,
            code(sharding, SHARDINGS), code(block_backward, BLOCK_CHOICES)]


def agree(ring: Gatherer, problem: str | None, values: list[int] | None, lens: list[int],
          device: torch.device) -> list[list[int]]:
    """Every rank's ``lens`` (rank order) once every rank agrees on ``values``; else raise the
    same :class:`RingError` on every rank. ``problem`` is why this rank cannot run the call
    (``values`` may then be None: zeros are sent)."""
    values = [0] * len(FIELDS) if problem is not None or values is None else values
    first = lens[0] if len(lens) == 1 else 0
    head = torch.tensor([int(problem is not None), len(lens), first, *values],
                        dtype=torch.int64, device=device)
    heads = [t.tolist() for t in ring.all_gather(head)]
    failed = [r for r, h in enumerate(heads) if h[0]]
    if failed:
        reasons = exchange_reasons(ring, problem or "", device)
        if problem is not None:
            raise RingError(problem)
        raise RingError("ring: " + "; ".join(
            f"rank {r} of {ring.world} cannot run this call ({reasons[r]})" for r in failed)
            + "; no rank runs it")
    diffs = [_describe(name, [h[3 + i] for h in heads])
             for i, name in enumerate(FIELDS) if len({h[3 + i] for h in heads}) > 1]
    counts = [h[1] for h in heads]
    if len(set(counts)) > 1:
        diffs.append("sequences (documents): " + ", ".join(
            f"rank {r}: {n}" for r, n in enumerate(counts)))
    if diffs:
        grad = any(d.startswith("gradients") for d in diffs)
        raise RingError(
            f"ring: the {ring.world} ranks disagree on " + "; ".join(diffs) + ". Every rank "
            "must pass the same batch, heads, head dims, dtypes, device type, mask, scale, "
            "sharding, block_backward and global_seqlens (only its shard of the sequence "
            "differs)"
            + (", and all or none must need gradients (the ring's backward is collective: "
               "requires_grad on q, k or v, under grad mode, on every rank alike)"
               if grad else ""))
    if counts[0] == 1:
        return [[h[2]] for h in heads]
    if counts[0] == 0:
        return [[] for _ in heads]
    mine = torch.tensor(lens, dtype=torch.int64, device=device)
    return [t.tolist() for t in ring.all_gather(mine)]


def exchange_reasons(ring: Gatherer, problem: str, device: torch.device) -> list[str]:
    """Every rank's ``problem`` (empty where it has none), cut to :data:`REASON_BYTES`: a
    refused handshake's reasons, or the failures of a drained ring (ring.py)."""
    raw = problem.encode("utf-8", "replace")[:REASON_BYTES]
    buf = torch.zeros(REASON_BYTES, dtype=torch.uint8, device=device)
    buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    return [bytes(t.tolist()).rstrip(b"\0").decode("utf-8", "replace")
            for t in ring.all_gather(buf)]


def _describe(name: str, values: list[int]) -> str:
    return f"{name}: " + ", ".join(f"rank {r}: {_show(name, x)}" for r, x in enumerate(values))


def changes(before: list[int], after: list[int]) -> list[str]:
    """The header fields that differ between two calls of one rank, ``name: old -> new``."""
    return [f"{name}: {_show(name, a)} -> {_show(name, b)}"
            for name, a, b in zip(FIELDS, before, after) if a != b]


def _show(name: str, x: int) -> str:
    if name in ("q dtype", "k dtype", "v dtype"):
        return str(_DTYPES[x]).removeprefix("torch.") if x < len(_DTYPES) else "other"
    if name == "device type":
        return _DEVICES[x] if x < len(_DEVICES) else "other"
    if name == "layout":
        return _LAYOUTS[x]
    if name == "sharding":
        return SHARDINGS[x] if x < len(SHARDINGS) else "other"
    if name == "block backward":
        return BLOCK_CHOICES[x] if x < len(BLOCK_CHOICES) else "other"
    if name in ("scale", "softcap"):
        return f"{_float(x):g}" if x else "none"
    if name == "global_seqlens":
        return f"checksum {x:#x}" if x else "not given"
    if name in ("causal", "gradients"):
        return "yes" if x else "no"
    return str(x)


def _bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def _float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])
