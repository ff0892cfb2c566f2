"""Adversarial backends against the conformance kit: each breaks one thing the contract asks
for, and the kit must fail it (never pass it, never hang on it) with a reason that names it."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import pytest
import torch

from attnhub.cli import main
from attnhub.conformance import grid, run_kit
from attnhub.core.builtin import ReferenceBackend
from attnhub.core.device import probe
from attnhub.plugin import AttentionOutput

pytest_plugins = ["pytester"]

CPU = probe("cpu")
CAPS = replace(ReferenceBackend.capabilities, layouts=frozenset({"bshd", "thd", "paged"}))
RELEASE = threading.Event()  # set at the end, so that a "hung" kit thread finishes


class Honest(ReferenceBackend):
    name = "honest3"
    plugin = "test"
    capabilities = CAPS


class DefaultScale(Honest):
    """Uses 1/sqrt(d) whatever params.scale says."""

    name = "default_scale"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        p = replace(params, scale=1 / math.sqrt(q.shape[-1]))
        return super().forward(q, k, v, spec, p)


class RightEdgeOffByOne(Honest):
    """The window's right edge one key too wide (hidden under causal, so only a non-causal
    window case shows it)."""

    name = "right_edge"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        if params.window is not None:
            params = replace(params, window=(params.window[0], params.window[1] + 1))
        return super().forward(q, k, v, spec, params)


class TopLeftWindow(Honest):
    """Measures the window from the top-left diagonal when Sq != Sk (causal done right)."""

    name = "top_left_window"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        if params.window is not None and not params.causal:
            params = replace(params, alignment="top_left")
        return super().forward(q, k, v, spec, params)


class ScalesKInPlace(Honest):
    """Pre-scales k in place (a "fused" kernel writing into its input), result still right
    because it compensates in the scale."""

    name = "scales_k"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        with torch.no_grad():
            k.mul_(2.0)
        return super().forward(q, k, v, spec, replace(params, scale=params.scale / 2))


class ShiftsCuSeqlens(Honest):
    """Rewrites cu_seqlens_q in place after use (a kernel reusing its metadata buffers)."""

    name = "shifts_cu"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        res = super().forward(q, k, v, spec, params)
        if params.cu_seqlens_q is not None:
            params.cu_seqlens_q[1:] += 1
        return res


class DropsCausalInPlace(Honest):
    """Sets params.causal = False on the caller's params (its own mask is applied first)."""

    name = "drops_causal"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        res = super().forward(q, k, v, spec, params)
        params.causal = False
        return res


class AnswerInQ(Honest):
    """Returns its (right) output in q's storage (out= q)."""

    name = "answer_in_q"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        out, lse = super().forward(q.clone(), k, v, spec, params)
        if out.shape != q.shape or q.requires_grad:
            return AttentionOutput(out, lse)
        q.copy_(out)
        return AttentionOutput(q, lse)


class WrongDk(Honest):
    """Right output, dq and dv; dk scaled by 1.5 in backward."""

    name = "wrong_dk"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        return super().forward(q, _ScaleGrad.apply(k), v, spec, params)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        return 1.5 * g


class Hangs(Honest):
    name = "hangs"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        RELEASE.wait()
        return super().forward(q, k, v, spec, params)


@pytest.fixture(autouse=True)
def _release():  # type: ignore[no-untyped-def]
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.mark.parametrize("backend, feature, words", [
    (DefaultScale(), "basic", "max error"),
    (RightEdgeOffByOne(), "mask sliding_window", "max error"),
    (TopLeftWindow(), "mask sliding_window", "max error"),
    (ScalesKInPlace(), "basic", "wrote into its input k"),
    (ShiftsCuSeqlens(), "layout thd", "wrote into its input params.cu_seqlens_q"),
    (AnswerInQ(), "basic", "input q"),
    (WrongDk(), "backward", "gradient dk: max error"),
    (DropsCausalInPlace(), "mask causal", "changed params.causal"),
])
def test_kit_fails_backend_with_a_reason(backend, feature, words) -> None:
    """Each was passed by the kit before: default scale, right window edge (quick grid),
    inputs written, output in an input's memory."""
    cases = [c for c in grid(backend.capabilities, quick=True) if c.feature == feature]
    assert cases
    rep = run_kit(backend, CPU, cases=cases)
    assert not rep.ok, rep.to_json()
    bad = [r.detail for r in rep.results if r.status == "fail"]
    assert bad and any(words in d for d in bad), bad


def test_honest_backend_still_passes_the_new_cases() -> None:
    backend = Honest()
    cases = [c for c in grid(CAPS, quick=True)
             if c.feature in ("basic", "mask sliding_window", "layout thd")]
    rep = run_kit(backend, CPU, cases=cases, case_timeout_s=60)
    assert rep.ok and {r.status for r in rep.results} == {"pass"}, rep.to_json()


