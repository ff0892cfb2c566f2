"""Serve thd and paged calls with a per-sequence bshd function.

The sparse and linear engines here are written for (B, S, H, D). Varlen (thd) and paged calls
are cut into their sequences (paged through :func:`attnhub.plugin.paged_to_varlen`, a copy)
and each runs as a batch of one; the ``Doc`` tells the engine which sequence it is, so that
per-sequence extras (packed gates, state ids) can be sliced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from attnhub.plugin import AttentionOutput, AttentionSpec, AttnParams, doc_ranges, paged_to_varlen


@dataclass(frozen=True)
class Doc:
    """Sequence ``index`` of a varlen batch; its keys are rows [k_start, k_end) of packed k."""

    index: int
    k_start: int
    k_end: int


#: (q, k, v, params, doc) -> (out (1|B, Sq, Hq, Dv), lse (1|B, Hq, Sq) or None); doc is None
#: for a plain bshd batch.
BshdFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttnParams, "Doc | None"],
                  tuple[torch.Tensor, "torch.Tensor | None"]]


def serve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
          params: AttnParams, run: BshdFn) -> AttentionOutput:
    """Run ``run`` on bshd directly, on each sequence of thd/paged, and reassemble."""
    if spec.layout == "paged":
        b, sq = q.shape[:2]
        qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, k, v, params.block_table, params.seqlens_k)
        p = replace(params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, block_table=None)
        out, lse = _varlen(qv, kv, vv, p, run)
        lse_b = lse.view(lse.shape[0], b, sq).transpose(0, 1) if lse is not None else None
        return AttentionOutput(out.view(b, sq, *out.shape[1:]), lse_b)
    if spec.layout == "thd":
        return AttentionOutput(*_varlen(q, k, v, params, run))
    return AttentionOutput(*run(q, k, v, params, None))


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttnParams,
            run: BshdFn) -> tuple[torch.Tensor, torch.Tensor | None]:
    outs, lses = [], []
    slopes = params.alibi_slopes
    for i, ((qs, qe), (ks, ke)) in enumerate(zip(doc_ranges(params.cu_seqlens_q),
                                                   doc_ranges(params.cu_seqlens_k))):
        p = replace(params, cu_seqlens_q=None, cu_seqlens_k=None,
                    alibi_slopes=slopes[i] if slopes is not None and slopes.dim() == 2
                    else slopes)
        o, l = run(q[qs:qe][None], k[ks:ke][None], v[ks:ke][None], p, Doc(i, ks, ke))
        outs.append(o[0])
        lses.append(l[0] if l is not None else None)
    lse = torch.cat(lses, dim=-1) if lses and lses[0] is not None else None  # type: ignore
    return torch.cat(outs, dim=0), lse
