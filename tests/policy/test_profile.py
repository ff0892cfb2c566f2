"""The profile store: keys, lookups, atomic writes, merging of concurrent writers (threads
and processes), typed errors for malformed entries, shipped packs and their precedence."""

from __future__ import annotations

import json
import multiprocessing
import threading

import pytest

from attnhub.core.device import simulate, with_versions
from attnhub.core.spec import AttentionSpec, MaskSpec
from attnhub.errors import PolicyError
from attnhub.policy import ProfileStore
from attnhub.policy.profile import SCHEMA, bucket_key, default_profile_path, device_key

SPEC = AttentionSpec(phase="decode", num_q_heads=32, num_kv_heads=8, max_seqlen_q=1,
                     max_seqlen_k=30000, batch=3, mask=MaskSpec(causal=True))


def test_location_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNHUB_PROFILE", str(tmp_path / "x.json"))
    assert default_profile_path() == tmp_path / "x.json" == ProfileStore().path
    monkeypatch.delenv("ATTNHUB_PROFILE")
    assert default_profile_path().parts[-3:] == (".cache", "attnhub", "profile.json")


def test_keys_separate_devices_versions_and_buckets():
    dev = simulate("sm90")
    assert device_key(dev) != device_key(simulate("sm80"))
    assert device_key(dev) != device_key(with_versions(dev, torch="0.0"))
    assert device_key(dev) == device_key(with_versions(dev, transformers="0.0"))
    same_bucket = SPEC.with_(max_seqlen_k=32768, batch=4)
    assert bucket_key(SPEC) == bucket_key(same_bucket) != bucket_key(SPEC.with_(batch=5))
    assert "sk=32768" in bucket_key(SPEC) and "h=32:8" in bucket_key(SPEC)


def test_speed_and_fastest(store):
    dev = simulate("sm90")
    assert store.fastest(dev, SPEC, ["a", "b", "c"]) == [("a", None), ("b", None), ("c", None)]
    store.record_speed(dev, SPEC, "c", 3e-5)
    store.record_speed(dev, SPEC, "b", 5e-5)
    assert store.fastest(dev, SPEC, ["a", "b", "c"]) == [("c", 3e-5), ("b", 5e-5), ("a", None)]
    assert store.speed(simulate("sm80"), SPEC, "c") is None  # another device: not measured
    with pytest.raises(ValueError, match="positive finite"):
        store.record_speed(dev, SPEC, "a", float("nan"))


def test_attention_share_most_specific_first(store):
    dev = simulate("sm90")
    assert store.attention_share(dev, "llama", "decode") is None
    store.record_attention_share(dev, None, 0.5)
    store.record_attention_share(dev, "llama", 0.3)
    store.record_attention_share(dev, "llama", 0.1, phase="decode")
    assert store.attention_share(dev, "llama", "decode") == 0.1
    assert store.attention_share(dev, "llama", "prefill") == 0.3
    assert store.attention_share(dev, "gpt", "decode") == 0.5
    with pytest.raises(ValueError, match="between 0 and 1"):
        store.record_attention_share(dev, "x", 1.5)


def test_accuracy_by_bucket_then_device_wide(store):
    dev = simulate("sm90")
    assert store.accuracy(dev, SPEC, "fa3_fp8") is None
    store.record_accuracy(dev, "*", "fa3_fp8", True, {"rel_error": 0.01})
    store.record_accuracy(dev, SPEC, "fa3_fp8", False, {"rel_error": 0.2})
    rec = store.accuracy(dev, SPEC, "fa3_fp8")
    assert rec is not None and rec.passed is False and rec.metrics == {"rel_error": 0.2}
    other = store.accuracy(dev, SPEC.with_(batch=64), "fa3_fp8")
    assert other is not None and other.passed and other.key == "*" and other.reference == "bf16"


