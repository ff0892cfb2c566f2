"""Audit of fa2's translation against a literal model of flash_attn's kernel conventions.

The fake below follows ``csrc/flash_attn/flash_api.cpp`` and ``src/mask.h`` (flash-attention
0251105): window edges >= the key length clamp to unbounded, causal sets the right edge 0,
and the causal kernel adds ALiBi as ``+slope * key`` (not ``-slope * |pos - key|``), which
leaves the output exact and moves the LSE by ``slope * query_pos``. attnhub's LSE must not.
FlashInfer's wrappers are checked by binding every call to their real signatures.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import types

import pytest
import torch
from attnhub_sm80_fa2.fa2 import FlashAttn2Backend
from attnhub_sm80_fa2.flashinfer_paged import FlashInferDecodeBackend, FlashInferPrefillBackend

import attnhub
from attnhub.plugin import AttentionSpec, AttnParams, BackendUnavailableError, MaskSpec
from attnhub.plugin import reference_attention as ref_attn
from attnhub.testing import assert_lse

SM80 = attnhub.simulate("sm80")


def fa2_kernel(q, k, v, *, softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0,
               alibi_slopes=None, clamp_k=None, **_):
    """(out, lse) as flash_attn's kernel computes them for one bshd batch."""
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    clamp_k = sk if clamp_k is None else clamp_k
    left, right = (-1 if w >= clamp_k else w for w in window_size)
    right = 0 if causal else right
    is_causal = left < 0 and right == 0
    g = hq // k.shape[2]
    kk, vv = (x.repeat_interleave(g, 2).transpose(1, 2).float() for x in (k, v))
    s = q.transpose(1, 2).float() @ kk.transpose(-1, -2) * softmax_scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    row = torch.arange(sq).view(sq, 1) + sk - sq
    col = torch.arange(sk).view(1, sk)
    if alibi_slopes is not None:
        sl = alibi_slopes.view(-1, hq, 1, 1)
        s = s + (sl * col if is_causal else -sl * (row - col).abs())
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if is_causal or right >= 0:
        keep &= col <= row + max(right, 0)
    if left >= 0:
        keep &= col >= row - left
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse.unsqueeze(-1)))
    return (p @ vv).transpose(1, 2).to(q.dtype), lse.masked_fill(lse == -torch.inf, torch.inf)


def _row(slopes, i):
    """Sequence ``i``'s slopes from (Hq,) or (B, Hq) ones (the kernel indexes by batch)."""
    return slopes if slopes is None or slopes.dim() == 1 else slopes[i]


def _docs(cu):
    c = cu.tolist()
    return list(zip(c[:-1], c[1:]))


