"""FA3 capabilities from the installed build's flags; check() reasons on simulated devices."""

from __future__ import annotations

import sys

import pytest
from attnhub_sm90_fa3.build import fa3_build, import_interface
from attnhub_sm90_fa3.cudnn import CudnnBackend
from attnhub_sm90_fa3.fa3 import Fa3Backend
from attnhub_sm90_fa3.fa3_fp8 import Fa3Fp8Backend

import attnhub
from attnhub.plugin import AttentionSpec, MaskSpec

SM90 = attnhub.simulate("sm90")


def spec(**kw) -> AttentionSpec:
    base = dict(phase="prefill", dtype="bf16", head_dim=128, num_q_heads=16, num_kv_heads=4,
                max_seqlen_q=4096, max_seqlen_k=4096)
    base.update(kw)
    return AttentionSpec(**base)


def test_fa3_fwd_wheel_flags_switch_features_off(fa3_fwd):
    b = Fa3Backend()
    c = b.capabilities
    assert b.build.module == "fa3_fwd_interface" and b.build.source == "fa3_fwd_config.CONFIG"
    assert not c.backward and "train" not in c.phases
    assert "paged" not in c.layouts and "thd" in c.layouts
    assert "sliding_window" not in c.masks and {"causal", "softcap"} <= c.masks
    assert c.dtypes == {"bf16"} and c.max_head_dim == 256
    reasons = b.check(spec(phase="train", needs_grad=True), SM90)
    assert any("no backward" in r for r in reasons)
    assert any("dtype fp16" in r for r in b.check(spec(dtype="fp16"), SM90))
    assert any("sliding_window" in r
               for r in b.check(spec(mask=MaskSpec(causal=True, window=(64, 0))), SM90))
    fp8 = Fa3Fp8Backend().capabilities
    assert "sliding_window" not in fp8.masks and not fp8.exact and fp8.error_budget


def test_upstream_build_without_config_declares_everything(install):
    install(None, interface="flash_attn_interface")
    b = Fa3Backend()
    c = b.capabilities
    assert "no flash_attn_config" in b.build.source
    assert c.backward and {"paged", "thd"} <= c.layouts and "sliding_window" in c.masks
    assert c.dtypes == {"bf16", "fp16"}
    assert b.check(spec(phase="train", needs_grad=True, deterministic=True), SM90) == []


@pytest.mark.parametrize("off,s,needle", [
    ({"FLASHATTENTION_DISABLE_HDIM256": True, "FLASHATTENTION_DISABLE_HDIM192": True},
     spec(head_dim=192), "at most 128"),
    ({"FLASHATTENTION_DISABLE_VARLEN": True},
     spec(layout="thd", mask=MaskSpec(document=True)), "layout thd"),
    ({"FLASHATTENTION_DISABLE_SOFTCAP": True}, spec(mask=MaskSpec(softcap=True)), "softcap"),
    ({"FLASHATTENTION_DISABLE_PAGEDKV": True},
     spec(layout="paged", phase="decode", max_seqlen_q=1, page_size=16), "layout paged"),
])
def test_each_flag_removes_its_feature(install, off, s, needle):
    install(off)
    assert any(needle in r for r in Fa3Backend().check(s, SM90))


def test_fp8_disabled_build_is_refused_for_fa3_fp8(install):
    install({"FLASHATTENTION_DISABLE_FP8": True})
    reasons = Fa3Fp8Backend().check(spec(), SM90)
    assert any("without FP8" in r for r in reasons)


def test_import_interface_aliases_the_wheels_config(fa3_fwd):
    mod = import_interface(fa3_build())
    assert mod is sys.modules["fa3_fwd_interface"]
    assert sys.modules["flash_attn_config"] is sys.modules["fa3_fwd_config"]


def test_not_installed(monkeypatch):
    for name in ("flash_attn_interface", "fa3_fwd_interface", "flash_attn_config",
                 "fa3_fwd_config"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" in p])
    b = Fa3Backend()
    if b.build.module is not None:
        pytest.skip("a real FlashAttention-3 is installed here")
    assert any("not installed" in r for r in b.missing_requirements())
    assert b.check(spec(), SM90) == []  # planning for a fleet machine: declared, not refused
    with pytest.raises(ImportError, match="pip install"):
        import_interface(b.build)


@pytest.mark.parametrize("backend,device,s,needle", [
    (Fa3Backend(), "sm80", spec(), "needs arch sm90"),
    (Fa3Backend(), "sm90", spec(mask=MaskSpec(alibi=True)), "mask alibi"),
    (Fa3Backend(), "sm90", spec(head_dim=100), "head dim 100"),
    (Fa3Fp8Backend(), "sm90", spec(phase="train", needs_grad=True), "phase train"),
    (Fa3Fp8Backend(), "sm90", spec(dtype="fp16"), "dtype fp16"),
    (Fa3Fp8Backend(), "sm90", spec(layout="thd", mask=MaskSpec(document=True)), "layout thd"),
    (Fa3Fp8Backend(), "sm90", spec(mask=MaskSpec(softcap=True)), "smooth_k"),
    (Fa3Fp8Backend(), "sm90", spec(phase="decode", max_seqlen_q=1), "keep the cache in FP8"),
    (CudnnBackend(), "sm75", spec(), "compute capability >= 8.0"),
    (CudnnBackend(), "sm90", spec(head_dim=256), "at most 128"),
    (CudnnBackend(), "sm90", spec(mask=MaskSpec(causal=True, window=(8, 0))), "sliding_window"),
    (CudnnBackend(), "sm90", spec(max_seqlen_q=512, mask=MaskSpec(causal=True)),
     "no top-left form"),
])
def test_check_reasons(fa3_fwd, backend, device, s, needle):
    reasons = backend.check(s, attnhub.simulate(device))
    assert any(needle in r for r in reasons), reasons


def test_cudnn_accepts_what_it_converts():
    c = CudnnBackend()
    assert c.check(spec(mask=MaskSpec(causal=True), phase="train", needs_grad=True), SM90) == []
    assert c.check(spec(max_seqlen_q=512, mask=MaskSpec(causal=True, alignment="top_left")),
                   SM90) == []
    assert c.check(spec(max_seqlen_q=1, mask=MaskSpec(causal=True)), SM90) == []
    assert any("phase decode" in r for r in c.check(spec(max_seqlen_q=1, phase="decode"), SM90))
