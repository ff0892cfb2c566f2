"""Run a backend through its conformance grid and judge each call.

A call passes when the backend returns ``AttentionOutput(out, lse)`` with ``out`` of the
layout's shape, q's dtype and device, no NaN, and within the FlashAttention rule of the fp64
reference (2x the same-precision reference's error plus a rounding floor; 3x for gradients);
LSE, when asked for, of the right shape with -inf exactly on fully masked rows; and, where
determinism is declared, bitwise-equal results twice; and always q, k, v and the params'
tensors left unchanged, with an output of its own memory (``guards``). Approximate backends
(``exact=False``) are judged on the contract in every case (their error against the exact
reference is shown) and held to their declared ``error_budget`` (relative RMSE against dense
attention) in the "error budget" cases, on inputs the kit builds of the class the budget is
stated for (``budget``, ``_judge_budget``); with a backward, their dq, dk, dv are held to
``Capabilities.gradient_budget`` on the same inputs in the "gradient budget" cases.
``check()`` raising or returning junk is the backend's crash/failure, not a decline.
Declared dropout is judged by its law (``_judge_dropout``).

The backend is called directly (``check``, ``load``, ``forward``) with the spec and params the
hub would build, so the kit judges the backend's own contract, not the hub's safety nets.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..core.backend import Backend, plugin_fault, reasons_of, safe_check
from ..core.bounded import safe_str
from ..core.device import DeviceInfo
from ..core.outputs import check_output, shared_memory
from ..core.reference import reference_attention
from ..core.spec import AttnParams
from ..errors import BackendUnavailableError, InputError, OutputContractError
from ..testing import fa_rule_error
from . import budget, dropout
from .cases import Case, base_masks, grid
from .guards import (Hung, InputsWritten, check_fields, check_untouched, fields_of, named_inputs,
                     snapshot, within)
from .inputs import Inputs, build

STATUSES = ("pass", "fail", "crash", "skip")


@dataclass
class CaseResult:
    case: Case
    status: str  # pass | fail | crash | skip
    detail: str = ""
    error: float | None = None
    allowed: float | None = None
    seconds: float = 0.0
    hung: bool = False  # no result within the per-case limit (the call is still running)

    def to_json(self) -> dict[str, Any]:
        return {"feature": self.case.feature, "case": self.case.describe(),
                "status": self.status, "detail": self.detail, "error": self.error,
                "allowed": self.allowed, "seconds": round(self.seconds, 4)}


@dataclass
class KitReport:
    """Per-case results of one backend; ``features`` folds them to the worst per feature."""

    backend: str
    plugin: str
    device: str
    results: list[CaseResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(r.status in ("fail", "crash") for r in self.results)

    def features(self) -> list[dict[str, Any]]:
        order: dict[str, list[CaseResult]] = {}
        for r in self.results:
            order.setdefault(r.case.feature, []).append(r)
        rank = {"crash": 3, "fail": 2, "pass": 1, "skip": 0}
        out = []
        for feat, rs in order.items():
            worst = max(rs, key=lambda r: (rank[r.status], r.error or 0.0))
            if all(r.status == "skip" for r in rs):
                worst = rs[0]
            elif worst.status == "skip":
                worst = next(r for r in rs if r.status == "pass")
            out.append({"feature": feat, "status": worst.status, "cases": len(rs),
                        "error": worst.error, "allowed": worst.allowed,
                        "detail": worst.detail, "case": worst.case.describe()})
        return out

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "plugin": self.plugin, "device": self.device,
                "ok": self.ok, "features": self.features(),
                "cases": [r.to_json() for r in self.results]}


def backend_grid(backend: Backend, device: DeviceInfo, quick: bool = False,
                 timeout_s: float | None = None) -> list[Case]:
    """The grid on the first base mask the backend accepts (see ``cases.BASE_MASKS``);
    ``timeout_s`` bounds each check() call."""
    caps = backend.capabilities
    for mask in base_masks(caps):
        cases = grid(caps, quick, mask)
        spec = build(cases[0], device.torch_device).spec
        try:
            if not within(timeout_s, lambda: safe_check(backend, spec, device)):
                return cases
        except BaseException as exc:  # a hang here is judged (as a crash) by run_case
            if not plugin_fault(exc):
                raise
            return cases
    return grid(caps, quick)


def run_kit(backend: Backend, device: DeviceInfo, *, quick: bool = False,
            budget_s: float | None = None, cases: list[Case] | None = None,
            case_timeout_s: float | None = None) -> KitReport:
    """Every case of ``backend``'s grid on ``device`` (the kit's entry point). ``budget_s``
    stops starting new cases; ``case_timeout_s`` stops waiting for a running one (a crash,
    after which the backend's other cases are not run: the hung call still holds it)."""
    report = KitReport(backend.name, backend.plugin, device.describe())
    t_end = None if budget_s is None else time.monotonic() + budget_s
    hung = ""
    for case in cases if cases is not None else backend_grid(backend, device, quick):
        if hung or (t_end is not None and time.monotonic() > t_end):
            why = f"an earlier case hung ({hung})" if hung else f"time budget {budget_s:g}s spent"
            report.results.append(CaseResult(case, "skip", f"not run: {why}"))
            continue
        t0 = time.perf_counter()
        res = run_case(backend, device, case, timeout_s=case_timeout_s)
        hung = case.feature if res.hung else ""
        res.seconds = time.perf_counter() - t0
        report.results.append(res)
    _declined_throughout(report.results)
    return report


#: How a skip for a ``BackendUnavailableError`` raised from ``forward`` begins (``_declined``).
_AT_CALL = "declines at call time"


def _declined_throughout(results: list[CaseResult]) -> None:
    """A feature whose every case check() accepted and forward() then declined fails: the
    declaration promises it, the policy binds the backend for it, and every such call falls
    back (a refusal from ``forward`` is for what only the tensors show, not for a feature as
    a whole). Where check() declines any of them, or a case passes, skips stay skips."""
    by_feature: dict[str, list[CaseResult]] = {}
    for r in results:
        by_feature.setdefault(r.case.feature, []).append(r)
    for feature, rs in by_feature.items():
        if all(r.status == "skip" and r.detail.startswith(_AT_CALL) for r in rs):
            for r in rs:
                r.status = "fail"
                r.detail = (f"declares {feature!r} and check() accepts its calls, but forward() "
                            f"declined every case of it ({r.detail}): decline such calls in "
                            "extra_checks, or do not declare the feature")


def run_case(backend: Backend, device: DeviceInfo, case: Case,
             timeout_s: float | None = None) -> CaseResult:
    """One call, judged; never raises for the backend's faults; with ``timeout_s`` never
    waits longer than that for the backend (a crash with ``hung`` set)."""
    if case.notes:
        return CaseResult(case, "fail", "; ".join(case.notes))
    if case.untested:
        return CaseResult(case, "skip", case.untested)
    try:
        inp = build(case, device.torch_device)
    except Exception as exc:  # the kit's own fault: say so rather than blame the backend
        return CaseResult(case, "crash", f"kit could not build inputs: {_exc(exc)}")
    try:
        return within(timeout_s, lambda: _check_load_judge(backend, device, case, inp))
    except Hung as exc:
        return CaseResult(case, "crash", safe_str(exc), hung=True)
    except InputError as exc:
        return CaseResult(case, "fail", f"raised {_exc(exc)} for a call its check() accepted; "
                                        "decline such calls in extra_checks instead")
    except BaseException as exc:  # SystemExit from a plugin is its crash, not the kit's end
        if not plugin_fault(exc):
            raise
        return CaseResult(case, "crash", _exc(exc))


#: Marks the reasons ``Backend.check`` makes of its plugin's own bugs (``core.backend._bug``).
_BUG_MARK = "(a bug in plugin "


def _check_load_judge(backend: Backend, device: DeviceInfo, case: Case, inp: Inputs
                      ) -> CaseResult:
    """A check() that raises or returns no list of reasons is the backend's bug (a host
    would silently skip it for every such call), not a decline."""
    try:
        got = backend.check(inp.spec, device)
    except BaseException as exc:
        if not plugin_fault(exc):
            raise
        return CaseResult(case, "crash", f"check() raised {_exc(exc)}; return reasons instead")
    items = reasons_of(backend, "check", got)  # a bad return value becomes one bug reason
    bugs = [r for r in items if _BUG_MARK in r]  # check() or extra_checks returned junk,
    if bugs:  # or extra_checks raised (Backend.check turns that into a reason)
        return CaseResult(case, "fail", "; ".join(bugs))
    if items:
        return _declined(backend, device, case, items, "declines")
    backend.load()
    try:
        return _judge(backend, case, inp)
    except BackendUnavailableError as exc:  # the documented refusal of what only the call's
        reasons = [safe_str(r) for r in exc.reasons] or ["(no reason given)"]  # tensors show
        return _declined(backend, device, case, reasons, f"{_AT_CALL} "
                         "(BackendUnavailableError from forward)")


def _declined(backend: Backend, device: DeviceInfo, case: Case, reasons: list[str],
              how: str) -> CaseResult:
    """A skip, the hub's fallback serving such calls; but a budget case declined while its
    basis is served is a failure (the budget would go unjudged)."""
    if case.basis is not None and _serves(backend, case.basis, device):
        return CaseResult(case, "fail", "declines the call its error budget is stated for "
                          f"({'; '.join(reasons)}) but serves the grid's basic call: the "
                          "budget would go unjudged; serve it, or state the budget on "
                          "another input class")
    return CaseResult(case, "skip", f"{how}: " + "; ".join(reasons))


def _serves(backend: Backend, case: Case, device: DeviceInfo) -> bool:
    """Whether ``backend`` accepts ``case`` (a check that raises or returns junk: no)."""
    try:
        return reasons_of(backend, "check",
                          backend.check(build(case, device.torch_device).spec, device)) == []
    except BaseException as exc:
        if not plugin_fault(exc):
            raise
        return False


def _call(backend: Backend, inp: Inputs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    given = named_inputs(q, k, v, inp.params)
    before, fields = snapshot(given), fields_of(inp.params)
    res = backend.forward(q, k, v, inp.spec, inp.params)
    if not isinstance(res, tuple) or len(res) != 2 or not isinstance(res[0], torch.Tensor):
        raise _Fail(f"returned {type(res).__name__}, expected AttentionOutput(out, lse)")
    try:
        check_fields(inp.params, fields)
        check_untouched(given, before, res[0])
    except InputsWritten as exc:
        raise _Fail(safe_str(exc)) from None
    return res[0], res[1]


class _Fail(Exception):
    """A contract violation found while judging (reported as ``fail``)."""


def _judge(backend: Backend, case: Case, inp: Inputs) -> CaseResult:
    if case.dropout_p:
        return _judge_dropout(backend, case, inp)
    if case.budget_inputs:
        return _judge_budget(backend, case, inp)
    grad = case.backward
    q, k, v = inp.q, inp.k, inp.v
    if grad:
        q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    try:
        with torch.set_grad_enabled(grad):
            out, lse = _call(backend, inp, q, k, v)
        held = out.detach().clone()  # what the caller holds: a later call must not rewrite it
        _contract(out, lse, case, inp, backend.name, (q, k, v), grad)
        ref64, ref_lse, ref_same, ref_lse_same = _references(inp, q, k, v, grad)
        err, allowed = _compare(backend, out, ref64, ref_same)
        approx = not backend.capabilities.exact
        if approx:  # the contract only here; the budget has cases of its own
            note = (f"approximate: rel. RMSE {err:.3g} vs exact attention with this mask, "
                    f"shown; error_budget {backend.capabilities.error_budget} is judged in "
                    "the 'error budget' rows, on the inputs it is stated for")
            err, allowed = err, math.inf
        if err > allowed:
            return CaseResult(case, "fail", f"max error {err:.3g} > allowed {allowed:.3g} vs "
                                            "the fp64 reference", err, allowed)
        if case.return_lse:
            _check_lse(lse, ref_lse, ref_lse_same, judge_values=not approx)
        if grad:
            g_err, g_allowed, g_name = _grads(out, ref64, ref_same, (q, k, v), case, backend,
                                              inp)
            if approx:
                g_allowed = math.inf
            if g_err > g_allowed:
                return CaseResult(case, "fail", f"gradient {g_name}: max error {g_err:.3g} > "
                                                f"allowed {g_allowed:.3g}", g_err, g_allowed)
            err, allowed = g_err, g_allowed  # the row shows what backward adds
        if case.repeat and not grad:
            again, _ = _call(backend, inp, q, k, v)
            if not torch.equal(out, held):
                return CaseResult(case, "fail", "a second call rewrote the first call's "
                                                "output (one buffer returned for both): "
                                                "return a new tensor per call")
            if not torch.equal(again, held):
                return CaseResult(case, "fail", "declared deterministic, but two runs differ "
                                                f"(max {float((again - held).abs().max()):.3g})")
    except _Fail as exc:
        return CaseResult(case, "fail", str(exc))
    return CaseResult(case, "pass", note if approx else "", err, allowed)


def _judge_budget(backend: Backend, case: Case, inp: Inputs) -> CaseResult:
    """The declared ``error_budget`` (relative RMSE against dense attention) on inputs of
    the class it is stated for, which the kit builds and, for ``local``, tunes and checks
    (``budget``); in a backward case also dq, dk, dv, each against fp64 dense attention's
    gradients, within ``gradient_budget``. An unbounded budget (math.inf) is shown, never
    failed."""
    caps = backend.capabilities
    cap = caps.error_budget
    if cap is None:  # grid() makes this a failing case; a hand-made one lands here
        return CaseResult(case, "fail", "approximate (exact=False) but no error_budget "
                                        "declared: declare Capabilities(error_budget=...)")
    what = "dense attention" + (" (the call's mask without its window)"
                                if case.budget_inputs == "local" else " (the call's mask)")
    try:
        cond = ""
        if case.budget_inputs == "local" and math.isfinite(cap):
            inp, cond = _tune_local(case, inp, cap)
        x = [t.detach().clone().requires_grad_(case.backward) for t in (inp.q, inp.k, inp.v)]
        with torch.set_grad_enabled(case.backward):
            out, lse = _call(backend, inp, *x)
        _contract(out, lse, case, inp, backend.name, x, case.backward)
        dense_params = budget.dense_params(case, inp.ref_params)
        dense, _ = _reference(inp, dense_params)
        err = budget.rel_rmse(out, dense)
        grads = _budget_grads(out, x, inp, dense_params) if case.backward else []
    except _Fail as exc:
        return CaseResult(case, "fail", f"error budget: {exc}")
    where = f"on {case.budget_inputs} inputs" + (f" ({cond})" if cond else "")
    if not math.isfinite(cap):
        return CaseResult(case, "pass", f"rel. RMSE {err:.3g} vs {what} {where}; "
                          "error_budget inf declares no bound (another operator)", err, cap)
    if not err <= cap:  # NaN fails too
        return CaseResult(case, "fail", f"rel. RMSE {err:.3g} > error_budget {cap:g} vs {what} "
                          f"{where}: the budget does not hold on the inputs it is stated "
                          "for; fix the backend, or declare the budget it meets", err, cap)
    shown = f"rel. RMSE {err:.3g} <= error_budget {cap:g} vs {what} {where}"
    if not grads:
        return CaseResult(case, "pass", shown, err, cap)
    g_cap = caps.gradient_budget
    assert g_cap is not None  # grid() makes gradient cases only for a finite one
    g_name, g_err = max(grads, key=lambda ne: math.inf if math.isnan(ne[1]) else ne[1])
    listed = ", ".join(f"{n} {e:.3g}" for n, e in grads)
    named = "grad_error_budget" if caps.grad_error_budget is not None else (
        "error_budget (no grad_error_budget declared)")
    if not g_err <= g_cap:
        return CaseResult(case, "fail", f"gradient {g_name}: rel. RMSE {g_err:.3g} > {named} "
                          f"{g_cap:g} vs {what}'s gradients (fp64) {where}; {listed}: fix the "
                          "backward, or declare the grad_error_budget it meets", g_err, g_cap)
    return CaseResult(case, "pass", f"{shown}; gradients' rel. RMSE {listed} <= {named} "
                      f"{g_cap:g}", g_err, g_cap)


def _budget_grads(out: torch.Tensor, x: list[torch.Tensor], inp: Inputs,
                  params: AttnParams) -> list[tuple[str, float]]:
    """Relative RMSE of the backend's dq, dk, dv against those of fp64 ``params`` attention
    on the same data, for the upstream gradient ``_grads`` uses (seeded)."""
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(99),
                       dtype=torch.float32).to(out)
    got = torch.autograd.grad(out, x, dout, allow_unused=True)
    x64 = [t.detach().double().requires_grad_(True) for t in (inp.ref_q, inp.ref_k, inp.ref_v)]
    ref, _ = reference_attention(*x64, params, layout=inp.ref_layout)
    want = torch.autograd.grad(ref, x64, dout.double().reshape(ref.shape))
    errs = []
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _check_grad(name, g, tuple(w.shape), x[0].dtype)
        errs.append((name, budget.rel_rmse(g, w)))
    return errs


def _tune_local(case: Case, inp: Inputs, cap: float) -> tuple[Inputs, str]:
    """``local`` inputs as blunt as the class allows: the least sharpness (bisected in log
    space) at which exact attention over the window is provably within
    ``budget.LOCAL_TARGET`` of the budget, so that a backend worse than its window fails."""
    device = inp.q.device

    def at(log_a: float) -> tuple[Inputs, tuple[float, float, float]]:
        x = build(replace(case, sharpness=math.exp(log_a)), device)
        o_d, lse_d = _reference(x, budget.dense_params(case, x.ref_params))
        _, lse_w = _reference(x, x.ref_params)
        return x, budget.local_bound(o_d, lse_d, lse_w, x.ref_v)

    target = budget.LOCAL_TARGET * cap
    lo, hi = math.log(1.0), math.log(256.0)  # 9 halvings: within ~1% of the least sharpness
    best, b = at(hi)
    if not b[0] <= target:
        raise _Fail(f"the kit found no local inputs on which exact attention over the window "
                    f"is within error_budget {cap:g} (2 eps kappa {b[0]:.3g} at the sharpest): "
                    "declare a budget above 0 that local data can meet")
    for _ in range(9):
        mid = (lo + hi) / 2
        x, bm = at(mid)
        if bm[0] <= target:
            hi, best, b = mid, x, bm
        else:
            lo = mid
    return best, (f"2 eps kappa {b[0]:.3g} <= {budget.LOCAL_TARGET:g} x budget, eps "
                  f"{b[1]:.3g} dense mass outside the window, kappa {b[2]:.3g}")


def _reference(inp: Inputs, params: AttnParams) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 (out, lse) of ``params`` on the case's reference data, out in the backend's
    layout (paged: reshaped from packed thd)."""
    with torch.no_grad():
        out, lse = reference_attention(inp.ref_q, inp.ref_k, inp.ref_v, params,
                                       layout=inp.ref_layout)
    return (out.reshape(inp.out_shape) if inp.batched else out), lse


#: Draws averaged to judge dropout: the mean's standard error is 1/sqrt(200) of a draw's.
DROPOUT_DRAWS = 200


def _judge_dropout(backend: Backend, case: Case, inp: Inputs) -> CaseResult:
    """A dropout draw has no reference value; its law does: one torch seed repeats the draw
    (the generator a caller seeds), a draw differs from the exact output, and the mean of
    :data:`DROPOUT_DRAWS` draws is the exact output within 6 standard errors per element
    (plus twice the same-precision reference's rounding): zeroed probabilities with the
    rest scaled by 1/(1 - p), unbiased. The caller's generator state is left as it was."""
    q, k, v = inp.q, inp.k, inp.v
    devices = [q.device.index or 0] if q.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(5)
            first, _ = _call(backend, inp, q, k, v)
            _contract(first, None, case, inp, backend.name, (q, k, v), False)
            first = first.clone()  # a backend reusing one buffer would make the two equal
            torch.manual_seed(5)
            if not torch.equal(_call(backend, inp, q, k, v)[0], first):
                raise _Fail("two calls under one torch.manual_seed differ: draw the dropout "
                            "from torch's generator of q's device")
            total = first.double().clone()
            sq_sum = total.square()
            for _ in range(DROPOUT_DRAWS - 1):
                out = _call(backend, inp, q, k, v)[0].double()
                total += out
                sq_sum += out.square()
        ref64, _, ref_same, _ = _references(inp, q, k, v, grad=False)
        n = DROPOUT_DRAWS
        mean = total / n
        se = ((sq_sum / n - mean.square()).clamp_min(0) * n / (n - 1) / n).sqrt()
        rounding = 2 * (ref_same.double() - ref64).abs() + 1e-5
        if torch.allclose(first.double(), ref64, rtol=0, atol=1e-3):
            raise _Fail(f"dropout_p={case.dropout_p} requested and declared, but the output "
                        "is the exact one: no dropout applied")
        off = (mean - ref64).abs() - (6 * se + rounding)
        if (off > 0).any():
            raise _Fail(f"the mean of {n} dropout draws is off the exact output by "
                        f"{float((mean - ref64).abs().max()):.3g} (6 standard errors plus "
                        f"rounding allow {float((6 * se + rounding).min()):.3g} at least): "
                        "scale kept probabilities by 1/(1 - dropout_p)")
        if backend.capabilities.backward:  # training calls draw too (a model in train())
            x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
            with torch.enable_grad():
                trained = _call(backend, inp, *x)[0]
            if torch.allclose(trained.detach().double(), ref64, rtol=0, atol=1e-3):
                raise _Fail(f"dropout_p={case.dropout_p} requested and declared, but a call "
                            "with gradients gives the exact output: no dropout in training")
        read = inp.ref_layout == "bshd"  # dense: every probability of a draw can be read
        if read:
            with torch.random.fork_rng(devices=devices):
                _judge_draws(backend, case, inp)
    except _Fail as exc:
        return CaseResult(case, "fail", str(exc))
    return CaseResult(case, "pass", f"mean of {DROPOUT_DRAWS} draws within 6 standard errors"
                      + ("; every probability of 4 draws dropped or scaled, at rate p"
                         + (", gradients of the same draw" if backend.capabilities.backward
                            else "") if read else ""))


def _judge_draws(backend: Backend, case: Case, inp: Inputs) -> None:
    """Every probability of a few draws (``conformance.dropout``), in training mode where
    the backend declares backward, whose gradients must then be those of the draw."""
    grad, p, dtype = backend.capabilities.backward, case.dropout_p, inp.q.dtype
    q, k, v = (x.detach().clone().requires_grad_(grad) for x in (inp.q, inp.k, inp.v))
    exact = dropout.exact_probabilities(inp, inp.q, inp.k)
    zeros = counted = 0
    with torch.set_grad_enabled(grad):
        for seed in dropout.SEEDS:
            dropped = dropout.read_draw(lambda x: _call(backend, inp, q, k, x)[0], v, seed)
            why, z, n = dropout.entry_problem(dropped, exact, p, dtype)
            zeros, counted = zeros + z, counted + n
            torch.manual_seed(seed)
            out = _call(backend, inp, q, k, v)[0]
            why = why or dropout.output_problem(out, dropped, v, dtype)
            if why:
                raise _Fail(why + (" (in training mode)" if grad else ""))
    why = dropout.rate_problem(zeros, counted, p)
    if why:
        raise _Fail(why)
    if grad:
        _dropout_grads(out, dropped, (q, k, v), inp, p)


def _dropout_grads(out: torch.Tensor, dropped: torch.Tensor, qkv: tuple[torch.Tensor, ...],
                   inp: Inputs, p: float) -> None:
    """dq, dk, dv of one draw against fp64 ones of the same zeros (read from its output)."""
    x64 = [x.detach().double().requires_grad_(True) for x in qkv]
    kept = (dropped != 0).double() / (1 - p)
    probs = dropout.exact_probabilities(inp, x64[0], x64[1]) * kept
    v64 = x64[2].repeat_interleave(probs.shape[1] // x64[2].shape[2], dim=2)
    ref = torch.einsum("bhqk,bkhd->bqhd", probs, v64)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(98),
                       dtype=torch.float32).to(out)
    grads = torch.autograd.grad(out, qkv, dout)
    for name, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, x64,
                                                                          dout.double())):
        err = float((g.double() - r).abs().max())
        allowed = 4 * dropout.tolerance(out.dtype) * float(r.abs().max()) + 1e-4
        if not err <= allowed:
            raise _Fail(f"gradient {name} of a dropout draw is off by {err:.3g} (allowed "
                        f"{allowed:.3g}) from that of the same draw's zeros: the backward "
                        "must replay the forward's dropout mask, not draw another")


