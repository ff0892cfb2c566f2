"""Review 11 of the conformance kit: backends it passed although they are wrong, or refused
by the hub, and a documented refusal it called a crash.

* The kit's output contract was its own, weaker than the hub's (``core.outputs``): an fp64
  LSE or an output cut from the autograd graph passed the kit and was refused at run time.
* The LSE was judged only unmasked (and for Sq > Sk causal): an LSE that ignores the softcap
  or the window passed, which a ring (merging its blocks by LSE) turns into wrong outputs.
* Gradients were judged only unmasked and causal: a backward ignoring the softcap or the
  window passed.
* ALiBi slopes were drawn (Hq,) only; the (B, Hq) form the docs allow went untested.
* Packed documents always had Sq == Sk per document, where both alignments agree: a thd
  kernel aligning causal masks top-left passed.
* A ``BackendUnavailableError`` from ``forward`` (the documented refusal of what only the
  tensors show) was a crash, its reasons cut to the first line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from attnhub.conformance import grid, run_kit
from attnhub.core.builtin import ReferenceBackend
from attnhub.core.device import probe
from attnhub.errors import BackendUnavailableError
from attnhub.plugin import AttentionOutput

CPU = probe("cpu")


class Honest(ReferenceBackend):
    name = "honest11"
    plugin = "test"


def _variant(name: str, forward: Callable) -> Honest:
    """A backend whose forward is ``forward(honest_forward, q, k, v, spec, params)``."""
    def fwd(self, q, k, v, spec, params):  # type: ignore[no-untyped-def]
        return forward(lambda *a: Honest.forward(self, *a), q, k, v, spec, params)
    return type(name, (Honest,), {"name": name, "forward": fwd})()


def _lse_without(field: str) -> Callable:
    """The right output, with the LSE of the same call without ``field``."""
    def forward(run, q, k, v, spec, params):  # type: ignore[no-untyped-def]
        out, lse = run(q, k, v, spec, params)
        if lse is not None and getattr(params, field) is not None:
            lse = run(q, k, v, spec, replace(params, **{field: None}))[1]
        return AttentionOutput(out, lse)
    return forward


def _backward_without(field: str) -> Callable:
    """The right output, with the gradients of the same call without ``field``."""
    def forward(run, q, k, v, spec, params):  # type: ignore[no-untyped-def]
        out, lse = run(q, k, v, spec, params)
        if torch.is_grad_enabled() and getattr(params, field) is not None:
            plain = run(q, k, v, spec, replace(params, **{field: None}))[0]
            out = out.detach() + (plain - plain.detach())
        return AttentionOutput(out, lse)
    return forward


def _first_slopes(run, q, k, v, spec, params):  # type: ignore[no-untyped-def]
    """Reads (B, Hq) ALiBi slopes as the first sequence's (Hq,) for every sequence."""
    s = params.alibi_slopes
    if s is not None and s.dim() == 2:
        params = replace(params, alibi_slopes=s[0])
    return run(q, k, v, spec, params)


def _thd_top_left(run, q, k, v, spec, params):  # type: ignore[no-untyped-def]
    """Aligns packed documents' causal masks top-left whatever was asked."""
    if spec.layout == "thd" and params.causal:
        params = replace(params, alignment="top_left")
    return run(q, k, v, spec, params)


def _lse_fp64(run, q, k, v, spec, params):  # type: ignore[no-untyped-def]
    out, lse = run(q, k, v, spec, params)
    return AttentionOutput(out, None if lse is None else lse.double())


def _cut_from_graph(run, q, k, v, spec, params):  # type: ignore[no-untyped-def]
    out, lse = run(q, k, v, spec, params)
    return AttentionOutput(out.detach().requires_grad_(out.requires_grad), lse)


def _failures(backend: Honest, features: tuple[str, ...]) -> list[str]:
    """Status and detail of each failed or crashed case among ``features`` of the grid."""
    cases = [c for c in grid(backend.capabilities) if c.feature.startswith(features)]
    rep = run_kit(backend, CPU, cases=cases)
    return [f"{r.case.feature}: {r.detail}" for r in rep.results if r.status in ("fail",
                                                                              "crash")]


