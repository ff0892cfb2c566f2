"""Review 11: FlashInfer's real limits and empty-row conventions, checked with the recording
fakes of ``conftest.py`` made stricter where the real library is.

* The CUDA-core decode kernel is compiled for GQA group sizes 1, 2, 3, 4, 8 only
  (``DISPATCH_GQA_GROUP_SIZE``, ``include/flashinfer/utils.cuh``): plan() raises
  "Unsupported group_size" for a 7:1 model (Qwen2-7B's 28/4) or 16:1 (Llama-3.1-405B).
* A causal chunk longer than its sequence's cache (Sq > seqlens_k > 0) has rows that see no
  key; FlashInfer before 0.6.18 returned a finite sentinel LSE for them (PR 4401: "#4452
  paged causal, fully masked head-rows: finite sentinel LSE"), the fake FA's +inf marker.
  attnhub's contract is output 0 and LSE -inf.
"""

from __future__ import annotations

import sys

import pytest
import torch
from attnhub_sm80_fa2 import decode_choice
from attnhub_sm80_fa2.flashinfer_paged import (
    CUDA_CORE_DECODE_GROUPS,
    FlashInferDecodeBackend,
    FlashInferPrefillBackend,
    rows_without_keys,
)
from attnhub_sm80_fa2.probe import FlashInferBuild

import attnhub
from attnhub.plugin import AttnParams
from attnhub.testing import assert_lse

SM80 = attnhub.simulate("sm80")




@pytest.fixture
def strict_groups(fake_flashinfer):
    """The fake's CUDA-core decode plan refuses group sizes the real kernel is not built for."""
    cls = sys.modules["flashinfer"].BatchDecodeWithPagedKVCacheWrapper
    plan = cls.plan

    def checked(self, indptr, indices, last, hq, hkv, d, page, **kw):
        tc = [c for n, c in fake_flashinfer.calls if n == "decode.__init__"][-1]
        if not tc["use_tensor_cores"] and hq // hkv not in (1, 2, 3, 4, 8):
            raise RuntimeError(f"Unsupported group_size: {hq // hkv}")
        return plan(self, indptr, indices, last, hq, hkv, d, page, **kw)

    cls.plan = checked
    return fake_flashinfer