def test_file_is_documented_schema_and_writers_merge(store):
    dev = simulate("cpu")
    other = ProfileStore(store.path)  # a second process writing the same file
    store.record_speed(dev, SPEC, "torch_sdpa", 1e-3)
    other.record_speed(dev, SPEC, "reference", 2e-3)
    store.record_attention_share(dev, "m", 0.4)
    data = json.loads(store.path.read_text())
    assert data["schema"] == SCHEMA and set(data) == {"schema", "devices"}
    entry = data["devices"][device_key(dev)]
    assert set(entry) == {"device", "speed", "attention_share"}
    assert set(entry["speed"][bucket_key(SPEC)]) == {"torch_sdpa", "reference"}
    assert set(entry["speed"][bucket_key(SPEC)]["reference"]) == {"seconds", "samples", "updated"}
    left = sorted(p.name for p in store.path.parent.iterdir())
    assert left == [".profile.json.lock", "profile.json"]  # the lock file, no temp left
    assert store.revision == 2


def test_corrupt_file_is_an_error_not_a_silent_reset(store):
    store.path.write_text("{not json")
    with pytest.raises(PolicyError, match="cannot be read"):
        store.speed(simulate("cpu"), SPEC, "x")
    store.path.write_text('{"schema": "other"}')
    with pytest.raises(PolicyError, match="not an attnhub profile store"):
        ProfileStore(store.path).speed(simulate("cpu"), SPEC, "x")


def _writer(path: str, worker: int, n: int, start) -> None:  # type: ignore[no-untyped-def]
    store = ProfileStore(path, packs="off")
    dev = simulate("sm90")
    start.wait()
    for i in range(n):
        store.record_speed(dev, SPEC, f"w{worker}_{i}", 1e-5 * (i + 1))


def test_concurrent_processes_and_threads_lose_no_record(store):
    """3 processes x 40 records plus 2 threads x 20, all at once: every record survives."""
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(3 + 1)
    procs = [ctx.Process(target=_writer, args=(str(store.path), w, 40, start))
             for w in range(3)]
    for p in procs:
        p.start()
    tstart = threading.Barrier(2)
    threads = [threading.Thread(target=_writer, args=(str(store.path), 10 + w, 20, tstart))
               for w in range(2)]
    start.wait()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got = ProfileStore(store.path).data()["devices"][device_key(simulate("sm90"))]
    names = set(got["speed"][bucket_key(SPEC)])
    want = {f"w{w}_{i}" for w in range(3) for i in range(40)} | {
        f"w{10 + w}_{i}" for w in range(2) for i in range(20)}
    assert names == want


@pytest.mark.parametrize("entry,where", [
    ({"seconds": "fast", "samples": 3}, "['fa3'].seconds"),
    ({"seconds": -1.0}, "['fa3'].seconds"),
    ({"samples": 3}, "missing 'seconds'"),
    ([1e-5], "['fa3']: expected a mapping"),
])
def test_wrong_entry_types_are_located_policy_errors(store, entry, where):
    dev = simulate("sm90")
    store.record_speed(dev, SPEC, "fa3", 1e-5)
    data = json.loads(store.path.read_text())
    data["devices"][device_key(dev)]["speed"][bucket_key(SPEC)]["fa3"] = entry
    store.path.write_text(json.dumps(data))
    with pytest.raises(PolicyError) as exc:
        ProfileStore(store.path).fastest(dev, SPEC, ["fa3"])
    msg = str(exc.value)
    assert where in msg and str(store.path) in msg and device_key(dev) in msg


def test_wrong_accuracy_and_share_types_are_located(store):
    dev = simulate("sm90")
    store.record_accuracy(dev, "*", "fa3_fp8", True, {"rel_error": 0.01})
    store.record_attention_share(dev, "m", 0.5)
    data = json.loads(store.path.read_text())
    entry = data["devices"][device_key(dev)]
    entry["accuracy"]["*"]["fa3_fp8"]["passed"] = "yes"
    entry["attention_share"]["m|*"]["share"] = 7
    store.path.write_text(json.dumps(data))
    with pytest.raises(PolicyError, match=r"\['fa3_fp8'\]\.passed.*true or false") as exc:
        ProfileStore(store.path).accuracy(dev, "*", "fa3_fp8")
    assert "['m|*'].share: expected a fraction" in str(exc.value)


