"""Lockfiles: bindings frozen with versions; drift found when resolution changes."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from attnhub.cli import main
from attnhub.core.capabilities import Capabilities
from attnhub.core.decision import BindContext
from attnhub.core.device import simulate
from attnhub.core.spec import AttentionSpec, MaskSpec
from attnhub.policy import load_policy
from attnhub.policy.lock import (EXIT_BAD_LOCK, LockfileError, build_lock, check_lock,
                                 read_lock, spec_from_json, spec_to_json, write_lock)

POLICY = """
    name: locked
    rules:
      - {name: decode, when: {phase: decode}, use: [newkernel, torch_sdpa]}
      - {name: rest, use: [torch_sdpa, reference]}
    """


def _pairs(policy, registry):
    dev = simulate("sm90")
    specs = [AttentionSpec(phase=p, mask=MaskSpec(causal=True), max_seqlen_q=1 if p == "decode"
                           else 2048, max_seqlen_k=2048).bucketed()
             for p in ("prefill", "decode")]
    return [(dev, policy.resolve(s, dev, registry, BindContext(model="m"))) for s in specs]


def test_spec_round_trip():
    spec = AttentionSpec(phase="decode", dtype="fp16", kv_dtype="bf16", layout="paged",
                         mask=MaskSpec(causal=True, window=(128, 0), softcap=True),
                         max_seqlen_q=4, max_seqlen_k=999).bucketed()
    assert spec_from_json(json.loads(json.dumps(spec_to_json(spec)))) == spec


def test_drift_after_a_backend_appears(write, tmp_path, make_registry, fake):
    policy = load_policy(write("p.yaml", POLICY))
    before = make_registry()
    lock_path = tmp_path / "attnhub.lock"
    write_lock(lock_path, build_lock(policy, before, _pairs(policy, before)))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left
    lock = read_lock(lock_path)
    assert [b["backend"] for b in lock["bindings"]] == ["torch_sdpa", "torch_sdpa"]
    assert check_lock(lock, policy, before).drifted is False

    # "a library upgrade": a new plugin now serves decode, so the decode binding changes
    after = make_registry(fake("newkernel", "serving", Capabilities(
        phases=frozenset({"decode"}), masks=frozenset({"causal"}))))
    drift = check_lock(lock, policy, after)
    assert drift.drifted and len(drift.changed) == 1
    assert "decode" in drift.changed[0] and "[model=m]" in drift.changed[0]
    assert "backend 'torch_sdpa' -> 'newkernel'" in drift.changed[0]
    assert "fallbacks [] -> ['torch_sdpa']" in drift.changed[0]


def test_version_and_policy_changes_are_reported(write, tmp_path, make_registry):
    path = write("p.yaml", POLICY)
    policy, reg = load_policy(path), make_registry()
    lock = build_lock(policy, reg, _pairs(policy, reg))
    drift = check_lock(lock, policy, reg, versions={**lock["versions"], "torch": "9.9"})
    assert not drift.drifted and any("torch" in v and "9.9" in v for v in drift.versions)
    path.write_text(path.read_text().replace("[torch_sdpa, reference]", "[reference]"))
    drift = check_lock(lock, load_policy(path), reg)
    assert drift.policy and len(drift.changed) == 1 and "'rest'" not in drift.changed[0]
    assert "backend 'torch_sdpa' -> 'reference'" in drift.changed[0]


def test_cli_lock_and_check_exit_codes(write, tmp_path, capsys):
    path = write("p.yaml", POLICY)
    out = tmp_path / "a.lock"
    assert main(["lock", "--policy", str(path), "--hardware", "cpu", "-o", str(out)]) == 0
    assert main(["lock", "--check", str(out)]) == 0
    assert "unchanged" in capsys.readouterr().out
    path.write_text(path.read_text().replace("[torch_sdpa, reference]", "[reference]"))
    assert main(["lock", "--check", str(out), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["drifted"] and report["changed"] and report["policy"]
    assert main(["lock", "--check", str(out)]) == 1  # the text report names both fixes
    text = capsys.readouterr().out
    assert "DRIFT" in text and f"attnhub lock -o {out}" in text and "restore the policy" in text
    bad = tmp_path / "bad.lock"
    bad.write_text("{}")
    assert main(["lock", "--check", str(bad)]) == EXIT_BAD_LOCK
    assert "bad.lock:1:1 schema: got None, expected 'attnhub.lock/2'" in capsys.readouterr().err


@pytest.mark.parametrize("edit, where, what", [
    (lambda d: d["bindings"][1]["spec"].__setitem__("head_dim", "128"),
     "bindings[1].spec.head_dim", "got '128', expected a valid integer"),
    (lambda d: d["bindings"][0].pop("rule"), "bindings[0].rule", "required key is missing"),
    (lambda d: d["bindings"][0]["context"].__setitem__("world_size", 0),
     "bindings[0].context.world_size", "greater than or equal to 1"),
    (lambda d: d["bindings"][0]["context"].__setitem__("layer", -1),
     "bindings[0].context.layer", "greater than or equal to 0"),
    (lambda d: d.pop("providers"), "providers", "required key is missing"),
    (lambda d: d["bindings"][0].__setitem__("fallbacks", "reference"),
     "bindings[0].fallbacks", "expected a valid list"),
    (lambda d: d["bindings"][1]["spec"].__setitem__("phase", "serve"),
     "bindings[1].spec.phase", "expected 'train', 'prefill' or 'decode'"),
])
def test_hand_edited_lock_is_a_located_error_not_drift(write, tmp_path, capsys, edit, where,
                                                        what):
    out = tmp_path / "a.lock"
    assert main(["lock", "--policy", str(write("p.yaml", POLICY)), "--hardware", "cpu",
                 "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    edit(doc)
    out.write_text(json.dumps(doc, indent=1))
    assert main(["lock", "--check", str(out)]) == EXIT_BAD_LOCK
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if where in x)
    assert what in line and "attnhub lock -o" in line, err
    assert re.search(rf"a\.lock:\d+:\d+ {re.escape(where)}:", line), line
    with pytest.raises(LockfileError):
        read_lock(out)


def test_broken_json_lock_is_located(tmp_path, capsys):
    bad = tmp_path / "x.lock"
    bad.write_text('{"schema": "attnhub.lock/2",\n  "bindings": [,]}')
    assert main(["lock", "--check", str(bad)]) == EXIT_BAD_LOCK
    assert "x.lock:2:16 (json)" in capsys.readouterr().err
    bad.write_bytes(b"\xff\xfe{}")
    assert main(["lock", "--check", str(bad)]) == EXIT_BAD_LOCK
    assert "not UTF-8" in capsys.readouterr().err


def test_provider_change_is_drift(write, tmp_path, make_registry, fake):
    """The same backend name served by another plugin (a name takeover) is drift."""
    policy = load_policy(write("p.yaml", POLICY.replace("[torch_sdpa, reference]",
                                                        "[mykernel, reference]")))
    caps = Capabilities(masks=frozenset({"causal"}), phases=frozenset({"prefill", "decode"}))
    before = make_registry(fake("mykernel", "portable", caps))
    lock = build_lock(policy, before, _pairs(policy, before))
    assert lock["providers"]["mykernel"]["plugin"] == before.get("mykernel").plugin
    assert check_lock(lock, policy, before).drifted is False
    after = make_registry(fake("mykernel", "portable", caps), base=make_registry())
    after.plugins[after.get("mykernel").plugin].distribution = "evil-kernels"
    drift = check_lock(lock, policy, after)
    assert drift.drifted
    assert any("backend mykernel: provider" in c and "evil-kernels" in c for c in drift.changed)


def test_bind_context_hash_survives_another_process() -> None:
    """BindContext caches its hash (it is in every exact-shape key); a pickled context is
    rebuilt in the loading process, whose string hashes differ (PYTHONHASHSEED), so equal
    contexts still hash equal there."""
    import os
    import pickle
    import subprocess
    import sys

    ctx = BindContext(model="llama", layer=3, layer_kind="sliding")
    code = ("import pickle, sys; from attnhub.core.decision import BindContext as B; "
            "c = pickle.loads(sys.stdin.buffer.read()); "
            "print(hash(c) == hash(B(model='llama', layer=3, layer_kind='sliding')) "
            "and c == B(model='llama', layer=3, layer_kind='sliding'))")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(ctx),
                         capture_output=True, timeout=120, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == b"True", out.stderr


@dataclasses.dataclass(frozen=True)
class _TaggedContext(BindContext):
    """A caller's subclass with a field of its own."""

    tag: str = "x"


def test_bind_context_subclass_pickles_as_itself() -> None:
    import pickle

    ctx = _TaggedContext(model="m", layer=1, tag="draft")
    back = pickle.loads(pickle.dumps(ctx))
    assert type(back) is _TaggedContext and back == ctx and back.tag == "draft"
    assert hash(back) == hash(ctx)
