"""fa3, fa3_fp8 and cudnn against recording fakes: arguments passed and numbers returned."""

from __future__ import annotations

import pytest
import torch
from attnhub_sm90_fa3 import cudnn
from attnhub_sm90_fa3.cudnn import CudnnBackend
from attnhub_sm90_fa3.fa3 import Fa3Backend
from attnhub_sm90_fa3.fa3_fp8 import Fa3Fp8Backend
from attnhub_sm90_fa3.fp8 import E4M3, quantize

from attnhub.plugin import AttnParams, BackendUnavailableError, InputError, paged_to_varlen
from attnhub.plugin import reference_attention as ref_attn
from attnhub.testing import assert_lse, flash_reference


def qkv(b, sq, sk, hq=4, hkv=2, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).to(dtype)
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def run(backend, q, k, v, spec, params):
    backend.load()
    return backend.forward(q, k, v, spec, params)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("sq,sk,causal,align,softcap", [
    (5, 9, True, "top_left", None), (9, 5, True, "bottom_right", None),
    (6, 6, False, "bottom_right", 4.0), (3, 8, True, "bottom_right", 2.0)])
def test_fa3_dense_matches_reference(fa3_fwd, spec_of, sq, sk, causal, align, softcap):
    q, k, v = qkv(2, sq, sk)
    p = AttnParams(scale=0.3, causal=causal, alignment=align, softcap=softcap, return_lse=True)
    out, lse = run(Fa3Backend(), q, k, v,
                   spec_of(q, k, causal=causal, alignment=align, softcap=bool(softcap)), p)
    ref, ref_lse = ref_attn(q, k, v, p, compute_dtype=torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert_lse(lse, ref_lse, atol=1e-4)
    kw = fa3_fwd.last("flash_attn_func")
    assert "alibi_slopes" not in kw and kw["softmax_scale"] == 0.3


@pytest.mark.parametrize("flags,splits", [({}, 0), ({"FLASHATTENTION_DISABLE_SPLIT": True}, 1)])
def test_fa3_decode_uses_kvcache_with_split_heuristic(install, spec_of, flags, splits):
    fake = install(flags)
    q, k, v = qkv(2, 1, 40)
    p = AttnParams(scale=0.3, causal=True)
    out, _ = run(Fa3Backend(), q, k, v, spec_of(q, k, phase="decode", causal=True), p)
    assert fake.last("flash_attn_with_kvcache")["num_splits"] == splits
    torch.testing.assert_close(out, ref_attn(q, k, v, p, compute_dtype=torch.float32)[0],
                               atol=2e-5, rtol=1e-5)


def test_fa3_paged_any_page_size_and_varlen(fa3_full, spec_of):
    g = torch.Generator().manual_seed(3)
    page, lens = 3, [7, 11]
    kc, vc = torch.randn(9, page, 2, 16, generator=g), torch.randn(9, page, 2, 16, generator=g)
    table = torch.tensor([[4, 0, 7, 0], [1, 2, 3, 5]], dtype=torch.int32)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, 2, 4, 16, generator=g)
    p = AttnParams(scale=0.3, causal=True, block_table=table, seqlens_k=seqlens)
    out, _ = run(Fa3Backend(), q, kc, vc, spec_of(q, kc, "paged", phase="decode", causal=True),
                 p)
    kw = fa3_full.last("flash_attn_with_kvcache")
    assert kw["page_table"] is table and kw["cache_seqlens"] is seqlens
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, kc, vc, table, seqlens)
    pv = AttnParams(scale=0.3, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=2, max_seqlen_k=11, return_lse=True)
    ref, ref_lse = ref_attn(qv, kv, vv, pv, layout="thd", compute_dtype=torch.float32)
    torch.testing.assert_close(out.reshape(4, 4, 16), ref, atol=2e-5, rtol=1e-5)
    out2, lse2 = run(Fa3Backend(), qv, kv, vv, spec_of(qv, kv, "thd", causal=True), pv)
    torch.testing.assert_close(out2, ref, atol=2e-5, rtol=1e-5)
    assert_lse(lse2, ref_lse, atol=1e-4)
    assert fa3_full.last("flash_attn_varlen_func")["max_seqlen_k"] == 11


