"""``ring_attention``: the ring without a policy, for scripts that pick the local kernel."""

from __future__ import annotations

import math

import torch

import attnhub
from attnhub import UnknownBackendError
from attnhub.plugin import (AttentionSpec, AttnParams, Backend, InputError, MaskSpec, check_call,
                            dtype_name)

from .backend import check_local, load_local
from .comm import ProcessGroup, RingError
from .ring import Transport, run_ring


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, local_backend: Backend | str,
    causal: bool = False, scale: float | None = None, softcap: float | None = None,
    cu_seqlens: torch.Tensor | None = None, group: ProcessGroup | None = None,
    global_seqlens: list[int] | None = None, return_lse: bool = False,
    deterministic: bool = False, transport: Transport | None = None,
    block_backward: str = "auto", sharding: str = "zigzag",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of this rank's shard against the whole sequence.

    q/k/v are this rank's shard: bshd (B, S_local, H, D) from :func:`zigzag_shard`, or thd
    (T_local, H, D) with its local ``cu_seqlens`` from :func:`zigzag_shard_varlen`.
    ``sharding`` says how the sequence was cut: ``"zigzag"`` (those helpers) or
    ``"contiguous"`` (``torch.tensor_split``, :func:`contiguous_shard`). Shards carry no
    positions, so the ring cannot tell them apart: a causal call on contiguous shards passed
    as zigzag would be silently wrong. Every rank must pass the same (the handshake checks).
    ``local_backend`` is a backend object or a registered name (``"torch_sdpa"``).
    Every call starts with a handshake (handshake.py: one small all-gather and host sync)
    that checks the ranks agree and raises the same error on every rank when they do not or
    when one rank's inputs are refused; ``global_seqlens`` (the unsharded lengths) limits it
    to calls that differ from the last agreed call of their geometry.
    ``transport`` replaces the process group: :class:`attnhub_ring.simulate.SimulatedRing`
    plays one rank of a ring on a single device (for measuring, see simulate.py). Any
    backend that returns the LSE is accepted here; a policy binds only one that returns it
    natively (not ``lse_second_pass``). ``block_backward`` forces the kernel of the blocks'
    gradients (``cudnn``, ``flash``, ``math``; ``auto`` picks the first that serves the call,
    see block_kernels.py).
    """
    thd = cu_seqlens is not None
    problem = _input_problem(q, k, v, causal, scale, softcap, cu_seqlens, return_lse,
                             deterministic)
    seq = q.shape[0] if thd else q.shape[1]
    spec = params = local = None
    if problem is None:
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
        try:
            if isinstance(local_backend, str):
                local_backend = attnhub.default_hub().registry.get(local_backend)
            local = check_local(local_backend, spec)
            load_local(local)
        except (RingError, UnknownBackendError) as exc:
            problem = str(exc) if isinstance(exc, RingError) else f"ring: {exc}"
            local = None
    if problem is not None:  # raised on every rank (the handshake), or here without a group
        spec, params = _UNUSED_SPEC, AttnParams(scale=1.0)
    assert spec is not None and params is not None
    out, lse = run_ring(q, k, v, local, spec, params, group, global_seqlens, transport,
                        block_backward, problem=problem, sharding=sharding)
    return (out, lse) if return_lse else out


#: What run_ring is given on a rank that refuses the call (it reads neither).
_UNUSED_SPEC = AttentionSpec(phase="prefill", dtype="fp32", head_dim=1, num_q_heads=1,
                             num_kv_heads=1)


def _input_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float | None, softcap: float | None,
                   cu_seqlens: torch.Tensor | None, return_lse: bool,
                   deterministic: bool) -> str | None:
    """The hub's own input contract (docs/contract.md) for a ring call made without the
    hub: why this rank's q/k/v and arguments are not a valid call, or None. Not tensors at
    all (no device to tell the other ranks from) raise here."""
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        raise RingError("ring_attention: q, k and v must be torch tensors (this rank's shard)")
    try:
        check_call(q, k, v, layout="bshd" if cu_seqlens is None else "thd", causal=causal,
                   causal_alignment="bottom_right", window=None, softcap=softcap, scale=scale,
                   alibi_slopes=None, prefix_lens=None, colmask_start=None, colmask_end=None,
                   cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=None,
                   max_seqlen_k=None, block_table=None, seqlens_k=None, phase=None,
                   return_lse=return_lse, deterministic=deterministic)
    except InputError as exc:
        return f"ring_attention: {exc}"
    return None
