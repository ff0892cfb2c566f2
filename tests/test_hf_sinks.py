"""Attention sinks through attn_implementation="attnhub" (GPT-OSS's ``s_aux``, one learned
logit per head; GraniteSWA, Flint, MiMo-V2-Flash, DeepSeek-V4 the same): once refused, now
applied exactly from the output and its LSE (``with_sinks``).

``with_sinks`` against the definition (the sink's logit appended to each row's scores, the
softmax, the sink's column dropped) in fp64 on random inputs, with masked rows and per-query
sinks; then tiny random models of every sink family this transformers has against eager:
logits on a padded batch, generate(), and training gradients (the sinks' included)."""

from __future__ import annotations

import pytest
import torch

import attnhub
from attnhub import InputError
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.integrations.transformers import with_sinks

transformers = pytest.importorskip("transformers")


def _by_definition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   allowed: torch.Tensor) -> torch.Tensor:
    """bshd; ``sinks`` (B, H, Sq); ``allowed`` (Sq, Sk): eager's sink attention in fp64."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.cat([s, sinks[..., None]], -1).softmax(-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("per", ["head", "query"])
@pytest.mark.parametrize("window", [None, (3, 0)])
def test_with_sinks_is_the_definition(per: str, window: tuple[int, int] | None) -> None:
    g = torch.Generator().manual_seed(7 + (window is None))
    b, sq, sk, h, d = 2, 7, 9, 3, 8
    q, k, v = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
               for s in (sq, sk, sk))
    sinks = torch.randn(h if per == "head" else (b, h, sq, 1), generator=g,
                        dtype=torch.float64) * 2
    # top-left causal: query 0 sees key 0 only; with the window, rows see 1..4 keys
    params = AttnParams(scale=d ** -0.5, causal=True, alignment="top_left", window=window,
                        return_lse=True)
    out, lse = reference_attention(q, k, v, params)
    got = with_sinks(out, lse, sinks)
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    allowed = (j <= i) & ((i - j <= window[0]) if window else True)
    per_row = sinks.view(1, h, 1).expand(b, h, sq) if per == "head" else sinks[..., 0]
    want = _by_definition(q, k, v, per_row, allowed)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    # more sink, less attention: every row's norm shrinks as its sink grows
    bigger = with_sinks(out, lse, sinks + 3)
    assert bool((bigger.norm(dim=-1) < got.norm(dim=-1)).all())


def test_a_row_that_sees_no_key_stays_zero() -> None:
    out = torch.randn(1, 4, 2, 8)
    lse = torch.randn(1, 2, 4)
    out[:, 1], lse[:, :, 1] = 0.0, float("-inf")
    got = with_sinks(out, lse, torch.randn(2))
    assert bool((got[:, 1] == 0).all()) and bool(torch.isfinite(got).all())


def test_sinks_of_another_shape_or_without_lse_gradient_are_refused() -> None:
    out, lse = torch.randn(2, 5, 4, 8), torch.randn(2, 4, 5)
    for bad in (torch.randn(3), torch.randn(2, 4, 6, 1), torch.randn(4, 5)):
        with pytest.raises(InputError, match="attention sinks of shape"):
            with_sinks(out, lse, bad)
    out.requires_grad_()
    with pytest.raises(InputError, match="LSE that carries no gradient.*policy"):
        with_sinks(out, lse, torch.randn(4))


def test_a_layer_passing_sinks_of_another_shape_is_named() -> None:
    from attnhub.integrations import transformers as hf

    q = k = v = torch.randn(1, 4, 5, 8)
    module = torch.nn.Module()
    module.is_causal, module.layer_idx = True, 3
    hf.register(attnhub.Hub(hardware="cpu"))
    with pytest.raises(InputError, match=r"Module \(layer 3\): attention sinks of shape \(3,\)"):
        hf.attention_forward(module, q, k, v, None, s_aux=torch.randn(3))


def test_the_attention_function_applies_sinks_and_ignores_logits_to_keep() -> None:
    """What transformers hands the function: q/k/v (B, H, S, D), ``s_aux`` per head; the
    generate()-only ``logits_to_keep`` some models leak into the layers changes nothing."""
    from attnhub.integrations import transformers as hf

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    sinks = torch.randn(4, generator=g)
    module = torch.nn.Module()
    module.is_causal = True
    hf.register(attnhub.Hub(hardware="cpu"))
    got, weights = hf.attention_forward(module, q, k, v, None, scaling=8 ** -0.5, s_aux=sinks)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    want = _by_definition(*(t.transpose(1, 2).double() for t in (q, k, v)),
                          sinks.double().view(1, 4, 1).expand(2, 4, 6), allowed)
    assert weights is None
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    again, _ = hf.attention_forward(module, q, k, v, None, scaling=8 ** -0.5, s_aux=sinks,
                                    logits_to_keep=1)
    assert torch.equal(again, got)


#: transformers model types whose attention passes ``s_aux`` (those this version has).
SINK_FAMILIES = ("gpt_oss", "granite_swa", "granitemoe_swa", "flint", "mimo_v2_flash",
                 "deepseek_v4")

@pytest.mark.parametrize("model_type", SINK_FAMILIES)
def test_sink_families_match_eager(model_type: str) -> None:
    from attnhub.integrations import transformers as hf
    from attnhub.integrations.transformers.testing import (matches_eager, one_intraop_thread,
                                                          sharpened, tiny_config)

    hf.register(attnhub.Hub(hardware="cpu"))
    with one_intraop_thread():
        ours, twin = sharpened(tiny_config(model_type) or pytest.skip(f"no {model_type} here"), transformers.AutoModelForCausalLM, 4.0)
        with torch.no_grad():  # sinks well away from 0, so that they matter
            g = torch.Generator().manual_seed(1)
            for (name, p), (_, p2) in zip(ours.named_parameters(), twin.named_parameters()):
                if name.endswith("sinks"):
                    p.copy_(torch.randn(p.shape, generator=g) * 2)
                    p2.copy_(p)
        assert any(n.endswith("sinks") for n, _ in ours.named_parameters())
        matches_eager(ours, twin, 99, model_type)
