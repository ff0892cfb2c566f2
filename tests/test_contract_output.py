"""The output contract and the hub's tables: a backend whose result has the wrong shape,
dtype, device or LSE is that backend failing (the rule's on_failure, counted); NaN from
inputs without NaN is caught in debug mode; a backend's InputError is never retried; the
caller's score/mask callable is the one used on every call; runner tables stay bounded."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

import attnhub
from attnhub.core.backend import AttentionOutput, Backend
from attnhub.core.capabilities import ALL_MASKS, Capabilities
from attnhub.core.reference import reference_attention
from attnhub.core.registry import Registry
from attnhub.core.spec import AttnParams
from attnhub.errors import InputError, NoBackendError, ShapeError
from attnhub.testing import assert_fa_rule, fa_references

CAPS = Capabilities(dtypes=frozenset({"fp32", "fp16", "bf16"}), masks=ALL_MASKS, gqa=True,
                    returns_lse=True, top_left_causal=True, max_head_dim=256,
                    layouts=frozenset({"bshd", "thd", "paged"}), backward=True)


class Broken(Backend):
    """Exact attention, then spoiled as ``how`` says."""

    name = "broken"
    capabilities = CAPS

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.calls = 0

    def forward(self, q, k, v, spec, params):  # type: ignore[override]
        self.calls += 1
        if self.how == "input_error":
            raise ShapeError("broken: refuses this input")
        out, lse = reference_attention(q, k, v, params, layout=spec.layout)
        out, lse = out.to(q.dtype), lse if params.return_lse else None
        spoil = {
            "shape": lambda: (out[:, :-1], lse),
            "transposed": lambda: (out.transpose(1, 2), lse),
            "dtype": lambda: (out.double(), lse),
            "device": lambda: (out.to("meta"), lse),
            "not_tensor": lambda: (out.tolist(), lse),
            "lse_missing": lambda: (out, None),
            "lse_shape": lambda: (out, lse.transpose(1, 2) if lse is not None else None),
            "lse_dtype": lambda: (out, lse.half() if lse is not None else None),
            "nan": lambda: (out.masked_fill(torch.rand_like(out) < 0.2, math.nan), lse),
        }[self.how]
        return AttentionOutput(*spoil())


POLICY = """
    name: contract
    rules:
      - name: strict
        when: {phase: train}
        use: [broken, torch_sdpa]
        on_failure: error
      - name: lenient
        use: [broken, torch_sdpa]
    """


def _hub(tmp_path, how: str, debug: bool | None = None) -> attnhub.Hub:
    reg = Registry.of(Broken(how), plugin="broken")
    path = tmp_path / "contract.yaml"
    path.write_text(textwrap.dedent(POLICY).lstrip(), encoding="utf-8")
    return attnhub.Hub(policy=str(path), hardware="cpu", registry=reg, debug=debug)


def _check(out, q, k, v, **kw):
    p = AttnParams(scale=q.shape[-1] ** -0.5, **kw)
    ref64, _, same = fa_references(q, k, v, p)
    assert_fa_rule(out, ref64, same)


SPOILS = ["shape", "transposed", "dtype", "device", "not_tensor", "lse_missing", "lse_shape",
          "lse_dtype"]


@pytest.mark.parametrize("how", SPOILS)
def test_bad_output_falls_back_counted(tmp_path, how):
    hub = _hub(tmp_path, how)
    q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    for _ in range(2):  # the slow path, then the exact-shape hot path
        out, lse = hub.attention(q, k, v, causal=True, return_lse=True)
        assert out.shape == (2, 6, 4, 8) and lse.shape == (2, 4, 6)
        _check(out, q, k, v, causal=True)
    assert hub.fallback_counts == {("broken", "torch_sdpa"): 2}


@pytest.mark.parametrize("how", ["shape", "dtype", "device"])
def test_bad_output_with_on_failure_error_raises(tmp_path, how):
    hub = _hub(tmp_path, how)
    q, k, v = (torch.randn(1, 4, 2, 8, requires_grad=True) for _ in range(3))
    with pytest.raises(NoBackendError, match="broken"):
        hub.attention(q, k, v)
    assert not hub.fallback_counts


def test_nan_output_caught_in_debug_mode_only(tmp_path, monkeypatch):
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    plain = _hub(tmp_path, "nan", debug=False)
    assert torch.isnan(plain.attention(q, k, v)).any()  # the hot path does not look
    debug = _hub(tmp_path, "nan", debug=True)
    _check(debug.attention(q, k, v), q, k, v)
    assert debug.fallback_counts == {("broken", "torch_sdpa"): 1}
    monkeypatch.setenv("ATTNHUB_DEBUG", "1")
    assert _hub(tmp_path, "nan").debug


def test_backend_input_error_is_never_retried(tmp_path):
    hub = _hub(tmp_path, "input_error")
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    with pytest.raises(InputError, match="refuses"):
        hub.attention(q, k, v)
    assert not hub.fallback_counts


@pytest.mark.parametrize("backend,with_score", [("reference", True), ("torch_sdpa", False),
                                                 (None, False)])
def test_callers_own_callables_run_on_the_hot_path(hub, backend, with_score):
    """Fresh closures over different tensors: each call uses its own, and the runner and
    exact-shape tables gain one entry for all of them. (Backend-side caches keyed by the
    callable, such as flex's compiled block masks, are their backend's contract.)"""
    q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))
    for i in range(4):
        bias = torch.randn(8, 8)
        keep = torch.rand(8, 8) < 0.6
        keep[:, 0] = True
        score = (lambda s, b, h, qi, ki, bias=bias: s + bias[qi, ki]) if with_score else None
        mask = lambda b, h, qi, ki, keep=keep: keep[qi, ki]  # noqa: E731
        out = hub.attention(q, k, v, score_mod=score, mask_mod=mask, backend=backend)
        _check(out, q, k, v, score_mod=score, mask_mod=mask)
    assert len(hub._runners) == 1 and len({id(e) for e in hub._exact.values()}) == 1


def test_runner_table_is_bounded(hub, monkeypatch):
    import attnhub.hub as hub_module

    monkeypatch.setattr(hub_module, "RUNNER_LIMIT", 3)
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    for i in range(6):  # six kinds of callables: six names
        fn = eval(f"lambda s, b, h, qi, ki: s * {1 + i / 10}")
        fn.__name__ = f"scaled_{i}"
        hub.attention(q, k, v, score_mod=fn, backend="reference")
    assert len(hub._runners) == 3
    assert [s.mask.score_mod for s, _ in hub._runners.values()] == [
        "scaled_3", "scaled_4", "scaled_5"]


def test_named_variant_beside_a_fresh_callable(hub):
    """A variant name resolved once, the caller's own mask_mod on every call."""
    variant = hub.registry.variants.get("softcap30")
    if variant is None:
        pytest.skip("no plugin registers the 'softcap30' variant here")
    q, k, v = (torch.randn(1, 8, 2, 8) * 4 for _ in range(3))
    for _ in range(3):
        keep = torch.rand(8, 8) < 0.5
        keep[:, 0] = True
        mask = lambda b, h, qi, ki, keep=keep: keep[qi, ki]  # noqa: E731
        out = hub.attention(q, k, v, score_mod="softcap30", mask_mod=mask, backend="reference")
        _check(out, q, k, v, score_mod=variant.score_mod, mask_mod=mask)


def test_tables_do_not_keep_a_callers_closure_alive(hub):
    """A closure over a tensor, passed once, is not retained by the hub's tables."""
    import gc
    import weakref

    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    held = torch.randn(4, 4)
    ref = weakref.ref(held)
    hub.attention(q, k, v, score_mod=lambda s, b, h, qi, ki, t=held: s + t[qi, ki],
                  backend="reference")
    del held
    gc.collect()
    assert ref() is None
