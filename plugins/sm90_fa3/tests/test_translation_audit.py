"""Audit of the Hopper tier's translations: cuDNN's top-left ``is_causal`` and FA3's refusals.

SDPA's ``is_causal`` (which the cuDNN path passes on) is top-left: one query sees key 0 only.
Dropping the mask for one query is right only under bottom-right alignment, where that query
sits on the last key. FA3's ``flash_attn_with_kvcache`` (hopper/flash_attn_interface.py,
flash-attention 0251105) calls the forward op without an autograd Function: no backward.
"""

from __future__ import annotations

import pytest
import torch
from attnhub_sm90_fa3 import cudnn
from attnhub_sm90_fa3.cudnn import CudnnBackend
from attnhub_sm90_fa3.fa3 import Fa3Backend

import attnhub
from attnhub.plugin import AttnParams
from attnhub.plugin import reference_attention as ref_attn
from attnhub.testing import assert_lse

SM90 = attnhub.simulate("sm90")


class TopLeftSdpa:
    """SDPA restricted to cuDNN, modelled as what it computes: top-left ``is_causal``."""

    def __init__(self) -> None:
        self.causal: list[bool] = []

    def __call__(self, q, k, v, causal, scale, lse=False):
        self.causal.append(causal)
        p = AttnParams(scale=scale, causal=causal, alignment="top_left")
        out, l_ = ref_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), p,
                           compute_dtype=torch.float32)
        return (out.transpose(1, 2), l_.unsqueeze(-1)) if lse else out.transpose(1, 2)


@pytest.mark.parametrize("want_lse", [False, True])
@pytest.mark.parametrize("sq,sk,align", [(1, 7, "top_left"), (1, 7, "bottom_right"),
                                         (1, 1, "top_left")])
def test_cudnn_one_query_keeps_a_top_left_mask(monkeypatch, spec_of, want_lse, sq, sk, align):
    """Before the audit the top-left query saw all 7 keys instead of key 0 only."""
    fake = TopLeftSdpa()
    monkeypatch.setattr(cudnn, "sdpa_cudnn", fake)
    monkeypatch.setattr(cudnn, "cudnn_with_lse", lambda *a: fake(*a, lse=True))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, s, h, 16, generator=g) for s, h in ((sq, 4), (sk, 2), (sk, 2)))
    p = AttnParams(scale=0.3, causal=True, alignment=align, return_lse=want_lse)
    be = CudnnBackend()
    be.load()
    out, lse = be.forward(q, k, v, spec_of(q, k, causal=True, alignment=align), p)
    ref, ref_lse = ref_attn(q, k, v, p, compute_dtype=torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    if want_lse:
        assert_lse(lse, ref_lse, atol=1e-4)
    assert fake.causal == [align == "top_left"]  # SDPA is_causal (top-left) only there


def test_fa3_refuses_gradients_through_the_paged_path(fa3_full, spec_of):
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16)
    reasons = Fa3Backend().check(spec_of(q, kc, "paged", phase="train", needs_grad=True), SM90)
    assert any("no backward" in r for r in reasons)
    assert not any("no backward" in r
                   for r in Fa3Backend().check(spec_of(q, kc, "paged", phase="decode"), SM90))
