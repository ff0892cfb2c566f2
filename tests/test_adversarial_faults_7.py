"""Fault injection, seventh round: a number past float range in the profile store, a
``~user`` store path that does not exist, a report that cannot be written after bench
measured, and a Ctrl-C inside ``free()`` between releasing pages and revoking the tables
that name them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import attnhub
from attnhub.core.kvcache import PagedKVCache
from attnhub.errors import PolicyError, SeqlensError
from attnhub.policy.profile import ProfileStore, _is_num


def test_a_400_digit_number_is_not_a_number() -> None:
    assert not _is_num(10 ** 400) and _is_num(3) and _is_num(0.5) and not _is_num(True)


def test_a_store_path_under_a_user_that_does_not_exist_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNHUB_PROFILE", "~attnhub_no_such_user_7/p.json")
    from attnhub.policy.profile import default_profile_path

    with pytest.raises(PolicyError, match="ATTNHUB_PROFILE=.*without '~'"):
        default_profile_path()
    with pytest.raises(PolicyError, match="store path"):
        ProfileStore("~attnhub_no_such_user_7/p.json")


def test_a_report_that_cannot_be_written_is_named_after_the_store(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """A full disk at ``--md``: bench printed nothing, stored nothing and raised OSError."""
    from attnhub.cli import bench, main

    def full(path, text):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "write_text_atomic", full)
    store = tmp_path / "store.json"
    rc = main(["bench", "--phases", "decode", "--seqlens", "64", "--warmup", "0",
               "--repeats", "1", "--md", str(tmp_path / "b.md"), "--store", str(store)])
    assert rc != 0
    assert json.loads(store.read_text())  # the measurements were stored before the report


def test_an_interrupted_free_leaves_no_table_reading_a_freed_page(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8)
    a = cache.allocate()
    cache.append(a, [torch.ones(4, 1, 8)], [torch.ones(4, 1, 8)])
    bt, sl = cache.block_table([a]), cache.seqlens([a])
    states_free = cache.states.free

    def interrupted(seq_id):  # type: ignore[no-untyped-def]
        states_free(seq_id)
        raise KeyboardInterrupt  # Ctrl-C lands after the tables were revoked

    monkeypatch.setattr(cache.states, "free", interrupted)  # and again on the retry
    with pytest.raises(KeyboardInterrupt):
        cache.free(a)
    # the stores are freed first and the tables revoked before any page is released: cut
    # there (twice, so the finish waits for the next operation), the pages are still a's
    assert cache.free_pages == 3 and a in cache.seq_ids
    q = torch.ones(1, 1, 1, 8)
    hub = attnhub.Hub(hardware="cpu")
    out = hub.attention(q, cache.k_cache(0), cache.v_cache(0), layout="paged",
                        block_table=bt, seqlens_k=sl)
    torch.testing.assert_close(out, torch.ones_like(out))
    monkeypatch.undo()
    cache.allocate()  # the next operation finishes the free: pages back, tables revoked
    assert a not in cache.seq_ids and cache.free_pages == 4
    with pytest.raises(SeqlensError, match="freed"):
        hub.attention(q, cache.k_cache(0), cache.v_cache(0), layout="paged", block_table=bt,
                      seqlens_k=sl)


def test_several_records_are_written_together_or_not_at_all(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """fp8-check, bench and profile wrote one record per write: a disk that filled after the
    first left it stored while the command said "not recorded"."""
    from attnhub.policy import profile

    store = ProfileStore(tmp_path / "s.json")
    device = attnhub.probe()
    spec = attnhub.AttentionSpec(phase="decode", dtype="bf16", num_q_heads=8, num_kv_heads=2,
                                 head_dim=64, max_seqlen_q=1, max_seqlen_k=1024)
    writes = []
    real = profile.write_json_atomic

    def once_then_full(path, data):  # type: ignore[no-untyped-def]
        if writes:
            raise OSError(28, "No space left on device")
        writes.append(path)
        real(path, data)

    monkeypatch.setattr(profile, "write_json_atomic", once_then_full)
    with store.batch():
        store.record_speed(device, spec, "torch_sdpa", 1e-3)
        store.record_speed(device, spec.with_(max_seqlen_k=4096), "torch_sdpa", 2e-3)
    assert len(writes) == 1  # both in the one write
    with pytest.raises(PolicyError, match="free space"), store.batch():
        store.record_speed(device, spec, "reference", 5e-3)
        store.record_speed(device, spec, "triton", 4e-3)
    data = json.loads((tmp_path / "s.json").read_text())
    backends = {b for dev in data["devices"].values() for entry in dev["speed"].values()
                for b in entry}
    assert backends == {"torch_sdpa"}, backends


def test_a_lockfile_under_a_file_names_the_file_in_the_way(tmp_path: Path) -> None:
    from attnhub.policy.lock import LockfileError, write_lock

    (tmp_path / "afile").write_text("x")
    with pytest.raises(LockfileError, match=f"at {tmp_path / 'afile'}"):
        write_lock(tmp_path / "afile" / "x.lock", {})
