"""benchmarks/hf_generate.py dry-runs on the CPU (tiny model): it measures both
implementations on every cell, agrees on the logits and tokens, and writes its JSON and table."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from attnhub.integrations.transformers.testing import one_intraop_thread

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_generate.py"


def test_tiny_cpu_dry_run_writes_json_and_table(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("hf_generate", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # main() arms a watchdog that ends its process with os._exit(124) after 2 x --budget-s;
    # left armed in process, it killed this pytest worker 300 s later, mid whatever test then
    # ran (seen as "worker crashed" in test_flex_cache): main cancels it on return
    armed: list[threading.Timer] = []
    real = bench.watchdog
    monkeypatch.setattr(bench, "watchdog", lambda s: armed.append(real(s)) or armed[-1])
    with one_intraop_thread():
        result = bench.main(["--device", "cpu", "--tiny", "--cells", "2x12",
                             "--new-tokens", "2", "--repeats", "1", "--out", str(tmp_path)])
    (timer,) = armed
    assert timer.interval == 300.0 and timer.finished.is_set()  # twice the budget; cancelled
    assert [(c["batch"], c["prompt"]) for c in result["cells"]] == [(2, 12)]
    for cell in result["cells"]:
        for impl in ("sdpa", "attnhub"):
            assert cell[impl]["prefill_tok_s"] > 0 and cell[impl]["decode_tok_s"] > 0
        agree = cell["agreement"]
        assert agree["within_noise"] and agree["max_abs_diff"] < 1e-4, agree  # fp32
        assert agree["greedy_tokens_equal"] == 1.0
    assert json.loads((tmp_path / "hf_generate.json").read_text()) == result
    table = (tmp_path / "hf_generate.md").read_text()
    assert table.count("| attnhub |") == 1 and "commit" in table
