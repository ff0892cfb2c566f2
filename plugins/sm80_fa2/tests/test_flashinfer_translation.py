"""flashinfer_decode / flashinfer_prefill against a recording FlashInfer fake: block tables to
CSR, NHD/HND, plan caching, the tensor-core choice and base-2 LSE conversion."""

from __future__ import annotations

import pytest
import torch
from attnhub_sm80_fa2 import decode_choice, flashinfer_paged
from attnhub_sm80_fa2.flashinfer_paged import FlashInferDecodeBackend, FlashInferPrefillBackend
from attnhub_sm80_fa2.paged_csr import block_table_to_csr

from attnhub.plugin import AttnParams, BackendUnavailableError
from attnhub.testing import assert_lse




@pytest.mark.parametrize("page,lens", [(16, [40, 7, 16]), (4, [1, 13, 9])])
def test_decode_matches_reference_and_plans_csr(fake_flashinfer, helpers, page, lens):
    kc, vc, table, seqlens = helpers.paged(3, lens, page, 2, 16)
    q = torch.randn(3, 1, 8, 16)
    p = AttnParams(scale=0.25, causal=True, block_table=table, seqlens_k=seqlens,
                   max_seqlen_k=max(lens), softcap=3.0, window=(5, 0), return_lse=True)
    spec = helpers.spec(q, kc, "paged", phase="decode", causal=True, window=(5, 0),
                        softcap=True)
    out, lse = helpers.small(FlashInferDecodeBackend).forward(q, kc, vc, spec, p)
    ref, ref_lse = helpers.paged_reference(q, kc, vc, table, seqlens, p)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert_lse(lse, ref_lse, atol=1e-4)  # base-2 LSE converted to natural log
    plan = fake_flashinfer.last("decode.plan")
    csr = block_table_to_csr(table, seqlens, page)
    assert torch.equal(plan["indptr"], csr.indptr) and torch.equal(plan["indices"], csr.indices)
    assert plan["window_left"] == 5 and plan["logits_soft_cap"] == 3.0
    assert plan["sm_scale"] == 0.25 and plan["heads"] == (8, 2) and plan["page_size"] == page


def test_hnd_storage_is_detected_from_strides(fake_flashinfer, helpers):
    kc, vc, table, seqlens = helpers.paged(2, [20, 33], 8, 2, 16)
    k_hnd = kc.transpose(1, 2).contiguous()  # (pages, H, page, D) storage
    v_hnd = vc.transpose(1, 2).contiguous()
    q = torch.randn(2, 1, 4, 16)
    p = AttnParams(scale=0.3, block_table=table, seqlens_k=seqlens, max_seqlen_k=33)
    spec = helpers.spec(q, kc, "paged", phase="decode")
    out, _ = helpers.small(FlashInferDecodeBackend).forward(
        q, k_hnd.transpose(1, 2), v_hnd.transpose(1, 2), spec, p)
    assert fake_flashinfer.last("decode.__init__")["kv_layout"] == "HND"
    torch.testing.assert_close(out, helpers.paged_reference(q, kc, vc, table, seqlens, p)[0],
                               atol=2e-5, rtol=1e-5)


def test_strided_head_dims_are_copied_or_refused(fake_flashinfer, helpers):
    """FlashInfer reads the head dim as dense: a strided q is copied (the kernel gets a unit
    stride), a strided cache is refused with the reason (copying it would cost a whole
    cache per call)."""
    kc, vc, table, seqlens = helpers.paged(2, [20, 33], 8, 2, 16)
    q = torch.randn(2, 1, 4, 32)[..., ::2]
    p = AttnParams(scale=0.3, block_table=table, seqlens_k=seqlens, max_seqlen_k=33)
    spec = helpers.spec(q, kc, "paged", phase="decode")
    out, _ = helpers.small(FlashInferDecodeBackend).forward(q, kc, vc, spec, p)
    assert fake_flashinfer.last("decode.run")["q_head_stride"] == 1
    torch.testing.assert_close(out, helpers.paged_reference(q, kc, vc, table, seqlens, p)[0],
                               atol=2e-5, rtol=1e-5)
    wide = torch.zeros(*kc.shape[:-1], 32)
    wide[..., ::2] = kc
    with pytest.raises(BackendUnavailableError, match="stride 2/1"):
        helpers.small(FlashInferDecodeBackend).forward(q, wide[..., ::2], vc, spec, p)


