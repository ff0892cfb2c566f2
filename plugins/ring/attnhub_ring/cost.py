"""A first-order model of one ring step: bytes on the wire, FLOPs, and when the wire hides.

Per layer and per hop, a rank sends one K/V block of ``s = S / W`` tokens
(``2 * s * Hkv * d * bytes``) while it computes attention of its ``s`` queries against the
block it holds. With zigzag sharding every causal step is half a block
(``2 * s^2 * Hq * d`` FLOPs; a full block is twice that). The hop hides under the compute when
``compute_time >= bytes / bandwidth``; ``d`` cancels, leaving a minimum number of tokens per
GPU: ``s >= F * Hkv * bytes * (1 if causal else 0.5) / (Hq * B)``. The backward moves K/V and
the fp32 dK/dV accumulator (3x the forward bytes) against 2.5x the forward FLOPs.
Latency per message and kernel efficiency at small blocks are left out (see the doc).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Attention forward throughput assumed per GPU (FLOP/s): FA3 bf16 on the H200 measured
#: 600-677 TFLOP/s for full blocks of 1k-16k tokens (shared/gpu/README.md).
FWD_FLOPS = 600e12
#: Backward: cuDNN measured 541 TFLOP/s at 16k (2.5x the forward FLOPs over its time).
BWD_FLOPS = 540e12
#: Link bandwidth per direction (bytes/s): NVLink 4 on H100/H200, and a 400 Gb/s NIC.
NVLINK = 450e9
INFINIBAND = 50e9


@dataclass(frozen=True)
class Shape:
    """The attention shape of a model: heads, head dim, layers, element size."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int = 128
    layers: int = 32
    elem_bytes: int = 2  # bf16

    def kv_bytes_per_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.elem_bytes

    def bwd_bytes_per_token(self) -> float:
        """What a backward hop carries per token: K/V, plus dK/dV accumulated in fp32."""
        return self.kv_bytes_per_token() * (1 + 4 / self.elem_bytes)


LLAMA3_8B = Shape("Llama-3-8B", 32, 8, 128, 32)
LLAMA3_70B = Shape("Llama-3-70B", 64, 8, 128, 80)


@dataclass(frozen=True)
class Hop:
    """One layer's ring step on one rank, forward and backward."""

    kv_bytes: float
    fwd_flops: float
    fwd_compute_s: float
    fwd_comm_s: float
    bwd_bytes: float
    bwd_compute_s: float
    bwd_comm_s: float

    @property
    def fwd_hidden(self) -> bool:
        return self.fwd_comm_s <= self.fwd_compute_s

    @property
    def bwd_hidden(self) -> bool:
        return self.bwd_comm_s <= self.bwd_compute_s


def hop(shape: Shape, tokens_per_gpu: int, bandwidth: float, causal: bool = True,
        fwd_flops: float = FWD_FLOPS, bwd_flops: float = BWD_FLOPS) -> Hop:
    """Bytes, FLOPs and times of one hop for ``tokens_per_gpu`` (= S / W) tokens."""
    s = tokens_per_gpu
    kv = s * shape.kv_bytes_per_token()
    flops = (2 if causal else 4) * s * s * shape.q_heads * shape.head_dim
    bwd_bytes = s * shape.bwd_bytes_per_token()
    return Hop(kv, flops, flops / fwd_flops, kv / bandwidth,
               bwd_bytes, 2.5 * flops / bwd_flops, bwd_bytes / bandwidth)


def min_tokens_per_gpu(shape: Shape, bandwidth: float, causal: bool = True,
                       backward: bool = False, fwd_flops: float = FWD_FLOPS,
                       bwd_flops: float = BWD_FLOPS) -> float:
    """Tokens per GPU above which a hop hides under the compute of its step (forward, or
    backward with its 3x bytes and 2.5x FLOPs)."""
    flops_per_pair = (2 if causal else 4) * shape.q_heads * shape.head_dim
    if backward:
        return (shape.bwd_bytes_per_token() / bandwidth) / (2.5 * flops_per_pair / bwd_flops)
    return (shape.kv_bytes_per_token() / bandwidth) / (flops_per_pair / fwd_flops)


