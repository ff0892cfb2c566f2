"""``ring_attention``: the ring without a policy, for scripts that pick the local kernel."""

from __future__ import annotations

import math

import torch

import attnhub
from attnhub.plugin import AttentionSpec, AttnParams, Backend, MaskSpec, dtype_name

from .backend import check_local
from .comm import ProcessGroup
from .ring import Transport, run_ring


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, local_backend: Backend | str,
    causal: bool = False, scale: float | None = None, softcap: float | None = None,
    cu_seqlens: torch.Tensor | None = None, group: ProcessGroup | None = None,
    global_seqlens: list[int] | None = None, return_lse: bool = False,
    deterministic: bool = False, transport: Transport | None = None,
    block_backward: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of this rank's zigzag shard against the whole sequence.

    q/k/v are this rank's shard: bshd (B, S_local, H, D) from :func:`zigzag_shard`, or thd
    (T_local, H, D) with its local ``cu_seqlens`` from :func:`zigzag_shard_varlen`.
    ``local_backend`` is a backend object or a registered name (``"torch_sdpa"``).
    ``global_seqlens`` (the unsharded lengths) saves one all-gather and host sync per call.
    ``transport`` replaces the process group: :class:`attnhub_ring.simulate.SimulatedRing`
    plays one rank of a ring on a single device (for measuring, see simulate.py). Any
    backend that returns the LSE is accepted here; a policy binds only one that returns it
    natively (not ``lse_second_pass``). ``block_backward`` forces the kernel of the blocks'
    gradients (``cudnn``, ``flash``, ``math``; ``auto`` picks the first that serves the call,
    see block_kernels.py).
    """
    if isinstance(local_backend, str):
        local_backend = attnhub.default_hub().registry.get(local_backend)
    thd = cu_seqlens is not None
    seq = q.shape[0] if thd else q.shape[1]
    spec = AttentionSpec(
        phase="train" if torch.is_grad_enabled() and q.requires_grad else "prefill",
        dtype=dtype_name(q.dtype), head_dim=q.shape[-1], head_dim_v=v.shape[-1],
        num_q_heads=q.shape[-2], num_kv_heads=k.shape[-2], layout="thd" if thd else "bshd",
        mask=MaskSpec(causal=causal, softcap=softcap is not None, document=thd),
        max_seqlen_q=seq, max_seqlen_k=seq,
        batch=cu_seqlens.numel() - 1 if thd else q.shape[0], return_lse=return_lse,
        deterministic=deterministic)
    params = AttnParams(
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), causal=causal,
        softcap=softcap, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        deterministic=deterministic, return_lse=return_lse)
    local = check_local(local_backend, spec)
    local.load()
    out, lse = run_ring(q, k, v, local, spec, params, group, global_seqlens, transport,
                        block_backward)
    return (out, lse) if return_lse else out
