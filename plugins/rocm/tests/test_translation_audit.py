"""Audit of ck_fa's translation against CK's own conventions.

* ALiBi (the conftest fakes model it): ck_tile's ``make_alibi_from_lr_mask``
  (``block_position_encoding.hpp``) picks ``AlibiMode::VERTICAL`` (``+slope * key``) for a
  causal mask (left < 0, right == 0 after ``csrc/flash_attn_ck/mha_fwd.cpp`` clamps edges
  >= Sk), so the library's LSE is higher than attnhub's by ``slope * query_pos``; the output
  is unchanged.
* Windows: ``mha_varlen_fwd`` clamps an edge >= max_seqlen_k to unbounded, as the dense entry
  does; a packed call whose first queries sit before key 0 must be refused, not run.
"""

from __future__ import annotations

import pytest
import torch

from attnhub.plugin import AttentionSpec, AttnParams, BackendUnavailableError, MaskSpec
from attnhub.plugin import reference_attention as ref_attn
from attnhub.testing import assert_lse
from attnhub_rocm.ck_fa import CKFlashBackend
from attnhub_rocm.ck_libraries import AITER, FLASH_ATTN_CK


@pytest.fixture(params=["flash_attn", "aiter"])
def ck(request):
    """Either library's fake (conftest: CK's VERTICAL causal ALiBi in its LSE) and ck_fa."""
    lib = {"flash_attn": FLASH_ATTN_CK, "aiter": AITER}[request.param]
    return request.getfixturevalue(f"fake_{request.param}"), CKFlashBackend(lib)


def spec(layout: str, sq: int, sk: int, **mask) -> AttentionSpec:
    return AttentionSpec(phase="prefill", dtype="bf16", head_dim=16, num_q_heads=4,
                         num_kv_heads=2, layout=layout, max_seqlen_q=sq, max_seqlen_k=sk,
                         return_lse=True, mask=MaskSpec(document=layout == "thd", **mask))


SLOPES = [torch.tensor([0.5, 0.25, 0.125, 0.0625]), torch.rand(2, 4, dtype=torch.float64)]


@pytest.mark.parametrize("slopes", SLOPES, ids=["per_head", "per_batch"])
@pytest.mark.parametrize("sq,sk,window", [(5, 9, None), (6, 6, None), (7, 3, None),
                                          (5, 9, (30, 0)), (5, 9, (2, 0))])
def test_causal_alibi_lse_is_attnhubs(ck, slopes, sq, sk, window):
    """Before the audit ck_fa returned CK's LSE, off by slope * query position."""
    rec, be = ck
    q, k, v = torch.randn(2, sq, 4, 16), torch.randn(2, sk, 2, 16), torch.randn(2, sk, 2, 16)
    p = AttnParams(scale=0.3, causal=True, window=window, alibi_slopes=slopes, return_lse=True)
    out, lse = be.forward(q, k, v, spec("bshd", sq, sk, causal=True, window=window, alibi=True),
                          p)
    ref, ref_lse = ref_attn(q, k, v, p, compute_dtype=torch.float64)
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    assert_lse(lse, ref_lse, atol=1e-4)
    assert rec.calls[-1]["alibi_slopes"].dtype == torch.float32
    assert rec.calls[-1]["causal"] is True and rec.calls[-1]["window_size"][1] == 0


def test_varlen_causal_alibi_lse(ck):
    rec, be = ck
    cu_q = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9, 15], dtype=torch.int32)
    q, k, v = torch.randn(7, 4, 16), torch.randn(15, 2, 16), torch.randn(15, 2, 16)
    slopes = torch.rand(3, 4)
    p = AttnParams(scale=0.3, causal=True, alibi_slopes=slopes, cu_seqlens_q=cu_q,
                   cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6, return_lse=True)
    out, lse = be.forward(q, k, v, spec("thd", 5, 6, causal=True, alibi=True), p)
    ref, ref_lse = ref_attn(q, k, v, p, layout="thd", compute_dtype=torch.float64)
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    assert lse.shape == (4, 7)
    assert_lse(lse, ref_lse, atol=1e-4)
    assert rec.calls[-1]["max_q"] == 5 and rec.calls[-1]["max_k"] == 6


def test_varlen_window_the_kernel_clamps_is_refused(ck):
    """A right edge 6 >= max_seqlen_k=5 becomes unbounded in ``mha_varlen_fwd``, which would
    show the first queries (before key 0, Sq=12 > Sk=5) keys their window excludes."""
    rec, be = ck
    cu_q = torch.tensor([0, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 5], dtype=torch.int32)
    q, k, v = torch.randn(12, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    p = AttnParams(scale=0.3, window=(-1, 6), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                   max_seqlen_q=12, max_seqlen_k=5)
    with pytest.raises(BackendUnavailableError, match="Sq=12 > Sk=5"):
        be.forward(q, k, v, spec("thd", 12, 5, window=(-1, 6)), p)
    assert not rec.calls