# -- shipped packs ------------------------------------------------------------------------
def _pack(folder, dev, timings: dict[str, float], name: str = "gpu.json"):
    """A pack written the way `attnhub bench --regret --pack` writes one."""
    src = ProfileStore(folder / "src.json", packs="off")
    for b, sec in timings.items():
        src.record_speed(dev, SPEC, b, sec)
    data = src.data()
    data["pack"] = {"measured": "2026-12-01", "command": "attnhub bench --regret"}
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps(data))
    (folder / "src.json").unlink()


def test_ranking_store_then_matching_pack_then_list_order(tmp_path):
    dev = simulate("sm90")
    packs = tmp_path / "packs"
    _pack(packs, dev, {"b": 2e-5, "c": 1e-5})
    store = ProfileStore(tmp_path / "user.json", packs=packs)
    r = store.ranking(dev, SPEC, ["a", "b", "c"])
    assert (r.source, r.order) == ("pack", ["c", "b", "a"])
    assert "gpu.json" in r.note and "2026-12-01" in r.note and "unmeasured a" in r.note
    store.record_speed(dev, SPEC, "a", 3e-5)  # the user's own measurement wins
    r = store.ranking(dev, SPEC, ["a", "b", "c"])
    assert (r.source, r.order) == ("store", ["a", "b", "c"]) and str(store.path) in r.note
    other = SPEC.with_(batch=64)  # a bucket measured nowhere
    r = store.ranking(dev, other, ["b", "a"])
    assert (r.source, r.order) == ("list order", ["b", "a"])
    assert "gpu.json matches" in r.note


def test_stale_pack_is_ignored_with_the_versions_that_differ(tmp_path):
    dev = simulate("sm90")
    packs = tmp_path / "packs"
    _pack(packs, with_versions(dev, torch="0.1", triton="0.2"), {"b": 2e-5, "c": 1e-5})
    r = ProfileStore(tmp_path / "u.json", packs=packs).ranking(dev, SPEC, ["a", "b", "c"])
    assert (r.source, r.order) == ("list order", ["a", "b", "c"])
    assert "gpu.json is stale" in r.note and "torch 0.1 in the pack" in r.note
    assert "triton 0.2 in the pack" in r.note


def test_kernel_library_on_one_side_only_does_not_make_a_pack_stale(tmp_path):
    dev = with_versions(simulate("sm90"), **{"fa3-fwd": "0.0.3"})
    packs = tmp_path / "packs"
    _pack(packs, with_versions(dev, **{"flashinfer-python": "0.6.3"}), {"b": 1e-5})
    store = ProfileStore(tmp_path / "u.json", packs=packs)
    assert store.ranking(dev, SPEC, ["a", "b"]).source == "pack"
    _pack(packs, with_versions(dev, **{"fa3-fwd": "0.0.1"}), {"b": 1e-5})
    r = ProfileStore(tmp_path / "u.json", packs=packs).ranking(dev, SPEC, ["a", "b"])
    assert r.source == "list order" and "fa3-fwd 0.0.1 in the pack, 0.0.3 here" in r.note


def test_missing_or_switched_off_packs_say_so(tmp_path, monkeypatch):
    dev = simulate("sm90")
    packs = tmp_path / "packs"
    _pack(packs, simulate("sm80"), {"b": 2e-5})  # another device's pack
    r = ProfileStore(tmp_path / "u.json", packs=packs).ranking(dev, SPEC, ["a", "b"])
    assert r.source == "list order" and f"no shipped profile pack for {dev.name}" in r.note
    monkeypatch.setenv("ATTNHUB_PROFILE_PACKS", "off")
    r = ProfileStore(tmp_path / "u.json").ranking(dev, SPEC, ["a", "b"])
    assert r.source == "list order" and "switched off" in r.note


def test_shipped_packs_are_valid_stores_with_a_header():
    """Every pack in the package loads as a store and says when and how it was measured."""
    from attnhub.policy.profile import _load, packs_dir

    folder = packs_dir(None)
    for path in sorted(folder.glob("*.json")) if folder and folder.is_dir() else []:
        data = _load(path)
        assert {"measured", "command", "commit"} <= set(data["pack"])
        assert data["devices"], path


