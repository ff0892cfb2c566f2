"""Attention dropout on a CUDA GPU, through the policy: the binding, a seed repeating SDPA's
own draw (its fused kernels draw from the CUDA generator's Philox state), and the law."""

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
    spec_backend = hub.decide(attnhub.AttentionSpec(
        phase="train", dtype="bf16" if dtype == torch.bfloat16 else "fp16", head_dim=64,
        num_q_heads=heads[0], num_kv_heads=heads[1], max_seqlen_q=256, max_seqlen_k=256,
        batch=2, needs_grad=True, dropout=True,
        mask=attnhub.MaskSpec(causal=causal))).backend
    assert spec_backend == "torch_sdpa"
    torch.cuda.manual_seed(5)
    ours = hub.attention(q, k, v, causal=causal, dropout_p=0.2)
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
        draws = torch.stack([hub.attention(q, k, v, causal=causal, dropout_p=0.2).double()
                             for _ in range(n)])
    mean, se = draws.mean(0), draws.std(0) / n ** 0.5
    rounding = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    assert ((mean - exact).abs() <= 6 * se + rounding * exact.abs() + 1e-3).all()
