"""The regret report: arithmetic on fake timings, the misses and their causes, the pack it
writes (consumed by `fastest` rules), the plot, and `attnhub bench` with a store it cannot
write (measurements kept, printed, non-zero exit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnhub.cli import main
from attnhub.core.device import simulate
from attnhub.core.spec import AttentionSpec, MaskSpec, bucket
from attnhub.policy.profile import ProfileStore
from attnhub.regret import BOUND, CellResult, from_json, markdown, misses, pack_data, plot, regret

SPEC = AttentionSpec(phase="prefill", dtype="bf16", head_dim=64, num_q_heads=8,
                     num_kv_heads=2, mask=MaskSpec(causal=True), max_seqlen_q=4096,
                     max_seqlen_k=4096, batch=1)


def _cell(name: str, policy: str | None, policy_ms: float | None,
          times: dict[str, float], **kw) -> CellResult:
    return CellResult(name, spec=SPEC, policy_backend=policy, policy_rule="r",
                      policy_ms=policy_ms, times=times, **kw)


def test_regret_is_policy_over_best():
    assert regret(0.322, {"fa3": 0.322, "torch_sdpa": 0.114}) == pytest.approx(0.322 / 0.114)
    assert regret(None, {"a": 1.0}) is None and regret(1.0, {}) is None
    r = _cell("c", "fa3", 0.33, {"fa3": 0.322, "torch_sdpa": 0.114})
    assert r.best == ("torch_sdpa", 0.114)
    assert r.choice_regret == pytest.approx(0.322 / 0.114)


def test_misses_name_the_cause():
    good = _cell("good", "a", 1.02, {"a": 1.0, "b": 1.5})
    wrong_choice = _cell("choice", "b", 1.5, {"a": 1.0, "b": 1.5}, policy_source="pack")
    path_cost = _cell("path", "a", 1.2, {"a": 1.0, "b": 1.5})
    failed = _cell("failed", "a", None, {"a": 1.0}, policy_error="raised X")
    unserved = _cell("unserved", "reference", 9.0, {})
    got = dict((r.cell, why) for r, why in misses([good, wrong_choice, path_cost, failed,
                                                   unserved]))
    assert set(got) == {"choice", "path", "failed"}
    assert "a was faster" in got["choice"] and "(pack)" in got["choice"]
    assert "call path" in got["path"] and "choice regret 1.00" in got["path"]
    assert "raised X" in got["failed"]
    md = markdown([good, wrong_choice], "HEADER")
    assert md.startswith("HEADER") and "**1.50**" in md and "| 1.02 |" in md
    assert f"worst regret 1.50 (bound {BOUND})" in md


def test_a_path_miss_says_what_the_policy_ran_while_timed():
    """A policy slower than its own backend forced: the report names any other backend the
    policy bound while timed and its run-time fallbacks (data, not a guess), and both
    survive the JSON round trip."""
    quiet = _cell("quiet", "a", 1.2, {"a": 1.0}, policy_bound=["a"])
    busy = _cell("busy", "a", 1.2, {"a": 1.0}, policy_bound=["a", "cudnn"],
                 policy_fallbacks={"cudnn->a": 7})
    got = dict((r.cell, why) for r, why in misses([quiet, busy]))
    assert "also bound" not in got["quiet"] and "fell back" not in got["quiet"]
    assert "also bound cudnn" in got["busy"] and "{'cudnn->a': 7}" in got["busy"]
    back = from_json(busy.to_json())
    assert (back.policy_bound, back.policy_fallbacks) == (["a", "cudnn"], {"cudnn->a": 7})


def test_pack_from_results_drives_fastest(tmp_path: Path):
    dev = simulate("sm90")
    results = [_cell("c", "fa3", 0.33, {"fa3": 0.322, "torch_sdpa": 0.114})]
    data = pack_data(results, dev, {"measured": "2026-12-01", "command": "x", "commit": "y"}, 20)
    folder = tmp_path / "packs"
    folder.mkdir()
    (folder / "h.json").write_text(json.dumps(data))
    r = ProfileStore(tmp_path / "u.json", packs=folder).ranking(dev, SPEC,
                                                                ["fa3", "cudnn", "torch_sdpa"])
    assert (r.source, r.order) == ("pack", ["torch_sdpa", "fa3", "cudnn"])


def test_plot_writes_a_png(tmp_path: Path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "r.png"
    plot([_cell("a", "x", 1.0, {"x": 1.0, "y": 2.0}), _cell("b", "y", 3.0, {"x": 1.0})],
         str(png), title="t")
    assert png.read_bytes()[:4] == b"\x89PNG"


TINY = ["--layers", "1", "--heads", "2:1", "--head-dim", "8", "--vocab", "32", "--batch", "1",
        "--prompt-len", "8", "--new-tokens", "2", "--page-size", "4"]


def test_bench_with_unwritable_store_keeps_measurements(tmp_path: Path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    md = tmp_path / "b.md"
    rc = main(["bench", *TINY, "--phases", "prefill", "--backends", "torch_sdpa",
               "--repeats", "1", "--warmup", "0", "--no-progress", "--md", str(md),
               "--store", str(blocker / "profile.json")])
    out, err = capsys.readouterr()
    assert rc == 3
    assert "torch_sdpa" in out and "median ms" in out and md.exists()
    assert "could not be written" in err and str(blocker / "profile.json") in err


def test_saved_reports_render_again(tmp_path: Path, capsys):
    """`--from-json` renders md/png from saved reports; a later file replaces a cell."""
    a, b = _cell("decode tiny 1 query, 1k keys", "x", 2.0, {"x": 1.0}), \
        _cell("prefill full 16k", "x", 1.0, {"x": 1.0})
    first = {"measured": "t1", "device": "d", "commit": "c", "cells": [a.to_json(), b.to_json()]}
    fixed = _cell("decode tiny 1 query, 1k keys", "x", 1.01, {"x": 1.0})
    second = {"measured": "t2", "device": "d", "commit": "c", "cells": [fixed.to_json()]}
    paths = [tmp_path / "1.json", tmp_path / "2.json"]
    for p, d in zip(paths, (first, second)):
        p.write_text(json.dumps(d))
    md = tmp_path / "r.md"
    assert main(["bench", "--regret", "--from-json", ",".join(map(str, paths)),
                 "--md", str(md)]) == 0
    text = md.read_text()
    assert text.index("prefill full 16k") < text.index("decode tiny")  # grid order
    assert "| 1.01 |" in text and "**2.00**" not in text


def test_interleaved_timing_shuffles_and_batches():
    """Every callable is sampled once per repeat, in an order drawn afresh each repeat (no
    callable always follows the same one: a fixed predecessor leaves it the same warm
    caches); calls far under 0.1 ms are timed in batches (the same count for all), slow
    ones one at a time."""
    import time

    from attnhub.timing import interleaved_ms

    log: list[str] = []
    fns = {n: (lambda n=n: log.append(n)) for n in "abcd"}
    t = interleaved_ms(fns, "cpu", warmup=1, repeats=40, rounds=1, max_batch=2)
    assert t.batch == 2 and set(t.ms) == set("abcd")
    # warm-up, then three single calls of each (calibration), then the samples
    assert log[:4] == list("abcd") and sorted(log[4:16]) == sorted("abcd" * 3)
    samples = "".join(log[16:])
    repeats = [samples[i:i + 8:2] for i in range(0, len(samples), 8)]
    assert len(repeats) == 40 and all(sorted(r) == list("abcd") for r in repeats)
    assert all(samples[i] == samples[i + 1] for i in range(0, len(samples), 2))  # batches
    predecessors = {(r[i - 1], r[i]) for r in repeats for i in range(1, 4)}
    assert len(predecessors) > 6  # a rotation of 4 names gives only 4 ordered pairs
    slow = interleaved_ms({"s": lambda: time.sleep(0.002)}, "cpu", warmup=0, repeats=1,
                          rounds=1)
    assert slow.batch == 1 and slow.ms["s"] >= 2.0


@pytest.mark.parametrize("n", range(1, 10))
def test_balanced_orders_give_no_callable_a_favoured_predecessor(n):
    """Over one cycle of rows every ordered pair of distinct callables is adjacent equally
    often (once for even n, twice for odd), and every row is a permutation."""
    from collections import Counter

    from attnhub.timing import balanced_orders

    rows = balanced_orders(n)
    assert all(sorted(r) == list(range(n)) for r in rows)
    assert len(rows) == (n if n % 2 == 0 or n == 1 else 2 * n)
    pairs = Counter((r[i - 1], r[i]) for r in rows for i in range(1, n))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1


class _Timed:
    """A callable whose samples a fake ``sample_ms`` reads: ``calib`` for the three
    calibration samples, then ``series[i]`` for its i-th sample of the rounds."""

    def __init__(self, calib: float, series: list[float]):
        self.calib, self.series, self.n = calib, series, -3

    def __call__(self) -> None:
        pass

    def sample(self) -> float:
        self.n += 1
        return self.calib if self.n <= 0 else self.series[self.n - 1]


def _fake_samples(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import attnhub.timing as timing

    monkeypatch.setattr(timing, "sample_ms", lambda fn, device, calls=1: fn.sample())


def test_paired_timing_cancels_what_moves_every_callable_alike(monkeypatch):
    """A walk's lengths grow call by call (a trend every callable shares) and four early
    samples of the faster callable are slow: its plain median then lands above the other's,
    while the paired figures keep the true 2% between them."""
    from attnhub.timing import interleaved_ms

    _fake_samples(monkeypatch)
    trend = [1.0 + 0.05 * r for r in range(30)]

    def make() -> dict[str, _Timed]:
        a = [t * (3.0 if r < 4 else 1.0) for r, t in enumerate(trend)]
        return {"a": _Timed(1.0, a), "b": _Timed(1.02, [t * 1.02 for t in trend])}

    plain = interleaved_ms(make(), "cpu", warmup=0, repeats=30, rounds=1, batch_below_ms=0)
    assert plain.ms["a"] > plain.ms["b"]  # the ranks moved: a looks slower
    paired = interleaved_ms(make(), "cpu", warmup=0, repeats=30, rounds=1, batch_below_ms=0,
                            paired=True)
    assert paired.ms["b"] / paired.ms["a"] == pytest.approx(1.02, rel=1e-9)
    assert min(trend) < paired.ms["a"] < max(trend)  # still milliseconds of a call


def test_interleaved_timing_skips_callables_far_slower_in_calibration(monkeypatch):
    """A callable over ``skip_above`` x the fastest in its calibration calls keeps that
    figure and is never sampled in a round; the others are."""
    from attnhub.timing import interleaved_ms

    _fake_samples(monkeypatch)
    fns = {"fast": _Timed(1.0, [1.0] * 6), "near": _Timed(2.0, [2.0] * 6),
           "slow": _Timed(50.0, [50.0] * 6)}
    t = interleaved_ms(fns, "cpu", warmup=0, repeats=3, rounds=2, batch_below_ms=0,
                       skip_above=20.0, drop_above=3.0, paired=True)
    assert t.ms == pytest.approx({"fast": 1.0, "near": 2.0, "slow": 50.0})
    assert fns["slow"].n == 0 and fns["fast"].n == fns["near"].n == 6


def test_interleaved_timing_drops_far_slower_callables_after_a_round(virtual_clock):
    """A callable over ``drop_above`` x the fastest keeps its first round's figure and is
    not sampled again; the others are sampled in every round."""
    from attnhub.timing import interleaved_ms

    calls = {"fast": 0, "near": 0, "slow": 0}
    naps = {"fast": 0.001, "near": 0.0015, "slow": 0.006}

    def fn(name: str):  # type: ignore[no-untyped-def]
        def call() -> None:
            calls[name] += 1
            virtual_clock.advance(naps[name])
        return call

    t = interleaved_ms({n: fn(n) for n in naps}, "cpu", warmup=0, repeats=3, rounds=3,
                       drop_above=3.0)
    assert calls["fast"] == calls["near"] == 3 + 9 and calls["slow"] == 3 + 3
    assert t.ms == pytest.approx({"fast": 1.0, "near": 1.5, "slow": 6.0})


def test_report_shows_the_policy_backend_forced_and_raw_libraries():
    r = _cell("decode contiguous 1 x 32k", "torch_sdpa", 0.0957,
              {"torch_sdpa": 0.0884, "fa3": 0.2}, raw={"SDPA": 0.0645, "fa3": 0.19},
              raw_failed={"torch varlen": "wrong: x"}, batch=6)
    assert r.policy_forced_ms == 0.0884 and r.path_ratio == pytest.approx(0.0957 / 0.0884)
    md = markdown([r])
    assert "| 0.0884 (1.08) |" in md and "SDPA 0.0645, fa3 0.19" in md and "| 6 |" in md
    assert "raw torch varlen: wrong: x" in md
    back = from_json(json.loads(json.dumps(r.to_json())))
    assert (back.raw, back.raw_failed, back.batch, back.raw_sdpa_ms) == (
        r.raw, r.raw_failed, 6, 0.0645)
    old = r.to_json()
    del old["raw_ms"], old["raw_failed"], old["batch"]  # a report from before raw_ms
    assert from_json(old).raw == {"SDPA": 0.0645}


@pytest.mark.parametrize("name", ["decode tiny", "varlen", "train", "paged/16 32 x 4k",
                                  "window"])
def test_measure_cell_on_cpu_checks_times_and_binds(name, wrong_registry):
    """One real cell per layout/phase at CPU sizes: the policy's call and a forced backend
    are checked against the fp64 reference and timed; a backend that returns a wrong answer
    is reported as failed, never timed."""
    from dataclasses import replace as dc_replace

    import torch

    from attnhub.regret import measure_cell, standard_grid

    reg = wrong_registry
    cell = next(c for c in standard_grid("fp32", scale=256) if name in c.name)
    cell = dc_replace(cell, spec=dc_replace(cell.spec, num_q_heads=4, num_kv_heads=2,
                                            head_dim=16, head_dim_v=16))
    r = measure_cell(cell, ["torch_sdpa", "wrong"], reg, torch.device("cpu"), warmup=0,
                     repeats=1, rounds=1)
    assert r.policy_backend == "torch_sdpa" and r.policy_error is None
    assert r.policy_ms is not None and r.policy_ms > 0 and set(r.times) == {"torch_sdpa"}
    assert "wrong" in r.failed and r.failed["wrong"].startswith("wrong: max error")
    assert r.spec is not None and r.spec.phase == cell.spec.phase
    assert r.to_json()["regret"] == pytest.approx(r.policy_ms / r.times["torch_sdpa"])
    assert r.to_json()["policy"]["forced_ms"] == r.times["torch_sdpa"] and r.batch >= 1
    # raw SDPA where the cell has a native SDPA form (paged: on the contiguous cache); no
    # FA3 or torch varlen kernel on the CPU: absent, not failed
    want = {"SDPA"} if name in ("decode tiny", "paged/16 32 x 4k") else set()
    assert set(r.raw) == want and not r.raw_failed


def test_wrong_raw_peer_is_reported_not_timed(monkeypatch):
    import torch

    from attnhub import regret as rg
    from attnhub.core.registry import Registry

    real = rg._raw_peers

    def peers(inp, spec, fa3_ok):
        out = real(inp, spec, fa3_ok)
        good = out["SDPA"]
        out["bogus"] = lambda: good() * 1.01
        return out

    monkeypatch.setattr(rg, "_raw_peers", peers)
    cell = next(c for c in rg.standard_grid("fp32", scale=256) if "decode tiny" in c.name)
    r = rg.measure_cell(cell, ["torch_sdpa"], Registry.load(), torch.device("cpu"), warmup=0,
                        repeats=1, rounds=1)
    assert set(r.raw) == {"SDPA"} and r.raw_failed["bogus"].startswith("wrong: max error")


def test_growing_cell_walks_fresh_lengths_per_callable(monkeypatch, wrong_registry):
    """A growing-cache cell (DynamicCache decode): the checked call runs on the cell's own
    inputs, then every call of every timed callable gets a cache one step longer, in
    transformers' layout, and no two callables ever meet the same length; a backend that is
    wrong on the checked inputs is still refused."""
    from dataclasses import replace as dc_replace

    import torch

    from attnhub import regret as rg
    from attnhub.hub import Hub

    seen: list[tuple[int, tuple[int, ...]]] = []
    real = Hub.attention

    def spy(self, q, k, v, **kw):
        seen.append((id(self), kw.get("backend"), k.shape[1], k.stride()))
        return real(self, q, k, v, **kw)

    monkeypatch.setattr(Hub, "attention", spy)
    monkeypatch.setattr(rg, "SKIP_ABOVE", None)  # every walk timed to its end, reference's too
    cell = next(c for c in rg.standard_grid("fp32", scale=256) if "growing cache 1 x" in c.name)
    assert cell.grow and cell.spec.phase == "decode"
    cell = dc_replace(cell, spec=dc_replace(cell.spec, num_q_heads=4, num_kv_heads=2,
                                            head_dim=16, head_dim_v=16))
    r = rg.measure_cell(cell, ["torch_sdpa", "wrong"], wrong_registry, torch.device("cpu"),
                        warmup=1, repeats=2, rounds=1)
    assert r.policy_error is None and set(r.times) == {"torch_sdpa"}
    assert r.failed["wrong"].startswith("wrong: max error")
    assert set(r.raw) == {"SDPA", "SDPA cuDNN off"}
    sk = cell.spec.max_seqlen_k
    by_caller: dict = {}
    for hub, backend, length, stride in seen:
        by_caller.setdefault((hub, backend), []).append((length, stride))
    lengths = {c: [n for n, _ in calls] for c, calls in by_caller.items()}
    assert all(ls[0] == sk for ls in lengths.values())  # the checked call: the cell's inputs
    for c, ls in lengths.items():
        if len(ls) > 1:  # then one key... step longer each call, as a bhsd cache seen as bshd
            cycle = sorted(set(ls[1:]))  # (its own lengths again once all are taken)
            assert ls[1:] == (cycle * len(ls))[:len(ls) - 1] and cycle[0] > sk
            assert all(st[1] == 16 and st[2] == n * 16 for n, st in by_caller[c][1:])
            # every length in the cell's bucket: the binding timed is the one reported
            assert max(ls) <= bucket(sk)
    later = [set(ls[1:]) for ls in lengths.values()]
    assert all(not (a & b) for i, a in enumerate(later) for b in later[i + 1:])


def test_new_length_cells_walk_q_k_v_together(monkeypatch):
    """Prefill and training cells at a new length per call: q, k and v walk together (Sq ==
    Sk, contiguous bshd), every timed callable on lengths no other meets, so a backend that
    builds per exact shape pays its build in the timing; training leaves are made per call."""
    import torch

    from attnhub import regret as rg
    from attnhub.core.registry import Registry
    from attnhub.hub import Hub

    seen: list[tuple] = []
    real = Hub.attention

    def spy(self, q, k, v, **kw):
        seen.append((id(self), kw.get("backend"), q.shape[1], k.shape[1], v.shape[1],
                     q.is_contiguous() and k.is_contiguous(), q.requires_grad))
        return real(self, q, k, v, **kw)

    monkeypatch.setattr(Hub, "attention", spy)
    grid = rg.standard_grid("fp32", scale=256)
    for name, train in (("a new prompt length per call, 1 x", False),
                        ("a new length per step", True)):
        seen.clear()
        cell = next(c for c in grid if name in c.name)
        assert cell.grow and (cell.spec.phase == "train") == train
        r = rg.measure_cell(cell, ["torch_sdpa"], Registry.load(), torch.device("cpu"),
                            warmup=1, repeats=2, rounds=1)
        assert r.policy_error is None and set(r.times) == {"torch_sdpa"}
        assert (set(r.raw) == {"SDPA", "SDPA cuDNN off"}) != train  # raw: not for training
        sk = cell.spec.max_seqlen_k
        by_caller: dict = {}
        for hub, backend, lq, lk, lv, contiguous, grad in seen:
            assert lq == lk == lv and contiguous and grad == train
            by_caller.setdefault((hub, backend), []).append(lk)
        assert len(by_caller) == 2 and all(ls[0] == sk and len(ls) > 2
                                           for ls in by_caller.values())
        later = [set(ls[1:]) for ls in by_caller.values()]
        assert all(min(s) > sk for s in later) and not (later[0] & later[1])


def test_regret_batches_sub_millisecond_calls(monkeypatch):
    """The regret batches every call under BATCH_BELOW_MS (1 ms): at 0.1 ms one cell of the
    H200 grid was batched in one step and timed from an idle GPU in the next (2x apart)."""
    import torch

    from attnhub import regret as rg
    from attnhub.core.registry import Registry

    seen: dict = {}
    real = rg.interleaved_ms

    def spy(fns, device, **kw):
        seen.update(kw)
        return real(fns, device, **kw)

    monkeypatch.setattr(rg, "interleaved_ms", spy)
    cell = next(c for c in rg.standard_grid("fp32", scale=256) if "decode tiny" in c.name)
    r = rg.measure_cell(cell, ["torch_sdpa"], Registry.load(), torch.device("cpu"), warmup=0,
                        repeats=1, rounds=1)
    assert seen["batch_below_ms"] == rg.BATCH_BELOW_MS == 1.0 and seen["batch_ms"] == 2.0
    assert r.times and r.batch >= 1  # (the batch itself depends on this box's timing)


def test_growing_cell_stays_in_its_key_length_bucket(monkeypatch):
    """However many calls the timing takes, a growing cell's lengths stay in the bucket of
    its key length (past it the hub binds anew: the policy's time would mix bindings), and
    a walk that has taken all its lengths starts over from its own first fresh length."""
    from dataclasses import replace as dc_replace

    import torch

    from attnhub import regret as rg
    from attnhub.core.registry import Registry
    from attnhub.hub import Hub

    seen: list[tuple[str | None, int]] = []
    real = Hub.attention

    def spy(self, q, k, v, **kw):
        seen.append((kw.get("backend"), k.shape[1]))
        return real(self, q, k, v, **kw)

    monkeypatch.setattr(Hub, "attention", spy)
    monkeypatch.setattr(rg, "SKIP_ABOVE", None)  # every walk timed to its end, reference's too
    cell = next(c for c in rg.standard_grid("fp32", scale=256) if "growing cache 1 x" in c.name)
    cell = dc_replace(cell, spec=dc_replace(cell.spec, num_q_heads=4, num_kv_heads=2,
                                            head_dim=16, head_dim_v=16))
    r = rg.measure_cell(cell, ["torch_sdpa", "reference"], Registry.load(),
                        torch.device("cpu"), warmup=3, repeats=12, rounds=2)
    assert r.policy_error is None and set(r.times) == {"torch_sdpa", "reference"}
    sk = cell.spec.max_seqlen_k
    assert r.spec is not None and r.spec.max_seqlen_k == bucket(sk)
    by: dict = {}
    for backend, n in seen:
        by.setdefault(backend, []).append(n)
    assert set(by) == {None, "torch_sdpa", "reference"}
    for ls in by.values():
        assert ls[0] == sk and sk < min(ls[1:]) and max(ls) <= bucket(sk), ls
    assert sum(len(ls) for ls in by.values()) > bucket(sk) - sk  # they had to start over


@pytest.mark.parametrize("count", [2, 5, 8])
def test_walks_meet_every_alignment_equally(count):
    """Each walk's lengths cover every residue mod 8 equally (an odd stride): with an even
    one, one walk took only lengths 2 mod 8 and another only 7 mod 8, so one backend could
    time differently per walk. Walks stay disjoint."""
    import torch

    from attnhub import regret as rg
    from attnhub.core.spec import AttentionSpec

    spec = AttentionSpec(phase="prefill", dtype="fp32", kv_dtype="fp32", head_dim=4,
                         head_dim_v=4, num_q_heads=1, num_kv_heads=1, max_seqlen_q=1025,
                         max_seqlen_k=1025, batch=1)
    inp = rg.make_inputs(spec, torch.device("cpu"), seed=0)
    walks = rg._Walks(inp, count, calls=8 * 9)
    seen = []
    for _ in range(count):
        w = walks.next()
        lengths = [w.q.shape[1] for _ in range(1 + 8 * 9)][1:]  # the first: the cell's own
        seen.append(set(lengths))
        residues = [n % 8 for n in lengths]
        assert all(residues.count(r) == 9 for r in range(8)), (count, residues)
    assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1:])


def test_walk_calls_covers_the_timing():
    from attnhub import regret as rg

    assert rg.walk_calls(3, 20, 2) == 1 + 3 + 3 + 2 * 20 * 4


def test_a_backend_failing_while_timed_is_recorded_not_fatal(monkeypatch):
    """A callable that passes the check and then raises while it is timed (cuDNN refusing a
    new shape past its build budget in a new-length cell) is recorded as failed, with the
    reason, and the cell is timed without it."""
    import torch

    from attnhub import regret as rg
    from attnhub.core.registry import Registry
    from attnhub.hub import Hub

    calls = {"n": 0}
    real = Hub.attention

    def flaky(self, q, k, v, **kw):
        if kw.get("backend") == "reference":
            calls["n"] += 1
            if calls["n"] > 3:
                raise RuntimeError("budget spent")
        return real(self, q, k, v, **kw)

    monkeypatch.setattr(Hub, "attention", flaky)
    cell = next(c for c in rg.standard_grid("fp32", scale=256) if "decode tiny" in c.name)
    r = rg.measure_cell(cell, ["torch_sdpa", "reference"], Registry.load(),
                        torch.device("cpu"), warmup=1, repeats=2, rounds=1)
    assert set(r.times) == {"torch_sdpa"} and r.policy_ms is not None
    assert r.failed["reference"].startswith("raised while timed") and "budget" in \
        r.failed["reference"]


def test_a_failure_while_timed_rewinds_every_walk(monkeypatch):
    """A walking cell whose forced backend raises mid-timing: the timing starts again with
    every walk rewound, so the policy's call and the same backend forced time the same
    lengths from there on, call for call (left where the failure found them, the callables
    timed before it in that repeat had walked further, to longer and slower lengths: the
    policy's call timed 1.07-1.20 of the same backend forced on the H200)."""
    import torch

    from attnhub import regret as rg
    from attnhub.core.registry import Registry
    from attnhub.hub import Hub

    seen: dict[str, list[int]] = {"policy": [], "torch_sdpa": [], "reference": []}
    real = Hub.attention

    def recording(self, q, k, v, **kw):
        name = kw.get("backend") or "policy"
        seen[name].append(q.shape[1])
        if name == "reference" and len(seen[name]) > 8:  # mid-timing: in a repeat
            raise RuntimeError("budget spent")
        return real(self, q, k, v, **kw)

    monkeypatch.setattr(Hub, "attention", recording)
    # the fp64 reference can take over SKIP_ABOVE x torch_sdpa's time in calibration on the
    # CPU, and would then sit out the rounds in which it is to fail
    monkeypatch.setattr(rg, "SKIP_ABOVE", None)
    cell = next(c for c in rg.standard_grid("fp32", scale=16)
                if "new prompt length" in c.name)
    r = rg.measure_cell(cell, ["torch_sdpa", "reference"], Registry.load(),
                        torch.device("cpu"), warmup=1, repeats=4, rounds=1)
    assert r.failed["reference"].startswith("raised while timed")
    policy, forced = seen["policy"], seen["torch_sdpa"]
    # from the restart (the last call at each walk's first fresh length) the same walk
    # position at every call: lengths apart by the walks' residues alone
    tails = [calls[len(calls) - 1 - calls[::-1].index(calls[1]):] for calls in (policy, forced)]
    assert len(tails[0]) < len(policy) and len(tails[1]) < len(forced)  # rewound
    offset = forced[1] - policy[1]
    assert len(tails[0]) == len(tails[1]) > 5 and 0 < offset < 8
    assert all(b - a == offset for a, b in zip(*tails)), (policy, forced)
