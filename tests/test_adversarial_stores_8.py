"""Review round 8, stores: ``ProfileStore.batch`` kept its pending records on the store, so
another thread's record made meanwhile was swallowed into the batch (and dropped with it),
and a batch inside another wrote the outer one's later records at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import attnhub
from attnhub.core.device import probe
from attnhub.policy.profile import ProfileStore

DEV = probe("cpu")
SPEC = attnhub.AttentionSpec(phase="prefill", dtype="fp32", num_q_heads=4, num_kv_heads=4,
                             head_dim=64, max_seqlen_q=128, max_seqlen_k=128).bucketed()


def test_another_threads_record_is_its_own_not_the_open_batchs(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path / "profile.json")
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(5)
        store.record_speed(DEV, SPEC, "from_b", 0.002)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with pytest.raises(RuntimeError):
        with store.batch():
            store.record_speed(DEV, SPEC, "from_a", 0.001)
            inside.set()
            assert done.wait(5)
            assert "from_b" in (tmp_path / "profile.json").read_text()  # written on return
            raise RuntimeError("A's run fails: its batch writes nothing")
    t.join(5)
    text = (tmp_path / "profile.json").read_text()
    assert "from_b" in text and "from_a" not in text


def test_a_nested_batch_is_all_or_none_with_the_outer_one(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    store = ProfileStore(path)
    with pytest.raises(RuntimeError):
        with store.batch():
            store.record_speed(DEV, SPEC, "outer_1", 0.001)
            with store.batch():
                store.record_speed(DEV, SPEC, "inner", 0.001)
            store.record_speed(DEV, SPEC, "outer_2", 0.001)
            raise RuntimeError("the outer batch fails")
    assert not path.exists() or not any(n in path.read_text()
                                        for n in ("outer_1", "inner", "outer_2"))
    with store.batch():
        with store.batch():
            store.record_speed(DEV, SPEC, "inner", 0.001)
        store.record_speed(DEV, SPEC, "outer", 0.001)
    assert all(n in path.read_text() for n in ("inner", "outer"))


def test_bench_regret_stores_before_a_report_it_cannot_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``bench --regret`` wrote ``--md`` before the store: a full disk there lost the store,
    and the error said the timings were stored."""
    import errno

    import attnhub.cli.bench as bench
    from attnhub.cli import main

    def full(path, text):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(bench, "write_text_atomic", full)
    store = tmp_path / "store.json"
    assert main(["bench", "--regret", "--cells", "decode tiny", "--scale", "64", "--rounds",
                 "1", "--backends", "torch_sdpa", "--warmup", "0", "--repeats", "1", "--store",
                 str(store), "--md", str(tmp_path / "report.md"), "--no-progress"]) != 0
    assert "--md" in capsys.readouterr().err
    assert "torch_sdpa" in store.read_text()
