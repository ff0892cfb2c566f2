"""Attention dropout on a CUDA GPU: torch_sdpa repeating SDPA's own draw under a seed (its
fused kernels draw from the CUDA generator's Philox state) and its law; the policy binding
FlashAttention-2 (dense and packed documents) and the conformance kit judging fa2's dropout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnhub
from attnhub.testing import gpu_marks

pytestmark = gpu_marks()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal, heads", [(False, (8, 8)), (True, (8, 2))])
def test_dropout_on_the_gpu_is_sdpas_draw_and_unbiased(dtype: torch.dtype, causal: bool,
                                                        heads: tuple[int, int]) -> None:
    hub = attnhub.Hub()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 256, h, 64, device="cuda", dtype=dtype, generator=g)
               .requires_grad_() for h in (heads[0], heads[1], heads[1]))
    torch.cuda.manual_seed(5)
    ours = hub.attention(q, k, v, causal=causal, dropout_p=0.2, backend="torch_sdpa")
    torch.cuda.manual_seed(5)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH]):  # the kernels the hub lets SDPA pick (no cuDNN)
        ref = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            dropout_p=0.2, enable_gqa=heads[0] != heads[1]).transpose(1, 2)
    torch.testing.assert_close(ours, ref, rtol=1e-2, atol=1e-2)  # another mask: far off
    dout = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), dout),
                    torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        exact = hub.attention(q, k, v, causal=causal).double()
        n = 400
        draws = torch.stack([hub.attention(q, k, v, causal=causal, dropout_p=0.2,
                                           backend="torch_sdpa").double() for _ in range(n)])
    mean, se = draws.mean(0), draws.std(0) / n ** 0.5
    rounding = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    assert ((mean - exact).abs() <= 6 * se + rounding * exact.abs() + 1e-3).all()


def test_the_policy_binds_fa2_for_dropout_and_the_kit_passes_it() -> None:
    pytest.importorskip("flash_attn")
    from attnhub.conformance.kit import run_kit

    hub = attnhub.Hub()
    g = torch.Generator(device="cuda").manual_seed(1)
    cu = torch.tensor([0, 100, 356, 400], device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(400, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_() for h in (8, 2, 2))
    kw = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    torch.cuda.manual_seed(3)
    a = hub.attention(q, k, v, dropout_p=0.1, **kw)
    torch.cuda.manual_seed(3)
    b = hub.attention(q, k, v, dropout_p=0.1, **kw)
    (runner,) = [r for r in hub.bound() if r.decision.spec.dropout]
    assert runner.decision.backend == "fa2", runner.decision.explain()
    assert torch.equal(a, b)
    grads = torch.autograd.grad(a, (q, k, v), torch.randn_like(a))
    assert all(torch.isfinite(x).all() and x.abs().sum() > 0 for x in grads)
    with torch.no_grad():
        exact = hub.attention(q, k, v, **kw).double()
        n = 300
        draws = torch.stack([hub.attention(q, k, v, dropout_p=0.1, **kw).double()
                             for _ in range(n)])
    mean, se = draws.mean(0), draws.std(0) / n ** 0.5
    assert ((mean - exact).abs() <= 6 * se + 2 ** -7 * exact.abs() + 1e-3).all()
    import attnhub_sm80_fa2.fa2 as fa2

    results = [r for r in run_kit(fa2.FlashAttn2Backend(), hub.device).results
               if r.case.dropout_p]
    assert results and all(r.status == "pass" for r in results), results
