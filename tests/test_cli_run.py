"""``attnhub run``, ``bench`` and ``profile`` on tiny sizes (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnhub import Hub
from attnhub.benchmark import measure
from attnhub.cli import main
from attnhub.core.registry import Registry
from attnhub.core.spec import AttentionSpec, MaskSpec
from attnhub.policy import load_policy
from attnhub.policy.profile import ProfileStore

TINY = ["--layers", "2", "--heads", "4:2", "--head-dim", "16", "--vocab", "64", "--batch", "2",
        "--prompt-len", "12", "--new-tokens", "4", "--page-size", "4"]


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], rc: int = 0) -> dict:
    assert main(argv) == rc
    return json.loads(capsys.readouterr().out)


def test_run_binds_runs_and_checks_against_reference(capsys) -> None:  # type: ignore[no-untyped-def]
    r = _json(capsys, ["run", *TINY, "--compare-decode", "--json"])
    assert len(r["bindings"]["bindings"]) == 2 * 2  # 2 layers x (prefill + one decode bucket)
    for phase, tokens in (("prefill", 2 * 12), ("decode", 2 * 4)):
        assert r["phases"][phase]["tokens"] == tokens and r["phases"][phase]["tokens_per_s"] > 0
    chk = r["check"]
    assert chk["ok"] and chk["steps"] == 4 and chk["max_abs_diff"] < 1e-3
    timed = {x["backend"]: x for x in r["decode_backends"] if "tokens_per_s" in x}
    assert {"policy", "torch_sdpa"} <= set(timed)
    assert max(x["vs_best"] for x in timed.values()) == 1.0


def test_run_text_output_has_table_phases_and_check(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["run", *TINY, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| layers" in out and "tokens/s" in out and "check vs reference" in out
    assert "-> ok" in out


def test_run_on_a_simulated_gpu_binds_gpu_backends(capsys) -> None:  # type: ignore[no-untyped-def]
    r = _json(capsys, ["run", *TINY, "--hardware", "sm90", "--json"])
    assert "phases" not in r and "plan only" in r["note"]
    reg = Registry.load()
    prefill = {b["backend"] for b in r["bindings"]["bindings"] if b["phase"] == "prefill"}
    assert prefill and all("cpu" not in reg.get(b).capabilities.vendors for b in prefill)


def test_bench_checks_times_stores_and_plots(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    store, png, md = tmp_path / "p.json", tmp_path / "b.png", tmp_path / "b.md"
    r = _json(capsys, ["bench", *TINY, "--seqlens", "8,16", "--backends", "torch_sdpa",
                       "--repeats", "2", "--warmup", "1", "--store", str(store), "--plot",
                       str(png), "--md", str(md), "--json"])
    assert len(r["results"]) == 4 and all(x["ms"] > 0 for x in r["results"])
    assert all(x["error"] <= x["allowed"] for x in r["results"])
    assert png.read_bytes()[:4] == b"\x89PNG" and "torch_sdpa" in md.read_text()
    spec = AttentionSpec(phase="prefill", dtype="fp32", head_dim=16, num_q_heads=4,
                         num_kv_heads=2, mask=MaskSpec(causal=True), max_seqlen_q=16,
                         max_seqlen_k=16, batch=2)
    assert ProfileStore(store).speed(Hub(policy=load_policy()).device, spec, "torch_sdpa") > 0


def test_bench_reports_a_wrong_backend_and_does_not_time_it(wrong_registry) -> None:
    hub = Hub(policy=load_policy(), registry=wrong_registry)
    spec = AttentionSpec(phase="decode", dtype="fp32", head_dim=16, num_q_heads=4,
                         num_kv_heads=2, layout="paged", max_seqlen_q=1, max_seqlen_k=24,
                         batch=2, page_size=8)
    res = {m.backend: m for m in measure(hub, spec, ["torch_sdpa", "wrong"],
                                         torch.device("cpu"), warmup=1, repeats=2)}
    assert res["torch_sdpa"].ok
    assert res["wrong"].ms is None and "wrong: max error" in (res["wrong"].failed or "")


def test_profile_records_attention_share(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "p.json"
    r = _json(capsys, ["profile", *TINY, "--repeats", "2", "--store", str(store), "--json"])
    dev = Hub(policy=load_policy()).device
    for phase in ("prefill", "decode"):
        share = r["phases"][phase]["share"]
        assert 0 < share <= 1
        assert ProfileStore(store).attention_share(dev, r["model"], phase) == pytest.approx(share)