def memory_per_gpu(shape: Shape, tokens_per_gpu: int) -> dict[str, float]:
    """Bytes per layer a rank holds for ring attention, beyond q/k/v/out themselves."""
    s, hq, d = tokens_per_gpu, shape.q_heads, shape.head_dim
    kv = s * shape.kv_bytes_per_token()
    return {
        "kv_block_in_flight": kv,                      # the block being received
        "fwd_accumulators_fp32": s * hq * (d + 1) * 4,  # out and LSE, merged by LSE
        "bwd_dq_fp32": s * hq * d * 4,
        "bwd_dkv_fp32": 3 * kv * 4 / shape.elem_bytes,  # own share, in flight out, in flight in
    }


#: Device memory bandwidth for the ring's own memory-bound work (merges, the final cast):
#: about 80% of the H200's 4.8 TB/s (a device copy measured 4.24 TB/s).
HBM = 3.5e12
#: Bytes per output element moved by one in-place LSE merge (scale the fp32 accumulator,
#: add the weighted bf16 block: read 4 + write 4, then read 4 + 2 + write 4) plus slack.
MERGE_BYTES = 20
#: Bytes per query element per backward step beyond the kernel: dQ added into fp32 (10),
#: the block's dK/dV into its travelling fp32 accumulator and the received one added (about
#: 8 per query element at 4 query heads per KV head), K/V heads expanded for cuDNN and dK/dV
#: summed back (about 12).
BWD_STEP_BYTES = 30
#: Host and launch time per ring step beyond the kernels (posting a hop, a merge's launches).
STEP_OVERHEAD_S = 30e-6
#: Latency of one point-to-point message on NVLink (NCCL, small-message floor).
HOP_LATENCY_S = 20e-6


@dataclass(frozen=True)
class Prediction:
    """The paper model of one ring call (one layer) on ``world`` ranks."""

    world: int
    seqlen: int
    t_one_s: float
    t_ring_s: float
    comm_hidden: bool

    @property
    def efficiency(self) -> float:
        """``t_one / (W t_ring)``: 1.0 is perfect strong scaling."""
        return self.t_one_s / (self.world * self.t_ring_s)


def predict(shape: Shape, seqlen: int, world: int, bandwidth: float, causal: bool = True,
            backward: bool = False, fwd_flops: float = FWD_FLOPS, bwd_flops: float = BWD_FLOPS,
            hbm: float = HBM, step_overhead_s: float = STEP_OVERHEAD_S,
            latency_s: float = HOP_LATENCY_S) -> Prediction:
    """Ring time vs one GPU for one layer, batch 1: ``W`` steps, each the slower of its
    block's compute and its hop (+ latency), plus per-step host overhead; the forward adds
    ``W - 1`` merges and a final cast, the backward (fwd+bwd) its own ``W`` steps with the
    K/V and fp32 dK/dV hops and their gradient accumulation (``BWD_STEP_BYTES``). Same kernel throughput for blocks as for the whole sequence
    (true from ~4k tokens per block; below that small blocks run slower, see the doc)."""
    s = seqlen / world
    h = hop(shape, int(s), bandwidth, causal, fwd_flops, bwd_flops)
    elems = s * shape.q_heads * shape.head_dim
    merge_s = MERGE_BYTES * elems / hbm
    fwd = world * (step_overhead_s + max(h.fwd_compute_s, h.fwd_comm_s + latency_s))
    fwd += (world - 1) * merge_s + 6 * elems / hbm  # merges + the fp32 -> bf16 cast
    one_flops = (2 if causal else 4) * seqlen ** 2 * shape.q_heads * shape.head_dim
    t_one = one_flops / fwd_flops
    hidden = h.fwd_comm_s + latency_s <= h.fwd_compute_s
    if backward:
        fwd += world * (step_overhead_s + max(h.bwd_compute_s, h.bwd_comm_s + latency_s)
                        + BWD_STEP_BYTES * elems / hbm)
        t_one += 2.5 * one_flops / bwd_flops
        hidden = hidden and h.bwd_comm_s + latency_s <= h.bwd_compute_s
    return Prediction(world, seqlen, t_one, fwd, hidden)
