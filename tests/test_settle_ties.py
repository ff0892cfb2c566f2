"""Near-ties of a shipped pack are timed on the first call of a bucket and the fastest bound:
a pack measured on another machine cannot rank candidates it puts within its tie margin."""

from __future__ import annotations

import json
import types
from typing import Any

import pytest
import torch

import attnhub
from attnhub.core.builtin import ReferenceBackend
from attnhub.core.registry import Registry
from attnhub.hookspecs import hookimpl
from attnhub.policy import ProfileStore, load_policy

POLICY = """
name: ties
version: 1
rules:
  - name: tied
    use: {fastest: [tie_slow, tie_fast]}
"""


class _Counted(ReferenceBackend):
    """The reference kernel, counting its calls, each costing ``cost`` seconds on the
    test's virtual clock (a wall clock on a loaded CI core once timed the fast one's tiny
    call past the slow one's 10 ms sleep)."""

    tier = "portable"
    cost = 0.0

    def __init__(self, clock: Any) -> None:
        super().__init__()
        self.calls = 0
        self.clock = clock

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        self.calls += 1
        self.clock.advance(self.cost)
        return super().forward(q, k, v, spec, params)


class TieSlow(_Counted):
    name = "tie_slow"
    cost = 1.0e-3


class TieFast(_Counted):
    name = "tie_fast"
    cost = 0.9e-3  # 10% faster: the pack (1% apart, the other way) cannot rank them


@pytest.fixture
def registry(virtual_clock: Any) -> Registry:
    slow, fast = TieSlow(virtual_clock), TieFast(virtual_clock)

    @hookimpl
    def attnhub_register_backends(register):  # type: ignore[no-untyped-def]
        register(slow)
        register(fast)

    reg = Registry.load()
    reg.add_plugin(types.SimpleNamespace(attnhub_register_backends=attnhub_register_backends),
                   "tie_plugin")
    return reg


def _qkv(sq: int = 5, sk: int = 40, grad: bool = False):
    q, k, v = (torch.randn(1, n, 2, 16, requires_grad=grad) for n in (sq, sk, sk))
    return q, k, v


