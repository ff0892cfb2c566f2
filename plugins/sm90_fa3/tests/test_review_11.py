"""Review 11: fa3_fp8 over an e4m3 bshd cache passes FA3 descales of the one shape its C++
entry takes (``CHECK_SHAPE(k_descale, batch_size, num_heads_k)``, ``hopper/flash_api.cpp``).

The hub's contract lets ``extra`` carry a descale as a number or a tensor per (batch, KV head);
a number or a per-KV-head tensor used to reach the library as is (``float.float()`` raised
AttributeError, an ``(Hkv,)`` tensor failed FA3's shape check): a crash of the backend rather
than the answer or a refusal naming the argument.
"""

from __future__ import annotations

import pytest
import torch
from attnhub_sm90_fa3.fa3_fp8 import Fa3Fp8Backend, kv_descale
from attnhub_sm90_fa3.fp8 import E4M3, E4M3_TARGET

from attnhub.plugin import AttnParams, InputError
from attnhub.plugin import reference_attention as ref_attn


def qkv(b, sq, sk, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).to(torch.bfloat16)
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def per_head(x, hkv):
    """e4m3 values with one descale per KV head shared by every sequence: (Hkv,) fp32."""
    amax = x.float().abs().amax(dim=(0, 1, 3)).clamp_min(1e-6)
    descale = amax / E4M3_TARGET
    return (x.float() / descale.view(1, 1, hkv, 1)).to(E4M3), descale


def run(q, k, v, spec, p):
    backend = Fa3Fp8Backend("plain")
    backend.load()
    return backend.forward(q, k, v, spec, p)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("form", ["per_kv_head", "one_row", "batch_rows", "number", "0-d"])
def test_descales_of_every_allowed_form_reach_fa3_as_batch_by_kv_head(fa3_fwd, spec_of, form):
    q, k, v = qkv(2, 8, 24)
    k8, kd = per_head(k, 2)
    v8, vd = per_head(v, 2)
    if form in ("number", "0-d"):  # one descale for the whole cache
        kd, vd = kd.max(), vd.max()
        k8 = (k.float() / kd).to(E4M3)
        v8 = (v.float() / vd).to(E4M3)
        if form == "number":
            kd, vd = float(kd), float(vd)
    elif form == "one_row":
        kd, vd = kd.view(1, 2), vd.view(1, 2)
    elif form == "batch_rows":
        kd, vd = kd.expand(2, 2).clone(), vd.expand(2, 2).clone()
    p = AttnParams(scale=0.25, causal=True, extra={"k_descale": kd, "v_descale": vd})
    out, _ = run(q, k8, v8, spec_of(q, k8, causal=True), p)
    kw = fa3_fwd.last("flash_attn_func")
    for name in ("k_descale", "v_descale"):
        assert kw[name].shape == (2, 2) and kw[name].dtype == torch.float32
        assert kw[name].is_contiguous()
    ref = ref_attn(q, k, v, p, compute_dtype=torch.float32)[0]
    assert rel(out, ref) < 0.08


def test_a_descale_of_another_shape_is_the_callers_error_named(fa3_fwd, spec_of):
    q, k, v = qkv(2, 8, 24)
    k8, kd = per_head(k, 2)
    v8, vd = per_head(v, 2)
    bad = kd.view(1, 2).expand(3, 2)  # three rows for a batch of two (per-page descales)
    p = AttnParams(scale=0.25, extra={"k_descale": bad, "v_descale": vd})
    with pytest.raises(InputError, match=r"k_descale.*\(3, 2\).*\(2, 2\)"):
        run(q, k8, v8, spec_of(q, k8), p)


def test_kv_descale_shapes():
    dev = torch.device("cpu")
    assert torch.equal(kv_descale("k", 0.5, 3, 2, dev), torch.full((3, 2), 0.5))
    got = kv_descale("k", torch.tensor([1.0, 2.0], dtype=torch.float16), 3, 2, dev)
    assert got.dtype == torch.float32 and got.tolist() == [[1.0, 2.0]] * 3
    with pytest.raises(InputError, match="per KV head"):
        kv_descale("k", torch.ones(4), 3, 2, dev)
