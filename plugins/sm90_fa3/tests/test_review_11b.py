"""Review 11b: fa3_fp8's descales of an e4m3 bshd cache took a number, (Hkv,), (1, Hkv) or
(B, Hkv) only: one descale per sequence, (B, 1), which the hub's contract allows and
``triton_decode_fp8`` serves (it broadcasts to (B, Hkv)), raised InputError from fa3_fp8,
so a call the policy bound there failed with no fallback. Every form that broadcasts to
(B, Hkv) now reaches FA3 as (B, Hkv) fp32; another shape is still refused by name."""

from __future__ import annotations

import pytest
import torch
from attnhub_sm90_fa3.fa3_fp8 import Fa3Fp8Backend, kv_descale
from attnhub_sm90_fa3.fp8 import E4M3, E4M3_TARGET

from attnhub.plugin import AttnParams, InputError
from attnhub.plugin import reference_attention as ref_attn


def _per_sequence(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values with one descale per sequence shared by its KV heads: (B, 1) fp32."""
    descale = x.float().abs().amax(dim=(1, 2, 3)).clamp_min(1e-6) / E4M3_TARGET
    return (x.float() / descale.view(-1, 1, 1, 1)).to(E4M3), descale.view(-1, 1)


def test_per_sequence_descales_reach_fa3_as_batch_by_kv_head(fa3_fwd, spec_of) -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, s, h, 16, generator=g).to(torch.bfloat16)
               for s, h in ((8, 4), (24, 2), (24, 2)))
    k8, kd = _per_sequence(k)
    v8, vd = _per_sequence(v)
    p = AttnParams(scale=0.25, causal=True, extra={"k_descale": kd, "v_descale": vd})
    backend = Fa3Fp8Backend("plain")
    backend.load()
    out, _ = backend.forward(q, k8, v8, spec_of(q, k8, causal=True), p)
    kw = fa3_fwd.last("flash_attn_func")
    assert kw["k_descale"].shape == (2, 2) and kw["k_descale"].is_contiguous()
    assert torch.equal(kw["k_descale"], kd.expand(2, 2))
    ref = ref_attn(q, k, v, p, compute_dtype=torch.float32)[0]
    rel = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 0.08


@pytest.mark.parametrize("shape", [(3, 1), (1, 1), (1,), (2,), (1, 2), (3, 2), ()])
def test_every_broadcastable_form_is_taken(shape) -> None:
    got = kv_descale("k_descale", torch.full(shape, 0.5), 3, 2, torch.device("cpu"))
    assert got.shape == (3, 2) and got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, torch.full((3, 2), 0.5))


@pytest.mark.parametrize("shape", [(5, 2), (4,), (3, 3), (1, 3, 2)])
def test_per_page_and_other_shapes_are_named(shape) -> None:
    with pytest.raises(InputError, match=r"k_descale.*per sequence \(3, 1\)"):
        kv_descale("k_descale", torch.ones(shape), 3, 2, torch.device("cpu"))
