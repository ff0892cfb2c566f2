"""The ring's local kernel and fused backward, in one process: torch_flash_cpu against the
fp64 reference, the policy's choice of a kernel that returns its LSE natively (explained),
and a simulated ring (W virtual ranks on one device) against a single device."""

from __future__ import annotations

import pytest
import torch
from attnhub_ring import ZigzagLayout, ring_attention, zigzag_shard
from attnhub_ring.block_kernels import block_backward_kernel, fused_backward_reasons
from attnhub_ring.simulate import SimulatedRing, pack_kv

import attnhub
from attnhub.plugin import AttnParams, reference_attention
from attnhub.testing import assert_fa_rule, assert_lse


def _refs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
          params: AttnParams, layout: str = "bshd") -> dict[str, dict[str, torch.Tensor]]:
    res = {}
    for name, dt in (("64", torch.float64), ("same", q.dtype)):
        leaves = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        out, lse = reference_attention(*leaves, params, layout=layout, compute_dtype=dt)
        (out * dout.to(out.dtype)).sum().backward()
        res[name] = {"out": out.detach(), "lse": lse.detach(),
                     **{n: x.grad for n, x in zip(("dq", "dk", "dv"), leaves)}}
    return res


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_torch_flash_cpu_matches_the_reference_with_gqa(causal: bool, layout: str) -> None:
    g = torch.Generator().manual_seed(7 + causal)
    thd = layout == "thd"
    lens = [5, 9, 1]
    shape = (lambda h: (sum(lens), h, 16)) if thd else (lambda h: (2, 11, h, 16))
    q, k, v, dout = (torch.randn(*shape(h), generator=g).bfloat16() for h in (4, 2, 2, 4))
    cu = torch.tensor([0, 5, 14, 15], dtype=torch.int32)
    params = AttnParams(scale=0.25, causal=causal, cu_seqlens_q=cu if thd else None,
                        cu_seqlens_k=cu if thd else None, return_lse=True)
    refs = _refs(q, k, v, dout, params, layout)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    hub = attnhub.Hub(hardware="cpu")
    kw: dict = {"layout": "thd", "cu_seqlens_q": cu, "cu_seqlens_k": cu} if thd else {}
    out, lse = hub.attention(*leaves, causal=causal, scale=0.25, backend="torch_flash_cpu",
                             return_lse=True, **kw)
    (out * dout).sum().backward()
    assert_fa_rule(out, refs["64"]["out"], refs["same"]["out"], mult=2, what="out")
    assert_lse(lse, refs["64"]["lse"])
    for x, n in zip(leaves, ("dq", "dk", "dv")):
        assert_fa_rule(x.grad, refs["64"][n], refs["same"][n], mult=3, what=n)


def test_the_policy_binds_a_local_kernel_that_returns_its_lse_natively() -> None:
    """Offline plan for a 2-rank ring on the CPU: SDPA (LSE by a second pass) is rejected
    inside ring with that reason, torch_flash_cpu is chosen, and explain shows both."""
    hub = attnhub.Hub(hardware="cpu")
    spec = attnhub.AttentionSpec(phase="train", dtype="bf16", head_dim=64, num_q_heads=8,
                                 num_kv_heads=2, mask=attnhub.MaskSpec(causal=True),
                                 max_seqlen_q=4096, max_seqlen_k=4096, needs_grad=True)
    decision = hub.resolver.resolve(spec, hub.device, hub.registry,
                                    attnhub.BindContext(world_size=2))
    assert decision.backend == "ring" and decision.inner is not None
    assert decision.inner.backend == "torch_flash_cpu"
    why = {r.backend: " ".join(r.reasons) for r in decision.inner.rejected}
    assert "second pass" in why["torch_sdpa"]
    text = decision.explain()
    assert "torch_flash_cpu" in text and "second pass" in text


def test_the_block_backward_is_chosen_by_data_and_says_why() -> None:
    q = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
    kernel, passed = block_backward_kernel(q, q, None, False, False)
    assert kernel == "flash" and passed and "cudnn: device cpu" in passed[0]
    kernel, passed = block_backward_kernel(q, q, 5.0, False, False)
    assert kernel == "math" and any("softcap" in p for p in passed)
    with pytest.raises(attnhub.InputError, match="cudnn.*device cpu"):
        block_backward_kernel(q, q, None, False, False, want="cudnn")
    with pytest.raises(attnhub.InputError, match="auto, cudnn, flash, math"):
        block_backward_kernel(q, q, None, False, False, want="fast")


def test_the_fused_block_backward_says_when_it_cannot_serve() -> None:
    q = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
    assert fused_backward_reasons(q, q, None, False, False) == []
    assert any("softcap" in r for r in fused_backward_reasons(q, q, 5.0, False, False))
    assert any("LSE" in r for r in fused_backward_reasons(q, q, None, False, True))
    assert any("value head dim" in r for r in fused_backward_reasons(q, q[..., :4], None,
                                                                       False, False))


@pytest.mark.parametrize(("world", "seqlen", "causal", "bwd"), [
    (2, 13, True, "auto"), (3, 12, False, "auto"), (4, 9, True, "auto"), (2, 10, True, "math")])
def test_a_simulated_ring_gives_every_rank_its_exact_out_lse_and_dq(
        world: int, seqlen: int, causal: bool, bwd: str) -> None:
    g = torch.Generator().manual_seed(world * 100 + seqlen)
    q, k, v, dout = (torch.randn(1, seqlen, h, 16, generator=g).bfloat16()
                     for h in (4, 2, 2, 4))
    refs = _refs(q, k, v, dout, AttnParams(scale=0.25, causal=causal))
    blocks = [pack_kv(zigzag_shard(k, r, world), zigzag_shard(v, r, world))
              for r in range(world)]
    for rank in range(world):
        ql = zigzag_shard(q, rank, world).requires_grad_()
        kl, vl = zigzag_shard(k, rank, world), zigzag_shard(v, rank, world)
        out, lse = ring_attention(ql, kl, vl, local_backend="torch_flash_cpu", causal=causal,
                                  scale=0.25, global_seqlens=[seqlen], return_lse=True,
                                  transport=SimulatedRing(rank, blocks), block_backward=bwd)
        (out * zigzag_shard(dout, rank, world)).sum().backward()

        def mine(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
            idx = ZigzagLayout(world, (seqlen,)).global_indices(rank)
            return x.index_select(dim, idx)

        where = f"W={world} rank {rank}"
        assert_fa_rule(out, mine(refs["64"]["out"]), mine(refs["same"]["out"]), mult=2,
                       what=f"{where} out")
        assert_lse(lse, mine(refs["64"]["lse"], 2))
        assert_fa_rule(ql.grad, mine(refs["64"]["dq"]), mine(refs["same"]["dq"]), mult=3,
                       what=f"{where} dq")


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_torch_flash_cpu_gives_nan_out_in_the_rows_that_see_nan(where: str) -> None:
    """docs/contract.md: the CPU flash kernel alone returns 0 for a row whose scores are all
    NaN; torch_flash_cpu must give NaN in exactly the reference's rows."""
    from attnhub.testing import assert_nan_pattern, nan_case

    q, k, v, causal = nan_case(where)
    out = attnhub.Hub(hardware="cpu").attention(q, k, v, causal=causal, scale=0.25,
                                                backend="torch_flash_cpu")
    assert_nan_pattern(out, q, k, v, AttnParams(scale=0.25, causal=causal))
