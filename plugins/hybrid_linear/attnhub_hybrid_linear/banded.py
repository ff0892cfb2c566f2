"""Local (banded) attention with optional global tokens, block by block.

Queries are taken in blocks; each block reads only the keys its window can reach (a slice,
no copy), so work is O(Sq * (block + window)) instead of O(Sq * Sk): key tiles outside the
window are never touched. Exact for its mask, with the project's mask semantics
(:func:`attnhub.plugin.query_offset` alignment, ``window=(left, right)``, -1 unbounded, causal
bottom-right or top-left, softcap then ALiBi).

Global tokens (Longformer): every query also sees the global key positions, and a query
whose aligned position is global sees every key (both still subject to causal). The mask is
``causal? AND (window OR key in G OR query in G)``.
"""

from __future__ import annotations

import torch

from attnhub.plugin import AttnParams, query_offset

from .softmax_blocks import attend, no_queries


def _visible(qi: torch.Tensor, kj: torch.Tensor, left: int, right: int,
             causal: bool) -> torch.Tensor:
    """(Q, L) window-and-causal visibility of key positions ``kj`` for aligned queries ``qi``."""
    qi, kj = qi.view(-1, 1), kj.view(1, -1)
    ok = torch.ones(qi.shape[0], kj.shape[1], dtype=torch.bool, device=qi.device)
    if left >= 0:
        ok &= kj >= qi - left
    if right >= 0:
        ok &= kj <= qi + right
    if causal:
        ok &= kj <= qi
    return ok


def _alibi(slopes: torch.Tensor | None, qi: torch.Tensor, kj: torch.Tensor, hkv: int,
           groups: int) -> torch.Tensor | None:
    """-slope * |i - j| as (B|1, Hkv, G, Q, L) for the gathered key positions."""
    if slopes is None:
        return None
    s = slopes.float().to(qi.device)
    s = s.view(1, hkv, groups, 1, 1) if s.dim() == 1 else s.view(-1, hkv, groups, 1, 1)
    return -s * (qi.view(-1, 1) - kj.view(1, -1)).abs().float()


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttnParams,
                     global_pos: torch.Tensor | None = None,
                     block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D) -> (out (B,Sq,Hq,Dv) in q's dtype, lse (B,Hq,Sq) fp32).

    ``global_pos``: sorted unique key positions (G,) that are global; None for pure windows.
    """
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if sq == 0:  # a varlen document without queries: nothing to compute, nothing to cat
        return no_queries(q, k, v)
    groups = hq // hkv
    off = query_offset(sq, sk, params.alignment)
    left, right = params.window if params.window is not None else (-1, -1)
    if params.causal:
        right = 0 if right < 0 else min(right, 0)
    qh = q.view(b, sq, hkv, groups, d).permute(0, 2, 3, 1, 4)  # (B,Hkv,G,Sq,D)
    kh = k.permute(0, 2, 1, 3).unsqueeze(2)  # (B,Hkv,1,Sk,D)
    vh = v.permute(0, 2, 1, 3).unsqueeze(2)
    dev = q.device
    has_globals = global_pos is not None and global_pos.numel() > 0
    outs, lses = [], []
    for a in range(0, sq, block):
        e = min(a + block, sq)
        qi = torch.arange(a, e, device=dev) + off
        lo = 0 if left < 0 else min(max(0, a + off - left), sk)
        hi = sk if right < 0 else max(min(sk, e - 1 + off + right + 1), lo)
        kj = torch.arange(lo, hi, device=dev)
        keys, vals = kh[..., lo:hi, :], vh[..., lo:hi, :]
        ok = _visible(qi, kj, left, right, params.causal)
        if has_globals:
            assert global_pos is not None
            extra = ~_visible(qi, global_pos, left, right, False)  # not already in the window
            if params.causal:
                extra &= global_pos.view(1, -1) <= qi.view(-1, 1)
            keys = torch.cat([keys, kh.index_select(3, global_pos)], dim=3)
            vals = torch.cat([vals, vh.index_select(3, global_pos)], dim=3)
            kj = torch.cat([kj, global_pos])
            ok = torch.cat([ok, extra], dim=1)
        bias = _alibi(params.alibi_slopes, qi, kj, hkv, groups)
        o, l = attend(qh[..., a:e, :], keys, vals, ok, params.scale, params.softcap, bias)
        outs.append(o)
        lses.append(l)
    out = torch.cat(outs, dim=3)
    lse = torch.cat(lses, dim=3)
    if has_globals:
        assert global_pos is not None
        rows = global_pos - off
        rows = rows[(rows >= 0) & (rows < sq)]
        if rows.numel():
            qi = rows + off
            kj = torch.arange(sk, device=dev)
            ok = kj.view(1, -1) <= qi.view(-1, 1) if params.causal else None
            bias = _alibi(params.alibi_slopes, qi, kj, hkv, groups)
            o, l = attend(qh.index_select(3, rows), kh, vh, ok, params.scale, params.softcap,
                          bias)
            out = out.index_copy(3, rows, o)
            lse = lse.index_copy(3, rows, l)
    out = out.permute(0, 3, 1, 2, 4).reshape(b, sq, hq, v.shape[-1])
    return out.to(q.dtype), lse.reshape(b, hq, sq).float()
