"""Scratch buffers that kernels use within one call and that can be reused by the next.

A buffer is reused only where two uses can never overlap: one buffer per (thread, device,
stream). Work on one stream runs in order, so a call's kernels finish with the buffer
before the next call's kernels on that stream touch it; a thread of its own keeps two
threads that share a stream from interleaving their launches over one buffer; and when a
buffer grows, the old one goes back to torch's caching allocator, which only hands it out
again to work queued after it on the same stream. While a CUDA graph is being captured
nothing is taken from or put into the cache: the buffers of a captured call are fresh, owned
by the graph's memory pool, so replays never share them with eager calls.

Callers never return these buffers to their own callers (outputs are always fresh tensors).
A buffer lives as long as its thread, at the size of the largest request so far.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

# torch.cuda.is_current_stream_capturing without its Python frame (a hot path); asked only
# for CUDA tensors (a CPU build's stand-in raises when called)
from torch._C import _cuda_isCurrentStreamCapturing as _stream_capturing

_tls = threading.local()


class _Entry:
    """One thread's buffers on one (device, stream)."""

    __slots__ = ("buf", "counters")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None


def _entry(device: torch.device, stream: int) -> _Entry:
    """This thread's entry for ``device`` and ``stream``."""
    table: dict[tuple[torch.device, int], _Entry] | None = getattr(_tls, "table", None)
    if table is None:
        table = _tls.table = {}
    key = (device, stream)
    entry = table.get(key)
    if entry is None:
        entry = table[key] = _Entry()
    return entry


def capturing(cuda: bool) -> bool:
    """Whether the current stream of the current device is capturing a CUDA graph, for
    buffers on a CUDA device (``cuda``: the caller knows it; ``torch.device.type`` formats a
    string on every read)."""
    return cuda and _stream_capturing()


def fp32(device: torch.device, stream: int, sizes: tuple[int, ...],
         cuda: bool) -> tuple[torch.Tensor, ...]:
    """For one call's kernels on ``stream`` (the raw handle of the current stream of
    ``device``, the current device; 0 off CUDA; ``cuda``: whether ``device`` is a CUDA
    device): flat fp32 buffers of ``sizes`` elements, each 16-byte aligned, none
    overlapping another, contents undefined."""
    if capturing(cuda):
        return tuple(torch.empty(n, dtype=torch.float32, device=device) for n in sizes)
    # this thread's views by (device, stream, sizes): one lookup per call
    views: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] | None = getattr(_tls, "views", None)
    if views is None:
        views = _tls.views = {}
    key = (device, stream, sizes)
    hit = views.get(key)
    if hit is not None:
        return hit
    starts = []
    need = 0
    for n in sizes:
        starts.append(need)
        need += -(-n // 4) * 4  # the next view starts 16-byte aligned
    entry = _entry(device, stream)
    if entry.buf is None or entry.buf.numel() < need:
        entry.buf = torch.empty(need, dtype=torch.float32, device=device)
        views.clear()  # views of the old buffer (others are just made again)
    elif len(views) >= 256:
        views.clear()  # bounded: with many shapes, views are just made again
    buf = entry.buf
    made = views[key] = tuple(buf[a: a + n] for a, n in zip(starts, sizes))
    return made


def zeroed_counters(device: torch.device, stream: int, n: int, cuda: bool) -> torch.Tensor:
    """At least ``n`` int32 zeros on ``stream`` (as in ``fp32``) for kernels that return
    every counter they use to 0, so that the buffer stays zero between calls (and across
    CUDA-graph replays)."""
    if capturing(cuda):
        return torch.zeros(max(n, 1), dtype=torch.int32, device=device)
    entry = _entry(device, stream)
    if entry.counters is None or entry.counters.numel() < n:
        entry.counters = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return entry.counters