@pytest.fixture
def fa(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A fake ``flash_attn.flash_attn_interface`` built on ``fa2_kernel``; records kwargs."""
    calls: dict = {}
    mod = types.ModuleType("flash_attn.flash_attn_interface")

    def flash_attn_func(q, k, v, return_attn_probs=False, deterministic=False, **kw):
        calls["dense"] = dict(kw, deterministic=deterministic)
        out, lse = fa2_kernel(q, k, v, **kw)
        return (out, lse, None) if return_attn_probs else out

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_attn_probs=False,
                               deterministic=False, **kw):
        calls["varlen"] = dict(kw, max_q=max_q, max_k=max_k)
        slopes = kw.pop("alibi_slopes", None)
        res = [fa2_kernel(q[None, a:b], k[None, c:d], v[None, c:d], clamp_k=max_k,
                          alibi_slopes=_row(slopes, i), **kw)
               for i, ((a, b), (c, d)) in enumerate(zip(_docs(cu_q), _docs(cu_k)))]
        out = torch.cat([o[0] for o, _ in res])
        lse = torch.cat([lse[0] for _, lse in res], dim=-1)
        return (out, lse, None) if return_attn_probs else out

    def flash_attn_with_kvcache(q, kc, vc, cache_seqlens, block_table, return_softmax_lse,
                                alibi_slopes=None, **kw):
        calls["kvcache"] = dict(kw, alibi_slopes=alibi_slopes)
        page, res = kc.shape[1], []
        for i, n in enumerate(cache_seqlens.tolist()):
            pages = block_table[i, : (n + page - 1) // page].long()
            kk, vv = (c[pages].flatten(0, 1)[:n][None] for c in (kc, vc))
            res.append(fa2_kernel(q[i:i + 1], kk, vv, alibi_slopes=_row(alibi_slopes, i),
                                  clamp_k=block_table.shape[1] * page, **kw))
        return torch.cat([o for o, _ in res]), torch.cat([lse for _, lse in res])

    for f in (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache):
        setattr(mod, f.__name__, f)
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []  # type: ignore[attr-defined]
    pkg.flash_attn_interface = mod  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", mod)
    return calls


def spec(layout: str = "bshd", sq: int = 8, sk: int = 8, **mask) -> AttentionSpec:
    return AttentionSpec(phase="prefill", dtype="fp16", head_dim=16, num_q_heads=4,
                         num_kv_heads=2, layout=layout, max_seqlen_q=sq, max_seqlen_k=sk,
                         mask=MaskSpec(document=layout == "thd", **mask), return_lse=True)


def run(q, k, v, sp, p):
    be = FlashAttn2Backend()
    be.load()
    return be.forward(q, k, v, sp, p)


def qkv(lead: tuple[int, ...], sq: int, sk: int, seed: int = 0):
    """q (*lead, Sq, 4, 16) and k, v (*lead, Sk, 2, 16): bshd with lead (B,), thd with ()."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*lead, sq, 4, 16, generator=g),
            torch.randn(*lead, sk, 2, 16, generator=g),
            torch.randn(*lead, sk, 2, 16, generator=g))


SLOPES = {"per_head": torch.tensor([0.5, 0.25, 0.125, 0.0625]),
          "per_batch": torch.tensor([[0.5, 0.25, 0.125, 0.0625], [0.3, 0.2, 0.1, 0.05]],
                                    dtype=torch.float64)}