def test_plan_is_cached_per_batch_layout(fake_flashinfer, helpers, monkeypatch):
    choices = []
    monkeypatch.setattr(flashinfer_paged, "choose_tensor_cores",
                        lambda *a: choices.append(a) or (False, "test"))
    kc, vc, table, seqlens = helpers.paged(2, [20, 30], 8, 2, 16, extra_pages=8)
    q = torch.randn(2, 1, 4, 16)
    backend = helpers.small(FlashInferDecodeBackend)
    spec = helpers.spec(q, kc, "paged", phase="decode")
    p = AttnParams(scale=0.3, block_table=table, seqlens_k=seqlens, max_seqlen_k=30)
    for _ in range(3):  # three layers of one step: one plan
        backend.forward(q, kc, vc, spec, p)
    assert fake_flashinfer.names().count("decode.plan") == 1
    assert fake_flashinfer.names().count("decode.run") == 3
    assert len(choices) == 1  # a cache hit does no planning work at all
    seqlens.add_(1)  # the next step writes new lengths in place: replan
    out, _ = backend.forward(q, kc, vc, spec, p)
    assert fake_flashinfer.names().count("decode.plan") == 2
    torch.testing.assert_close(out, helpers.paged_reference(q, kc, vc, table, seqlens, p)[0],
                               atol=2e-5, rtol=1e-5)


def test_tensor_core_choice_follows_measurements(fake_flashinfer, helpers, monkeypatch):
    fast_tc = decode_choice.parse_measurements({"source": "test", "rows": [
        {"gqa": 4, "batch": 1, "seqlen_k": 64, "tensor_cores_us": 1.0, "cuda_cores_us": 9.0}]})
    monkeypatch.setattr(decode_choice, "packaged_measurements", lambda: fast_tc)
    kc, vc, table, seqlens = helpers.paged(1, [30], 8, 2, 16)
    q = torch.randn(1, 1, 8, 16)
    backend = helpers.small(FlashInferDecodeBackend)
    backend.forward(q, kc, vc, helpers.spec(q, kc, "paged", phase="decode"),
                    AttnParams(scale=0.3, block_table=table, seqlens_k=seqlens, max_seqlen_k=30))
    assert fake_flashinfer.last("decode.__init__")["use_tensor_cores"] is True
    assert backend.choices[(4, 1, 30)][0] is True and "test" in backend.choices[(4, 1, 30)][1]


def test_prefill_causal_chunk_and_empty_sequence(fake_flashinfer, helpers):
    kc, vc, table, seqlens = helpers.paged(3, [12, 0, 9], 4, 2, 16)
    q = torch.randn(3, 3, 4, 16)
    p = AttnParams(scale=0.3, causal=True, block_table=table, seqlens_k=seqlens,
                   max_seqlen_k=12, return_lse=True)
    out, lse = helpers.small(FlashInferPrefillBackend).forward(
        q, kc, vc, helpers.spec(q, kc, "paged", causal=True), p)
    plan = fake_flashinfer.last("prefill.plan")
    assert plan["qo_indptr"].tolist() == [0, 3, 6, 9] and plan["causal"] is True
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    live = [0, 2]
    ref, ref_lse = helpers.paged_reference(q[live], kc, vc, table[live], seqlens[live], p)
    torch.testing.assert_close(out[live], ref, atol=2e-5, rtol=1e-5)
    assert_lse(lse[live], ref_lse, atol=1e-4)


def test_prefill_window_right_edge_becomes_causal_or_is_refused(fake_flashinfer, helpers):
    kc, vc, table, seqlens = helpers.paged(1, [10], 4, 2, 16)
    q = torch.randn(1, 4, 4, 16)
    backend = helpers.small(FlashInferPrefillBackend)
    p = AttnParams(scale=0.3, window=(3, 0), block_table=table, seqlens_k=seqlens,
                   max_seqlen_k=10)
    out, _ = backend.forward(q, kc, vc, helpers.spec(q, kc, "paged", window=(3, 0)), p)
    assert fake_flashinfer.last("prefill.plan")["causal"] is True
    torch.testing.assert_close(out, helpers.paged_reference(q, kc, vc, table, seqlens, p)[0],
                               atol=2e-5, rtol=1e-5)
    p.window = (3, 2)
    with pytest.raises(BackendUnavailableError, match="left only"):
        backend.forward(q, kc, vc, helpers.spec(q, kc, "paged", window=(3, 2)), p)
