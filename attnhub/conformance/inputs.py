"""Tensors for one conformance case, packed in the case's layout, plus the same data in the
form the fp64 reference takes (bshd for equal lengths, thd otherwise)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.spec import AttentionSpec, AttnParams, MaskSpec, torch_dtype
from .budget import class_data
from .cases import SCALE, Case, relative_bias, skip_every_third


@dataclass
class Inputs:
    """What the backend gets (``q, k, v, spec, params``) and what the reference gets."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    spec: AttentionSpec
    params: AttnParams
    ref_layout: str
    ref_q: torch.Tensor
    ref_k: torch.Tensor
    ref_v: torch.Tensor
    ref_params: AttnParams
    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]
    #: Turns the reference's (out, lse) into the backend's layout.
    batched: bool


def _head_strided(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same values as views whose head dim has stride 2 (every other element of a
    tensor twice as wide)."""
    return tuple(x.new_zeros(*x.shape[:-1], 2 * x.shape[-1])[..., ::2].copy_(x) for x in ts)


def build(case: Case, device: torch.device) -> Inputs:
    """Random inputs for ``case`` on ``device`` (seeded), in the case's layout."""
    gen = torch.Generator().manual_seed(1234 + case.seed)
    dt = torch_dtype(case.dtype)
    hq, hkv = case.heads
    d, dv = case.head_dim, case.head_dim_v or case.head_dim
    amp = 3.0 if case.softcap else 1.0  # larger scores so that the cap changes the result
    # drawn in fp32 whatever torch's default dtype: a float64 draw of one seed differs
    qs = [amp * torch.randn(n, hq, d, generator=gen, dtype=torch.float32) for n in case.seqlens_q]
    ks = [amp * torch.randn(n, hkv, d, generator=gen, dtype=torch.float32) for n in case.seqlens_k]
    vs = [torch.randn(n, hkv, dv, generator=gen, dtype=torch.float32) for n in case.seqlens_k]
    b = len(qs)
    scale = SCALE / math.sqrt(d)  # not the default: a backend must use params.scale
    if case.budget_inputs:  # an error budget's input class (conformance.budget)
        qs, ks, vs = class_data(case, qs, ks, vs, gen, scale)
    extra = _mask_params(case, b, hq, hkv, max(case.seqlens_q), max(case.seqlens_k), gen)
    to = lambda t: t.to(device=device, dtype=dt)  # noqa: E731
    equal = len(set(case.seqlens_q)) == 1 and len(set(case.seqlens_k)) == 1
    if case.layout in ("bshd", "bhsd"):
        assert equal, "bshd cases have equal lengths"
        q, k, v = (to(torch.stack(x)) for x in (qs, ks, vs))
        if case.layout == "bhsd":  # what the API hands a backend: a transposed bshd view
            q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
        if case.strided:
            q, k, v = _head_strided(q, k, v)
        layout_args: dict = {}
        ref = ("bshd", q, k, v, {})
        out_shape, lse_shape = (b, qs[0].shape[0], hq, dv), (b, hq, qs[0].shape[0])
    else:
        cu_q, cu_k = _cu(case.seqlens_q, device), _cu(case.seqlens_k, device)
        ref_q, ref_k, ref_v = (to(torch.cat(x)) for x in (qs, ks, vs))
        ref = ("thd", ref_q, ref_k, ref_v, {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
                                            "max_seqlen_q": max(case.seqlens_q),
                                            "max_seqlen_k": max(case.seqlens_k)})
        if case.layout == "thd":
            q, k, v = _head_strided(ref_q, ref_k, ref_v) if case.strided else (ref_q, ref_k,
                                                                                ref_v)
            layout_args = dict(ref[4])
            out_shape = (ref_q.shape[0], hq, dv)
            lse_shape = (hq, ref_q.shape[0])
        else:  # paged: equal query counts, keys scattered over shuffled pages
            q = to(torch.stack(qs))
            k, v, table, lens = _paged(ks, vs, case.page_size, gen)
            k, v = to(k), to(v)
            layout_args = {"block_table": table.to(device), "seqlens_k": lens.to(device),
                           "max_seqlen_q": max(case.seqlens_q),
                           "max_seqlen_k": max(case.seqlens_k)}
            out_shape, lse_shape = (b, qs[0].shape[0], hq, dv), (b, hq, qs[0].shape[0])
    extra = {key: (t.to(device) if isinstance(t, torch.Tensor) else t)
             for key, t in extra.items()}
    common = dict(scale=scale, causal=case.causal, alignment=case.alignment,
                  window=case.window, softcap=case.softcap, return_lse=case.return_lse,
                  deterministic=case.deterministic, **extra)
    params = AttnParams(**common, **layout_args,  # type: ignore[arg-type]
                        dropout_p=case.dropout_p)
    if case.layout in ("bshd", "bhsd"):
        params.max_seqlen_q, params.max_seqlen_k = q.shape[1], k.shape[1]
    ref_params = AttnParams(**common, **ref[4])  # type: ignore[arg-type]
    mask = MaskSpec(causal=case.causal, alignment=case.alignment,  # type: ignore[arg-type]
                    window=case.window, alibi=case.alibi, softcap=case.softcap is not None,
                    prefix_lm=case.prefix_lm, document=case.layout == "thd",
                    column_sparse=case.column_sparse,
                    score_mod=relative_bias.__name__ if case.score_mod else None,
                    mask_mod=skip_every_third.__name__ if case.mask_mod else None)
    layout = "bshd" if case.layout == "bhsd" else case.layout
    spec = AttentionSpec(
        phase=case.phase, dtype=case.dtype, head_dim=d, head_dim_v=dv,  # type: ignore[arg-type]
        num_q_heads=hq, num_kv_heads=hkv, layout=layout, mask=mask,  # type: ignore[arg-type]
        max_seqlen_q=max(case.seqlens_q), max_seqlen_k=max(case.seqlens_k), batch=b,
        needs_grad=case.backward, deterministic=case.deterministic,
        return_lse=case.return_lse, page_size=case.page_size,
        dropout=case.dropout_p > 0).bucketed()
    return Inputs(q, k, v, spec, params, ref[0], ref[1], ref[2], ref[3], ref_params,
                  out_shape, lse_shape, batched=case.layout == "paged")


def _mask_params(case: Case, b: int, hq: int, hkv: int, sq: int, sk: int,
                 gen: torch.Generator) -> dict:
    out: dict = {}
    if case.alibi:  # per sequence: (B, Hq), which the docs allow besides (Hq,)
        shape = (b, hq) if case.alibi_per_batch else (hq,)
        out["alibi_slopes"] = torch.rand(shape, generator=gen, dtype=torch.float32) * 0.5 + 0.05
    if case.prefix_lm:
        out["prefix_lens"] = torch.randint(1, max(sk, 2), (b,), generator=gen, dtype=torch.int32)
    if case.column_sparse:
        start = torch.randint(0, max(sq, 1), (b, hkv, sk), generator=gen, dtype=torch.int32)
        out["colmask_start"] = start
        out["colmask_end"] = (start + torch.randint(0, 4, (b, hkv, sk), generator=gen,
                                                    dtype=torch.int32)).clamp(max=sq)
    if case.score_mod:
        out["score_mod"] = relative_bias
    if case.mask_mod:
        out["mask_mod"] = skip_every_third
    return out


def _cu(lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return cu.to(device)


def _paged(ks: list[torch.Tensor], vs: list[torch.Tensor], page: int, gen: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A page pool holding each sequence's keys on shuffled pages (plus one spare page)."""
    need = [-(-k.shape[0] // page) for k in ks]
    n_pages = sum(need) + 1
    order = torch.randperm(n_pages, generator=gen)
    hkv, d, dv = ks[0].shape[1], ks[0].shape[2], vs[0].shape[2]
    kc = torch.randn(n_pages, page, hkv, d, generator=gen, dtype=torch.float32)
    vc = torch.randn(n_pages, page, hkv, dv, generator=gen, dtype=torch.float32)
    table = torch.zeros(len(ks), max(need), dtype=torch.int32)
    used = 0
    for i, (k, v) in enumerate(zip(ks, vs)):
        for j in range(need[i]):
            p = int(order[used])
            used += 1
            table[i, j] = p
            chunk = slice(j * page, min((j + 1) * page, k.shape[0]))
            n = chunk.stop - chunk.start
            kc[p, :n], vc[p, :n] = k[chunk], v[chunk]
    lens = torch.tensor([k.shape[0] for k in ks], dtype=torch.int32)
    return kc, vc, table, lens
