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


class _NoStr(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("no text")


@pytest.mark.parametrize("exc", [SystemExit(1), GeneratorExit(), _NoStr()],
                         ids=["SystemExit", "GeneratorExit", "str-raises"])
def test_a_candidate_raising_anything_while_timed_keeps_the_pack_order(
        tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        exc: BaseException) -> None:
    """Its first call worked; a later one, inside the timing loop, raised: SystemExit ended
    the process (a kernel library's exit() is the backend's failure, docs/plugins.md)."""
    hub = _hub(tmp_path, registry, PACK)
    fast = registry.get("tie_fast")
    real = type(fast).forward

    def later_call_fails(self, *a, **kw):  # type: ignore[no-untyped-def]
        if self.calls >= 1:
            raise exc
        return real(self, *a, **kw)

    monkeypatch.setattr(type(fast), "forward", later_call_fails)
    q, k, v = _qkv()
    out = hub.attention(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    d = hub.bound()[-1].decision
    assert d.backend == "tie_slow" and d.tied == ()
    assert any(f"a candidate raised {type(exc).__name__} while timed" in n for n in d.notes)


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
