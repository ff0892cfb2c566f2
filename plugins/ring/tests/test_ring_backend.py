"""The ring backend's questions and errors, in one process (no process group)."""

from __future__ import annotations

import pytest
import torch
from attnhub_ring import RingBackend, RingError, process_group_reasons, ring_attention

import attnhub
from attnhub.plugin import AttentionSpec, AttnParams, MaskSpec

TRAIN = AttentionSpec(phase="train", dtype="bf16", head_dim=128, num_q_heads=32,
                      num_kv_heads=8, mask=MaskSpec(causal=True), max_seqlen_q=8192,
                      max_seqlen_k=8192, needs_grad=True)


def test_the_plugin_registers_a_distributed_ring_backend() -> None:
    ring = attnhub.Hub(hardware="cpu").registry.get("ring")
    assert isinstance(ring, RingBackend) and ring.tier == "distributed"


def test_without_a_process_group_the_reasons_say_how_to_get_one() -> None:
    if torch.distributed.is_initialized():  # another test in this worker made a group
        pytest.skip("a process group exists in this process")
    this_cpu = attnhub.DeviceInfo(vendor="cpu", arch="cpu")  # a real (not simulated) device
    reasons = RingBackend().check(TRAIN, this_cpu)
    assert reasons == process_group_reasons()
    assert len(reasons) == 1 and "init_process_group" in reasons[0] and "torchrun" in reasons[0]


def test_offline_planning_checks_only_the_spec() -> None:
    """A simulated device has no process group to ask; the policy's world_size decides."""
    assert RingBackend().check(TRAIN, attnhub.simulate("sm90")) == []


@pytest.mark.parametrize(("change", "words"), [
    ({"mask": MaskSpec(causal=True, window=(128, 0))}, "sliding_window"),
    ({"mask": MaskSpec(alibi=True)}, "alibi"),
    ({"phase": "decode", "needs_grad": False}, "phase decode"),
    ({"layout": "paged"}, "layout paged"),
    ({"max_seqlen_q": 4096}, "self-attention"),
])
def test_what_the_ring_cannot_shard_is_rejected_with_a_reason(change: dict, words: str) -> None:
    reasons = RingBackend().check(TRAIN.with_(**change), attnhub.simulate("sm90"))
    assert any(words in r for r in reasons), reasons


def _shard() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(1, 6, 2, 8)
    return q, torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)


def test_a_ring_without_a_local_backend_says_how_to_bind_one() -> None:
    spec = TRAIN.with_(dtype="fp32", head_dim=8, num_q_heads=2, num_kv_heads=2)
    with pytest.raises(RingError, match="policy") as err:
        RingBackend().forward(*_shard(), spec, AttnParams(scale=0.3, causal=True))
    assert "local_backend=" in str(err.value)


def test_a_local_backend_that_cannot_run_the_blocks_is_refused_before_any_communication(
) -> None:
    with pytest.raises(RingError, match="torch_sdpa.*softcap"):
        ring_attention(*_shard(), local_backend="torch_sdpa", causal=True, softcap=5.0)
    with pytest.raises(RingError, match="itself distributed"):
        ring_attention(*_shard(), local_backend="ring")


def test_a_ring_call_without_a_process_group_names_the_launcher() -> None:
    with pytest.raises(RingError, match="init_process_group"):
        ring_attention(*_shard(), local_backend="torch_sdpa", causal=True)
