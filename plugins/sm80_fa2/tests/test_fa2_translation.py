"""fa2 and fa2_torch against recording fakes: the arguments they pass and the numbers they get.

The fakes compute what a bottom-right FlashAttention kernel returns, so a wrong translation of
alignment, window, softcap, ALiBi or LSE shows up as a mismatch with attnhub's reference.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attnhub_sm80_fa2 import fa2_torch
from attnhub_sm80_fa2.fa2 import FlashAttn2Backend
from attnhub_sm80_fa2.fa2_torch import TorchFlashBackend

import attnhub
from attnhub.plugin import AttnParams, BackendUnavailableError, paged_to_varlen
from attnhub.plugin import reference_attention as ref_attn
from attnhub.testing import assert_lse, flash_reference


def qkv(b: int, sq: int, sk: int, hq: int = 4, hkv: int = 2, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, hq, d, generator=g), torch.randn(b, sk, hkv, d, generator=g),
            torch.randn(b, sk, hkv, d, generator=g))


def run(backend, q, k, v, spec, params):
    backend.load()
    return backend.forward(q, k, v, spec, params)


MASKS = [  # sq, sk, causal, alignment, window
    (5, 9, True, "top_left", None),
    (6, 6, True, "bottom_right", (2, 0)),
    (4, 10, False, "top_left", (1, 2)),
    (7, 3, False, "bottom_right", None),
    (3, 8, True, "bottom_right", (4, -1)),
]


@pytest.mark.parametrize("sq,sk,causal,align,window", MASKS)
def test_fa2_dense_masks_match_reference(fake_flash_attn, helpers, sq, sk, causal, align,
                                         window):
    q, k, v = qkv(2, sq, sk)
    p = AttnParams(scale=0.3, causal=causal, alignment=align, window=window, return_lse=True)
    spec = helpers.spec(q, k, causal=causal, alignment=align, window=window, return_lse=True)
    out, lse = run(FlashAttn2Backend(), q, k, v, spec, p)
    ref, ref_lse = ref_attn(q, k, v, p, compute_dtype=torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert_lse(lse, ref_lse, atol=1e-4)
    kw = fake_flash_attn.last("flash_attn_func")
    assert kw["softmax_scale"] == 0.3 and kw["return_attn_probs"] is True


def test_fa2_top_left_causal_is_converted_not_approximated(fake_flash_attn, helpers):
    q, k, v = qkv(1, 5, 9)
    p = AttnParams(scale=0.25, causal=True, alignment="top_left")
    run(FlashAttn2Backend(), q, k, v, helpers.spec(q, k, causal=True, alignment="top_left"), p)
    kw = fake_flash_attn.last("flash_attn_func")
    assert kw["sk"] == 5 and kw["causal"] is True  # keys no query sees are cut off


@pytest.mark.parametrize("sq,sk,align,window", [
    (9, 6, "top_left", None),  # a right edge of 3 < Sk would do, but FA3 builds lack windows
    (12, 5, "top_left", None),  # right edge 7 >= Sk: FlashAttention would make it unbounded
    (12, 5, "bottom_right", (-1, 6)),  # the same clamp on a user's window
])
def test_fa2_refuses_masks_the_kernel_clamps(fake_flash_attn, helpers, sq, sk, align, window):
    """Found by the conformance kit on the H200 (fa2_torch: error 3.92, fa3: crash): with
    Sq > Sk a window edge >= Sk is clamped to unbounded by the kernels, so such calls are
    refused with the reason instead of answered wrong."""
    q, k, v = qkv(1, sq, sk)
    causal = window is None
    p = AttnParams(scale=0.25, causal=causal, alignment=align, window=window)
    spec = helpers.spec(q, k, causal=causal, alignment=align, window=window)
    for backend in (FlashAttn2Backend(), TorchFlashBackend()):
        with pytest.raises(BackendUnavailableError, match="Sq=.* > Sk"):
            run(backend, q, k, v, spec, p)


def test_fa2_softcap_alibi_deterministic_are_passed(fake_flash_attn, helpers):
    q, k, v = qkv(2, 4, 8)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    p = AttnParams(scale=0.2, causal=True, softcap=5.0, alibi_slopes=slopes, deterministic=True)
    out, lse = run(FlashAttn2Backend(), q, k, v,
                   helpers.spec(q, k, causal=True, softcap=True, alibi=True), p)
    kw = fake_flash_attn.last("flash_attn_func")
    assert kw["softcap"] == 5.0 and kw["deterministic"] is True
    assert kw["alibi_slopes"].dtype == torch.float32 and kw["return_attn_probs"] is False
    assert lse is None
    torch.testing.assert_close(out, ref_attn(q, k, v, p, compute_dtype=torch.float32)[0],
                               atol=2e-5, rtol=1e-5)


def test_fa2_fully_masked_rows_give_zero_and_minus_inf(fake_flash_attn, helpers):
    q, k, v = qkv(1, 6, 3)
    p = AttnParams(scale=0.3, causal=True, return_lse=True)
    out, lse = run(FlashAttn2Backend(), q, k, v, helpers.spec(q, k, causal=True), p)
    assert torch.all(out[:, :3] == 0) and torch.all(torch.isneginf(lse[:, :, :3]))
    assert torch.isfinite(lse[:, :, 3:]).all()


def test_fa2_alibi_with_moved_positions_is_refused(fake_flash_attn, helpers):
    q, k, v = qkv(1, 4, 10)  # top-left window (1, 2): keys cut to 6, positions move by 2
    p = AttnParams(scale=0.3, alignment="top_left", window=(1, 2),
                   alibi_slopes=torch.ones(4) * 0.1)
    with pytest.raises(BackendUnavailableError, match="ALiBi"):
        run(FlashAttn2Backend(), q, k, v,
            helpers.spec(q, k, alignment="top_left", window=(1, 2), alibi=True), p)


def test_fa2_varlen_matches_reference(fake_flash_attn, helpers):
    lens = [3, 5, 2]
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(10, h, 8, generator=g) for h in (4, 2, 2))
    p = AttnParams(scale=0.35, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                   max_seqlen_q=max(lens), max_seqlen_k=max(lens), return_lse=True)
    out, lse = run(FlashAttn2Backend(), q, k, v,
                   helpers.spec(q, k, "thd", causal=True, return_lse=True), p)
    ref, ref_lse = ref_attn(q, k, v, p, layout="thd", compute_dtype=torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert lse.shape == (4, 10)
    assert_lse(lse, ref_lse, atol=1e-4)
    assert fake_flash_attn.last("flash_attn_varlen_func")["max_seqlen_q"] == 5


def test_fa2_paged_passes_block_table_and_matches(fake_flash_attn, helpers):
    kc, vc, table, lens = helpers.paged(2, [300, 45], 256, 2, 8)
    q = torch.randn(2, 1, 4, 8)
    p = AttnParams(scale=0.3, causal=True, block_table=table, seqlens_k=lens, return_lse=True)
    out, lse = run(FlashAttn2Backend(), q, kc, vc,
                   helpers.spec(q, kc, "paged", phase="decode", causal=True), p)
    kw = fake_flash_attn.last("flash_attn_with_kvcache")
    assert kw["block_table"] is table and kw["cache_seqlens"] is lens
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, kc, vc, table, lens)
    ref, ref_lse = ref_attn(qv, kv, vv, AttnParams(scale=0.3, causal=True, cu_seqlens_q=cu_q,
                                                   cu_seqlens_k=cu_k), layout="thd",
                            compute_dtype=torch.float32)
    torch.testing.assert_close(out.view(2, 4, 8), ref, atol=2e-5, rtol=1e-5)


def test_fa2_paged_small_page_is_refused(fake_flash_attn, helpers):
    kc, vc, table, lens = helpers.paged(1, [40], 16, 2, 8)
    q = torch.randn(1, 1, 4, 8)
    p = AttnParams(scale=0.3, block_table=table, seqlens_k=lens)
    with pytest.raises(BackendUnavailableError, match="multiple of 256"):
        run(FlashAttn2Backend(), q, kc, vc, helpers.spec(q, kc, "paged", phase="decode"), p)


class _Recorded:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def op(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, **kw):
        self.calls.append(("op", dict(kw, causal=causal, sk=k.shape[1], cu_q=cu_q)))
        window = (kw.get("window_size_left", -1), kw.get("window_size_right", -1))
        return flash_reference(q, k, v, softmax_scale=kw["scale"], causal=causal,
                               window_size=window)

    def sdpa(self, q, k, v, scale, causal):
        self.calls.append(("sdpa", {"causal": causal, "sk": k.shape[1]}))
        return flash_reference(q, k, v, softmax_scale=scale, causal=causal)[0]


@pytest.mark.parametrize("sq,sk,causal,align,window,route", [
    (6, 6, True, "bottom_right", None, "sdpa"),
    (4, 9, True, "top_left", None, "sdpa"),  # keys cut to 4: square, top-left == bottom-right
    (4, 9, True, "bottom_right", None, "op"),  # SDPA's is_causal would be top-left: not used
    (6, 6, False, "bottom_right", (2, 1), "op"),
])
def test_fa2_torch_routes_and_matches(monkeypatch, helpers, sq, sk, causal, align, window,
                                      route):
    rec = _Recorded()
    monkeypatch.setattr(fa2_torch, "flash_op", rec.op)
    monkeypatch.setattr(fa2_torch, "_sdpa_flash", rec.sdpa)
    q, k, v = qkv(2, sq, sk)
    p = AttnParams(scale=0.3, causal=causal, alignment=align, window=window)
    out, _ = run(TorchFlashBackend(), q, k, v,
                 helpers.spec(q, k, causal=causal, alignment=align, window=window), p)
    assert rec.calls[-1][0] == route
    torch.testing.assert_close(out, ref_attn(q, k, v, p, compute_dtype=torch.float32)[0],
                               atol=2e-5, rtol=1e-5)


def test_fa2_torch_lse_and_varlen_use_the_op(monkeypatch, helpers):
    rec = _Recorded()
    monkeypatch.setattr(fa2_torch, "flash_op", rec.op)
    q, k, v = qkv(1, 5, 5)
    p = AttnParams(scale=0.3, causal=True, return_lse=True)
    out, lse = run(TorchFlashBackend(), q, k, v, helpers.spec(q, k, causal=True), p)
    assert rec.calls[-1][0] == "op" and lse.shape == (1, 4, 5)
    assert_lse(lse, ref_attn(q, k, v, p, compute_dtype=torch.float32)[1], atol=1e-4)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_fa2_dropout_is_passed_and_drawn_from_torch(fake_flash_attn, helpers, layout):
    """dropout_p reaches flash_attn only when above 0 (an eval call never names it), and the
    draw follows torch's generator, as flash_attn's Philox state does on the GPU."""
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    if layout == "thd":
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(12, h, 16, generator=g) for h in (4, 2, 2))
        extra = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
        fn = "flash_attn_varlen_func"
    else:
        q, k, v = qkv(2, 6, 9, seed=3)
        extra, fn = {}, "flash_attn_func"
    spec = replace(helpers.spec(q, k, layout, causal=True), dropout=True, needs_grad=True)
    p = AttnParams(scale=0.25, causal=True, dropout_p=0.3, **extra)
    backend = FlashAttn2Backend()
    outs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        outs.append(run(backend, q, k, v, spec, p).out)
    assert fake_flash_attn.last(fn)["dropout_p"] == 0.3
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    assert not torch.equal(outs[0], outs[2])
    exact = run(backend, q, k, v, replace(spec, dropout=False), replace(p, dropout_p=0.0)).out
    assert "dropout_p" not in fake_flash_attn.last(fn) or not fake_flash_attn.last(fn)[
        "dropout_p"]
    assert not torch.allclose(outs[0], exact, atol=1e-3)


@pytest.mark.parametrize("change, needle", [
    (dict(softcap=True), "softcap with dropout"),
    (dict(return_lse=True), "call without return_lse"),
])
def test_fa2_dropout_calls_it_cannot_serve_are_refused(helpers, change, needle):
    q, k, _ = qkv(1, 4, 4)
    spec = helpers.spec(q, k, causal=True, **change)
    reasons = FlashAttn2Backend().check(replace(spec, dropout=True, needs_grad=True),
                                        attnhub.simulate("sm80"))
    assert any(needle in r for r in reasons), reasons
    assert not FlashAttn2Backend().check(spec, attnhub.simulate("sm80"))


def test_fa2_paged_dropout_is_refused(helpers):
    kc, _, _, _ = helpers.paged(1, [300], 256, 2, 8)
    q = torch.randn(1, 1, 4, 8)
    spec = replace(helpers.spec(q, kc, "paged", phase="decode", causal=True), dropout=True)
    reasons = FlashAttn2Backend().check(spec, attnhub.simulate("sm80"))
    assert any("paged path (flash_attn_with_kvcache) has no dropout" in r for r in reasons)
