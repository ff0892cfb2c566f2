"""ck_fa: capabilities per gfx arch and library, and argument translation against fakes."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import attnhub
from attnhub.plugin import AttentionSpec, AttnParams, BackendUnavailableError, MaskSpec
from attnhub.plugin import reference_attention
from attnhub.testing import assert_fa_rule, assert_lse
from attnhub_rocm.ck_fa import CKFlashBackend, ck_call
from attnhub_rocm.ck_libraries import (
    AITER,
    FLASH_ATTN_CK,
    LIBRARIES,
    CKLibrary,
    select_library,
)

GFX942 = attnhub.simulate("gfx942")


def _spec(**kw: object) -> AttentionSpec:
    base: dict[str, object] = dict(phase="prefill", dtype="bf16", head_dim=128, num_q_heads=8,
                                   num_kv_heads=2, max_seqlen_q=4096, max_seqlen_k=4096)
    base.update(kw)
    return AttentionSpec(**base)  # type: ignore[arg-type]


# -- which library, and what it declares ------------------------------------------------------
def test_library_selection_env_and_auto(fake_aiter: object) -> None:
    assert select_library({}) is AITER  # aiter present -> preferred
    assert select_library({"ATTNHUB_CK_FA_LIBRARY": "flash_attn"}) is FLASH_ATTN_CK
    with pytest.raises(ValueError, match="use one of"):
        select_library({"ATTNHUB_CK_FA_LIBRARY": "ck"})


def test_missing_library_and_triton_switch_are_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert "flash_attn is not installed" in FLASH_ATTN_CK.missing()[0]
    assert "amd-aiter" in AITER.install


def test_triton_amd_env_refuses_ck(fake_flash_attn: object,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert FLASH_ATTN_CK.missing() == []
    monkeypatch.setenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")
    assert "Triton backend, not CK" in FLASH_ATTN_CK.missing()[0]


@pytest.mark.parametrize("arch,ok_ck,ok_aiter", [
    ("gfx90a", True, False), ("gfx942", True, True), ("gfx950", True, True),
    ("gfx1100", False, False), ("gfx1201", False, False), ("sm90", False, False),
    ("cpu", False, False)])
def test_capabilities_per_arch(arch: str, ok_ck: bool, ok_aiter: bool) -> None:
    dev = attnhub.simulate(arch)
    for lib, ok in ((FLASH_ATTN_CK, ok_ck), (AITER, ok_aiter)):
        reasons = CKFlashBackend(lib).check(_spec(), dev)
        assert (reasons == []) == ok, (arch, lib.name, reasons)


@pytest.mark.parametrize("lib", list(LIBRARIES.values()), ids=list(LIBRARIES))
@pytest.mark.parametrize("change,needle", [
    ({"dtype": "fp32"}, "dtype fp32"),
    ({"head_dim": 320}, "head dim 320"),
    ({"mask": MaskSpec(prefix_lm=True, causal=True)}, "prefix_lm"),
    ({"mask": MaskSpec(causal=True, alignment="top_left")}, "top-left"),
    ({"mask": MaskSpec(window=(8, 0), alignment="top_left")}, "bottom-right only"),
    ({"layout": "paged", "phase": "decode"}, "layout paged"),
    ({"mask": MaskSpec(score_mod="x")}, "score_mod"),
])
def test_refusals_name_the_reason(lib: CKLibrary, change: dict, needle: str) -> None:
    reasons = CKFlashBackend(lib).check(_spec(**change), GFX942)
    assert any(needle in r for r in reasons), reasons


@pytest.mark.parametrize("lib,needle", [(FLASH_ATTN_CK, "silently ignores"),
                                        (AITER, "no softcap argument")])
def test_softcap_refused_with_the_trap_named(lib: CKLibrary, needle: str) -> None:
    reasons = CKFlashBackend(lib).check(_spec(mask=MaskSpec(causal=True, softcap=True)), GFX942)
    assert any(needle in r and "triton_rocm" in r for r in reasons), reasons


def test_different_v_dim_only_where_generated() -> None:
    assert CKFlashBackend(AITER).check(_spec(head_dim=192, head_dim_v=128), GFX942) == []
    assert any("not generated" in r for r in
               CKFlashBackend(AITER).check(_spec(head_dim=128, head_dim_v=64), GFX942))
    assert any("value head dim" in r for r in
               CKFlashBackend(FLASH_ATTN_CK).check(_spec(head_dim=192, head_dim_v=128), GFX942))


def test_real_device_needs_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    real = attnhub.DeviceInfo(vendor="rocm", arch="gfx942", sm_count=304)
    assert any("not installed" in r for r in CKFlashBackend(FLASH_ATTN_CK).check(_spec(), real))


# -- translation: attnhub semantics in, the library's arguments out ----------------------------
def test_ck_call_window_and_causal() -> None:
    p = AttnParams(scale=0.1, causal=True, window=(16, -1), deterministic=True)
    c = ck_call(p)
    assert (c.causal, c.window_size, c.deterministic) == (True, (16, 0), True)
    assert ck_call(AttnParams(scale=0.1)).window_size == (-1, -1)
    assert ck_call(AttnParams(scale=0.1, window=(3, 5))).window_size == (3, 5)


CASES = [
    dict(causal=False),
    dict(causal=True),
    dict(causal=False, window=(5, 2)),
    dict(causal=True, window=(7, -1)),
    dict(causal=False, alibi="h"),
    dict(causal=True, alibi="bh"),
]


def _params(case: dict, b: int, h: int, d: int, lse: bool) -> AttnParams:
    slopes = None
    if case.get("alibi") == "h":
        slopes = torch.rand(h) * 0.3
    elif case.get("alibi") == "bh":
        slopes = torch.rand(b, h) * 0.3
    return AttnParams(scale=1 / math.sqrt(d), causal=case["causal"], window=case.get("window"),
                      alibi_slopes=slopes, return_lse=lse, deterministic=True)


def _mask(params: AttnParams) -> MaskSpec:
    return MaskSpec(causal=params.causal, window=params.window,
                    alibi=params.alibi_slopes is not None)


@pytest.mark.parametrize("libname", ["flash_attn", "aiter"])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("sq,sk", [(9, 9), (5, 13), (13, 5)])
def test_dense_translation_matches_reference(request: pytest.FixtureRequest, libname: str,
                                             case: dict, sq: int, sk: int) -> None:
    fake = request.getfixturevalue(f"fake_{libname}")
    b, h, hk, d = 2, 4, 2, 16
    q = torch.randn(b, sq, h, d, dtype=torch.float16)
    k = torch.randn(b, sk, hk, d, dtype=torch.float16)
    v = torch.randn(b, sk, hk, d, dtype=torch.float16)
    params = _params(case, b, h, d, lse=True)
    spec = _spec(dtype="fp16", head_dim=d, num_q_heads=h, num_kv_heads=hk, mask=_mask(params),
                 return_lse=True)
    backend = CKFlashBackend(LIBRARIES[libname])
    assert backend.check(spec, GFX942) == []
    out, lse = backend.forward(q, k, v, spec, params)
    call = fake.calls[-1]
    assert call["fn"] == "dense" and call["k_shape"] == (b, sk, hk, d)  # GQA: KV not repeated
    assert call["dropout_p"] == 0.0 and call["deterministic"] is True
    assert call.get("softcap", 0.0) == 0.0
    ref64, ref_lse = reference_attention(q, k, v, params)
    ref16, _ = reference_attention(q, k, v, params, compute_dtype=torch.float16)
    assert_fa_rule(out, ref64, ref16)
    assert_lse(lse, ref_lse)


@pytest.mark.parametrize("libname", ["flash_attn", "aiter"])
def test_varlen_translation_and_lse_layout(request: pytest.FixtureRequest, libname: str) -> None:
    fake = request.getfixturevalue(f"fake_{libname}")
    lens_q, lens_k = [3, 0, 6], [5, 4, 2]
    cu_q = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9, 11], dtype=torch.int32)
    h, hk, d = 4, 1, 16
    q = torch.randn(sum(lens_q), h, d, dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), hk, d, dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), hk, d, dtype=torch.bfloat16)
    params = AttnParams(scale=0.25, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                        return_lse=True)
    spec = _spec(head_dim=d, num_q_heads=h, num_kv_heads=hk, layout="thd",
                 mask=MaskSpec(causal=True, document=True), return_lse=True)
    out, lse = CKFlashBackend(LIBRARIES[libname]).forward(q, k, v, spec, params)
    call = fake.calls[-1]
    assert (call["fn"], call["max_q"], call["max_k"]) == ("varlen", 6, 5)
    assert lse is not None and lse.shape == (h, sum(lens_q))
    ref64, ref_lse = reference_attention(q, k, v, params, layout="thd")
    ref_same, _ = reference_attention(q, k, v, params, layout="thd", compute_dtype=torch.bfloat16)
    assert_fa_rule(out, ref64, ref_same)
    assert_lse(lse, ref_lse)  # the 3rd doc has fully masked rows: +inf became -inf


def test_empty_keys_give_zero_and_minus_inf(fake_flash_attn: object) -> None:
    q = torch.randn(1, 3, 2, 16, dtype=torch.float16)
    kv = torch.randn(1, 0, 2, 16, dtype=torch.float16)
    params = AttnParams(scale=0.25, return_lse=True)
    out, lse = CKFlashBackend(FLASH_ATTN_CK).forward(
        q, kv, kv, _spec(dtype="fp16", head_dim=16, num_q_heads=2, num_kv_heads=2), params)
    assert torch.count_nonzero(out) == 0
    assert lse is not None and bool(torch.isneginf(lse).all())


def test_no_lse_requested_returns_none(fake_aiter: object) -> None:
    q = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    kv = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    res = CKFlashBackend(AITER).forward(q, kv, kv, _spec(head_dim=16, num_q_heads=2,
                                                         num_kv_heads=2), AttnParams(scale=0.25))
    assert res.lse is None and res.out.shape == q.shape


def test_softcap_never_reaches_the_library(fake_flash_attn: object) -> None:
    q = torch.randn(1, 4, 2, 16, dtype=torch.float16)
    with pytest.raises(BackendUnavailableError, match="silently ignores"):
        CKFlashBackend(FLASH_ATTN_CK).forward(q, q, q, _spec(dtype="fp16", head_dim=16),
                                              AttnParams(scale=0.25, softcap=30.0))
    assert fake_flash_attn.calls == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("libname", ["flash_attn", "aiter"])
def test_window_edge_the_kernel_clamps_is_refused(request: pytest.FixtureRequest,
                                                  libname: str) -> None:
    """Sq > Sk with a right window edge >= Sk: FlashAttention (CK too) clamps the edge to
    unbounded, which would show the first queries keys outside their window."""
    request.getfixturevalue(f"fake_{libname}")
    q = torch.randn(1, 12, 4, 16, dtype=torch.float16)
    k = v = torch.randn(1, 5, 2, 16, dtype=torch.float16)
    params = AttnParams(scale=0.25, window=(-1, 6))
    spec = _spec(dtype="fp16", head_dim=16, num_q_heads=4, num_kv_heads=2,
                 mask=MaskSpec(window=(-1, 6)))
    with pytest.raises(BackendUnavailableError, match="unbounded"):
        CKFlashBackend(LIBRARIES[libname]).forward(q, k, v, spec, params)
