"""attnhub's block tables in FlashInfer's terms, and the key a plan is cached under.

attnhub passes a paged cache as ``block_table`` (B, max_pages) int32 plus ``seqlens_k`` (B,);
FlashInfer wants CSR arrays: ``indptr`` (B+1), ``indices`` (the used pages, row after row) and
``last_page_len`` (entries in each sequence's last page). A plan depends only on these and on
the problem's shape, so it is computed once per batch layout and reused by every layer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class PagedCSR(NamedTuple):
    indptr: torch.Tensor  # (B+1,) int32
    indices: torch.Tensor  # (indptr[-1],) int32
    last_page_len: torch.Tensor  # (B,) int32, in [1, page_size]; 0 for an empty sequence
    empty: torch.Tensor | None  # (B,) bool where seqlens_k == 0, None when there is none


def block_table_to_csr(block_table: torch.Tensor, seqlens_k: torch.Tensor,
                       page_size: int) -> PagedCSR:
    """CSR page table of the pages each sequence uses (on the tables' device)."""
    lens = seqlens_k.to(torch.int64)
    pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(block_table.shape[1], device=lens.device).view(1, -1) < pages.view(-1, 1)
    indices = block_table[used].to(torch.int32)
    last = torch.where(pages > 0, lens - (pages - 1) * page_size, torch.zeros_like(lens))
    empty = lens == 0
    return PagedCSR(indptr, indices, last.to(torch.int32), empty if bool(empty.any()) else None)


def kv_layout_of(k_cache: torch.Tensor) -> str:
    """``NHD`` for (pages, page, H, D) storage; ``HND`` when the (pages, page, H, D) tensor is
    a transposed view of (pages, H, page, D) storage (its head stride exceeds its token
    stride)."""
    return "HND" if k_cache.stride(2) > k_cache.stride(1) else "NHD"


def tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Identity and in-place version of a tensor: changes whenever torch writes into it.
    The plan cache keeps the tensor alive, so its id cannot be reused while cached."""
    return (id(t), t._version, t.data_ptr(), tuple(t.shape))