def _contract(out: torch.Tensor, lse: torch.Tensor | None, case: Case, inp: Inputs,
              name: str, qkv: Any, grad: bool) -> None:
    """The kit's words for shape, dtype, device and NaN, then the hub's own output contract
    (``core.outputs``: fp32 LSE on q's device, a plain tensor, in the graph when gradients
    are needed, no stride-0 or shared memory), so that no result the kit passes is refused
    by the hub at run time. ``grad``: whether the call ran with gradients."""
    if tuple(out.shape) != inp.out_shape:
        raise _Fail(f"output shape {tuple(out.shape)}, expected {inp.out_shape} "
                    f"({case.layout}, value head dim {case.head_dim_v or case.head_dim})")
    if out.dtype != inp.q.dtype:
        raise _Fail(f"output dtype {out.dtype}, expected q's dtype {inp.q.dtype}")
    if out.device != inp.q.device:
        raise _Fail(f"output on {out.device}, expected q's device {inp.q.device}")
    if torch.isnan(out).any():
        raise _Fail(f"NaN in the output ({int(torch.isnan(out).sum())} values) for finite "
                    "inputs")
    if case.return_lse:
        if lse is None:
            raise _Fail("return_lse requested and returns_lse declared, but lse is None")
        if tuple(lse.shape) != inp.lse_shape:
            raise _Fail(f"lse shape {tuple(lse.shape)}, expected {inp.lse_shape}")
    q, k, v = qkv
    try:
        check_output(name, out, lse, q, v, inp.spec.layout, case.return_lse, needs_grad=grad)
        with torch.set_grad_enabled(grad):
            bad = shared_memory(name, out, lse if case.return_lse else None,
                                named_inputs(q, k, v, inp.params))
    except OutputContractError as exc:
        bad = exc
    if bad is not None:
        raise _Fail(f"refused by the hub's output contract: {safe_str(bad)}")