def _hub(tmp_path, registry, pack: dict[str, float] | None, **kw) -> attnhub.Hub:
    """A hub whose shipped pack (a folder with one file) holds ``pack`` for the inference
    and the training bucket of ``_qkv``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "p.yaml").write_text(POLICY)
    folder = tmp_path / "packs"
    folder.mkdir()
    hub = attnhub.Hub(load_policy(tmp_path / "p.yaml"), hardware="cpu", registry=registry,
                      **kw)
    src = ProfileStore(tmp_path / "src.json", packs="off")
    for grad in (False, True):
        for name, sec in (pack or {}).items():
            src.record_speed(hub.device, _spec(tmp_path, registry, grad), name, sec)
    data = src.data()
    data["pack"] = {"measured": "2026-12-02", "command": "test"}
    (folder / "pack.json").write_text(json.dumps(data))
    hub.resolver.profile = ProfileStore(tmp_path / "user.json", packs=folder)
    registry.get("tie_slow").calls = registry.get("tie_fast").calls = 0
    return hub


def _spec(tmp_path, registry, grad: bool = False):
    """The bucketed spec a call of ``_qkv`` binds for."""
    probe = attnhub.Hub(load_policy(tmp_path / "p.yaml"), hardware="cpu", registry=registry,
                        settle_ties=False)
    probe.resolver.profile = ProfileStore(tmp_path / "none.json", packs="off")
    probe.attention(*_qkv(grad=grad))
    return probe.bound()[-1].decision.spec


def test_a_near_tie_is_timed_once_and_the_fastest_bound(tmp_path, registry):
    hub = _hub(tmp_path, registry, {"tie_slow": 1.00e-4, "tie_fast": 1.01e-4})
    q, k, v = _qkv()
    out = hub.attention(q, k, v)
    d = hub.bound()[-1].decision
    assert d.backend == "tie_fast" and d.fallbacks == ("tie_slow",) and d.tied == ()
    assert d.notes[0].startswith("fastest (timed at bind time): tie_fast")
    assert "the pack had tie_slow, tie_fast within its tie margin" in d.notes[0]
    assert any("near-tie in the pack: tie_slow, tie_fast" in n for n in d.notes)
    assert hub.decide(d.spec) is d  # explain reports the settled binding
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    slow = registry.get("tie_slow").calls
    assert slow >= 3  # warm-up and samples
    q2, k2, v2 = _qkv(sq=6, sk=41)  # same bucket, new shape: no second timing
    hub.attention(q2, k2, v2)
    assert registry.get("tie_slow").calls == slow
    assert hub.bound()[-1].decision.backend == "tie_fast"


def test_a_pack_lead_inside_the_settle_margin_is_timed_again(tmp_path, registry):
    """A 6% lead in the pack ranks (outside the 3% list-order tie) but is timed here: one
    run on one host cannot tell 6% apart (fa3 vs torch_sdpa on the H200); nor 20% for a
    call short enough to be bound by host work."""
    for n, pack in enumerate(({"tie_slow": 1.00e-3, "tie_fast": 1.06e-3},  # a 1 ms call
                              {"tie_slow": 1.00e-4, "tie_fast": 1.20e-4})):  # a short one
        hub = _hub(tmp_path / str(n), registry, pack)
        hub.attention(*_qkv())
        d = hub.bound()[-1].decision
        assert d.backend == "tie_fast" and registry.get("tie_slow").calls >= 3


def test_no_timing_when_off_apart_or_measured_here(tmp_path, registry):
    q, k, v = _qkv()
    hub = _hub(tmp_path, registry, {"tie_slow": 1.00e-4, "tie_fast": 1.01e-4},
               settle_ties=False)
    hub.attention(q, k, v)
    d = hub.bound()[-1].decision
    assert d.backend == "tie_slow" and d.tied == ("tie_slow", "tie_fast")
    assert registry.get("tie_fast").calls == 0

    # apart: 40% for a short call, 20% for a 1 ms one (past the 10% margin of longer calls)
    for n, pack in enumerate(({"tie_slow": 1.0e-4, "tie_fast": 1.4e-4},
                              {"tie_slow": 1.0e-3, "tie_fast": 1.2e-3})):
        hub = _hub(tmp_path / f"apart{n}", registry, pack)
        hub.attention(q, k, v)
        d = hub.bound()[-1].decision
        assert d.backend == "tie_slow" and d.tied == () and registry.get("tie_fast").calls == 0

    hub = _hub(tmp_path / "store", registry, {"tie_slow": 1.00e-4, "tie_fast": 1.01e-4})
    # the user's own measurement outranks the pack: nothing to settle
    spec = _spec(tmp_path / "store", registry)
    hub.resolver.profile.record_speed(hub.device, spec, "tie_slow", 1e-4)
    registry.get("tie_fast").calls = 0
    hub.attention(q, k, v)
    d = hub.bound()[-1].decision
    assert d.backend == "tie_slow" and d.tied == () and registry.get("tie_fast").calls == 0


def test_training_calls_keep_the_pack_order_and_say_why(tmp_path, registry):
    hub = _hub(tmp_path, registry, {"tie_slow": 1.00e-4, "tie_fast": 1.01e-4})
    q, k, v = _qkv(grad=True)
    hub.attention(q, k, v).sum().backward()
    d = hub.bound()[-1].decision
    assert d.backend == "tie_slow" and registry.get("tie_fast").calls == 0
    assert any(n.startswith("near-tie not timed: a training call") for n in d.notes)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_a_tied_candidate_that_raises_is_left_out(tmp_path, registry, monkeypatch):
    hub = _hub(tmp_path, registry, {"tie_slow": 1.00e-4, "tie_fast": 1.01e-4})

    def boom(*a, **kw):  # type: ignore[no-untyped-def]
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(registry.get("tie_fast"), "forward", boom)
    q, k, v = _qkv()
    hub.attention(q, k, v)
    d = hub.bound()[-1].decision
    assert d.backend == "tie_slow"
    assert "left out: tie_fast raised RuntimeError: no kernel for this shape" in d.notes[0]


def test_setting_the_registry_drops_settled_ties(tmp_path, registry):
    hub = _hub(tmp_path, registry, {"tie_slow": 1.00e-4, "tie_fast": 1.01e-4})
    q, k, v = _qkv()
    hub.attention(q, k, v)
    assert hub._settled
    hub.registry = registry
    assert not hub._settled and not hub.bound()
