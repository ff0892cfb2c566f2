"""On a CUDA GPU: the ring's fused block backwards and a simulated ring against fp64.

Not run in this repository's CI (no GPU); ``pytest -m gpu plugins`` in a GPU session runs it.
Block level: one block is a whole attention, so ``cudnn_backward`` / ``flash_backward`` given
the kernel's own out and LSE must give the exact dQ, dK, dV (FlashAttention rule, 3x).
Ring level: W virtual ranks (attnhub_ring.simulate) with the policy's local kernel and each
block backward: out, LSE and dQ of every rank against fp64 (FlashAttention rule).
"""

from __future__ import annotations

import pytest
import torch
from attnhub_ring import ZigzagLayout, ring_attention, zigzag_shard
from attnhub_ring.block_kernels import block_backward_fn, block_backward_kernel
from attnhub_ring.simulate import SimulatedRing, pack_kv

from attnhub.plugin import AttnParams, reference_attention
from attnhub.testing import assert_fa_rule, assert_lse

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HQ, HKV, D = 8, 2, 128


def _inputs(seqlen: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(seed)
    return [torch.randn(1, seqlen, h, D, generator=g, device="cuda").bfloat16()
            for h in (HQ, HKV, HKV, HQ)]


def _refs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
          causal: bool) -> dict[str, list[torch.Tensor]]:
    res = {}
    for name, dt in (("64", torch.float64), ("same", torch.bfloat16)):
        lv = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        out, lse = reference_attention(*lv, AttnParams(scale=D ** -0.5, causal=causal),
                                       compute_dtype=dt)
        (out * dout.to(dt)).sum().backward()
        res[name] = [out.detach(), lse.detach(), *(x.grad for x in lv)]
    return res


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_fused_block_backward_is_exact_on_one_block(kernel: str, causal: bool) -> None:
    q, k, v, dout = _inputs(384, 1 + causal)
    chosen, why = block_backward_kernel(q, v, None, False, False, kernel)
    assert chosen == kernel, why
    refs = _refs(q, k, v, dout, causal)
    out, lse = refs["same"][0], refs["64"][1].float()
    grads = block_backward_fn(kernel)(dout, q, k, v, out, lse, causal, D ** -0.5)
    for got, i, name in zip(grads, (2, 3, 4), ("dq", "dk", "dv")):
        assert got.shape == refs["64"][i].shape, name
        assert_fa_rule(got, refs["64"][i], refs["same"][i], mult=3, what=f"{kernel} {name}")


@pytest.mark.parametrize("bwd", ["cudnn", "flash", "math"])
@pytest.mark.parametrize(("world", "seqlen", "causal"), [(2, 1000, True), (4, 777, True),
                                                         (2, 640, False)])
def test_a_simulated_ring_on_the_gpu_matches_fp64(bwd: str, world: int, seqlen: int,
                                                  causal: bool) -> None:
    import attnhub

    q, k, v, dout = _inputs(seqlen, world * 7 + seqlen)
    refs = _refs(q, k, v, dout, causal)
    hub = attnhub.Hub()
    inner = hub.resolver._resolve(  # the level the resolver binds inside ring
        attnhub.AttentionSpec(phase="train", dtype="bf16", head_dim=D, num_q_heads=HQ,
                              num_kv_heads=HKV, mask=attnhub.MaskSpec(causal=causal),
                              max_seqlen_q=seqlen // world, max_seqlen_k=seqlen // world,
                              needs_grad=True, return_lse=True).bucketed(),
        hub.device, hub.registry, attnhub.BindContext(world_size=1), local=True)
    assert inner.backend is not None, inner.explain()
    blocks = [pack_kv(zigzag_shard(k, r, world), zigzag_shard(v, r, world))
              for r in range(world)]
    for rank in range(world):
        idx = ZigzagLayout(world, (seqlen,)).global_indices(rank).cuda()
        ql = zigzag_shard(q, rank, world).requires_grad_()
        out, lse = ring_attention(ql, zigzag_shard(k, rank, world), zigzag_shard(v, rank, world),
                                  local_backend=inner.backend, causal=causal,
                                  global_seqlens=[seqlen], return_lse=True,
                                  transport=SimulatedRing(rank, blocks), block_backward=bwd)
        (out * dout.index_select(1, idx)).sum().backward()
        where = f"{inner.backend}+{bwd} W={world} rank {rank}"
        assert_fa_rule(out, refs["64"][0].index_select(1, idx),
                       refs["same"][0].index_select(1, idx), mult=2, what=f"{where} out")
        assert_lse(lse, refs["64"][1].index_select(2, idx), atol=1e-2)
        assert_fa_rule(ql.grad, refs["64"][2].index_select(1, idx),
                       refs["same"][2].index_select(1, idx), mult=3, what=f"{where} dq")