def _references(inp: Inputs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp64 out, fp64-path lse, same-precision out, same-precision lse) in the backend's
    layout; with ``grad`` the outputs keep the graph of the backend's own q, k, v."""
    rq, rk, rv = (q, k, v) if grad else (inp.ref_q, inp.ref_k, inp.ref_v)
    with torch.set_grad_enabled(grad):
        o64, l64 = reference_attention(rq, rk, rv, inp.ref_params, layout=inp.ref_layout)
        osame, lsame = reference_attention(rq, rk, rv, inp.ref_params, layout=inp.ref_layout,
                                           compute_dtype=q.dtype)
    if inp.batched:  # paged: the reference ran on packed thd
        b, sq = inp.out_shape[:2]
        o64, osame = (o.reshape(inp.out_shape) for o in (o64, osame))
        l64, lsame = (x.reshape(x.shape[0], b, sq).transpose(0, 1) for x in (l64, lsame))
    return o64, l64, osame, lsame


def _compare(backend: Backend, out: torch.Tensor, ref64: torch.Tensor,
             ref_same: torch.Tensor) -> tuple[float, float]:
    """(error, allowed): the FlashAttention rule, or for an approximate backend its relative
    RMSE against the exact reference (shown, not judged: see ``_judge``)."""
    if backend.capabilities.exact:
        return fa_rule_error(out, ref64, ref_same)
    diff = (out.detach().double() - ref64.detach()).pow(2).mean().sqrt()
    return float(diff / ref64.detach().pow(2).mean().sqrt().clamp_min(1e-12)), math.inf


