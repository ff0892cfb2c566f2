"""``flash_attention``: the dense Triton kernels as one differentiable call.

The forward saves q, k, v, out and the LSE; the backward recomputes probabilities from the
LSE (FlashAttention-2's scheme). Tile configs come from the tables in :mod:`.configs` (tuned
per shape bucket on a GPU) unless the caller passes its own, which is how another plugin
(ROCm) runs these kernels with its tables.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from attnhub.plugin import AttnParams, InputError, dtype_name, first_order_only

from . import autotune
from .bwd import flash_bwd, gluon_bwd_unsupported
from .configs import bwd_candidates, fwd_candidates
from .fwd import flash_fwd, gluon_unsupported
from .interpreted import serialized
from .launch import DenseArgs, device_arch

Config = dict[str, Any]


def _key(kind: str, args: DenseArgs, extra: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    return (kind, device_arch(args.q.device), args.head_dim, args.q.dtype,
            tuple(sorted(args.mask_constants().items(), key=lambda kv: kv[0])),
            autotune.bucket(args.max_seqlen_q), autotune.bucket(args.max_seqlen_k),
            autotune.bucket(args.batch * args.num_heads), args.group, *extra)


#: The forward config each exact call signature (``_call_key``) took: the candidates'
#: filter and the tuned choice read nothing else, and redoing them (a ``supports`` check per
#: Gluon candidate, the tuning key) cost tens of microseconds per call.
_FWD_CHOICE: dict[tuple[Any, ...], Config] = {}
_CHOICE_LIMIT = 1024


def _call_key(args: DenseArgs) -> tuple[Any, ...]:
    """Everything ``fwd_config_for`` depends on: q/k/v geometry, dtype, device and 16-byte
    alignment (all three aligned or not), lengths, batch and the mask switches and values."""
    q, k, v = args.q, args.k, args.v
    return (q.device, q.dtype, k.dtype, q.shape, q.stride(), k.shape, k.stride(), v.shape,
            v.stride(), (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0, args.varlen,
            args.batch, args.max_seqlen_q, args.max_seqlen_k, args.causal, args.bottom_right,
            args.left, args.right, args.softcap > 0, args.slopes is None, args.prefix is None,
            args.colmask)


def fwd_config_for(args: DenseArgs) -> Config:
    """The forward tile config for this call (table entry, or tuned on a GPU), once per
    call signature."""
    key = _call_key(args)
    cfg = _FWD_CHOICE.get(key)
    if cfg is None:
        cfg = _fwd_config(args)
        if len(_FWD_CHOICE) >= _CHOICE_LIMIT:
            _FWD_CHOICE.clear()
        _FWD_CHOICE[key] = cfg
    return cfg


def _fwd_config(args: DenseArgs) -> Config:
    cands = fwd_candidates(device_arch(args.q.device), args.head_dim, dtype_name(args.q.dtype),
                           args.causal)
    if any(c.get("GLUON") for c in cands):  # drop the Gluon ones this call cannot take
        cands = [c for c in cands if not c.get("GLUON") or gluon_unsupported(args, c) is None]
    gluon_ok = tuple(bool(c.get("GLUON")) for c in cands)
    return autotune.pick(_key("fwd", args, (gluon_ok,)), cands, args.q.device,
                         lambda cfg: flash_fwd(args, cfg))


def bwd_config_for(args: DenseArgs, out: torch.Tensor, lse: torch.Tensor,
                   dout: torch.Tensor, deterministic: bool) -> Config:
    """The backward configs for this call; only atomic-free ones when deterministic."""
    cands = bwd_candidates(device_arch(args.q.device), args.head_dim, dtype_name(args.q.dtype),
                           args.causal, deterministic)
    if any(c.get("GLUON") for c in cands):  # drop the Gluon one where it cannot run
        cands = [c for c in cands if not c.get("GLUON") or gluon_bwd_unsupported(args) is None]
    gluon_ok = any(c.get("GLUON") for c in cands)
    return autotune.pick(_key("bwd", args, (deterministic, gluon_ok)), cands, args.q.device,
                         lambda cfg: flash_bwd(args, out, lse, dout, cfg))


#: DenseArgs' tensors besides q, k, v (which may be the caller's own, when already int32 /
#: fp32 and contiguous)
_SIDE = ("cu_q", "cu_k", "slopes", "prefix", "colmask_start", "colmask_end")


def _own(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


class _DenseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                params: AttnParams, layout: str, fwd_cfg: Config | None,
                bwd_cfg: Config | None) -> tuple[torch.Tensor, torch.Tensor]:
        args = DenseArgs.from_params(q, k, v, params, layout)
        out, lse = flash_fwd(args, fwd_cfg or fwd_config_for(args))
        ctx.save_for_backward(args.q, args.k, args.v, out, lse)
        # q, k, v travel as saved tensors (version-checked), not on the args copy; the side
        # tensors as copies: a caller may refill its slopes, prefix or offsets buffer for
        # the next call before this one's backward, which must read this call's values
        ctx.args = replace(args, q=None, k=None, v=None,  # type: ignore[arg-type]
                           **{n: _own(getattr(args, n)) for n in _SIDE})
        ctx.bwd_cfg = bwd_cfg
        ctx.deterministic = bool(params.deterministic)
        ctx.set_materialize_grads(False)  # dlse stays None unless the loss uses the LSE
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:  # only the LSE reached the loss
            dout = torch.zeros_like(out)
        args = replace(ctx.args, q=q, k=k, v=v)
        with torch.no_grad(), serialized(q):  # create_graph=True: no derivative
            cfg = ctx.bwd_cfg or bwd_config_for(args, out, lse, dout, ctx.deterministic)
            dq, dk, dv = flash_bwd(args, out, lse, dout, cfg, dlse)
        # the gradients are right; differentiating them (create_graph=True) raises
        dq, dk, dv = first_order_only((dq, dk, dv), (q, k, v, dout, dlse),
                                      lambda: InputError(SECOND_ORDER))
        return dq, dk, dv, None, None, None, None


SECOND_ORDER = (
    "triton: second-order gradients (differentiating the gradients of the dense Triton "
    "kernels, e.g. a gradient penalty through torch.autograd.grad(..., create_graph=True)) "
    "are not supported: the backward is a fused kernel autograd cannot differentiate, and "
    "its gradients would silently count as constants. The first-order gradients are exact; "
    "for that term use a backend whose backward is differentiable (backend='reference' or "
    "'sliding_window'), or detach() the gradients")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttnParams,
                    layout: str = "bshd", *, fwd_cfg: Config | None = None,
                    bwd_cfg: Config | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with the dense Triton kernels: ``(out, lse)``, differentiable in q, k, v.

    ``layout`` is ``bshd`` (q (B,Sq,Hq,D), lse (B,Hq,Sq)) or ``thd`` (q (Tq,Hq,D) with
    ``params.cu_seqlens_q/k``, lse (Hq,Tq)); ``params.max_seqlen_q/k`` size the launch grid,
    so, as in FlashAttention, they must be at least the longest sequence (read from
    cu_seqlens, with a host sync, when absent). ``fwd_cfg``/``bwd_cfg`` override the tile
    tables (see :mod:`.configs` for their form).
    """
    if params.deterministic and bwd_cfg is not None and bwd_cfg.get("dq_mode") == "atomic":
        raise InputError("deterministic=True with a backward config whose dq_mode is "
                         "'atomic': use dq_mode='separate' (no atomics) for bitwise-equal "
                         "gradients")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if needs_grad:
        out, lse = _DenseAttention.apply(q, k, v, params, layout, fwd_cfg, bwd_cfg)
        return out, lse
    args = DenseArgs.from_params(q, k, v, params, layout)
    return flash_fwd(args, fwd_cfg or fwd_config_for(args))
