"""Stores, ninth round: a profile store of another schema version was "not an attnhub
profile store ... move it away"; settling a shipped pack's near-tie let a candidate's
``SystemExit`` on a timed call end the host, and an exception whose ``str()`` raises fail
the user's call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnhub.core.device import simulate
from attnhub.core.registry import Registry
from attnhub.core.spec import AttentionSpec
from attnhub.errors import PolicyError
from attnhub.policy.profile import ProfileStore
from tests.test_adversarial_stores_settle import _NoStr
from tests.test_settle_ties import _hub, _qkv, registry  # noqa: F401 (fixture)

SPEC = AttentionSpec(phase="decode", dtype="bf16", num_q_heads=8, num_kv_heads=2,
                     max_seqlen_k=1024)
PACK = {"tie_slow": 1.00e-4, "tie_fast": 1.01e-4}


@pytest.mark.parametrize("write", [False, True])
def test_a_store_of_another_schema_version_says_so_and_is_kept(tmp_path: Path,
                                                              write: bool) -> None:
    path = tmp_path / "profile.json"
    text = json.dumps({"schema": "attnhub.profile/2", "devices": {}, "new": [1]})
    path.write_text(text)
    store = ProfileStore(path)
    with pytest.raises(PolicyError) as exc:
        if write:
            store.record_speed(simulate("cpu"), SPEC, "torch_sdpa", 1e-5)
        else:
            store.speed(simulate("cpu"), SPEC, "torch_sdpa")
    (line,) = exc.value.problems
    assert str(path) in line and "another attnhub version" in line, line
    assert "'attnhub.profile/2'" in line and "move it away" not in line, line
    assert path.read_text() == text


def test_a_first_call_error_whose_str_raises_is_a_note(
        tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The note's ``str(failure)`` raised ValueError out of the user's attention call."""
    hub = _hub(tmp_path, registry, PACK)

    def fails(self, *a, **kw):  # type: ignore[no-untyped-def]
        raise _NoStr()

    monkeypatch.setattr(type(registry.get("tie_fast")), "forward", fails)
    q, k, v = _qkv()
    hub.attention(q, k, v)
    d = hub.bound()[-1].decision
    assert d.backend == "tie_slow"
    assert any("tie_fast raised _NoStr: <_NoStr: str() raised ValueError>" in n
               for n in d.notes), d.notes
