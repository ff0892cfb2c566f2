"""The profile store: keys, lookups, atomic writes, merging of concurrent writers."""

from __future__ import annotations

import json

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
    assert [p.name for p in store.path.parent.iterdir()] == ["profile.json"]  # no temp left
    assert store.revision == 2


def test_corrupt_file_is_an_error_not_a_silent_reset(store):
    store.path.write_text("{not json")
    with pytest.raises(PolicyError, match="cannot be read"):
        store.speed(simulate("cpu"), SPEC, "x")
    store.path.write_text('{"schema": "other"}')
    with pytest.raises(PolicyError, match="not an attnhub profile store"):
        ProfileStore(store.path).speed(simulate("cpu"), SPEC, "x")
