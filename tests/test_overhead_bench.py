"""benchmarks/overhead.py's cases on the CPU: every case's direct call runs the backend the
policy bound for that case (its own spec and lengths), and its policy, forced and raw calls
compute the same attention (a case whose callables took another case's backend or lengths,
say by a late-bound loop variable, would time the wrong thing)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import attnhub

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"


def _bench():
    spec = importlib.util.spec_from_file_location("overhead_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_walking_cases_time_the_bound_backend_on_their_own_lengths(monkeypatch) -> None:
    bench = _bench()
    hub = attnhub.Hub(hardware="cpu")
    seen: list[tuple[str, object]] = []
    for name in hub.registry.names():  # every backend's forward records what it is handed
        backend = hub.registry.get(name)
        real = backend.forward
        monkeypatch.setattr(backend, "forward",
                            lambda q, k, v, spec, params, real=real, name=name:
                            seen.append((name, spec)) or real(q, k, v, spec, params))
    cases = bench.walk_cases(hub, torch.device("cpu"), torch.float32, scale=64)
    assert set(cases) == {"growing_cache_decode", "new_length_prefill", "fixed_prefill"}
    for case, (name, _, calls) in cases.items():
        assert {"direct", "policy", "forced", "raw_sdpa"} <= set(calls), case
        seen.clear()
        out = calls["direct"]()[0]
        # the direct call runs the case's bound backend with this case's spec
        want_phase = "decode" if case == "growing_cache_decode" else "prefill"
        assert [(n, s.phase) for n, s in seen] == [(name, want_phase)], case
        assert seen[0][1].max_seqlen_k >= out.shape[1], case
        # and every callable of the case computes the same attention on the same lengths
        fresh = bench.walk_cases(attnhub.Hub(hardware="cpu"), torch.device("cpu"),
                                 torch.float32, scale=64)[case][2]
        outs = {which: fn() for which, fn in fresh.items()}
        direct = outs.pop("direct")[0]
        for which, got in outs.items():
            if which == "raw_sdpa":  # SDPA's own (B, H, S, D)
                got = got.transpose(1, 2)
            assert got.shape == direct.shape, (case, which)
            assert torch.allclose(got, direct, atol=1e-5), (case, which)
