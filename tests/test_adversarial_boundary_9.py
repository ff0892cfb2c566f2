"""Review round 9, the hub boundary: arguments read as "not given" or reaching the policy
unchecked (``backend=""``, ``extra=[]``, a ``BindContext`` of world size 0), a named variant
that its own policy rule never matched, and backend results that broke the contract unseen
(an LSE leaf that kept the gradient to itself, an LSE subclass, out and LSE in one piece of
memory, an inference tensor or a graph handed to a caller that cannot use it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import attnhub
from attnhub import BindContext
from attnhub.core.registry import Registry
from attnhub.errors import ArgumentError, InputError
from attnhub.hookspecs import hookimpl
from attnhub.plugin import AttentionOutput, Backend, Capabilities

CAPS = Capabilities(vendors=frozenset({"cpu"}), dtypes=frozenset({"fp32"}), gqa=True,
                    returns_lse=True, backward=True)
Spoil = Callable[[Any, Any], AttentionOutput]


class _Spoils(Backend):
    """The reference's answer (in the graph), then ``spoil(out, lse)``."""

    name, plugin = "spoils9", "adv9"
    capabilities = CAPS
    spoil: Spoil = staticmethod(lambda out, lse: AttentionOutput(out, lse))

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        out, lse = attnhub.attention(q, k, v, backend="reference", return_lse=True)
        return self.spoil(out, lse if params.return_lse else None)


def _hub(spoil: Spoil, tmp_path: Path) -> attnhub.Hub:
    b = _Spoils()
    b.spoil = spoil  # type: ignore[assignment]
    p = tmp_path / "p.yaml"
    p.write_text("name: t\nrules:\n  - {name: r, use: [spoils9, reference], on_failure: next}\n")
    return attnhub.Hub(policy=p, hardware="cpu", registry=Registry.of(b, plugin="adv9"))


def _qkv(grad: bool = False) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(1, 5, 2, 8, requires_grad=grad) for _ in range(3))


@pytest.mark.parametrize("bad", ["", 0, False, ["reference"], b"reference"])
def test_a_backend_argument_that_is_no_name_is_refused(bad: Any) -> None:
    hub = attnhub.Hub(hardware="cpu")
    q, k, v = _qkv()
    for _ in range(2):  # the key without a backend is in the exact table: the hot path too
        hub.attention(q, k, v)
    with pytest.raises(ArgumentError, match="backend="):
        hub.attention(q, k, v, backend=bad)  # "" and 0 bound the policy, a list TypeError


@pytest.mark.parametrize("bad", [[], 0, "", (), False])
def test_extra_that_is_not_a_dict_is_refused_on_both_paths(bad: Any) -> None:
    hub = attnhub.Hub(hardware="cpu")
    q, k, v = _qkv()
    for _ in range(2):
        hub.attention(q, k, v, extra={})  # an empty dict changes nothing: taken
    with pytest.raises(ArgumentError, match="extra="):
        hub.attention(q, k, v, extra=bad)  # hot path (the key holds no extra)
    with pytest.raises(ArgumentError, match="extra="):
        attnhub.Hub(hardware="cpu").attention(q, k, v, extra=bad)  # slow path


@pytest.mark.parametrize("fields", [{"world_size": 0}, {"world_size": -2}, {"world_size": "2"},
                                    {"world_size": 2.5}, {"world_size": True}, {"layer": -1},
                                    {"layer": "3"}, {"layer_kind": None}, {"layer_kind": ""},
                                    {"model": 7}])
def test_a_bind_context_the_policy_cannot_read_is_refused(fields: dict[str, Any]) -> None:
    # world_size=0 bound a local kernel to a "sharded" sequence, "2" raised a TypeError from
    # the policy's comparison, True shared the bindings of 1
    with pytest.raises(ArgumentError, match=next(iter(fields))):
        BindContext(**fields)
    ok = BindContext(model="m", layer=0, layer_kind="gla", world_size=2)
    assert ok == BindContext(model="m", layer=0, layer_kind="gla", world_size=2)