def test_fa3_fp8_passes_descales_and_smoothing_cuts_the_error(fa3_fwd, spec_of):
    q, k, v = qkv(2, 64, 64, dtype=torch.bfloat16)
    k = k + torch.linspace(-6, 6, 16).to(torch.bfloat16)  # a per-channel offset in K
    err = {}
    for recipe in ("plain", "smooth_k"):
        p = AttnParams(scale=0.25, causal=True, return_lse=True, extra={"fp8_recipe": recipe})
        out, lse = run(Fa3Fp8Backend(), q, k, v, spec_of(q, k, causal=True, return_lse=True),
                       p)
        kw = fa3_fwd.last("flash_attn_func")
        assert kw["q"].dtype == kw["k"].dtype == kw["v"].dtype == E4M3
        for name in ("q_descale", "k_descale", "v_descale"):
            assert kw[name].shape == (2, 2) and kw[name].dtype == torch.float32
        k_mean = kw["k"].float().mean(dim=1).abs().max() * kw["k_descale"].max()
        assert (k_mean < 0.1) == (recipe == "smooth_k")  # smoothing removed the offset
        ref, ref_lse = ref_attn(q, k, v, p, compute_dtype=torch.float32)
        assert out.dtype == torch.bfloat16
        err[recipe] = rel(out, ref), float((lse - ref_lse).abs().max())
    # smoothing leaves softmax unchanged and its LSE correction is exact: both errors drop
    assert err["smooth_k"][0] < 0.06 and err["smooth_k"][0] < 0.8 * err["plain"][0], err
    assert err["smooth_k"][1] < 0.15 and err["smooth_k"][1] < 0.8 * err["plain"][1], err


def test_fa3_fp8_takes_an_fp8_kv_cache_with_descales(fa3_fwd, spec_of):
    q, k, v = qkv(1, 8, 32, dtype=torch.bfloat16)
    k8, kd = quantize(k, 2)
    v8, vd = quantize(v, 2)
    p = AttnParams(scale=0.25, extra={"k_descale": kd, "v_descale": vd})
    out, _ = run(Fa3Fp8Backend(), q, k8, v8, spec_of(q, k8), p)
    assert fa3_fwd.last("flash_attn_func")["k"] is k8  # the cache itself, no copy
    assert rel(out, ref_attn(q, k, v, p, compute_dtype=torch.float32)[0]) < 0.08
    with pytest.raises(InputError, match="k_descale"):
        run(Fa3Fp8Backend(), q, k8, v8, spec_of(q, k8), AttnParams(scale=0.25))


def test_fa3_fp8_smooth_k_refuses_softcap(fa3_fwd, spec_of):
    q, k, v = qkv(1, 8, 8, dtype=torch.bfloat16)
    p = AttnParams(scale=0.25, softcap=5.0)
    with pytest.raises(InputError, match="softcap"):
        run(Fa3Fp8Backend("smooth_k"), q, k, v, spec_of(q, k, softcap=True), p)
    out, _ = run(Fa3Fp8Backend("plain"), q, k, v, spec_of(q, k, softcap=True), p)
    assert fa3_fwd.last("flash_attn_func")["softcap"] == 5.0 and out.isfinite().all()


class _CudnnRecorder:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def sdpa(self, q, k, v, causal, scale):  # (B, H, S, D), SDPA's top-left is_causal
        self.calls.append({"causal": causal, "q": q.shape, "k": k.shape})
        return self._tl(q, k, v, causal, scale)[0]

    def with_lse(self, q, k, v, causal, scale):
        self.calls.append({"causal": causal, "q": q.shape, "k": k.shape, "lse": True})
        out, lse = self._tl(q, k, v, causal, scale)
        return out, lse.unsqueeze(-1)  # cuDNN's (B, H, S, 1)

    @staticmethod
    def _tl(q, k, v, causal, scale):
        p = AttnParams(scale=scale, causal=causal, alignment="top_left")
        out, lse = ref_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), p,
                            compute_dtype=torch.float32)
        return out.transpose(1, 2), lse