def test_explain_names_the_pack(tmp_path, full_registry):
    """Through the policy: a `fastest` rule follows the pack and the decision says so."""
    from attnhub.policy import load_policy

    dev = simulate("sm90")
    spec = SPEC.with_(layout="paged", page_size=16, dtype="bf16", kv_dtype="bf16",
                      head_dim=128, head_dim_v=128)
    packs = _write_pack(tmp_path, dev, spec, {"torch_sdpa": 1e-5, "triton_decode": 9e-5})
    policy = load_policy(None, profile=ProfileStore(tmp_path / "u.json", packs=packs))
    d = policy.resolve(spec, dev, full_registry)
    assert d.candidates[:2] == ("torch_sdpa", "triton_decode")
    assert any(n.startswith("fastest (pack)") and "h.json" in n for n in d.notes)


def test_near_ties_keep_list_order(store):
    """Times within 3% are run-to-run noise: the rule's order decides among them."""
    dev = simulate("sm90")
    store.record_speed(dev, SPEC, "b", 1.000e-3)
    store.record_speed(dev, SPEC, "a", 1.02e-3)   # tie with b: a is listed first
    store.record_speed(dev, SPEC, "c", 0.90e-3)   # clearly fastest
    store.record_speed(dev, SPEC, "d", 1.50e-3)
    r = store.ranking(dev, SPEC, ["a", "b", "c", "d", "e"])
    assert r.order == ["c", "a", "b", "d", "e"] and "ties within 3%" in r.note


def test_accuracy_gated_backend_leads_a_fastest_rule_over_a_pack(tmp_path, fake,
                                                                make_registry):
    """FP8 on Hopper stays opt-in by accuracy record: with the H200-style pack ranking the
    BF16 kernels, a passing record for fa3_fp8 still puts it first; without one it is
    rejected and the pack's fastest BF16 kernel serves."""
    from attnhub.policy import load_policy

    from .conftest import Capabilities

    cuda, sm90 = frozenset({"cuda"}), frozenset({"sm90"})
    reg = make_registry(
        fake("fa3_fp8", "vendor", Capabilities(vendors=cuda, archs=sm90, exact=False,
                                                error_budget=0.05)),
        *(fake(n, "vendor", Capabilities(vendors=cuda)) for n in ("fa3", "cudnn", "triton")))
    dev = simulate("sm90")
    spec = AttentionSpec(phase="prefill", dtype="bf16", kv_dtype="bf16", num_q_heads=8,
                         num_kv_heads=2, head_dim=64, head_dim_v=64, max_seqlen_q=4096,
                         max_seqlen_k=4096, mask=MaskSpec(causal=True))
    packs = _write_pack(tmp_path, dev, spec, {"torch_sdpa": 1.2e-4, "fa3": 3.2e-4})
    store = ProfileStore(tmp_path / "u.json", packs=packs)
    policy = load_policy(None, profile=store)
    d = policy.resolve(spec, dev, reg)
    assert d.rule == "fp8-hopper-prefill" and d.backend == "torch_sdpa", d.explain()
    assert d.candidates[:2] == ("torch_sdpa", "fa3")
    store.record_accuracy(dev, spec, "fa3_fp8", True, {"rel_error": 0.004})
    policy.profile = store
    d = policy.resolve(spec, dev, reg)
    assert d.backend == "fa3_fp8" and any("opted in" in n for n in d.notes), d.explain()
    assert d.fallbacks[:1] == ("torch_sdpa",)


def _write_pack(tmp_path, dev, spec, seconds: dict[str, float]):
    """A shipped-pack folder holding one pack (h.json) with these per-backend times."""
    src = ProfileStore(tmp_path / "src.json", packs="off")
    for name, t in seconds.items():
        src.record_speed(dev, spec, name, t)
    data = src.data()
    data["pack"] = {"measured": "2026-12-01", "command": "x", "commit": "y"}
    packs = tmp_path / "packs"
    packs.mkdir()
    (packs / "h.json").write_text(json.dumps(data))
    return packs
