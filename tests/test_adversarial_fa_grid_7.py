"""Review round 7, numerics at the boundary:

- flex cast a score_mod's result back to q's dtype: fp16 scores past 65504 became inf, and
  finite inputs gave NaN (ALiBi, softcap, any score_mod);
- scale / softcap past float32's range made the Triton kernels' capped score of a 0 logit
  NaN: such a pair is refused where the call is checked;
- an unbounded window (-1, -1), or (-1, r >= 0) under causal, counted as a sliding window,
  and backends without windows refused the mask they had just served;
- a forced backend refusing at run time raised NoBackendError, not its own refusal.
"""

from __future__ import annotations

import pytest
import torch

import attnhub
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.errors import ArgumentError, BackendUnavailableError


@pytest.mark.parametrize("kw", [{"score_mod": lambda s, b, h, qi, kj: s},
                                {"alibi_slopes": torch.tensor([0.1, 0.2])},
                                {"softcap": 1e5}], ids=["identity", "alibi", "softcap"])
def test_flex_fp16_scores_past_65504_stay_finite(kw: dict) -> None:
    g = torch.Generator().manual_seed(307)
    q, k = (300 * torch.randn(1, 7, 2, 16, generator=g) for _ in range(2))
    v = torch.randn(1, 7, 2, 16, generator=g)
    q, k, v = (t.half() for t in (q, k, v))
    out = attnhub.Hub(hardware="cpu").attention(q, k, v, backend="flex", **kw)
    p = AttnParams(scale=0.25, score_mod=kw.get("score_mod"),
                   alibi_slopes=kw.get("alibi_slopes"), softcap=kw.get("softcap"))
    want = reference_attention(q, k, v, p)[0]
    assert torch.isfinite(out).all()
    assert float((out.double() - want).abs().max()) <= 2e-3


def test_a_scale_over_softcap_past_float32_is_refused() -> None:
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ArgumentError, match="overflows float32"):
        attnhub.Hub(hardware="cpu").attention(q, q, q, scale=100.0, softcap=1e-37)


@pytest.mark.parametrize("kw", [{"window": (-1, -1)}, {"window": -1},
                                {"causal": True, "window": -1},
                                {"causal": True, "window": (-1, 0)},
                                {"causal": True, "window": (-1, 3)}])
def test_an_unbounded_window_is_no_window(kw: dict) -> None:
    """torch_flash_cpu declares no window: it serves these as the masks they are."""
    q = torch.randn(1, 6, 2, 16)
    hub = attnhub.Hub(hardware="cpu")
    out = hub.attention(q, q, q, backend="torch_flash_cpu", **kw)
    plain = hub.attention(q, q, q, backend="torch_flash_cpu", causal=kw.get("causal", False))
    torch.testing.assert_close(out, plain)


def test_a_forced_backend_refusing_at_run_time_raises_its_refusal() -> None:
    """Sq=7, Sk=8 share a length bucket, so the bucket's check passes and the run refuses."""
    q, k = torch.randn(1, 7, 4, 32), torch.randn(1, 8, 2, 32)
    with pytest.raises(BackendUnavailableError):
        attnhub.Hub(hardware="cpu").attention(q, k, k, backend="torch_flash_cpu", causal=True)


def test_a_window_with_a_prefix_keeps_its_right_bound() -> None:
    """(-1, 1) under causal bounds nothing only without a prefix: prefix rows see keys right
    of the diagonal, which the window's right edge still bounds (self-review of the fix)."""
    torch.manual_seed(0)
    q = torch.randn(1, 8, 2, 16)
    hub = attnhub.Hub(hardware="cpu")
    kw = {"causal": True, "prefix_lens": torch.tensor([6])}
    for backend in ("reference", "torch_sdpa"):
        unbounded_left = hub.attention(q, q, q, window=(-1, 1), backend=backend, **kw)
        torch.testing.assert_close(unbounded_left, hub.attention(q, q, q, window=(7, 1),
                                                                 backend=backend, **kw))
        assert not torch.allclose(unbounded_left, hub.attention(q, q, q, backend=backend, **kw))


def test_the_hot_path_refuses_a_scale_over_softcap_past_float32_too() -> None:
    hub = attnhub.Hub(hardware="cpu")
    q = torch.randn(1, 4, 2, 8)
    hub.attention(q, q, q, scale=0.5, softcap=5.0)  # the binding's exact entry
    with pytest.raises(ArgumentError, match="overflows float32"):
        hub.attention(q, q, q, scale=1e30, softcap=1e-10)