def _check_lse(lse: torch.Tensor | None, ref: torch.Tensor, ref_same: torch.Tensor,
               judge_values: bool = True) -> None:
    assert lse is not None
    lse = lse.detach().float()
    if not judge_values:
        if torch.isnan(lse).any():
            raise _Fail("lse: NaN")
        return
    inf_ref = torch.isinf(ref)
    if not torch.equal(torch.isneginf(lse), inf_ref):
        raise _Fail("lse: -inf pattern differs from the reference (fully masked rows must "
                    "give -inf, every other row a finite value)")
    if torch.isnan(lse).any():
        raise _Fail("lse: NaN")
    finite = ~inf_ref
    err = float((lse - ref.float())[finite].abs().max()) if finite.any() else 0.0
    base = float((ref_same.float() - ref.float())[finite].abs().max()) if finite.any() else 0.0
    allowed = 2 * base + 1e-3
    if err > allowed:
        raise _Fail(f"lse: max error {err:.3g} > allowed {allowed:.3g} (natural log, "
                    "(B, Hq, Sq) or (Hq, total_q))")


def _grads(out: torch.Tensor, ref64: torch.Tensor, ref_same: torch.Tensor,
           inputs: tuple[torch.Tensor, ...], case: Case, backend: Backend,
           inp: Inputs) -> tuple[float, float, str]:
    """(error, allowed, name) of the gradient (dq, dk or dv) furthest past its bound."""
    gen = torch.Generator().manual_seed(99)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float32).to(out)
    grads = torch.autograd.grad(out, inputs, dout, retain_graph=case.repeat)
    g64 = torch.autograd.grad(ref64, inputs, dout.double())
    gsame = torch.autograd.grad(ref_same, inputs, dout)
    worst, worst_allowed, worst_name = 0.0, math.inf, "dq"
    for name, g, r64, rs in zip(("dq", "dk", "dv"), grads, g64, gsame):
        _check_grad(name, g, tuple(r64.shape), rs.dtype)
        e, a = fa_rule_error(g, r64, rs, mult=3.0)
        if e - a > worst - worst_allowed:
            worst, worst_allowed, worst_name = e, a, name
    if case.repeat:
        q, k, v = (x.detach().clone().requires_grad_(True) for x in inputs)
        with torch.enable_grad():
            out2, _ = _call(backend, inp, q, k, v)
        again = torch.autograd.grad(out2, (q, k, v), dout)
        if not all(torch.equal(a, b) for a, b in zip(again, grads)):
            raise _Fail("declared deterministic backward, but two backward passes differ")
    return worst, worst_allowed, worst_name


def _check_grad(name: str, g: torch.Tensor | None, shape: tuple[int, ...],
                dtype: torch.dtype) -> None:
    """A declared backward gives every gradient, of its input's shape and dtype, NaN-free."""
    if g is None or torch.isnan(g).any():
        raise _Fail(f"gradient {name} missing or NaN (backward declared)")
    if tuple(g.shape) != shape or g.dtype != dtype:
        raise _Fail(f"gradient {name} of shape {tuple(g.shape)} {g.dtype}, expected "
                    f"{shape} {dtype}")


def _exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {safe_str(exc)}".splitlines()[0][:240]
