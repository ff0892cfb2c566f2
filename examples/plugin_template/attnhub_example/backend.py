"""An exact attention backend in plain torch: what a plugin declares and how it computes.

Replace ``_attention`` with your kernel; keep the declaration honest (``attnhub
check-plugin example`` tests every feature it claims against the fp64 reference).
"""

from __future__ import annotations

import torch

from attnhub.plugin import (
    FLOAT_DTYPES,
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    Capabilities,
    DeviceInfo,
    allowed_mask,
)


class ExampleBackend(Backend):
    """Dense bshd attention with causal masks (both alignments), softcap, GQA, LSE and a
    backward pass through autograd."""

    name = "example"
    tier = "portable"
    description = "example plugin: exact torch attention (causal, softcap, GQA, LSE, backward)"
    #: Everything left out is not claimed (docs/plugins.md lists each field and its default).
    capabilities = Capabilities(
        vendors=frozenset({"cpu", "cuda", "rocm"}),
        dtypes=FLOAT_DTYPES,
        max_head_dim=256,
        masks=frozenset({"none", "causal", "softcap"}),
        phases=frozenset({"train", "prefill", "decode"}),
        layouts=frozenset({"bshd"}),
        gqa=True,
        returns_lse=True,
        top_left_causal=True,
        backward=True,
        deterministic_forward=True,
        deterministic_backward=True,
    )
    #: Libraries the kernel imports in ``_load`` (checked without importing): {module: hint}.
    requires: dict[str, str] = {}

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """What the data above cannot say; here: scores are materialised, so cap the size."""
        if spec.max_seqlen_q * spec.max_seqlen_k > 1 << 26:
            return [f"materialises {spec.max_seqlen_q}x{spec.max_seqlen_k} scores per head; "
                    "use a flash kernel for long sequences"]
        return []

    def _load(self) -> None:
        """Import the kernel library here (called once, on first use), never at import."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        out, lse = _attention(q, k, v, params)
        return AttentionOutput(out, lse if params.return_lse else None)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               p: AttnParams) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D) -> out (B,Sq,Hq,Dv) in q's dtype, LSE (B,Hq,Sq) fp32.

    GQA without copying K/V: query heads are grouped per KV head. Fully masked rows give 0
    and LSE -inf (bottom-right causal with Sq > Sk has such rows)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.float().view(b, sq, hkv, g, d)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.float()) * p.scale
    if p.softcap:
        s = torch.tanh(s / p.softcap) * p.softcap
    allowed = allowed_mask(p, b, hq, sq, sk, q.device, kv_heads=hkv)
    row_ok = None
    if allowed is not None:
        allowed = allowed.expand(b, hq, sq, sk).reshape(b, hkv, g, sq, sk)
        row_ok = allowed.any(dim=-1)
        # a fully masked row attends nowhere: keep its scores finite (no NaN in softmax or
        # its gradient), then zero its output and give it LSE -inf
        s = s.masked_fill(~allowed & row_ok.unsqueeze(-1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    probs = torch.exp(s - lse.unsqueeze(-1))
    if row_ok is not None:
        probs = probs * row_ok.unsqueeze(-1)
        lse = lse.masked_fill(~row_ok, float("-inf"))
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float())
    return out.reshape(b, sq, hq, v.shape[-1]).to(q.dtype), lse.reshape(b, hq, sq)
