"""Math attention for every mask kind: the oracle the tests compare backends against.

``reference_attention`` materialises scores, so it is for tests, planning checks and tiny
shapes only. It computes in ``compute_dtype`` (fp64 by default); calling it with the input's
own dtype gives the same-precision reference of the FlashAttention rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .masking import allowed_mask, alibi_bias, call_user_mod, doc_ranges
from .spec import AttnParams


def _bshd_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttnParams,
                    compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D) -> out (B,Sq,Hq,Dv) in compute_dtype, lse (B,Hq,Sq) fp32."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    qt = q.transpose(1, 2).to(compute_dtype)
    kt = k.transpose(1, 2).to(compute_dtype).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).to(compute_dtype).repeat_interleave(group, dim=1)
    s = torch.matmul(qt, kt.transpose(-1, -2)) * params.scale
    if params.softcap:
        s = torch.tanh(s / params.softcap) * params.softcap
    if params.alibi_slopes is not None:
        s = s + alibi_bias(params.alibi_slopes, sq, sk, params.alignment, q.device,
                           torch.promote_types(s.dtype, torch.float32)).to(s.dtype)
    if params.score_mod is not None:
        bi = torch.arange(b, device=q.device).view(b, 1, 1, 1)
        hi = torch.arange(hq, device=q.device).view(1, hq, 1, 1)
        qi = torch.arange(sq, device=q.device).view(1, 1, sq, 1)
        ki = torch.arange(sk, device=q.device).view(1, 1, 1, sk)
        s = call_user_mod("score_mod", params.score_mod, (s, bi, hi, qi, ki), tuple(s.shape),
                          lambda t: t.is_floating_point(), "floating scores (score + bias, "
                          "torch.where(keep, score, -inf))").to(s.dtype)  # as flex casts
    allowed = allowed_mask(params, b, hq, sq, sk, q.device, kv_heads=hkv)
    if params.score_mod is not None:  # a score_mod that masks by -inf masks: its rows can
        kept = ~torch.isneginf(s.detach())  # be fully masked too (0 out, -inf LSE, as flex)
        allowed = kept if allowed is None else allowed & kept
    if allowed is None:
        lse = torch.logsumexp(s, dim=-1)
        p = _dropped(torch.softmax(s, dim=-1), params)
        return torch.matmul(p, vt).transpose(1, 2), lse.float()
    allowed = torch.broadcast_to(allowed, s.shape)
    row_ok = allowed.any(dim=-1, keepdim=True)
    s = s.masked_fill(~allowed, float("-inf"))
    s = torch.where(row_ok, s, torch.zeros_like(s))  # fully masked rows: finite, then zeroed
    p = _dropped(torch.softmax(s, dim=-1) * row_ok, params)
    lse = torch.where(row_ok.squeeze(-1), torch.logsumexp(s, dim=-1),
                      s.new_full(s.shape[:-1], float("-inf")))  # Sk may be 0
    # a fully masked row is 0 even where v holds NaN (its weights 0 times NaN are NaN)
    out = torch.matmul(p, vt).masked_fill(~row_ok, 0.0)
    return out.transpose(1, 2), lse.float()


def _dropped(p: torch.Tensor, params: AttnParams) -> torch.Tensor:
    """Attention dropout on the probabilities (B, H, Sq, Sk), as eager attention applies it:
    one Bernoulli draw per probability from torch's generator; the LSE stays undropped."""
    return F.dropout(p, params.dropout_p) if params.dropout_p else p


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttnParams, *,
    layout: str = "bshd", compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention. Returns (out in ``compute_dtype``, lse fp32).

    ``bshd``: q (B,Sq,Hq,D) -> out (B,Sq,Hq,Dv), lse (B,Hq,Sq).
    ``thd``: q (Tq,Hq,D) with ``params.cu_seqlens_q/k`` -> out (Tq,Hq,Dv), lse (Hq,Tq).
    """
    if layout == "bshd":
        return _bshd_attention(q, k, v, params, compute_dtype)
    if layout != "thd":
        raise ValueError(f"reference_attention takes bshd or thd, not {layout!r}")
    outs, lses = [], []
    slopes = params.alibi_slopes
    for i, ((qs, qe), (ks, ke)) in enumerate(zip(doc_ranges(params.cu_seqlens_q),
                                                   doc_ranges(params.cu_seqlens_k))):
        p_i = _doc_params(params, i, slopes)
        o, l = _bshd_attention(q[qs:qe].unsqueeze(0), k[ks:ke].unsqueeze(0),
                               v[ks:ke].unsqueeze(0), p_i, compute_dtype)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs, 0), torch.cat(lses, -1)


def _doc_params(params: AttnParams, i: int, slopes: torch.Tensor | None) -> AttnParams:
    """Params for document ``i`` of a varlen batch (per-batch tensors sliced to that row)."""
    from dataclasses import replace

    return replace(
        params,
        cu_seqlens_q=None, cu_seqlens_k=None,
        alibi_slopes=slopes[i] if slopes is not None and slopes.dim() == 2 else slopes,
        prefix_lens=params.prefix_lens[i:i + 1] if params.prefix_lens is not None else None,
    )
