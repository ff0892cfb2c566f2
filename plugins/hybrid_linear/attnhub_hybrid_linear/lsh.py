"""Reformer-style LSH attention: hash, sort, attend within buckets (approximate).

Angular LSH (Kitaev et al. 2020, "Reformer"): a unit vector x goes to bucket
``argmax([xR, -xR])`` for a random rotation R (D x n_buckets/2). Queries and keys are hashed
with the same rotations, in ``n_rounds`` independent rounds. A query attends exactly (softmax)
to the keys that share its bucket in at least one round, and to no other key.

How: per round, keys and queries are sorted by (bucket, position); a block of sorted queries
spans a few buckets, whose keys are one contiguous run of the sorted keys, gathered once.
Rounds are merged by their LSEs after subtracting log(number of rounds a pair collides in)
from each score, so a key found in several rounds counts once: the result is exact softmax
attention over the union of colliding keys. Consequences worth testing: with one bucket it
is dense attention; in general it equals dense attention under the collision mask.
"""

from __future__ import annotations

import torch

from attnhub.plugin import AttnParams, InputError, query_offset

from .softmax_blocks import attend, compute_dtype, merge, no_queries


def lsh_rotations(n_rounds: int, heads: int, dim: int, n_buckets: int, seed: int,
                  device: torch.device) -> torch.Tensor:
    """(R, H, D, n_buckets/2) fp32 random rotations from a seeded CPU generator."""
    if n_buckets != 1 and (n_buckets < 2 or n_buckets % 2):
        raise InputError(f"lsh: extra['lsh_buckets']={n_buckets}; use 1 or an even number "
                         "(angular LSH splits [xR, -xR])")
    if n_rounds < 1:
        raise InputError(f"lsh: extra['lsh_rounds']={n_rounds}; use at least 1")
    gen = torch.Generator().manual_seed(seed)
    # fp32 on the generator's device, whatever torch's defaults: a float64 default failed
    # the einsum with fp32 keys (and a float64 draw of one seed is another rotation)
    rot = torch.randn(n_rounds, heads, dim, max(n_buckets // 2, 1), generator=gen,
                      dtype=torch.float32, device="cpu")
    return rot.to(device)


def lsh_buckets(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Bucket ids (R, B, H, S) of x (B, S, H, D) under rotations (R, H, D, nb/2)."""
    xn = torch.nn.functional.normalize(x.float(), dim=-1)
    proj = torch.einsum("bshd,rhdn->rbhsn", xn, rot)
    return torch.cat([proj, -proj], dim=-1).argmax(dim=-1)


def hash_queries_keys(q: torch.Tensor, k: torch.Tensor, n_buckets: int, n_rounds: int,
                      seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucket ids of q (R,B,H,Sq) and k (R,B,H,Sk); k already has q's head count."""
    if n_buckets == 1:
        lsh_rotations(n_rounds, 1, 1, 1, seed, q.device)  # validates n_rounds
        return (q.new_zeros(n_rounds, q.shape[0], q.shape[2], q.shape[1], dtype=torch.long),
                k.new_zeros(n_rounds, k.shape[0], k.shape[2], k.shape[1], dtype=torch.long))
    rot = lsh_rotations(n_rounds, q.shape[2], q.shape[3], n_buckets, seed, q.device)
    return lsh_buckets(q, rot), lsh_buckets(k, rot)


def lsh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttnParams,
                  n_buckets: int = 8, n_rounds: int = 4, seed: int = 0,
                  block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D) -> (out (B,Sq,Hq,Dv) in q's dtype, lse (B,Hq,Sq))."""
    sq, hq, sk, hkv = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    if sq == 0:  # a varlen document without queries: no block to attend, nothing to cat
        return no_queries(q, k, v)
    if hkv != hq:
        k, v = (x.repeat_interleave(hq // hkv, dim=2) for x in (k, v))
    off = query_offset(sq, sk, params.alignment)
    qb, kb = hash_queries_keys(q, k, n_buckets, n_rounds, seed)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # (B,H,S,D)
    outs, lses = [], []
    for r in range(n_rounds):
        o, l = _one_round(qh, kh, vh, qb, kb, r, n_buckets, params, off, block)
        outs.append(o)
        lses.append(l)
    out, lse = merge(outs, lses)
    return out.transpose(1, 2).to(q.dtype), lse.float()


def _one_round(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, qb: torch.Tensor,
               kb: torch.Tensor, r: int, n_buckets: int, params: AttnParams, off: int,
               block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One hashing round: (out (B,H,Sq,Dv), lse (B,H,Sq)), in the compute dtype."""
    sq, sk = qh.shape[2], kh.shape[2]
    dev = qh.device
    k_order = torch.argsort(kb[r] * sk + torch.arange(sk, device=dev))  # (B,H,Sk)
    k_sorted = kb[r].gather(-1, k_order)
    ids = torch.arange(n_buckets, device=dev).expand(*k_sorted.shape[:-1], n_buckets)
    starts = torch.searchsorted(k_sorted, ids.contiguous())
    ends = torch.searchsorted(k_sorted, ids.contiguous(), right=True)
    q_order = torch.argsort(qb[r] * sq + torch.arange(sq, device=dev))  # (B,H,Sq)
    q_sorted_b = qb[r].gather(-1, q_order)
    q_sorted = qh.gather(2, q_order.unsqueeze(-1).expand(*q_order.shape, qh.shape[-1]))
    outs, lses = [], []
    for a in range(0, sq, block):
        e = min(a + block, sq)
        lo = starts.gather(-1, q_sorted_b[..., a:a + 1])  # (B,H,1)
        hi = ends.gather(-1, q_sorted_b[..., e - 1:e])
        span = int((hi - lo).max()) if sk else 0
        idx = lo + torch.arange(span, device=dev)
        valid = idx < hi
        k_pos = k_order.gather(-1, idx.clamp(max=max(sk - 1, 0)))  # (B,H,L) key positions
        q_pos = q_order[..., a:e]  # (B,H,Q) query positions
        gather_d = k_pos.unsqueeze(-1)
        keys = kh.gather(2, gather_d.expand(*k_pos.shape, kh.shape[-1]))
        vals = vh.gather(2, gather_d.expand(*k_pos.shape, vh.shape[-1]))
        k_ids = kb.gather(-1, k_pos.expand(kb.shape[0], *k_pos.shape))  # (R,B,H,L)
        q_ids = qb.gather(-1, q_pos.expand(qb.shape[0], *q_pos.shape))  # (R,B,H,Q)
        collide = q_ids.unsqueeze(-1) == k_ids.unsqueeze(-2)  # (R,B,H,Q,L)
        ok = collide[r] & valid.unsqueeze(-2)
        if params.causal:
            ok &= k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1) + off
        rounds_seen = collide.sum(0).clamp(min=1)
        bias = -torch.log(rounds_seen.to(compute_dtype(qh)))
        o, l = attend(q_sorted[..., a:e, :], keys, vals, ok, params.scale, params.softcap, bias)
        outs.append(o)
        lses.append(l)
    inv = torch.argsort(q_order)
    out = torch.cat(outs, dim=2)
    lse = torch.cat(lses, dim=2)
    out = out.gather(2, inv.unsqueeze(-1).expand(*inv.shape, out.shape[-1]))
    return out, lse.gather(-1, inv)
