"""Broken and hostile plugins, seventh round: state a backend changes while it only answers
(``check``, ``available``, ``capabilities``), frozen arguments it edits there (the host's
cached ``DeviceInfo`` is shared by every later decision), numerics switches that were not
watched, and an interval timer armed at import (``signal.alarm`` killed the host later)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

import attnhub
import attnhub.core.process_state as process_state
from attnhub.core.registry import Registry
from attnhub.plugin import AttentionOutput, Backend, Capabilities

CPU32 = Capabilities(vendors=frozenset({"cpu"}), dtypes=frozenset({"fp32"}), gqa=True)


class _Answers(Backend):
    """Declines every call; ``side`` is what its check does besides answering."""

    name, plugin = "answers7", "adv7"
    capabilities = CPU32
    side = staticmethod(lambda spec, device: None)

    def extra_checks(self, spec, device):  # type: ignore[no-untyped-def, override]
        self.side(spec, device)
        return []

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        return AttentionOutput(torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2))


def _hub(side, tmp_path: Path) -> attnhub.Hub:  # type: ignore[no-untyped-def]
    b = _Answers()
    b.side = side
    policy = tmp_path / "p.yaml"
    policy.write_text("name: t\nrules:\n  - {name: only, use: [answers7, torch_sdpa]}\n")
    return attnhub.Hub(policy=policy, hardware="cpu", registry=Registry.of(b, plugin="adv7"))


def _dtype(spec, device):  # type: ignore[no-untyped-def]
    torch.set_default_dtype(torch.float64)


def _precision(spec, device):  # type: ignore[no-untyped-def]
    torch.set_float32_matmul_precision("medium")


def _edits(spec, device):  # type: ignore[no-untyped-def]
    object.__setattr__(spec, "num_kv_heads", spec.num_q_heads)
    object.__setattr__(device, "name", "NVIDIA H100")


@pytest.mark.parametrize("side", [_dtype, _precision, _edits])
def test_a_check_that_changes_state_is_undone_and_rejects_its_backend(side, tmp_path: Path  # type: ignore[no-untyped-def]
                                                                      ) -> None:
    hub = _hub(side, tmp_path)
    spec = attnhub.AttentionSpec(phase="prefill", dtype="fp32", num_q_heads=4, num_kv_heads=2,
                                 head_dim=8, max_seqlen_q=8, max_seqlen_k=8)
    name = hub.device.name
    d = hub.decide(spec)
    assert d.backend == "torch_sdpa"
    assert "answers7" in d.explain() and "put back" in d.explain()
    assert torch.get_default_dtype() == torch.float32
    assert torch.get_float32_matmul_precision() == "highest"
    assert (spec.num_kv_heads, hub.device.name) == (2, name)


@pytest.mark.parametrize("switch", ["torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
                                    "torch.backends.mkldnn.enabled"])
def test_numerics_switches_are_watched(switch: str) -> None:
    owner, attr = switch.rsplit(".", 1)
    obj = eval(owner, {"torch": torch})  # noqa: S307 - a fixed name of this test
    before = process_state.snapshot()
    was = getattr(obj, attr)
    setattr(obj, attr, not was)
    try:
        changed = process_state.restore(before)
    finally:
        setattr(obj, attr, was)
    assert any(switch in c for c in changed), changed
    assert getattr(obj, attr) == was


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no interval timers here")
def test_an_interval_timer_armed_by_a_plugin_is_disarmed() -> None:
    before = process_state.snapshot()
    signal.setitimer(signal.ITIMER_REAL, 3600)
    try:
        changed = process_state.restore(before)
    finally:
        armed = signal.getitimer(signal.ITIMER_REAL)[0] > 0
        signal.setitimer(signal.ITIMER_REAL, 0)
    assert any("REAL interval timer" in c for c in changed), changed
    assert not armed


def test_another_threads_settings_are_neither_blamed_nor_undone(tmp_path: Path) -> None:
    """Another thread toggling a process-wide switch (``mkldnn.flags``) while this one
    resolved got a backend blamed and the switch left changed (self-review of the fix)."""
    import threading

    stop = threading.Event()

    def toggle() -> None:
        while not stop.is_set():
            with torch.backends.mkldnn.flags(enabled=False):
                pass

    t = threading.Thread(target=toggle, daemon=True)
    t.start()
    try:
        hub = attnhub.Hub(hardware="cpu")
        for n in range(64):
            spec = attnhub.AttentionSpec(phase="prefill", dtype="fp32", num_q_heads=4,
                                         num_kv_heads=2, head_dim=8, max_seqlen_q=2 ** (n % 12),
                                         max_seqlen_k=2 ** (n % 12), batch=1 + n // 12)
            assert "changed" not in hub.decide(spec).explain()
    finally:
        stop.set()
        t.join(5)
    assert torch.backends.mkldnn.enabled


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no interval timers here")
def test_a_host_timer_that_runs_out_is_not_a_plugins_doing() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    old = signal.signal(signal.SIGALRM, lambda *a: None)
    try:
        before = process_state.snapshot()
        import time
        time.sleep(0.1)  # the host's own timer runs out meanwhile
        assert not any("interval timer" in c for c in process_state.restore(before))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
