"""FP8 (e4m3) operands for FA3 with per-(batch, KV head) descales, and an error-reducing recipe.

FA3's FP8 forward takes e4m3 q/k/v plus one descale per (batch, KV head) for each, and
returns bf16. ``plain`` scales each (batch, KV head) slice by its absolute maximum.
``smooth_k`` first subtracts K's per-channel mean over the sequence: every score of a query
row moves by the same ``scale * q . mean``, so softmax (and the output) is unchanged, while a
K channel that carries a large common offset (the outlier pattern of real keys) no longer
dominates K's range and rounding error. The LSE moves by that same amount and is corrected.
Not valid with softcap (tanh is not shift-invariant).

``emulate`` models the kernel on any device (dequantized scores in fp32, probabilities
rounded to e4m3 before the PV product, as FA3's FP8 path does) for CPU tests and planning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnhub.plugin import AttnParams, allowed_mask

E4M3 = torch.float8_e4m3fn
#: Quantize to a little under e4m3's 448 so bf16 rounding of x * scale cannot overflow it.
E4M3_TARGET = 440.0
RECIPES: tuple[str, ...] = ("plain", "smooth_k")


@dataclass
class Fp8Operands:
    """e4m3 q/k/v (bshd) with (B, Hkv) fp32 descales; ``k_mean`` (B, Hkv, D) when K was
    smoothed (the value subtracted, for the LSE correction)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    k_mean: torch.Tensor | None = None

    def descales(self) -> dict[str, torch.Tensor]:
        return {"q_descale": self.q_descale, "k_descale": self.k_descale,
                "v_descale": self.v_descale}


def kv_head_amax(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """max |x| per (batch, KV head), over the sequence and the heads of its group: (B, Hkv)
    fp32. One reduction, no |x| temporary."""
    b, s, h, d = x.shape
    grouped = x.reshape(b, s, kv_heads, (h // kv_heads) * d)
    return torch.linalg.vector_norm(grouped, ord=float("inf"), dim=(1, 3)).float()


def quantize(x: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 tensor, (B, Hkv) descale) with one scale per (batch, KV head)."""
    b, s, h, d = x.shape
    amax = kv_head_amax(x, kv_heads).clamp_min(1e-12)
    scale = (E4M3_TARGET / amax).to(x.dtype)  # the scale actually applied, in x's precision
    descale = 1.0 / scale.float()
    per_head = scale.repeat_interleave(h // kv_heads, dim=1).view(b, 1, h, 1)
    return (x * per_head).to(E4M3), descale


def quantize_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      recipe: str = "plain") -> Fp8Operands:
    """e4m3 operands and descales for ``flash_attn_func(..., q/k/v_descale=...)``."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; use one of {', '.join(RECIPES)}")
    hkv = k.shape[2]
    k_mean = None
    if recipe == "smooth_k":
        k_mean = k.mean(dim=1, dtype=torch.float32).to(k.dtype)  # (B, Hkv, D), as subtracted
        k = k - k_mean.unsqueeze(1)
    q8, qd = quantize(q, hkv)
    k8, kd = quantize(k, hkv)
    v8, vd = quantize(v, hkv)
    return Fp8Operands(q8, k8, v8, qd, kd, vd, k_mean)


def lse_shift(q: torch.Tensor, k_mean: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, Hq, Sq) amount by which smoothing lowered each row's scores: ``scale * q . mean``."""
    b, sq, hq, d = q.shape
    hkv = k_mean.shape[1]
    qg = q.float().view(b, sq, hkv, hq // hkv, d)
    return torch.einsum("bskgd,bkd->bkgs", qg, k_mean.float()).reshape(b, hq, sq) * scale


def dequantize(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """fp32 values of an e4m3 bshd tensor with (B, Hkv) descales."""
    b, s, h, d = x8.shape
    per_head = descale.repeat_interleave(h // descale.shape[1], dim=1).view(b, 1, h, 1)
    return x8.float() * per_head


def emulate(ops: Fp8Operands, params: AttnParams) -> tuple[torch.Tensor, torch.Tensor]:
    """A model of FA3's FP8 forward: (bf16 out (B,Sq,Hq,Dv), fp32 LSE (B,Hq,Sq)).

    Scores from the dequantized operands in fp32, softcap, mask, then the unnormalised
    probabilities rounded to e4m3 for the PV product while the row sums stay fp32. Like the
    kernel's, the LSE is that of the smoothed scores: add ``lse_shift`` of the original q.
    """
    q, k, v = (dequantize(ops.q, ops.q_descale), dequantize(ops.k, ops.k_descale),
               dequantize(ops.v, ops.v_descale))
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(group, dim=1)
    s = torch.matmul(qt, kt.transpose(-1, -2)) * params.scale
    if params.softcap:
        s = torch.tanh(s / params.softcap) * params.softcap
    allowed = allowed_mask(params, b, hq, sq, sk, q.device, kv_heads=hkv)
    if allowed is not None:
        s = s.masked_fill(~torch.broadcast_to(allowed, s.shape), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p.to(E4M3).float(), vt) / denom.clamp_min(1e-30)
    lse = (m_safe + torch.log(denom)).squeeze(-1)
    lse = torch.where(denom.squeeze(-1) > 0, lse, torch.full_like(lse, float("-inf")))
    return out.transpose(1, 2).to(torch.bfloat16), lse