def test_hanging_case_is_reported_and_the_rest_not_run() -> None:
    cases = [c for c in grid(CAPS, quick=True) if c.feature in ("basic", "mask causal")]
    rep = run_kit(Hangs(), CPU, cases=cases, case_timeout_s=0.3)
    first, rest = rep.results[0], rep.results[1:]
    assert first.status == "crash" and first.hung and "no result after 0.3s" in first.detail
    assert rest and all(r.status == "skip" and "hung" in r.detail for r in rest)
    assert not rep.ok


def _hang_plugin(tmp_path, monkeypatch,  # type: ignore[no-untyped-def]
                 cls: str = "Hangs") -> None:
    (tmp_path / f"kit_{cls.lower()}_plugin.py").write_text(
        "from attnhub.plugin import hookimpl\n"
        f"from test_adversarial_conformance_3 import {cls}\n"
        "@hookimpl\n"
        "def attnhub_register_backends(register):\n"
        f"    register({cls}())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(__file__.rsplit("/", 1)[0])
    monkeypatch.setenv("ATTNHUB_PLUGINS", f"kit_{cls.lower()}_plugin")
    monkeypatch.setenv("ATTNHUB_PLUGIN_MODULES", f"kit_{cls.lower()}_plugin")


def test_cli_case_timeout_stops_a_hanging_plugin(tmp_path, monkeypatch, capsys) -> None:
    _hang_plugin(tmp_path, monkeypatch)
    assert main(["check-plugin", "hangs", "--quick", "-k", "basic", "--case-timeout",
                 "0.3"]) == 1
    out = capsys.readouterr().out
    assert "CRASH" in out and "no result after 0.3s" in out


def test_pytest_entry_fails_the_hung_case_and_skips_the_rest(tmp_path, monkeypatch,
                                                              pytester) -> None:
    _hang_plugin(tmp_path, monkeypatch)
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs",
                                       "attnhub.conformance", "--backend", "hangs", "--quick",
                                       "--case-timeout", "0.3", "-k", "basic or mask_causal")
    outcomes = res.parseoutcomes()
    assert outcomes.get("failed") == 1 and outcomes.get("skipped", 0) >= 2, outcomes
    assert "passed" not in outcomes, outcomes
    res.stdout.fnmatch_lines(["*no result after 0.3s*"])


class CheckRaisesOnThd(Honest):
    """extra_checks crashes on varlen calls: a host reads that as "declines", the kit must not."""

    name = "check_raises"

    def extra_checks(self, spec, device):  # type: ignore[no-untyped-def, override]
        if spec.layout == "thd":
            raise KeyError("cu_seqlens")
        return []


class CheckOverrideRaises(Honest):
    name = "check_override_raises"

    def check(self, spec, device):  # type: ignore[no-untyped-def, override]
        if spec.layout == "thd":
            raise RuntimeError("no varlen")
        return super().check(spec, device)


class CheckReturnsNone(Honest):
    name = "check_none"

    def check(self, spec, device):  # type: ignore[no-untyped-def, override]
        return None if spec.layout == "thd" else super().check(spec, device)


@pytest.mark.parametrize("backend, status, words", [
    (CheckRaisesOnThd(), "fail", "raised KeyError"),
    (CheckOverrideRaises(), "crash", "check() raised RuntimeError: no varlen"),
    (CheckReturnsNone(), "fail", "returned NoneType"),
])
def test_broken_check_is_not_a_decline(backend, status, words) -> None:
    """A check() that raises or returns junk was a skip (the kit passed); it is the
    backend's fault, and the kit says so."""
    cases = [c for c in grid(backend.capabilities, quick=True) if c.feature == "layout thd"]
    rep = run_kit(backend, CPU, cases=cases)
    assert not rep.ok and rep.results[0].status == status, rep.to_json()
    assert words in rep.results[0].detail, rep.results[0].detail


class CheckHangs(Honest):
    name = "check_hangs"

    def extra_checks(self, spec, device):  # type: ignore[no-untyped-def, override]
        RELEASE.wait()
        return []


def test_cli_bounds_a_hanging_check(tmp_path, monkeypatch, capsys) -> None:
    """check() is plugin code too: a hang there is reported like one in forward."""
    _hang_plugin(tmp_path, monkeypatch, "CheckHangs")
    assert main(["check-plugin", "check_hangs", "--quick", "-k", "basic", "--case-timeout",
                 "0.3"]) == 1
    assert "no result after 0.3s" in capsys.readouterr().out