@pytest.mark.parametrize("hq,hkv", [(7, 1), (14, 2), (16, 1), (12, 2)])
def test_decode_group_sizes_without_a_cuda_core_kernel_take_tensor_cores(
        strict_groups, helpers, monkeypatch, hq, hkv):
    monkeypatch.setenv(decode_choice.ENV_FORCE, "0")  # even when CUDA cores are forced
    kc, vc, table, seqlens = helpers.paged(2, [20, 9], 8, hkv, 16)
    q = torch.randn(2, 1, hq, 16)
    p = AttnParams(scale=0.3, block_table=table, seqlens_k=seqlens, max_seqlen_k=20,
                   return_lse=True)
    backend = helpers.small(FlashInferDecodeBackend)
    out, lse = backend.forward(q, kc, vc, helpers.spec(q, kc, "paged", phase="decode"), p)
    assert strict_groups.last("decode.__init__")["use_tensor_cores"] is True
    ref, ref_lse = helpers.paged_reference(q, kc, vc, table, seqlens, p)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert_lse(lse, ref_lse, atol=1e-4)
    use, why = backend.choices[(hq // hkv, 2, 20)]
    assert use and f"group size {hq // hkv}" in why


def test_supported_group_sizes_still_follow_the_measurements(strict_groups, helpers,
                                                             monkeypatch):
    monkeypatch.setenv(decode_choice.ENV_FORCE, "0")
    kc, vc, table, seqlens = helpers.paged(1, [20], 8, 2, 16)
    q = torch.randn(1, 1, 8, 16)  # 4:1, compiled into the CUDA-core kernel
    helpers.small(FlashInferDecodeBackend).forward(
        q, kc, vc, helpers.spec(q, kc, "paged", phase="decode"),
        AttnParams(scale=0.3, block_table=table, seqlens_k=seqlens, max_seqlen_k=20))
    assert strict_groups.last("decode.__init__")["use_tensor_cores"] is False
    assert CUDA_CORE_DECODE_GROUPS == {1, 2, 3, 4, 8}


def test_decode_without_a_tensor_core_switch_refuses_other_group_sizes(helpers):
    backend = FlashInferDecodeBackend()
    backend.__dict__["build"] = FlashInferBuild(  # a build whose __init__ has no switch
        installed=True, decode_init=frozenset({"kv_layout"}),
        decode_plan=frozenset({"window_left", "logits_soft_cap", "sm_scale"}),
        decode_run=frozenset({"return_lse"}), prefill_plan=frozenset({"causal"}),
        prefill_run=frozenset({"return_lse"}))
    kc = torch.zeros(4, 8, 1, 64, dtype=torch.float16)
    seven = helpers.spec(torch.zeros(1, 1, 7, 64, dtype=torch.float16), kc, "paged",
                         phase="decode")
    reasons = backend.extra_checks(seven, SM80)
    assert any("group size 7" in r and "flashinfer_prefill" in r for r in reasons)
    eight = helpers.spec(torch.zeros(1, 1, 8, 64, dtype=torch.float16), kc, "paged",
                         phase="decode")
    assert backend.extra_checks(eight, SM80) == []


@pytest.fixture
def sentinel_lse(fake_flashinfer):
    """FlashInfer < 0.6.18: a row that sees no key gets output 0 and the finite sentinel
    -5e4 (base 2) as its LSE, not -inf."""
    mod = sys.modules["flashinfer"]
    for cls in (mod.BatchDecodeWithPagedKVCacheWrapper, mod.BatchPrefillWithPagedKVCacheWrapper):
        run = cls.run

        def old(self, q, kv, return_lse=False, _run=run):
            res = _run(self, q, kv, return_lse=True)
            out, lse = res
            dead = ~torch.isfinite(lse)
            out = out.masked_fill(dead.unsqueeze(-1), 0.0)
            lse = lse.masked_fill(dead, -5e4)
            return (out, lse) if return_lse else out

        cls.run = old
    return fake_flashinfer


def test_prefill_rows_before_the_cache_start_are_empty(sentinel_lse, helpers):
    """Sq = 5 queries against 2 and 7 cached keys, causal: rows 0-2 of the first sequence
    sit before key 0 and see nothing."""
    kc, vc, table, seqlens = helpers.paged(2, [2, 7], 4, 2, 16)
    q = torch.randn(2, 5, 4, 16)
    p = AttnParams(scale=0.3, causal=True, block_table=table, seqlens_k=seqlens,
                   max_seqlen_k=7, return_lse=True)
    out, lse = helpers.small(FlashInferPrefillBackend).forward(
        q, kc, vc, helpers.spec(q, kc, "paged", causal=True), p)
    ref, ref_lse = helpers.paged_reference(q, kc, vc, table, seqlens, p)
    assert torch.isneginf(ref_lse[0, :, :3]).all()
    assert torch.isneginf(lse[0, :, :3]).all() and (out[0, :3] == 0).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert_lse(lse, ref_lse, atol=1e-4)


def test_empty_sequences_still_give_zero_and_minus_inf(sentinel_lse, helpers):
    kc, vc, table, seqlens = helpers.paged(2, [0, 5], 4, 2, 16)
    q = torch.randn(2, 1, 4, 16)
    p = AttnParams(scale=0.3, block_table=table, seqlens_k=seqlens, max_seqlen_k=5,
                   return_lse=True)
    out, lse = helpers.small(FlashInferDecodeBackend).forward(
        q, kc, vc, helpers.spec(q, kc, "paged", phase="decode"), p)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_rows_without_keys_matches_the_reference_pattern(causal):
    lens = torch.tensor([0, 1, 3, 8], dtype=torch.int32)
    sq = 4
    got = rows_without_keys(lens, sq, causal)
    want = torch.zeros(4, sq, dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        for i in range(sq):
            pos = i + n - sq  # bottom-right
            want[b, i] = n == 0 or (causal and pos < 0)
    assert torch.equal(got, want)
    assert rows_without_keys(torch.tensor([4, 9], dtype=torch.int32), 4, True) is None
