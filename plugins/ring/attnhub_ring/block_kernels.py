"""torch's own FlashAttention ops, called directly so the LSE comes out of the kernel.

Two uses: the forward of the ``torch_flash_cpu`` local backend (CPU has no other kernel that
returns the LSE natively), and the ring's fused block backward on every device. The backward
of FlashAttention takes ``(dout, q, k, v, out, lse)``; called with the ring's *merged* output
and *global* LSE it is exactly the gradient of one block of ring attention (``P = exp(S -
lse)``, ``delta = rowsum(dO * O)``), so no score matrix is materialised.

- CPU: ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward (BHSD views,
  GQA native, fp32/bf16/fp16).
- CUDA: ``aten::_flash_attention_forward`` / ``_flash_attention_backward`` (the
  FlashAttention-2 torch vendors; BSHD and varlen, GQA native, fp16/bf16, head dim <= 256).

Causal here is square (the ring's diagonal blocks): top-left and bottom-right are the same.
"""

from __future__ import annotations

import torch

#: FlashAttention-2 on CUDA: half precision and head dims up to 256, multiples of 8.
CUDA_DTYPES = (torch.float16, torch.bfloat16)
CUDA_MAX_HEAD_DIM = 256


def fused_backward_reasons(q: torch.Tensor, v: torch.Tensor, softcap: float | None,
                           deterministic: bool, lse_grad: bool) -> list[str]:
    """Why torch's flash backward cannot serve the ring's blocks for this call (empty: it
    can); the ring then takes the exact fp32 math backward (block_backward.py)."""
    r = []
    if softcap:
        r.append("softcap (torch's flash backward has no softcap)")
    if lse_grad:
        r.append("a gradient flows into the returned LSE (the flash backward takes dO only)")
    if v.shape[-1] != q.shape[-1]:
        r.append(f"value head dim {v.shape[-1]} != {q.shape[-1]}")
    if q.device.type == "cuda":
        if q.dtype not in CUDA_DTYPES:
            r.append(f"{q.dtype} on CUDA (FlashAttention-2 takes fp16/bf16)")
        if q.shape[-1] > CUDA_MAX_HEAD_DIM or q.shape[-1] % 8:
            r.append(f"head dim {q.shape[-1]} (FlashAttention-2: <= 256, multiple of 8)")
        if deterministic:
            r.append("deterministic requested (FlashAttention-2's dQ accumulation is atomic)")
    elif q.device.type != "cpu":
        r.append(f"device {q.device.type} (CPU and CUDA only)")
    return r


def flash_forward_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """bshd in, (out bshd, lse (B, Hq, Sq) fp32) out, from the CPU flash kernel."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
    return out.transpose(1, 2), lse


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one bshd block given the (global) ``out`` and ``lse`` (B, Hq, M) fp32.

    Returns dq (B,M,Hq,D), dk/dv (B,N,Hkv,D) in the input dtype."""
    if q.device.type == "cuda":
        m, n = q.shape[1], k.shape[1]
        rng = torch.empty(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), None, None, m, n,
            0.0, causal, rng, unused, scale=scale)
        return dq, dk, dv
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse.contiguous(), 0.0, causal, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def flash_backward_segments(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                            causal: bool, scale: float, q_lens: tuple[int, ...],
                            k_lens: tuple[int, ...]
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed (thd) segments, segment ``i`` of ``q_lens[i]`` queries against ``k_lens[i]``
    keys; ``lse`` (Hq, T) fp32. Lengths are host ints from the plan (no device sync)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    qs = ks = 0
    for ql, kl in zip(q_lens, k_lens):
        qe, ke = qs + ql, ks + kl
        g = flash_backward(dout[None, qs:qe], q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
                           out[None, qs:qe], lse[None, :, qs:qe], causal, scale)
        dq[qs:qe], dk[ks:ke], dv[ks:ke] = g[0][0], g[1][0], g[2][0]
        qs, ks = qe, ke
    return dq, dk, dv
