"""The paper model of docs/ring-attention.md: its thresholds are where the wire hides."""

from __future__ import annotations

import math

import pytest
from attnhub_ring.cost import (
    INFINIBAND,
    LLAMA3_8B,
    LLAMA3_70B,
    NVLINK,
    Shape,
    hop,
    min_tokens_per_gpu,
)


@pytest.mark.parametrize("shape", [LLAMA3_8B, LLAMA3_70B, Shape("mha", 16, 16, 64, 24)])
@pytest.mark.parametrize("bandwidth", [NVLINK, INFINIBAND])
@pytest.mark.parametrize("causal", [True, False])
def test_the_threshold_is_where_communication_starts_to_hide(shape: Shape, bandwidth: float,
                                                             causal: bool) -> None:
    fwd = min_tokens_per_gpu(shape, bandwidth, causal)
    bwd = min_tokens_per_gpu(shape, bandwidth, causal, backward=True)
    assert hop(shape, math.ceil(fwd * 1.01), bandwidth, causal).fwd_hidden
    assert not hop(shape, math.floor(fwd * 0.99), bandwidth, causal).fwd_hidden
    assert hop(shape, math.ceil(bwd * 1.01), bandwidth, causal).bwd_hidden
    assert not hop(shape, math.floor(bwd * 0.99), bandwidth, causal).bwd_hidden


def test_the_8b_and_70b_figures_of_the_doc() -> None:
    """KV per hop is 4 KiB per token per layer for both (8 KV heads x 128); 70B has twice
    the query heads, so it hides with half the tokens."""
    assert LLAMA3_8B.kv_bytes_per_token() == LLAMA3_70B.kv_bytes_per_token() == 4096
    assert min_tokens_per_gpu(LLAMA3_8B, NVLINK) == pytest.approx(2000 / 3)
    assert min_tokens_per_gpu(LLAMA3_70B, INFINIBAND) == pytest.approx(3000)


def test_the_prediction_is_perfect_scaling_without_wire_or_overheads() -> None:
    """With an infinite link, no latency and no memory-bound work, the ring's W steps cost
    exactly the one-GPU time / W (the zigzag balance), forward and backward."""
    from attnhub_ring.cost import predict

    for w in (2, 4, 8):
        for bwd in (False, True):
            p = predict(LLAMA3_8B, 65536, w, float("inf"), backward=bwd, hbm=float("inf"),
                        step_overhead_s=0.0, latency_s=0.0)
            assert p.comm_hidden and abs(p.efficiency - 1.0) < 1e-9


def test_the_predicted_efficiency_grows_with_length_and_falls_with_ranks() -> None:
    from attnhub_ring.cost import NVLINK, predict

    for w in (2, 4, 8):
        effs = [predict(LLAMA3_8B, s, w, NVLINK).efficiency for s in (8192, 32768, 131072)]
        assert effs == sorted(effs) and all(0 < e < 1 for e in effs)
    by_w = [predict(LLAMA3_8B, 32768, w, NVLINK).efficiency for w in (2, 4, 8)]
    assert by_w == sorted(by_w, reverse=True)
