"""Tensor checks: catch bad input at the API with an error that names the argument and the fix.

Checks read only shapes, dtypes and devices (no host sync), except for cu_seqlens and block
tables, whose contents are checked once when they are given (a small host copy).
"""

from __future__ import annotations

import torch

from ..errors import (
    DeviceMismatchError,
    DTypeMismatchError,
    LayoutError,
    SeqlensError,
    ShapeError,
)

_RANK = {"bshd": 4, "bhsd": 4, "thd": 3, "paged": 4}
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    """Rank, device, dtype, head dims, head counts and batch agreement of q, k, v."""
    if layout not in _RANK:
        raise LayoutError(f"layout={layout!r} is unknown; use one of {', '.join(_RANK)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != _RANK[layout]:
            raise ShapeError(
                f"{name} has rank {t.dim()} {tuple(t.shape)}, layout {layout!r} needs rank "
                f"{_RANK[layout]} ({_shape_hint(layout)}); pass layout= to match your tensors")
    if not (q.device == k.device == v.device):
        raise DeviceMismatchError(
            f"q is on {q.device}, k on {k.device}, v on {v.device}; move them to one device "
            "(e.g. k = k.to(q.device))")
    if k.dtype != v.dtype:
        raise DTypeMismatchError(f"k is {k.dtype} but v is {v.dtype}; cast both to one dtype")
    if q.dtype not in _FLOAT:
        raise DTypeMismatchError(
            f"q is {q.dtype}; attention takes fp16, bf16 or fp32 queries (FP8 goes through an "
            "FP8 backend with descales)")
    if k.dtype != q.dtype and k.dtype in _FLOAT:
        raise DTypeMismatchError(
            f"q is {q.dtype} but k/v are {k.dtype}; cast them to one dtype "
            "(only an FP8 KV cache may differ from q)")
    hdim = -1
    hq = q.shape[1] if layout == "bhsd" else q.shape[-2]
    hk = k.shape[1] if layout == "bhsd" else k.shape[-2]
    hv = v.shape[1] if layout == "bhsd" else v.shape[-2]
    if q.shape[hdim] != k.shape[hdim]:
        raise ShapeError(f"q head dim {q.shape[hdim]} != k head dim {k.shape[hdim]}; "
                         "q and k must share the last dimension")
    if hk != hv:
        raise ShapeError(f"k has {hk} heads but v has {hv}; they must match")
    if hk == 0 or hq % hk:
        raise ShapeError(
            f"q has {hq} heads, k/v have {hk}: Hq % Hkv must be 0 (GQA groups whole heads); "
            "check the head axis of your layout")
    if layout in ("bshd", "bhsd") and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ShapeError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    seq_axis = 2 if layout == "bhsd" else 1
    if layout in ("bshd", "bhsd") and k.shape[seq_axis] != v.shape[seq_axis]:
        raise ShapeError(f"k has {k.shape[seq_axis]} keys but v has {v.shape[seq_axis]}")
    if layout == "thd" and k.shape[0] != v.shape[0]:
        raise ShapeError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")


def infer_layout_error(q: torch.Tensor) -> LayoutError:
    return LayoutError(
        f"cannot tell the layout of q {tuple(q.shape)}: pass layout='bshd' (B,S,H,D), 'bhsd' "
        "(B,H,S,D), 'thd' (T,H,D) with cu_seqlens, or 'paged' with a block_table")


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int, device: torch.device) -> int:
    """Validate cumulative lengths; returns the longest sequence."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise SeqlensError(f"{name} must be a 1-D tensor of B+1 offsets starting at 0")
    if cu.dtype != torch.int32:
        raise SeqlensError(f"{name} is {cu.dtype}; it must be torch.int32 "
                           f"(use {name}.to(torch.int32))")
    if cu.device != device:
        raise DeviceMismatchError(f"{name} is on {cu.device} but q is on {device}; move it")
    host = cu.tolist()
    if host[0] != 0:
        raise SeqlensError(f"{name}[0] is {host[0]}; offsets must start at 0")
    if any(b < a for a, b in zip(host, host[1:])):
        raise SeqlensError(f"{name} is not monotonic non-decreasing: {host[:8]}...")
    if host[-1] > total:
        raise SeqlensError(
            f"{name}[-1]={host[-1]} is past the {total} tokens of the packed tensor")
    return max(b - a for a, b in zip(host, host[1:]))


def check_paged(q: torch.Tensor, k: torch.Tensor, block_table: torch.Tensor | None,
                seqlens_k: torch.Tensor | None) -> int:
    """Validate a paged call; returns the longest context."""
    if block_table is None or seqlens_k is None:
        raise SeqlensError("layout='paged' needs block_table (B, pages) and seqlens_k (B,)")
    for name, t in (("block_table", block_table), ("seqlens_k", seqlens_k)):
        if t.dtype != torch.int32:
            raise SeqlensError(f"{name} is {t.dtype}; it must be torch.int32")
        if t.device != q.device:
            raise DeviceMismatchError(f"{name} is on {t.device} but q is on {q.device}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
        raise SeqlensError(f"block_table must be (B={q.shape[0]}, pages), "
                           f"got {tuple(block_table.shape)}")
    page = k.shape[1]
    global _paged_ok
    stamp = (block_table._version, seqlens_k._version, k.shape[0], page)
    memo = _paged_ok
    if memo and memo[0] is block_table and memo[1] is seqlens_k and memo[2] == stamp:
        return memo[3]  # same unmodified tables as the last call (the previous layer)
    lens = seqlens_k.tolist()
    cap = block_table.shape[1] * page
    if max(lens, default=0) > cap:
        raise SeqlensError(f"seqlens_k max {max(lens)} exceeds block_table capacity {cap} "
                           f"({block_table.shape[1]} pages x {page}); add pages")
    used = [block_table[i, : (n + page - 1) // page] for i, n in enumerate(lens)]
    if used and (bad := torch.cat(used)).numel() and (
            int(bad.min()) < 0 or int(bad.max()) >= k.shape[0]):
        raise SeqlensError(f"block_table refers to page outside 0..{k.shape[0] - 1}")
    _paged_ok = (block_table, seqlens_k, stamp, max(lens, default=0))
    return _paged_ok[3]


#: The last block table / seqlens pair whose contents passed ``check_paged``, with its result:
#: every layer of a model step passes the same two tensors, so their contents (a host copy,
#: a GPU sync) are read once per step, not once per layer. In-place changes bump ``_version``.
_paged_ok: tuple = ()


def _shape_hint(layout: str) -> str:
    return {"bshd": "B,S,H,D", "bhsd": "B,H,S,D", "thd": "T,H,D",
            "paged": "q B,S,H,D; k/v pages,page_size,H,D"}[layout]
