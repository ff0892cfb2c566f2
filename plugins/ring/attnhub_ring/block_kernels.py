"""torch's fused attention ops called directly: the LSE from the kernel, and the gradient
of one ring block from the merged output and the global LSE.

FlashAttention-style backwards take ``(dout, q, k, v, out, lse)``; called with the ring's
*merged* output and *global* LSE they give exactly one block's share of the gradient
(``P = exp(S - lse)``, ``delta = rowsum(dO * O)``) without materialising scores. The ring
picks one per call by data (:func:`block_backward_kernel`), in this order:

- ``cudnn``: ``aten::_scaled_dot_product_cudnn_attention_backward`` (CUDA; the fastest
  backward measured on the H200, 541 TFLOP/s; K/V heads expanded for GQA, as torch's op takes
  equal head counts, and dK/dV summed back over each group);
- ``flash``: ``aten::_flash_attention_backward`` (the FlashAttention-2 torch vendors: CUDA,
  BSHD, GQA native) or, on the CPU, ``aten::_scaled_dot_product_flash_attention_for_cpu_backward``;
- ``math``: the exact fp32 block backward of block_backward.py (softcap, a gradient through
  the returned LSE, fp32 on CUDA, deterministic requests).

The CPU flash forward also serves the ``torch_flash_cpu`` local backend (local_cpu.py).
Causal here is square (the ring's diagonal blocks): top-left and bottom-right are the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnhub.plugin import InputError, unit_head_stride

BlockBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

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


#: cuDNN's fused attention: head dims up to 128, multiples of 8 (as the cudnn backend).
CUDNN_MAX_HEAD_DIM = 128
BLOCK_BACKWARDS = ("cudnn", "flash", "math")


def cudnn_backward_reasons(q: torch.Tensor, v: torch.Tensor, softcap: float | None,
                           deterministic: bool, lse_grad: bool) -> list[str]:
    """Why cuDNN's backward cannot serve the ring's blocks for this call (empty: it can)."""
    if q.device.type != "cuda":
        return [f"device {q.device.type} (cuDNN attention runs on CUDA)"]
    r = fused_backward_reasons(q, v, softcap, deterministic, lse_grad)
    if q.shape[-1] > CUDNN_MAX_HEAD_DIM:
        r.append(f"head dim {q.shape[-1]} (cuDNN attention: <= 128)")
    if not torch.backends.cudnn.is_available():
        r.append("cuDNN is not available in this torch build")
    return r


def block_backward_kernel(q: torch.Tensor, v: torch.Tensor, softcap: float | None,
                          deterministic: bool, lse_grad: bool,
                          want: str = "auto") -> tuple[str, list[str]]:
    """The block backward for this call and why each faster one was passed over:
    ``(kernel, ["cudnn: ...", ...])``. ``want`` forces one (``cudnn``, ``flash``, ``math``);
    a forced kernel that cannot serve raises rather than run another."""
    checks = {"cudnn": cudnn_backward_reasons, "flash": fused_backward_reasons}
    passed: list[str] = []
    order = BLOCK_BACKWARDS if want == "auto" else (want,)
    if want not in ("auto", *BLOCK_BACKWARDS):
        raise InputError(f"ring: block_backward={want!r}; use auto, "
                         + ", ".join(BLOCK_BACKWARDS))
    for name in order:
        reasons = checks[name](q, v, softcap, deterministic, lse_grad) if name in checks else []
        if not reasons:
            return name, passed
        passed.append(f"{name}: " + "; ".join(reasons))
    raise InputError(f"ring: block_backward={want!r} cannot serve this call: {passed[-1]}")


def cudnn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one bshd block by cuDNN, given the (global) ``out`` and ``lse``
    (B, Hq, M) fp32; called as torch's own context parallelism calls it (BHSD views, the LSE
    with cuDNN's trailing unit axis). Returns dq (B,M,Hq,D), dk/dv (B,N,Hkv,D)."""
    dout, q, k, v, out = unit_head_stride(dout, q, k, v, out)
    m, hq = q.shape[1], q.shape[2]
    n, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    if g > 1:
        kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unused
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), kt, vt, out.transpose(1, 2),
        lse.unsqueeze(-1).contiguous(), seed, seed, None, None, None, m, n, 0.0, causal,
        scale=scale)
    if g > 1:
        dk, dv = (x.unflatten(1, (hkv, g)).sum(2) for x in (dk, dv))
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def flash_forward_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """bshd in, (out bshd, lse (B, Hq, Sq) fp32) out, from the CPU flash kernel."""
    q, k, v = unit_head_stride(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
    return out.transpose(1, 2), lse


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one bshd block given the (global) ``out`` and ``lse`` (B, Hq, M) fp32.

    Returns dq (B,M,Hq,D), dk/dv (B,N,Hkv,D) in the input dtype."""
    dout, q, k, v, out = unit_head_stride(dout, q, k, v, out)
    if q.device.type == "cuda":
        m, n = q.shape[1], k.shape[1]
        rng = torch.empty(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), None, None, m, n,
            0.0, causal, rng, unused, scale=scale)
        return dq, dk, dv
    # In fp16/bf16 the op broke the FlashAttention rule twice: on peaked softmaxes (scale 1,
    # D=64, a few keys: dq/dk up to 9.7x the bound in bf16) and for GQA (a KV head's
    # gradient summed over its query heads in half precision: MQA 32:1 dK/dV errors 3-5x).
    # It runs in fp32 and the gradients are cast back (the CPU: memory, not speed, bounds it)
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        dout, q, k, v, out = (x.float() for x in (dout, q, k, v, out))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse.contiguous(), 0.0, causal, scale=scale)
    return dq.transpose(1, 2).to(dtype), dk.transpose(1, 2).to(dtype), \
        dv.transpose(1, 2).to(dtype)


def block_backward_fn(kernel: str) -> BlockBackward:
    """The bshd function of a fused block backward kernel (``cudnn`` or ``flash``)."""
    return cudnn_backward if kernel == "cudnn" else flash_backward


def backward_segments(fn: BlockBackward, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                      scale: float, q_lens: tuple[int, ...], k_lens: tuple[int, ...]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fn`` over packed (thd) segments, segment ``i`` of ``q_lens[i]`` queries against
    ``k_lens[i]`` keys; ``lse`` (Hq, T) fp32. Lengths are host ints from the plan (no sync)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    qs = ks = 0
    for ql, kl in zip(q_lens, k_lens):
        qe, ke = qs + ql, ks + kl
        g = fn(dout[None, qs:qe], q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
               out[None, qs:qe], lse[None, :, qs:qe], causal, scale)
        dq[qs:qe], dk[ks:ke], dv[ks:ke] = g[0][0], g[1][0], g[2][0]
        qs, ks = qe, ke
    return dq, dk, dv
