"""torch_sdpa runs causal masks that SDPA can express natively without building a mask
tensor (decode, chunked prefill, spec-decode): same answers as the fp64 reference, and the
explicit-mask builder is never called for those shapes."""

from __future__ import annotations

import math

import pytest
import torch

import attnhub.core.builtin as builtin
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.testing import assert_fa_rule, assert_lse


@pytest.mark.parametrize("sq,sk,alignment", [(1, 97, "bottom_right"), (4, 97, "bottom_right"),
                                            (33, 97, "bottom_right"), (1, 97, "top_left"),
                                            (40, 40, "bottom_right")])
@pytest.mark.parametrize("return_lse", [False, True])
def test_native_causal_forms_match_reference(hub, monkeypatch, sq, sk, alignment, return_lse):
    def no_materialised_mask(*a, **kw):
        raise AssertionError("explicit mask built for a causal form SDPA has natively")

    if not return_lse:  # on the CPU, the one-pass LSE kernel takes a materialised mask
        monkeypatch.setattr(builtin, "allowed_mask", no_materialised_mask)
    gen = torch.Generator().manual_seed(sq * 1000 + sk)
    q = torch.randn(2, sq, 8, 32, generator=gen).bfloat16()
    k = torch.randn(2, sk, 2, 32, generator=gen).bfloat16()
    v = torch.randn(2, sk, 2, 32, generator=gen).bfloat16()
    res = hub.attention(q, k, v, causal=True, causal_alignment=alignment,
                        backend="torch_sdpa", return_lse=return_lse)
    out, lse = res if return_lse else (res, None)
    p = AttnParams(scale=1 / math.sqrt(32), causal=True, alignment=alignment)
    ref, ref_lse = reference_attention(q, k, v, p)
    same, _ = reference_attention(q, k, v, p, compute_dtype=q.dtype)
    assert_fa_rule(out, ref, same, what="output")
    if return_lse:
        assert_lse(lse, ref_lse, atol=2e-2)


def test_rows_seeing_no_key_keep_zero_output_and_minus_inf_lse(hub):
    """Bottom-right with Sq > Sk: the first Sq - Sk rows see nothing (explicit-mask path)."""
    q = torch.randn(1, 9, 4, 16)
    k = torch.randn(1, 5, 4, 16)
    out, lse = hub.attention(q, k, k.clone(), causal=True, backend="torch_sdpa",
                             return_lse=True)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.isneginf(lse[..., :4]).all() and torch.isfinite(lse[..., 4:]).all()
