"""torch_sdpa against the fp64 reference by the FlashAttention rule, forward and gradients."""

from __future__ import annotations

import math

import pytest
import torch

import attnhub
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.testing import assert_fa_rule, assert_lse

MASKS = {
    "none": {},
    "causal": {"causal": True},
    "causal_top_left": {"causal": True, "causal_alignment": "top_left"},
    "window": {"window": (7, 3)},
    "causal_window": {"causal": True, "window": 5},
    "alibi": {"alibi_slopes": "rand"},
    "causal_alibi": {"causal": True, "alibi_slopes": "rand"},
    "prefix_lm": {"causal": True, "prefix_lens": "rand"},
    "column_sparse": {"colmask": True},
    "mask_mod": {"mask_mod": lambda b, h, q, k: (q + k) % 3 != 0},
}


def _kwargs(name: str, b: int, hq: int, hkv: int, sq: int, sk: int) -> dict:
    kw = dict(MASKS[name])
    if kw.get("alibi_slopes") == "rand":
        kw["alibi_slopes"] = torch.rand(hq) * 0.3
    if kw.get("prefix_lens") == "rand":
        kw["prefix_lens"] = torch.randint(0, sk + 1, (b,))
    if kw.pop("colmask", False):
        start = torch.randint(0, sq + 1, (b, hkv, sk), dtype=torch.int32)
        kw["colmask_start"] = start
        kw["colmask_end"] = torch.minimum(start + torch.randint(0, sq + 1, start.shape,
                                                                  dtype=torch.int32),
                                          torch.tensor(sq, dtype=torch.int32))
    return kw


def _params(q: torch.Tensor, kw: dict) -> AttnParams:
    p = AttnParams(scale=1 / math.sqrt(q.shape[-1]))
    for key, val in kw.items():
        setattr(p, {"causal_alignment": "alignment"}.get(key, key), val)
    if isinstance(p.window, int):
        p.window = (p.window, 0)
    return p


def _check(hub, q, k, v, kw, grads: bool) -> None:
    for t in (q, k, v):
        t.requires_grad_(grads)
    out, lse = hub.attention(q, k, v, backend="torch_sdpa", return_lse=True, **kw)
    p = _params(q, kw)
    ref, ref_lse = reference_attention(q, k, v, p)
    same, _ = reference_attention(q, k, v, p, compute_dtype=q.dtype)
    assert_fa_rule(out, ref, same, what="output")
    assert_lse(lse, ref_lse, atol=1e-3 if q.dtype == torch.float32 else 2e-2)
    if not grads:
        return
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    dref = torch.autograd.grad(ref, (q, k, v), g.double())
    dsame = torch.autograd.grad(same, (q, k, v), g)
    for name, a, r, s in zip("qkv", (dq, dk, dv), dref, dsame):
        assert_fa_rule(a, r, s, mult=3, what=f"d{name}")


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("sq,sk", [(113, 203), (203, 113), (1, 113), (17, 17)])
def test_masks_fwd_bwd(hub, mask, sq, sk):
    b, hq, hkv, d = 2, 6, 2, 40
    q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16)
    k = torch.randn(b, sk, hkv, d, dtype=torch.bfloat16)
    v = torch.randn(b, sk, hkv, d, dtype=torch.bfloat16)
    _check(hub, q, k, v, _kwargs(mask, b, hq, hkv, sq, sk), grads=True)


@pytest.mark.parametrize("d", [32, 59, 64, 111, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (6, 1)])
def test_head_dims_and_gqa(hub, d, hq, hkv):
    q = torch.randn(1, 37, hq, d, dtype=torch.float16)
    k = torch.randn(1, 53, hkv, d, dtype=torch.float16)
    v = torch.randn(1, 53, hkv, d, dtype=torch.float16)
    _check(hub, q, k, v, {"causal": True}, grads=True)


def test_long_sequence_fp32(hub):
    q, k, v = (torch.randn(1, 1023, 2, 64) for _ in range(3))
    _check(hub, q, k, v, {"causal": True}, grads=False)