@pytest.mark.parametrize("sq,sk,causal,align", [
    (9, 5, True, "bottom_right"), (1, 7, True, "bottom_right"), (6, 6, True, "bottom_right"),
    (4, 9, True, "top_left"), (4, 9, False, "bottom_right")])
def test_cudnn_bottom_right_conversion(monkeypatch, spec_of, sq, sk, causal, align):
    rec = _CudnnRecorder()
    monkeypatch.setattr(cudnn, "sdpa_cudnn", rec.sdpa)
    monkeypatch.setattr(cudnn, "cudnn_with_lse", rec.with_lse)
    q, k, v = qkv(2, sq, sk)
    for want_lse in (False, True):
        p = AttnParams(scale=0.3, causal=causal, alignment=align, return_lse=want_lse)
        out, lse = run(CudnnBackend(), q, k, v, spec_of(q, k, causal=causal, alignment=align), p)
        ref, ref_lse = ref_attn(q, k, v, p, compute_dtype=torch.float32)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
        if want_lse:
            assert_lse(lse, ref_lse, atol=1e-4)
    assert rec.calls[-2]["k"][1] == 2  # GQA: SDPA's enable_gqa, KV heads not copied
    assert rec.calls[-1]["k"][1] == 4  # the LSE op takes equal head counts: expanded
    assert rec.calls[-1]["causal"] == (causal and sq > 1)


def test_cudnn_refuses_bottom_right_chunked_prefill(monkeypatch, spec_of):
    monkeypatch.setattr(cudnn, "sdpa_cudnn", _CudnnRecorder().sdpa)
    q, k, v = qkv(1, 3, 8)
    with pytest.raises(BackendUnavailableError, match="no top-left form"):
        run(CudnnBackend(), q, k, v, spec_of(q, k, causal=True),
            AttnParams(scale=0.3, causal=True))


def test_fake_matches_flash_convention():
    """The fake's kernel model is the FA convention: bottom-right, +inf LSE on empty rows."""
    q, k, v = qkv(1, 4, 2)
    out, lse = flash_reference(q, k, v, softmax_scale=0.3, causal=True)
    assert torch.all(out[:, :2] == 0) and torch.all(torch.isposinf(lse[:, :, :2]))


@pytest.mark.parametrize("preset,want", [(None, False), ("0", False), ("1", True),
                                         ("on", True)])
def test_cudnn_reads_the_ragged_switch_and_never_sets_it(monkeypatch, preset, want):
    """The ragged path is the user's choice (torch reads it once per process, for every
    cuDNN attention call): loading the backend reads the variable and leaves it as it was."""
    if preset is None:
        monkeypatch.delenv(cudnn.RAGGED_ENV, raising=False)
    else:
        monkeypatch.setenv(cudnn.RAGGED_ENV, preset)
    b = CudnnBackend()
    b.load()
    assert b.ragged is want and cudnn.ragged_path_on() is want
    assert (cudnn.RAGGED_ENV in __import__("os").environ) == (preset is not None)
    assert cudnn.RAGGED_ENV in b.description


