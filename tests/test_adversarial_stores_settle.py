"""Settling a pack's near-tie times candidates on the call's own tensors: never on a call that
updates per-sequence state (each timed forward would advance it again), and a candidate
failing while timed falls back to the pack's order instead of failing the user's call."""

from __future__ import annotations

import pytest
import torch

from attnhub.core.registry import Registry
from attnhub.core.seqstate import STATE_KEY
from tests.test_settle_ties import _hub, _qkv, registry  # noqa: F401 (fixture)

PACK = {"tie_slow": 1.00e-4, "tie_fast": 1.01e-4}


def test_a_stateful_call_is_run_once_not_timed(tmp_path, registry: Registry) -> None:  # noqa: F811
    """Every timed forward of a stateful backend advances the sequences' recurrent state:
    settling ran each candidate 3+ times on the first decode step."""
    hub = _hub(tmp_path, registry, PACK)
    q, k, v = _qkv()
    hub.attention(q, k, v, extra={STATE_KEY: object(), "seq_ids": (0,), "layer": 0})
    d = hub.bound()[-1].decision
    calls = registry.get("tie_slow").calls + registry.get("tie_fast").calls
    assert calls == 1, calls
    assert d.backend == "tie_slow"
    assert any("near-tie not timed: a call that updates per-sequence state" in n
               for n in d.notes)


class _NoStr(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("no text")


@pytest.mark.parametrize("exc", [RuntimeError("injected: out of workspace"), SystemExit(1),
                                 GeneratorExit(), _NoStr()],
                         ids=["RuntimeError", "SystemExit", "GeneratorExit", "str-raises"])
def test_a_candidate_failing_while_timed_keeps_the_pack_order(
        tmp_path, registry: Registry, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        exc: BaseException) -> None:
    """Its first call worked, a later one raised inside the timing loop: the user's
    attention call raised (SystemExit ended the process: a kernel library's exit() is the
    backend's failure, docs/plugins.md), though the pack's own choice serves it."""
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
    assert any(f"near-tie not timed: a candidate raised {type(exc).__name__}" in n
               for n in d.notes), d.notes