def test_strided_inputs_match_contiguous(hub):
    base = torch.randn(2, 4, 50, 64, dtype=torch.bfloat16)
    q = base[:, :, :33, ::2].transpose(1, 2)  # non-contiguous in every way
    k = torch.randn(2, 60, 4, 64, dtype=torch.bfloat16)[:, 10:, :, :32]
    v = torch.randn(2, 4, 50, 32, dtype=torch.bfloat16).transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    p = AttnParams(scale=32 ** -0.5, causal=True)
    ref, _ = reference_attention(q, k, v, p)
    same, _ = reference_attention(q, k, v, p, compute_dtype=q.dtype)
    for name in ("torch_sdpa", "reference"):
        a = hub.attention(q, k, v, causal=True, backend=name)
        c = hub.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True,
                          backend=name)
        # SDPA may pick another CPU kernel for strided inputs: equal within rounding.
        assert_fa_rule(a, ref, same, what=f"{name} strided")
        torch.testing.assert_close(a, c, atol=8e-3, rtol=0)


def test_bhsd_layout_is_a_view_of_bshd(hub):
    q, k, v = (torch.randn(2, 3, 9, 16) for _ in range(3))
    a = hub.attention(q, k, v, layout="bhsd", causal=True, backend="torch_sdpa")
    b = hub.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                      backend="torch_sdpa")
    torch.testing.assert_close(a, b.transpose(1, 2))


def test_varlen_thd_matches_per_document(hub):
    lens_q, lens_k = [5, 0, 17, 1], [9, 3, 17, 30]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 32, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 32, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 32, requires_grad=True)
    kw = dict(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    out, lse = hub.attention(q, k, v, backend="torch_sdpa", return_lse=True, **kw)
    p = AttnParams(scale=32 ** -0.5, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref, ref_lse = reference_attention(q, k, v, p, layout="thd")
    same, _ = reference_attention(q, k, v, p, layout="thd", compute_dtype=torch.float32)
    assert_fa_rule(out, ref, same)
    assert_lse(lse, ref_lse)
    out.sum().backward()
    assert not torch.isnan(q.grad).any() and k.grad.abs().sum() > 0


def test_paged_matches_contiguous(hub):
    page, b, hkv, d = 5, 3, 2, 16
    lens = [7, 13, 1]
    n_pages = sum((n + page - 1) // page for n in lens) + 2
    kc, vc = torch.randn(n_pages, page, hkv, d), torch.randn(n_pages, page, hkv, d)
    perm = torch.randperm(n_pages).to(torch.int32)
    table = torch.zeros(b, 3, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        m = (n + page - 1) // page
        table[i, :m] = perm[used:used + m]
        used += m
    q = torch.randn(b, 2, 4, d)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out = hub.attention(q, kc, vc, layout="paged", block_table=table, seqlens_k=seqlens,
                        causal=True, backend="torch_sdpa")
    for i, n in enumerate(lens):
        pages = table[i, : (n + page - 1) // page].long()
        k = kc[pages].flatten(0, 1)[:n][None]
        v = vc[pages].flatten(0, 1)[:n][None]
        ref = hub.attention(q[i:i + 1], k, v, causal=True, backend="reference")
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_zero_and_no_nan(hub):
    # Sq > Sk with bottom-right causal: the first Sq - Sk queries see no key at all.
    q = torch.randn(1, 6, 2, 16, requires_grad=True)
    k = torch.randn(1, 3, 2, 16, requires_grad=True)
    v = torch.randn(1, 3, 2, 16, requires_grad=True)
    for name in ("torch_sdpa", "reference"):
        out, lse = hub.attention(q, k, v, causal=True, return_lse=True, backend=name)
        assert torch.all(out[:, :3] == 0) and torch.all(out[:, 3:].abs().sum(-1) > 0)
        assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
        gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
        assert not any(torch.isnan(g).any() for g in (gq, gk, gv))
        assert torch.all(gq[:, :3] == 0)


def test_sdpa_refuses_softcap_with_reason(hub):
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(attnhub.BackendUnavailableError, match="softcap"):
        hub.attention(q, q, q, softcap=30.0, backend="torch_sdpa")
    out = hub.attention(q, q, q, softcap=5.0, backend="reference")
    p = AttnParams(scale=0.25, softcap=5.0)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), q.double()) * 0.25
    expect = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(torch.tanh(s / 5) * 5, -1), q.double())
    torch.testing.assert_close(out.double(), expect)
    assert reference_attention(q, q, q, p)[0].shape == out.shape