def test_cudnn_builds_a_bounded_number_of_shapes(monkeypatch, spec_of):
    """Without the ragged path every new exact shape is a cuDNN graph build (52-162 ms on the
    H200): in one spec bucket the backend serves SHAPE_BUDGET shapes, then refuses a new one
    with the reason and the fix, while shapes it has built keep running and another bucket
    has its own budget; with the ragged path, no budget."""
    rec = _CudnnRecorder()
    monkeypatch.setattr(cudnn, "sdpa_cudnn", rec.sdpa)
    monkeypatch.setattr(cudnn, "cudnn_with_lse", rec.with_lse)
    monkeypatch.setattr(cudnn, "SHAPE_BUDGET", 3)
    monkeypatch.delenv(cudnn.RAGGED_ENV, raising=False)
    b = CudnnBackend()
    p = AttnParams(scale=0.3, causal=True)

    def call(s, lse=False, bucket=8):  # every length in one bucket (lengths up to 8)
        q, k, v = qkv(1, s, s)
        params = AttnParams(scale=0.3, causal=True, return_lse=lse)
        spec = spec_of(*qkv(1, bucket, bucket)[:2], causal=True)
        return run(b, q, k, v, spec, params)

    for s in (5, 6):
        call(s)
    call(5, lse=True)  # the LSE op is another graph: the third shape
    call(6)  # built already: served
    with pytest.raises(BackendUnavailableError, match="builds a graph per exact shape.*"
                       + cudnn.RAGGED_ENV) as refused:
        call(7)
    assert refused.value.lasting  # the hub moves cudnn behind the binding's next candidate
    call(5, lse=True)
    call(9, bucket=16)  # another bucket: its own budget
    monkeypatch.setenv(cudnn.RAGGED_ENV, "1")
    ragged = CudnnBackend()
    ragged.load()
    for s in range(5, 12):
        q, k, v = qkv(1, s, s)
        out, _ = run(ragged, q, k, v, spec_of(q, k, causal=True), p)
        torch.testing.assert_close(out, ref_attn(q, k, v, p, compute_dtype=torch.float32)[0],
                                   atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("want_lse", [False, True])
def test_cudnn_ragged_path_gets_dense_bshd(monkeypatch, spec_of, want_lse):
    """torch takes the ragged path only for q, k, v that are dense BSHD seen as BHSD: a bhsd
    cache (transformers' layout, a strided bshd view here) and the LSE op's expanded heads
    are handed over dense, with the same numbers."""
    seen: list = []
    rec = _CudnnRecorder()

    def spy(fn):
        def call(q, k, v, causal, scale):
            seen.append(all(x.transpose(1, 2).is_contiguous() for x in (q, k, v)))
            return fn(q, k, v, causal, scale)
        return call

    monkeypatch.setattr(cudnn, "sdpa_cudnn", spy(rec.sdpa))
    monkeypatch.setattr(cudnn, "cudnn_with_lse", spy(rec.with_lse))
    monkeypatch.setenv(cudnn.RAGGED_ENV, "1")
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv(2, 5, 7))
    assert not k.is_contiguous()  # bhsd storage seen as bshd
    p = AttnParams(scale=0.3, causal=True, return_lse=want_lse)
    backend = CudnnBackend()
    backend.load()
    out, lse = run(backend, q[:, :1], k, v, spec_of(q[:, :1], k, causal=True), p)
    ref, ref_lse = ref_attn(q[:, :1], k, v, p, compute_dtype=torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    if want_lse:
        assert_lse(lse, ref_lse, atol=1e-4)
    assert seen == [True]


@pytest.mark.parametrize("raises", [False, True])
def test_sdpa_cudnn_allows_cudnn_only_and_restores_the_switches(monkeypatch, raises):
    """During the call SDPA may run cuDNN only (as under ``sdpa_kernel``); afterwards every
    switch is as the caller left it (here: flash off), also when SDPA raises."""
    cuda = torch.backends.cuda
    names = ("cudnn", "flash", "mem_efficient", "math")
    before = {n: getattr(cuda, f"{n}_sdp_enabled")() for n in names}
    seen = {}

    def fake_sdpa(q, k, v, **kw):
        seen.update({n: getattr(cuda, f"{n}_sdp_enabled")() for n in names}, gqa=kw["enable_gqa"])
        if raises:
            raise RuntimeError("No available kernel")
        return q

    monkeypatch.setattr(cudnn.F, "scaled_dot_product_attention", fake_sdpa)
    cuda.enable_flash_sdp(False)
    try:
        q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
        if raises:
            with pytest.raises(RuntimeError, match="No available kernel"):
                cudnn.sdpa_cudnn(q, k, k, True, 0.3)
        else:
            assert cudnn.sdpa_cudnn(q, k, k, True, 0.3) is q
        assert seen == {"cudnn": True, "flash": False, "mem_efficient": False,
                        "math": False, "gqa": True}
        assert {n: getattr(cuda, f"{n}_sdp_enabled")() for n in names} == {
            **before, "flash": False}
    finally:
        cuda.enable_flash_sdp(before["flash"])