@pytest.mark.parametrize("shape", ["per_head", "per_batch"])
@pytest.mark.parametrize("sq,sk,align,window", [
    (5, 9, "bottom_right", None), (6, 6, "bottom_right", None), (1, 7, "bottom_right", None),
    (4, 9, "top_left", None), (7, 3, "bottom_right", None), (5, 9, "bottom_right", (20, 0)),
    (5, 9, "bottom_right", (2, 0)),  # a bounded left edge: the kernel's local branch
])
def test_causal_alibi_lse_is_attnhubs(fa, shape, sq, sk, align, window):
    """Before the audit fa2 returned the kernel's LSE, off by slope * query position."""
    q, k, v = qkv((2,), sq, sk)
    p = AttnParams(scale=0.3, causal=True, alignment=align, window=window,
                   alibi_slopes=SLOPES[shape], return_lse=True)
    out, lse = run(q, k, v, spec(sq=sq, sk=sk, causal=True, alignment=align, window=window,
                                 alibi=True), p)
    ref, ref_lse = ref_attn(q, k, v, p, compute_dtype=torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert_lse(lse, ref_lse, atol=1e-4)
    assert fa["dense"]["alibi_slopes"].dtype == torch.float32
    assert fa["dense"]["causal"] is True


def test_varlen_causal_alibi_lse(fa):
    cu_q = torch.tensor([0, 2, 2, 7, 8], dtype=torch.int32)  # an empty document too
    cu_k = torch.tensor([0, 5, 9, 14, 14 + 6], dtype=torch.int32)
    q, k, v = qkv((), 8, 20)
    slopes = torch.rand(4, 4, dtype=torch.float64)
    p = AttnParams(scale=0.3, causal=True, alibi_slopes=slopes, cu_seqlens_q=cu_q,
                   cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6, return_lse=True)
    out, lse = run(q, k, v, spec("thd", 5, 6, causal=True, alibi=True), p)
    ref, ref_lse = ref_attn(q, k, v, p, layout="thd", compute_dtype=torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert lse.shape == (4, 8)
    assert_lse(lse, ref_lse, atol=1e-4)
    assert fa["varlen"]["max_q"] == 5 and fa["varlen"]["max_k"] == 6


def test_paged_causal_alibi_lse(fa, helpers):
    kc, vc, table, lens = helpers.paged(2, [300, 45], 256, 2, 16)
    q = torch.randn(2, 3, 4, 16)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    p = AttnParams(scale=0.3, causal=True, alibi_slopes=slopes, block_table=table,
                   seqlens_k=lens, return_lse=True)
    sp = AttentionSpec(phase="prefill", dtype="fp16", head_dim=16, num_q_heads=4,
                       num_kv_heads=2, layout="paged", page_size=256, return_lse=True,
                       mask=MaskSpec(causal=True, alibi=True))
    out, lse = run(q, kc, vc, sp, p)
    for i, n in enumerate(lens.tolist()):
        pages = table[i, : (n + 255) // 256].long()
        kk, vv = (c[pages].flatten(0, 1)[:n][None] for c in (kc, vc))
        ref, ref_lse = ref_attn(q[i:i + 1], kk, vv, p, compute_dtype=torch.float32)
        torch.testing.assert_close(out[i:i + 1], ref, atol=2e-5, rtol=1e-5)
        assert_lse(lse[i:i + 1], ref_lse, atol=1e-4)
    assert fa["kvcache"]["alibi_slopes"].dtype == torch.float32


@pytest.mark.parametrize("sq,sk", [(4, 9), (9, 4)])
def test_top_left_alibi_without_mask_is_refused(fa, sq, sk):
    """The kernel puts ALiBi's query positions bottom-right; top-left differs when Sq != Sk."""
    q, k, v = qkv((1,), sq, sk)
    p = AttnParams(scale=0.3, alignment="top_left", alibi_slopes=SLOPES["per_head"])
    with pytest.raises(BackendUnavailableError, match="ALiBi with top-left"):
        run(q, k, v, spec(sq=sq, sk=sk, alignment="top_left", alibi=True), p)
    assert "dense" not in fa


def test_top_left_alibi_same_lengths_runs(fa):
    q, k, v = qkv((1,), 6, 6)
    p = AttnParams(scale=0.3, alignment="top_left", alibi_slopes=SLOPES["per_head"],
                   return_lse=True)
    out, lse = run(q, k, v, spec(sq=6, sk=6, alignment="top_left", alibi=True), p)
    ref, ref_lse = ref_attn(q, k, v, p, compute_dtype=torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert_lse(lse, ref_lse, atol=1e-4)


@pytest.mark.parametrize("layout,sq,sk,refused", [
    ("thd", 8, 8, True), ("paged", 1, 512, True), ("bshd", 8, 16, True), ("bshd", 8, 8, False),
])
def test_top_left_alibi_capability_check(layout, sq, sk, refused):
    sp = spec(layout, sq, sk, alignment="top_left", alibi=True)
    if layout == "paged":
        sp = dataclasses.replace(sp, page_size=256, phase="decode")
    reasons = FlashAttn2Backend().check(sp, SM80)
    assert any("ALiBi with top-left" in r for r in reasons) is refused


# -- FlashInfer: arguments bound to the real signatures -------------------------------------
# flashinfer fb28d72 (flashinfer/decode.py, prefill.py): the recording fakes in conftest take
# ``**kw``, which would accept a misspelt keyword; these bind every call to the real names.
def _decode_init(float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None): ...


def _prefill_init(float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                  qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                  paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                  backend="auto", jit_args=None, jit_kwargs=None): ...


def _decode_plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                 page_size, *, pos_encoding_mode="NONE", window_left=-1, window_right=0,
                 logits_soft_cap=None, q_data_type="float16", kv_data_type=None,
                 o_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
                 rope_theta=None, non_blocking=True, seq_lens=None, block_tables=None,
                 fixed_split_size=None, disable_split_kv=False, q_len_per_req=1): ...


def _prefill_plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                  num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
                  custom_mask=None, packed_custom_mask=None, causal=False,
                  pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
                  window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                  q_data_type="float16", kv_data_type=None, o_data_type=None,
                  non_blocking=True): ...


def _run(q, paged_kv_cache, *args, k_scale=None, v_scale=None, out=None, lse=None,
         return_lse=False, enable_pdl=None, window_left=None, sinks=None): ...


@pytest.fixture
def strict_flashinfer(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Wrappers that bind each call to the real signature; ``run`` returns a known base-2
    LSE, ``lse2[token, head] = 10 * token + head``."""
    seen: dict = {}

    def wrapper(kind, init, plan):
        class Wrapper:
            def __init__(self, *a, **kw):
                seen[f"{kind}.init"] = inspect.signature(init).bind(*a, **kw).arguments

            def plan(self, *a, **kw):
                seen[f"{kind}.plan"] = inspect.signature(plan).bind(*a, **kw).arguments

            def run(self, *a, **kw):
                args = seen[f"{kind}.run"] = inspect.signature(_run).bind(*a, **kw).arguments
                q = args["q"]
                lse2 = torch.arange(q.shape[0]).view(-1, 1) * 10.0 + torch.arange(q.shape[1])
                out = torch.zeros_like(q)
                return (out, lse2) if args.get("return_lse") else out
        return Wrapper

    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = wrapper("decode", _decode_init, _decode_plan)
    mod.BatchPrefillWithPagedKVCacheWrapper = wrapper("prefill", _prefill_init, _prefill_plan)
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setenv("ATTNHUB_FLASHINFER_TENSOR_CORES", "0")
    return seen


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_flashinfer_arguments_bind_to_the_real_signatures(strict_flashinfer, helpers, kind):
    sq = 1 if kind == "decode" else 3
    kc, vc, table, lens = helpers.paged(2, [40, 20], 16, 2, 64, dtype=torch.float16)
    q = torch.randn(2, sq, 4, 64).half()
    p = AttnParams(scale=0.2, causal=True, window=(7, 0), softcap=4.0, block_table=table,
                   seqlens_k=lens, max_seqlen_k=40, return_lse=True)
    be = (FlashInferDecodeBackend if kind == "decode" else FlashInferPrefillBackend)()
    be.workspace_bytes = 64
    be.load()
    sp = AttentionSpec(phase="decode" if kind == "decode" else "prefill", dtype="fp16",
                       head_dim=64, num_q_heads=4, num_kv_heads=2, layout="paged",
                       page_size=16, return_lse=True,
                       mask=MaskSpec(causal=True, window=(7, 0), softcap=True))
    out, lse = be.forward(q, kc, vc, sp, p)
    plan = strict_flashinfer[f"{kind}.plan"]
    assert plan["num_qo_heads"] == 4 and plan["num_kv_heads"] == 2 and plan["page_size"] == 16
    assert plan["head_dim" if kind == "decode" else "head_dim_qk"] == 64
    assert plan["sm_scale"] == 0.2 and plan["window_left"] == 7
    assert plan["logits_soft_cap"] == 4.0
    assert plan["q_data_type"] == torch.float16 and plan["kv_data_type"] == torch.float16
    assert strict_flashinfer[f"{kind}.init"]["kv_layout"] == "NHD"
    if kind == "prefill":
        assert plan["causal"] is True
        assert plan["qo_indptr"].tolist() == [0, sq, 2 * sq]
    assert plan["paged_kv_indptr" if kind == "prefill" else "indptr"].dtype == torch.int32
    run = strict_flashinfer[f"{kind}.run"]
    assert run["return_lse"] is True and run["q"].shape == (2 * sq, 4, 64)
    token = torch.arange(2 * sq).view(2, 1, sq)
    want = (token * 10.0 + torch.arange(4).view(1, 4, 1)) * math.log(2.0)  # (B, Hq, Sq)
    torch.testing.assert_close(lse, want)
    assert out.shape == q.shape