def _halve(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    return score * 0.5


class _Variants:
    @hookimpl
    def attnhub_register_variants(self, register):  # type: ignore[no-untyped-def]
        register("halved", score_mod=_halve)  # the callable's __name__ is "_halve"
        register("halved_lambda", score_mod=lambda s, b, h, q, kv: s * 0.5)


@pytest.mark.parametrize("variant", ["halved", "halved_lambda"])
def test_a_named_variant_is_what_its_policy_rule_matches(variant: str, tmp_path: Path) -> None:
    reg = Registry.of()
    reg.add_plugin(_Variants(), "v9")
    p = tmp_path / "p.yaml"
    p.write_text("name: t\nrules:\n"
                 f"  - {{name: by-variant, when: {{variant: [{variant}]}}, use: [reference]}}\n"
                 "  - {name: rest, use: [torch_sdpa]}\n")
    hub = attnhub.Hub(policy=p, hardware="cpu", registry=reg)
    q, k, v = _qkv()
    for _ in range(2):  # the slow path, then the exact table
        out = hub.attention(q, k, v, score_mod=variant)
        torch.testing.assert_close(out, attnhub.attention(q, k, v, scale=0.5 / 8 ** 0.5))
    (run,) = hub.bound()
    assert run.decision.rule == "by-variant" and run.decision.backend == "reference"


def test_an_lse_leaf_does_not_keep_the_gradient_to_itself(tmp_path: Path) -> None:
    hub = _hub(lambda out, lse: AttentionOutput(
        out, None if lse is None else lse.detach().requires_grad_()), tmp_path)
    q, k, v = _qkv(grad=True)
    for _ in range(3):  # slow lane, then the hot path
        out, lse = hub.attention(q, k, v, return_lse=True)
        assert lse.grad_fn is not None
        with pytest.raises(InputError, match="spoils9"):  # dq from the LSE was silently None
            torch.autograd.grad(lse.sum(), q)
        assert torch.autograd.grad(out.sum(), q)[0].abs().sum() > 0  # the output still works


class _Sub(torch.Tensor):
    pass


def test_an_lse_subclass_is_refused(tmp_path: Path) -> None:
    hub = _hub(lambda out, lse: AttentionOutput(
        out, None if lse is None else lse.as_subclass(_Sub)), tmp_path)
    q, k, v = _qkv()
    for _ in range(2):
        _, lse = hub.attention(q, k, v, return_lse=True)
        assert lse.__class__ is torch.Tensor
    assert sum(hub.fallback_counts.values()) == 2


def _one_buffer(out: torch.Tensor, lse: Any) -> AttentionOutput:
    if lse is None:
        return AttentionOutput(out, None)
    buf = out.detach().clone().reshape(-1)
    view = buf[: lse.numel()].view(lse.shape)  # the LSE over the output's first elements
    view.copy_(lse)
    return AttentionOutput(buf.view(out.shape), view)


def _inference(out: torch.Tensor, lse: Any) -> AttentionOutput:
    with torch.inference_mode():
        return AttentionOutput(out.clone(), None if lse is None else lse.clone())


def _graph_under_no_grad(out: torch.Tensor, lse: Any) -> AttentionOutput:
    w = torch.ones((), requires_grad=True)
    with torch.enable_grad():
        return AttentionOutput(out * w, lse)


@pytest.mark.parametrize("spoil, lse", [(_one_buffer, True), (_inference, False),
                                        (_graph_under_no_grad, False)])
def test_results_the_caller_cannot_use_as_its_own_are_refused(spoil: Spoil, lse: bool,
                                                              tmp_path: Path) -> None:
    hub = _hub(spoil, tmp_path)
    q, k, v = _qkv()
    want = attnhub.attention(q, k, v, backend="reference")
    with torch.no_grad():
        res = hub.attention(q, k, v, return_lse=lse)
    out = res[0] if lse else res
    torch.testing.assert_close(out, want)
    assert not out.is_inference() and not out.requires_grad
    out.add_(1)  # the caller's own: in place is fine, and changes nothing else
    if lse:
        assert torch.isfinite(res[1]).all() and (res[1] < 10).all()
    assert sum(hub.fallback_counts.values()) == 1  # the backend failed, reference served


def test_torch_deterministic_algorithms_switch_binds_deterministic_kernels(
        tmp_path: Path) -> None:
    calls: list[int] = []

    def counted(out: torch.Tensor, lse: Any) -> AttentionOutput:
        calls.append(1)
        return AttentionOutput(out, lse)

    hub = _hub(counted, tmp_path)  # spoils9 declares no deterministic forward
    q, k, v = _qkv()
    was = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        for _ in range(2):
            hub.attention(q, k, v)
        assert len(calls) == 2  # bound, and in the exact table
        torch.use_deterministic_algorithms(True)
        for _ in range(2):  # neither the exact table nor the runner of the first calls
            out = hub.attention(q, k, v)
        assert len(calls) == 2
        torch.testing.assert_close(out, attnhub.attention(q, k, v, backend="reference"))
        assert {r.decision.backend for r in hub.bound()} == {"spoils9", "reference"}
        torch.use_deterministic_algorithms(False)
        hub.attention(q, k, v)
        assert len(calls) == 3
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def test_a_backend_raising_generator_exit_is_that_backend_failing(tmp_path: Path) -> None:
    """``GeneratorExit`` from a backend's forward() (a kernel library closing a generator it
    does not own) is the backend's failure, like ``SystemExit``: the next candidate runs."""
    def close(out: Any, lse: Any) -> AttentionOutput:
        raise GeneratorExit("closed")

    hub = _hub(close, tmp_path)
    q, k, v = _qkv()
    out = hub.attention(q, k, v)
    torch.testing.assert_close(out, attnhub.attention(q, k, v, backend="reference"))
    assert sum(hub.fallback_counts.values()) >= 1


def test_hub_with_an_empty_policy_path_says_so() -> None:
    """``Hub(policy="")`` is the caller's empty path, not "no policy given" (which would
    silently take ``ATTNHUB_POLICY`` or the packaged default)."""
    from attnhub.errors import PolicyError

    hub = attnhub.Hub(policy="", hardware="cpu")
    with pytest.raises(PolicyError, match="policy path '' is empty"):
        hub.attention(*_qkv())