@pytest.mark.parametrize("forward, features, words", [
    (_lse_without("softcap"), ("masks: lse",), "lse: max error"),
    (_lse_without("window"), ("masks: lse",), "lse: max error"),
    (_backward_without("softcap"), ("masks: backward",), "gradient"),
    (_backward_without("window"), ("masks: backward",), "gradient"),
    (_first_slopes, ("mask alibi",), "max error"),
    (_thd_top_left, ("mask causal bottom_right",), "max error"),
    (_lse_fp64, ("lse",), "the contract is (2, 4, 9) torch.float32"),
    (_cut_from_graph, ("backward",), "cut from the autograd graph"),
], ids=["lse-softcap", "lse-window", "grad-softcap", "grad-window", "alibi-b-hq",
        "thd-alignment", "lse-fp64", "no-grad-fn"])
def test_a_wrong_backend_fails_with_its_reason(forward, features, words) -> None:
    bad = _failures(_variant("wrong11", forward), features)
    assert bad and any(words in b for b in bad), bad
    assert not _failures(Honest(), features)  # the same cases pass an honest backend


def test_the_grid_has_every_mask_with_lse_and_backward_and_ragged_documents() -> None:
    cases = grid(Honest.capabilities, quick=True)
    lse = [c for c in cases if c.feature == "masks: lse"]
    assert lse and all(c.return_lse for c in lse) and any(c.window for c in lse)
    assert any(c.softcap for c in cases if c.feature == "masks: backward")
    assert any(c.alibi_per_batch for c in cases)
    ragged = [c for c in cases if c.layout == "thd" and c.causal
              and any(a != b for a, b in zip(c.seqlens_q, c.seqlens_k))]
    assert {c.alignment for c in ragged} == {"bottom_right", "top_left"}


def test_a_refusal_from_forward_is_a_skip_with_its_reasons() -> None:
    # (a refusal of what only the tensors show: per-document Sq != Sk in cu_seqlens; a
    # feature declined at call time in every case fails, test_review_11b_kit_second)
    def refuse_ragged(run, q, k, v, spec, params):  # type: ignore[no-untyped-def]
        if spec.layout == "thd" and not torch.equal(params.cu_seqlens_q, params.cu_seqlens_k):
            raise BackendUnavailableError("refuses11", ["documents of unequal lengths",
                                                        "a second reason"])
        return run(q, k, v, spec, params)

    backend = _variant("refuses11", refuse_ragged)
    feature = "mask causal bottom_right (Sq != Sk)"
    cases = [c for c in grid(backend.capabilities, quick=True) if c.feature == feature]
    rep = run_kit(backend, CPU, cases=cases)
    skips = [r for r in rep.results if r.status == "skip"]
    assert rep.ok and len(skips) == 2 and all(r.case.layout == "thd" for r in skips)
    assert {r.status for r in rep.results} == {"pass", "skip"}
    assert "unequal lengths; a second reason" in skips[0].detail


@pytest.mark.parametrize("failing_first", [True, False])
def test_fp8_check_shapes_of_one_bucket_share_a_failing_record(tmp_path, failing_first) -> None:
    """Two ``--shape``s in one bucket (lengths 40 and 48: sk=64) were recorded one after the
    other, the last verdict winning: a failing shape followed by a passing one left a
    passing record, which opts FP8 in for both. Now the bucket's record fails, with the
    worst metric of the two."""
    import argparse

    from attnhub.cli.fp8_check import _record, _spec, synthetic_cases
    from attnhub.policy.profile import ProfileStore, bucket_key

    cases = [synthetic_cases((1, n, 2, 1, 16), False, [1.0], None, torch.device("cpu"), 0)[0]
             for n in (40, 48)]
    assert bucket_key(_spec(cases[0])) == bucket_key(_spec(cases[1]))
    verdicts = {c.label: {"passed": ok, "metrics": {"rel_error": err}, "case": c}
                for c, ok, err in zip(cases, (False, True) if failing_first else (True, False),
                                      (0.2, 0.01) if failing_first else (0.01, 0.2))}
    store = tmp_path / "s.json"
    _record(argparse.Namespace(store=str(store), emulate=False), CPU, cases, verdicts,
            "fa3_fp8", "smooth_k", 0.1, "attnhub-test 1.0")
    rec = ProfileStore(str(store)).accuracy(CPU, _spec(cases[1]), "fa3_fp8")
    assert rec is not None and not rec.passed and rec.metrics["rel_error"] == 0.2
