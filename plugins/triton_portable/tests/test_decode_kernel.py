"""Split-KV decode kernel against the fp64 reference (FlashAttention rule), on the CPU through
Triton's interpreter (or on a GPU when there is one): contiguous and paged caches, GQA,
several query tokens, per-sequence lengths including 0, each mask kind the kernel takes."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():  # Triton reads this when a kernel is decorated (import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnhub_triton_portable.decode import decode_attention
from attnhub_triton_portable.decode_configs import decode_config

from attnhub.plugin import AttnParams, reference_attention
from attnhub.testing import assert_fa_rule, assert_lse

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ARCH = "sm90" if DEV == "cuda" else "cpu"


def _qkv(b: int, sq: int, hq: int, hkv: int, sk: int, d: int, dtype: torch.dtype,
         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype=dtype, device=DEV)
    return mk(b, sq, hq, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d)


def _references(q, k, v, params: AttnParams, lens: list[int]):
    """fp64 and same-precision references, each sequence over its own first ``lens[i]`` keys."""
    outs64, outs_same, lses = [], [], []
    for i, n in enumerate(lens):
        p = params
        if params.alibi_slopes is not None and params.alibi_slopes.dim() == 2:
            p = replace(params, alibi_slopes=params.alibi_slopes[i])
        qi, ki, vi = q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n]
        o64, lse = reference_attention(qi.cpu(), ki.cpu(), vi.cpu(), _cpu(p))
        o_same, _ = reference_attention(qi.cpu(), ki.cpu(), vi.cpu(), _cpu(p),
                                        compute_dtype=q.dtype)
        outs64.append(o64)
        outs_same.append(o_same)
        lses.append(lse)
    return torch.cat(outs64), torch.cat(outs_same), torch.cat(lses)


def _cpu(p: AttnParams) -> AttnParams:
    slopes = p.alibi_slopes.cpu() if p.alibi_slopes is not None else None
    return replace(p, alibi_slopes=slopes)


def _check(out, lse, refs, mult: float = 2.0) -> None:
    ref64, ref_same, ref_lse = refs
    assert_fa_rule(out.cpu(), ref64, ref_same, mult=mult)
    assert_lse(lse.cpu(), ref_lse, atol=1e-3 if out.dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype,sq,heads,splits", [
    (torch.float32, 1, (4, 1), None),
    (torch.bfloat16, 1, (4, 1), 3),
    (torch.float16, 4, (6, 2), None),
    (torch.bfloat16, 16, (6, 2), 2),
    (torch.float32, 5, (4, 4), 1),
])
def test_contiguous_matches_reference(dtype, sq, heads, splits):
    hq, hkv = heads
    q, k, v = _qkv(2, sq, hq, hkv, 77, 32, dtype)
    params = AttnParams(scale=32 ** -0.5, causal=sq > 1)
    out, lse = decode_attention(q, k, v, scale=params.scale, causal=params.causal,
                                num_splits=splits)
    _check(out, lse, _references(q, k, v, params, [77, 77]))


@pytest.mark.parametrize("kind", ["window", "softcap", "alibi_h", "alibi_bh", "top_left",
                                  "non_causal_multi"])
def test_mask_kinds(kind):
    b, sq, hq, hkv, sk, d = 2, 3, 6, 2, 53, 16
    q, k, v = _qkv(b, sq, hq, hkv, sk, d, torch.float32, seed=1)
    g = torch.Generator().manual_seed(2)
    params = {
        "window": AttnParams(scale=0.25, causal=True, window=(19, 0)),
        "softcap": AttnParams(scale=0.25, causal=True, softcap=2.0),
        "alibi_h": AttnParams(scale=0.25, causal=True,
                              alibi_slopes=torch.rand(hq, generator=g).to(DEV)),
        "alibi_bh": AttnParams(scale=0.25, causal=True,
                               alibi_slopes=torch.rand(b, hq, generator=g).to(DEV)),
        "top_left": AttnParams(scale=0.25, causal=True, alignment="top_left", window=(5, 2)),
        "non_causal_multi": AttnParams(scale=0.25, window=(30, 4)),
    }[kind]
    out, lse = decode_attention(
        q, k, v, scale=params.scale, causal=params.causal, alignment=params.alignment,
        window=params.window, softcap=params.softcap, alibi_slopes=params.alibi_slopes,
        num_splits=3)
    _check(out, lse, _references(q, k, v, params, [sk] * b))


def _paged(k: torch.Tensor, v: torch.Tensor, lens: list[int], page: int, seed: int):
    """Scatter a contiguous cache into shuffled pages (plus unused pages) and a block table."""
    b, sk, hkv, d = k.shape
    per_seq = -(-sk // page)
    num_pages = b * per_seq + 3
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    table = perm[: b * per_seq].view(b, per_seq).to(torch.int32)
    kc = torch.randn(num_pages, page, hkv, d).to(k)  # garbage where no key is stored
    vc = torch.randn(num_pages, page, hkv, d).to(v)
    for i in range(b):
        for j in range(per_seq):
            rows = slice(j * page, min((j + 1) * page, sk))
            n = rows.stop - rows.start
            kc[table[i, j], :n] = k[i, rows]
            vc[table[i, j], :n] = v[i, rows]
    return kc, vc, table.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("page,sq,dtype", [(1, 1, torch.float32), (5, 4, torch.bfloat16),
                                           (16, 2, torch.float32)])
def test_paged_matches_contiguous(page, sq, dtype):
    """Shuffled pages give bit-for-bit the contiguous result (same splits, same tiles), and
    both meet the FA rule per sequence, including a sequence of length 0."""
    lens = [37, 0, 61]
    q, k, v = _qkv(3, sq, 4, 1, 61, 32, dtype, seed=page)
    params = AttnParams(scale=32 ** -0.5, causal=True)
    kc, vc, table, seqlens = _paged(k, v, lens, page, seed=page)
    paged = decode_attention(q, kc, vc, scale=params.scale, causal=True, block_table=table,
                             seqlens_k=seqlens, num_splits=3)
    contiguous = decode_attention(q, k, v, scale=params.scale, causal=True,
                                  seqlens_k=seqlens, num_splits=3)
    assert torch.equal(paged[0], contiguous[0])
    assert torch.equal(paged[1], contiguous[1])
    _check(*paged, _references(q, k, v, params, lens))


def test_empty_rows_are_zero_with_minus_inf_lse():
    """Length-0 sequences and bottom-right rows left of key 0 (Sq > L): 0 output, -inf LSE."""
    q, k, v = _qkv(2, 4, 4, 2, 20, 16, torch.float32, seed=3)
    seqlens = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
    out, lse = decode_attention(q, k, v, scale=0.25, causal=True, seqlens_k=seqlens,
                                num_splits=2)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isneginf(lse[0]).all()
    # sequence 1 has 2 keys and 4 queries: queries 0 and 1 sit at positions -2 and -1
    assert torch.equal(out[1, :2], torch.zeros_like(out[1, :2]))
    assert torch.isneginf(lse[1, :, :2]).all() and torch.isfinite(lse[1, :, 2:]).all()
    _check(out, lse, _references(q, k, v, AttnParams(scale=0.25, causal=True), [0, 2]))


def test_fused_merge_equals_second_launch():
    """The merge in the last program and the merge as its own launch add in the same order."""
    q, k, v = _qkv(2, 2, 6, 2, 90, 32, torch.bfloat16, seed=4)
    base = decode_config(ARCH, "bf16")
    two = decode_attention(q, k, v, scale=0.2, causal=True, num_splits=4, config=base)
    one = decode_attention(q, k, v, scale=0.2, causal=True, num_splits=4,
                           config=base.with_(fused_merge=True))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    # a second call reuses the merge tickets, which the kernel must have reset to 0
    again = decode_attention(q, k, v, scale=0.2, causal=True, num_splits=4,
                             config=base.with_(fused_merge=True))
    assert torch.equal(again[0], two[0])


def test_many_rows_span_several_row_blocks():
    """16 query tokens x GQA 8 = 128 rows: two row blocks of 64 per KV head."""
    q, k, v = _qkv(1, 16, 8, 1, 40, 16, torch.float32, seed=5)
    params = AttnParams(scale=0.25, causal=True)
    out, lse = decode_attention(q, k, v, scale=0.25, causal=True, num_splits=2)
    _check(out, lse, _references(q, k, v, params, [40]))
