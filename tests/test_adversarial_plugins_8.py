"""Broken plugins, eighth round: a backend's changes to torch's settings while another
Python thread merely exists (a Jupyter kernel always runs a few) stayed for the whole host,
unblamed; only the switches torch itself sets for a block are another thread's to hold."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import attnhub
from attnhub.core.registry import Registry
from attnhub.plugin import AttentionOutput, Backend, Capabilities

CPU32 = Capabilities(vendors=frozenset({"cpu"}), dtypes=frozenset({"fp32"}), gqa=True)


class _Sets(Backend):
    """Sets the default dtype and the matmul precision in ``where`` (check or forward)."""

    name, plugin = "sets8", "adv8"
    capabilities = CPU32
    where = "check"

    def _stray(self, where: str) -> None:
        if self.where == where:
            torch.set_default_dtype(torch.float64)
            torch.set_float32_matmul_precision("medium")

    def extra_checks(self, spec, device):  # type: ignore[no-untyped-def, override]
        self._stray("check")
        return []

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        self._stray("forward")
        return AttentionOutput(torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2))


@pytest.fixture
def idle_thread() -> Iterator[None]:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True, name="host-idle")
    t.start()
    yield
    stop.set()
    t.join(5)


@pytest.mark.usefixtures("idle_thread")
@pytest.mark.parametrize("where", ["check", "forward"])
def test_settings_a_backend_changes_are_put_back_while_other_threads_live(
        where: str, tmp_path: Path) -> None:
    b = _Sets()
    b.where = where
    policy = tmp_path / "p.yaml"
    policy.write_text("name: t\nrules:\n  - {name: only, use: [sets8, torch_sdpa]}\n")
    hub = attnhub.Hub(policy=policy, hardware="cpu", registry=Registry.of(b, plugin="adv8"))
    precision = torch.get_float32_matmul_precision()
    try:
        q = torch.randn(1, 8, 4, 8)
        out = hub.attention(q, q, q)
        assert torch.get_default_dtype() == torch.float32
        assert torch.get_float32_matmul_precision() == precision
        assert out.dtype == torch.float32
        if where == "check":
            spec = attnhub.AttentionSpec(phase="prefill", dtype="fp32", num_q_heads=4,
                                         num_kv_heads=4, head_dim=8, max_seqlen_q=8,
                                         max_seqlen_k=8)
            assert "sets8" not in hub.decide(spec).backend
        else:
            assert sum(hub.fallback_counts.values()) > 0  # blamed, torch_sdpa served
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_float32_matmul_precision(precision)
