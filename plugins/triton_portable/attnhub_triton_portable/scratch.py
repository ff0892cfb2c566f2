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

import torch
from triton.runtime.driver import driver

_tls = threading.local()


class _Entry:
    """One thread's buffers on one (device, stream)."""

    __slots__ = ("buf", "counters", "views")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.counters: torch.Tensor | None = None


def _entry(device: torch.device) -> _Entry:
    """This thread's entry for ``device`` and its current stream."""
    # Triton's driver asks torch for the raw stream handle without building a Stream object
    stream = driver.active.get_current_stream(device.index) if device.type == "cuda" else 0
    table: dict[tuple[torch.device, int], _Entry] | None = getattr(_tls, "table", None)
    if table is None:
        table = _tls.table = {}
    key = (device, stream)
    entry = table.get(key)
    if entry is None:
        entry = table[key] = _Entry()
    return entry


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def partials(device: torch.device, rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (rows, dim) and (rows,) buffers, each 16-byte aligned, contents undefined."""
    if capturing(device):
        return (torch.empty((rows, dim), dtype=torch.float32, device=device),
                torch.empty((rows,), dtype=torch.float32, device=device))
    entry = _entry(device)
    hit = entry.views.get((rows, dim))
    if hit is not None:
        return hit
    off = -(-rows * dim // 4) * 4  # 16-byte aligned start of the second view
    need = off + rows
    if entry.buf is None or entry.buf.numel() < need:
        entry.buf = torch.empty(need, dtype=torch.float32, device=device)
        entry.views.clear()  # views of the old buffer
    elif len(entry.views) >= 256:
        entry.views.clear()  # bounded: with many shapes, views are just made again
    views = (entry.buf[: rows * dim].view(rows, dim), entry.buf[off: off + rows])
    entry.views[(rows, dim)] = views
    return views


def zeroed_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 zeros for kernels that return every counter they use to 0, so
    that the buffer stays zero between calls (and across CUDA-graph replays)."""
    if capturing(device):
        return torch.zeros(max(n, 1), dtype=torch.int32, device=device)
    entry = _entry(device)
    if entry.counters is None or entry.counters.numel() < n:
        entry.counters = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return entry.counters
