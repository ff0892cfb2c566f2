"""Paged KV helpers shared by backends that do not read block tables natively."""

from __future__ import annotations

import torch

from ..errors import SeqlensError
from .tables import _check_paged_contents


def paged_to_varlen(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, seqlens_k: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather a paged cache into packed THD tensors.

    q (B, Sq, Hq, D); k_cache/v_cache (num_pages, page_size, Hkv, D); block_table (B, P) int32;
    seqlens_k (B,). Returns q (B*Sq, Hq, D), k, v (sum(seqlens), Hkv, D), cu_seqlens_q,
    cu_seqlens_k. A copy: for backends without native paging and for tests.

    The tables are checked as the hub checks them (``tables._check_paged_contents``): a
    caller outside the hub must not gather another sequence's pages through a negative page
    id (which indexing wraps around) or a length past its table.
    """
    b, sq = q.shape[:2]
    page = k_cache.shape[1]
    if block_table.dim() != 2 or block_table.shape[0] != b or tuple(seqlens_k.shape) != (b,):
        raise SeqlensError(f"paged_to_varlen: block_table {tuple(block_table.shape)} and "
                           f"seqlens_k {tuple(seqlens_k.shape)} must be (B={b}, pages) and "
                           f"(B={b},) for q of batch {b}")
    for name, t in (("block_table", block_table), ("seqlens_k", seqlens_k)):
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            # a float page id or length would be truncated (page 1.7 read as page 1)
            raise SeqlensError(f"paged_to_varlen: {name} is {t.dtype}; pass integer page ids "
                               "and lengths (int32, as the hub's paged layout takes them)")
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise SeqlensError(f"paged_to_varlen: k_cache {tuple(k_cache.shape)} and v_cache "
                           f"{tuple(v_cache.shape)} must agree in pages, page_size and heads")
    if page < 1:
        raise SeqlensError(f"paged_to_varlen: k_cache {tuple(k_cache.shape)} has page_size 0 "
                           "(axis 1); a page holds at least one token")
    host = seqlens_k.cpu().to(torch.int64)
    try:
        _check_paged_contents(block_table, host, k_cache.shape[0], page)
    except SeqlensError as exc:
        raise SeqlensError(f"paged_to_varlen: {exc}") from None
    lens = host.tolist()
    ks, vs = [], []
    for i, n in enumerate(lens):
        pages = block_table[i, : (n + page - 1) // page].to(torch.int64)
        ks.append(k_cache[pages].flatten(0, 1)[:n])
        vs.append(v_cache[pages].flatten(0, 1)[:n])
    dev = q.device
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=dev)
    cu_k = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    cu_k[1:] = torch.cumsum(torch.tensor(lens, device=dev), 0)
    if not ks:  # an empty batch
        ks, vs = [k_cache[:0].flatten(0, 1)], [v_cache[:0].flatten(0, 1)]
    return q.reshape(b * sq, *q.shape[2:]), torch.cat(ks), torch.cat(vs), cu_q, cu_k
