"""Gradient of one (query rows, KV block) pair of ring attention, from the saved global LSE,
in plain fp32 torch: the ring's exact fallback (block_kernels.py picks it).

The merged output's gradient with respect to one block is FlashAttention's backward with the
*global* statistics: ``P = exp(S - lse)`` (probabilities normalised over all blocks),
``dV = P^T dO``, ``dS = P * (dO V^T - delta)`` with ``delta = rowsum(dO * O) - dlse`` over the
*merged* ``O``. The fused kernels (cuDNN, FlashAttention) compute the same given the merged
output and global LSE, but they take neither ``dlse`` (a loss that uses the returned LSE) nor
softcap; this does, a few hundred query rows at a time to bound the score memory, exactly and
deterministically for any local backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Score elements (fp32) materialised at once per block: 2^24, about 64 MiB per temporary.
SCORE_BUDGET = 1 << 24


def block_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, scale: float, softcap: float | None,
    allowed: Callable[[int, int], torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (B,M,Hq,D), dk (B,N,Hkv,D), dv (B,N,Hkv,Dv) in fp32 for one block.

    q (B,M,Hq,D), k/v (B,N,Hkv,·), dout (B,M,Hq,Dv); lse and delta (B,M,Hq) fp32, global;
    ``allowed(lo, hi)`` gives the (hi-lo, N) visibility of query rows [lo, hi) or None.
    """
    b, m, hq, d = q.shape
    n, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    kf, vf = k.float(), v.float()
    dq = torch.empty(b, m, hq, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, n, hkv, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(b, n, hkv, v.shape[-1], dtype=torch.float32, device=q.device)
    step = max(1, SCORE_BUDGET // max(1, b * hq * n))
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        qc = q[:, lo:hi].float().unflatten(2, (hkv, g))          # B,m,Hkv,G,D
        doc = dout[:, lo:hi].float().unflatten(2, (hkv, g))      # B,m,Hkv,G,Dv
        # rows no block has seen (lse -inf) get P = 0: exp(s - inf)
        lse_c = torch.where(torch.isfinite(lse[:, lo:hi]), lse[:, lo:hi], float("inf"))
        lse_c = lse_c.unflatten(2, (hkv, g)).permute(0, 2, 3, 1).unsqueeze(-1)
        delta_c = delta[:, lo:hi].unflatten(2, (hkv, g)).permute(0, 2, 3, 1).unsqueeze(-1)
        s = torch.einsum("bmhgd,bnhd->bhgmn", qc, kf) * scale
        t = None
        if softcap:
            t = torch.tanh(s / softcap)
            s = t * softcap
        ok = allowed(lo, hi)
        if ok is not None:
            s = s.masked_fill(~ok, float("-inf"))
        p = torch.exp(s - lse_c)                                  # B,Hkv,G,m,N
        dv += torch.einsum("bhgmn,bmhge->bnhe", p, doc)
        ds = p * (torch.einsum("bmhge,bnhe->bhgmn", doc, vf) - delta_c)
        if t is not None:
            ds = ds * (1.0 - t * t)
        dq[:, lo:hi] = torch.einsum("bhgmn,bnhd->bmhgd", ds, kf).flatten(2, 3) * scale
        dk += torch.einsum("bhgmn,bmhgd->bnhd", ds, qc) * scale
    return dq, dk, dv
