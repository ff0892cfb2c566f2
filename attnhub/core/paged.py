"""Paged KV helpers shared by backends that do not read block tables natively."""

from __future__ import annotations

import torch


def paged_to_varlen(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, seqlens_k: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather a paged cache into packed THD tensors.

    q (B, Sq, Hq, D); k_cache/v_cache (num_pages, page_size, Hkv, D); block_table (B, P) int32;
    seqlens_k (B,). Returns q (B*Sq, Hq, D), k, v (sum(seqlens), Hkv, D), cu_seqlens_q,
    cu_seqlens_k. A copy: for backends without native paging and for tests.
    """
    b, sq = q.shape[:2]
    page = k_cache.shape[1]
    lens = seqlens_k.to(torch.int64).tolist()
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
