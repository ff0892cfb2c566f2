"""Review 11b (second pass over review 11's kit changes).

* A ``BackendUnavailableError`` raised from ``forward`` became a skip: a backend declaring a
  feature, accepting its calls in check() and then declining every one of them at call time
  passed the kit (the policy binds it for that feature and every call falls back). A
  feature so declined throughout now fails; a refusal of some of its cases stays a skip.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnhub.conformance import grid, run_kit
from attnhub.core.builtin import ReferenceBackend
from attnhub.core.device import probe
from attnhub.errors import BackendUnavailableError

CPU = probe("cpu")


class Honest(ReferenceBackend):
    name = "honest11b"
    plugin = "test"


def _variant(name: str, refuse: Callable) -> Honest:
    """A backend that raises BackendUnavailableError from forward where ``refuse(spec,
    params)`` holds, and is exact elsewhere."""
    def fwd(self, q, k, v, spec, params):  # type: ignore[no-untyped-def]
        if refuse(spec, params):
            raise BackendUnavailableError(name, ["not served after all"])
        return Honest.forward(self, q, k, v, spec, params)
    return type(name, (Honest,), {"name": name, "forward": fwd})()


def _cases(backend: Honest, feature: str) -> list:
    return [c for c in grid(backend.capabilities, quick=True) if c.feature == feature]


def test_a_feature_declined_from_forward_in_every_case_fails() -> None:
    backend = _variant("liar11b", lambda spec, params: params.alibi_slopes is not None)
    cases = _cases(backend, "mask alibi")
    assert len(cases) >= 2
    rep = run_kit(backend, CPU, cases=cases)
    assert not rep.ok
    assert all(r.status == "fail" for r in rep.results), [r.status for r in rep.results]
    assert "declined every case of it" in rep.results[0].detail
    assert "not served after all" in rep.results[0].detail
    assert [f["status"] for f in rep.features()] == ["fail"]


def test_a_feature_declined_from_forward_in_some_cases_is_a_skip() -> None:
    def per_batch(spec, params):  # type: ignore[no-untyped-def]
        s = params.alibi_slopes
        return s is not None and s.dim() == 2  # (B, Hq) only: the tensors show it
    backend = _variant("partial11b", per_batch)
    rep = run_kit(backend, CPU, cases=_cases(backend, "mask alibi"))
    assert rep.ok and {r.status for r in rep.results} == {"pass", "skip"}


def test_check_declining_a_feature_stays_a_skip() -> None:
    class Declines(Honest):
        name = "declines11b"

        def extra_checks(self, spec, device):  # type: ignore[no-untyped-def]
            return ["no alibi here"] if spec.mask.alibi else []

    rep = run_kit(Declines(), CPU, cases=_cases(Declines(), "mask alibi"))
    assert rep.ok and {r.status for r in rep.results} == {"skip"}


def test_torch_cpu_backends_keep_passing_the_ragged_thd_cases() -> None:
    """The in-repo backend that declines per-document Sq != Sk at call time (its check sees
    only the bucket) still passes: check() declines the feature's bshd cases."""
    from attnhub.core.registry import Registry

    reg = Registry.load()
    if "torch_flash_cpu" not in reg.backends:
        return
    b = reg.get("torch_flash_cpu")
    feature = "mask causal bottom_right (Sq != Sk)"
    cases = [c for c in grid(b.capabilities, quick=True) if c.feature == feature]
    rep = run_kit(b, CPU, cases=cases)
    assert rep.ok, [(r.status, r.detail) for r in rep.results]
    assert torch.is_grad_enabled()
