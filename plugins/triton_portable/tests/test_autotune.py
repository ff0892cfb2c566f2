"""The autotuner keeps the fastest config only when its outputs agree with the table entry's:
timing cannot tell a wrong kernel from a right one, and some candidates (the Hopper Gluon
kernels) are only testable on their GPU with the Triton installed there."""

from __future__ import annotations

import pytest
import torch
import triton.testing
from attnhub_triton_portable import autotune
from attnhub_triton_portable.autotune import disagreement


def _outputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(2, 256, 4, 64, generator=g).bfloat16()
    lse = torch.randn(2, 4, 256, generator=g)
    lse[:, :, :7] = float("-inf")  # fully masked rows
    return out, lse


def _reordered(x: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """What another summation order gives: each finite value within a few bf16 ulps."""
    g = torch.Generator().manual_seed(9)
    out = []
    for t in x:
        noise = t.float().abs() * 4e-3 * torch.randn(t.shape, generator=g)
        out.append(torch.where(torch.isfinite(t), t + noise.to(t.dtype), t))
    return tuple(out)


def test_summation_order_agrees_a_wrong_tile_does_not() -> None:
    out, lse = _outputs()
    assert disagreement((out, lse), (out.clone(), lse.clone())) is None
    assert disagreement((out, lse), _reordered((out, lse))) is None
    wrong = out.clone()
    wrong[:, 64:128] = torch.randn_like(wrong[:, 64:128])  # one 64-row tile of another call
    assert "relative L2" in (disagreement((out, lse), (wrong, lse)) or "")
    assert "output 0" in (disagreement((out, lse), (out * 0, lse)) or "")


def test_non_finite_entries_must_match_in_place_and_value() -> None:
    out, lse = _outputs()
    moved = lse.clone()
    moved[:, :, 7] = float("-inf")
    assert "non-finite" in (disagreement((out, lse), (out, moved)) or "")
    flipped = lse.clone()
    flipped[:, :, 0] = float("inf")
    assert "infinities" in (disagreement((out, lse), (out, flipped)) or "")
    assert "shape" in (disagreement((out, lse), (out[:1], lse)) or "")


@pytest.fixture
def tuner(monkeypatch: pytest.MonkeyPatch) -> None:
    """pick() on a pretend GPU: do_bench reports what the run returns (its pretend time)."""
    monkeypatch.setattr(autotune, "tuning_enabled", lambda device: True)
    monkeypatch.setattr(autotune, "_CACHE", {})
    monkeypatch.setattr(autotune, "TUNING_LOG", [])
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn())


def _runner(times: dict[str, float], results: dict[str, tuple], seen: list[str]):
    """A run that gives each config's time while it is timed (once each, in order), then
    its outputs (the agreement check)."""
    def run(cfg: dict):
        seen.append(cfg["name"])
        return times[cfg["name"]] if len(seen) <= len(times) else results[cfg["name"]]
    return run


def test_the_fastest_that_agrees_wins_and_a_wrong_one_is_named(tuner: None) -> None:
    right = _outputs()
    cands = [{"name": "table"}, {"name": "fast-wrong"}, {"name": "mid-right"}]
    results = {"table": right, "fast-wrong": (-right[0], right[1]),
               "mid-right": _reordered(right)}
    seen: list[str] = []
    run = _runner({"table": 3.0, "fast-wrong": 1.0, "mid-right": 2.0}, results, seen)
    with pytest.warns(RuntimeWarning, match="fast-wrong.*disagree.*table"):
        got = autotune.pick(("k",), cands, torch.device("cpu"), run)
    assert got["name"] == "mid-right"
    assert seen[3:] == ["table", "fast-wrong", "mid-right"]  # the reference once
    log = [(c["name"], err) for _, c, _, err in autotune.TUNING_LOG if err]
    assert len(log) == 1 and log[0][0] == "fast-wrong" and "relative L2" in log[0][1]
    assert autotune.pick(("k",), cands, torch.device("cpu"), run) is got  # cached


def test_every_faster_one_wrong_leaves_the_table_entry(tuner: None) -> None:
    right = _outputs()
    cands = [{"name": "table"}, {"name": "bad"}]
    run = _runner({"table": 2.0, "bad": 1.0},
                  {"table": right, "bad": (right[0], right[1] + 1.0)}, [])
    with pytest.warns(RuntimeWarning, match="bad"):
        assert autotune.pick(("k2",), cands, torch.device("cpu"), run)["name"] == "table"


def test_a_table_entry_that_wins_needs_no_check(tuner: None) -> None:
    seen: list[str] = []
    run = _runner({"table": 1.0, "slow": 2.0}, {}, seen)
    cands = [{"name": "table"}, {"name": "slow"}]
    assert autotune.pick(("k3",), cands, torch.device("cpu"), run)["name"] == "table"
    assert seen == ["table", "slow"]  # timed once each, nothing run to compare
