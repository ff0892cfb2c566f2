"""Gated linear attention in plain torch: the recurrent oracle and a chunked form.

The operator (the one fla's ``chunk_gla`` computes, with ``g`` a natural-log decay)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t        (S: K x V per head)
    o_t = scale * q_t S_t

``recurrent`` is the definition, token by token: the oracle for tests and the decode step on
the CPU. ``chunked`` is the same maths in chunks of ``chunk`` tokens (states passed between
chunks, exact pairwise decays inside one), which autograd can differentiate and which runs
in O(T) memory per chunk; it is the CPU implementation for train and prefill.

All tensors are (B, T, H, D) with k, v and g already expanded to the query heads. Maths is in
fp32 (fp64 when the inputs are fp64, for the oracle); outputs come back in q's dtype, states
in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch

from attnhub.plugin import attends_nothing


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _zero_state(q: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    b, _, h, kd = q.shape
    return torch.zeros(b, h, kd, v.shape[-1], dtype=dtype, device=q.device)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
              initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token GLA: (o (B,T,H,V) in q's dtype, final state (B,H,K,V))."""
    cd = _compute_dtype(q)
    qf, kf, vf, gf = (x.to(cd) for x in (q, k, v, g))
    s = _zero_state(q, v, cd) if initial_state is None else initial_state.to(cd)
    outs = []
    for t in range(q.shape[1]):
        s = s * gf[:, t].exp().unsqueeze(-1) + kf[:, t].unsqueeze(-1) * vf[:, t].unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", qf[:, t], s) * scale)
    # no token: an empty output still in the graph of q, k, v (new_zeros would cut it)
    o = torch.stack(outs, dim=1) if outs else attends_nothing(qf, kf, vf)
    return o.to(q.dtype), s


def state_after(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """The state after consuming k, v, g (no outputs): what a prefix leaves for the rest."""
    cd = _compute_dtype(k)
    kf, vf, gf = (x.to(cd) for x in (k, v, g))
    # decay from token t (excluded) to the end, summed from the end: total - cumsum lost
    # digits on long prefixes (200k tokens: 1.5e-2 off the recurrence)
    after = gf.flip(1).cumsum(dim=1).flip(1)  # from t (included) to the end
    total = after[:, 0]  # (B,H,K): decay from the start to the end
    tail = torch.cat([after[:, 1:], torch.zeros_like(after[:, :1])], dim=1).exp()
    s = torch.einsum("bthk,bthv->bhkv", kf * tail, vf)
    if initial_state is not None:
        s = s + initial_state.to(cd) * total.exp().unsqueeze(-1)
    return s


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
            initial_state: torch.Tensor | None = None,
            chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """GLA in chunks: (o (B,T,H,V) in q's dtype, final state (B,H,K,V)). Differentiable.

    Inside a chunk the decay between t and s <= t is ``exp(G_t - G_s)`` with G the in-chunk
    cumulative log decay, formed pairwise (never as exp(G_t) * exp(-G_s), which overflows
    once a chunk's total decay passes ~88 nats).
    """
    cd = _compute_dtype(q)
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    pad = (-t) % chunk
    qf, kf, vf, gf = (torch.nn.functional.pad(x.to(cd), (0, 0, 0, 0, 0, pad))
                      for x in (q, k, v, g))
    n = (t + pad) // chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:  # (B,T,H,D) -> (B,H,N,C,D)
        return x.view(b, n, chunk, h, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc, kc, vc, gc = blocks(qf) * scale, blocks(kf), blocks(vf), blocks(gf).cumsum(dim=3)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril().unsqueeze(-1)
    diff = gc.unsqueeze(-2) - gc.unsqueeze(-3)  # (B,H,N,C_t,C_s,K)
    decay = torch.where(causal, diff, float("-inf")).exp()
    if all(bool(x.isfinite().all()) for x in (qc, kc, vc)):
        a = torch.einsum("bhntk,bhnsk,bhntsk->bhnts", qc, kc, decay)
        o = a @ vc
    else:
        # a masked pair's 0 decay times a NaN/inf k or v is NaN: it reached the earlier rows
        # of the chunk (and in the backward their dq, or an earlier NaN query reached later
        # keys' dk). So later tokens are selected away per pair; slower (C x C x V), and
        # taken only when some input is not finite
        ks, vs = (torch.where(causal, x.unsqueeze(-3), 0.0) for x in (kc, vc))
        a = torch.einsum("bhntk,bhntsk,bhntsk->bhnts", qc, ks, decay)
        o = torch.einsum("bhnts,bhntsv->bhntv", a, vs)
    last = gc[:, :, :, -1]  # (B,H,N,K)
    kv = (kc * (last.unsqueeze(-2) - gc).exp()).transpose(-1, -2) @ vc  # (B,H,N,K,V)
    s = torch.zeros(b, h, kd, vd, dtype=cd, device=q.device) if initial_state is None \
        else initial_state.to(cd)
    states = []
    for i in range(n):
        states.append(s)
        s = s * last[:, :, i].exp().unsqueeze(-1) + kv[:, :, i]
    if n:
        o = o + (qc * gc.exp()) @ torch.stack(states, dim=2)
    o = o.permute(0, 2, 3, 1, 4).reshape(b, n * chunk, h, vd)[:, :t]
    return o.to(q.dtype), s
