"""Each named variant, run through flex, equals the attnhub built-in mask kind it stands for
(computed by the fp64 reference from the built-in arguments, not from the variant itself)."""

from __future__ import annotations

import pytest
import torch
from attnhub_triton_portable import variants
from attnhub_triton_portable.backend_flex import FlexBackend

from attnhub import AttentionSpec, Hub, MaskSpec
from attnhub.core.registry import Registry
from attnhub.plugin import AttnParams, reference_attention
from attnhub.testing import assert_fa_rule

DEV = "cuda" if torch.cuda.is_available() else "cpu"
B, S, HQ, HKV, D = 2, 23, 8, 2, 16


@pytest.fixture(scope="module")
def eager() -> FlexBackend:
    b = FlexBackend(compiled=False)
    b.load()
    return b


@pytest.fixture(scope="module")
def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, S, h, D, generator=g).to(DEV) for h in (HQ, HKV, HKV))


def _flex(backend: FlexBackend, q, k, v, **mods) -> torch.Tensor:
    names = {key: fn.__name__ for key, fn in mods.items()}
    spec = AttentionSpec(phase="prefill", dtype="fp32", head_dim=D, num_q_heads=HQ,
                         num_kv_heads=HKV, mask=MaskSpec(**names))
    return backend.forward(q, k, v, spec, AttnParams(scale=D ** -0.5, **mods)).out


def _builtin(q, k, v, **kinds) -> tuple[torch.Tensor, torch.Tensor]:
    p = AttnParams(scale=D ** -0.5, **kinds)
    return (reference_attention(q.cpu(), k.cpu(), v.cpu(), p)[0],
            reference_attention(q.cpu(), k.cpu(), v.cpu(), p, compute_dtype=q.dtype)[0])


@pytest.mark.parametrize("variant,builtin", [
    (variants.softcap(0.5), {"softcap": 0.5}),
    (variants.alibi(HQ), {"alibi_slopes": variants.alibi_slopes(HQ)}),
    (variants.sliding_window(5), {"causal": True, "window": (5, 0)}),
    (variants.prefix_lm(7), {"causal": True, "prefix_lens": torch.tensor([7] * B)}),
])
def test_variant_equals_builtin(eager, qkv, variant, builtin):
    key = "score_mod" if variant.__code__.co_argcount == 5 else "mask_mod"
    out = _flex(eager, *qkv, **{key: variant})
    assert_fa_rule(out.cpu(), *_builtin(*qkv, **builtin))


@pytest.mark.parametrize("causal", [False, True])
def test_document_equals_thd_documents(eager, qkv, causal):
    """document(ids) over one packed row == thd with the same cu_seqlens (Sq = Sk per doc)."""
    lens = [6, 1, 9, 7]
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(lens)).to(DEV)
    q, k, v = (x[:1] for x in qkv)
    out = _flex(eager, q, k, v, mask_mod=variants.document(ids, causal=causal))
    cu = torch.tensor([0, 6, 7, 16, 23], dtype=torch.int32)
    p = AttnParams(scale=D ** -0.5, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref64, _ = reference_attention(q[0].cpu(), k[0].cpu(), v[0].cpu(), p, layout="thd")
    ref_same, _ = reference_attention(q[0].cpu(), k[0].cpu(), v[0].cpu(), p, layout="thd",
                                      compute_dtype=q.dtype)
    assert_fa_rule(out[0].cpu(), ref64, ref_same)


def test_named_defaults_are_registered_under_their_names():
    reg = Registry.load(allow=["triton_portable"])
    for fn in variants.DEFAULTS:
        v = reg.variant(fn.__name__)
        assert (v.score_mod or v.mask_mod) is fn
        assert v.plugin == "triton_portable" and v.doc
    assert {"softcap30", "softcap50", "alibi32", "window4096", "prefix_lm512"} <= set(
        reg.variants)


def test_string_name_reaches_the_spec_and_the_kernel(qkv):
    """attention(score_mod="softcap30") looks the variant up, names the spec after it (what a
    YAML ``when: {variant: [softcap30]}`` matches) and computes softcap 30."""
    hub = Hub(registry=Registry.load(allow=["triton_portable"]))
    q, k, v = (x * 12 for x in qkv)  # large scores, so that a cap of 30 matters
    out = hub.attention(q, k, v, score_mod="softcap30", backend="reference")
    assert [r.decision.spec.mask.score_mod for r in hub.bound()] == ["softcap30"]
    ref64, ref_same = _builtin(q, k, v, softcap=30.0)
    assert_fa_rule(out.cpu(), ref64, ref_same)


def test_alibi_slopes_follow_the_paper():
    """Powers of two: 2^(-8(h+1)/n); otherwise the lower power's slopes, then every other
    slope of twice that many heads."""
    assert torch.allclose(variants.alibi_slopes(8), 2.0 ** (-torch.arange(1.0, 9.0)))
    expect6 = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]
    assert torch.allclose(variants.alibi_slopes(6), torch.tensor(expect6))


def test_factories_reject_bad_parameters():
    with pytest.raises(ValueError, match="softcap"):
        variants.softcap(0)
    with pytest.raises(ValueError, match="sliding_window"):
        variants.sliding_window(-1)
    assert variants.sliding_window(2048).__name__ == "window2048"
