"""torch_sdpa leaves SDPA's cuDNN kernel out on CUDA: cuDNN builds a graph per new shape
(47-68 ms per call on the H200 for a decode cache one key longer each step), which a growing
KV cache or new prompt lengths would pay on every call. The flag is restored afterwards, also
when SDPA raises, and calls off CUDA never touch it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import attnhub
import attnhub.core.builtin as builtin


class _FakeCuda:
    """Stands in for a CUDA tensor: ``sdpa`` reads only ``device.type`` before calling."""
    device = SimpleNamespace(type="cuda")


def test_cudnn_off_during_the_call_and_restored(monkeypatch):
    seen = []

    def fake_sdpa(*a, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return "out"

    monkeypatch.setattr(builtin.F, "scaled_dot_product_attention", fake_sdpa)
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert builtin.sdpa(_FakeCuda(), None, None) == "out"
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled()


def test_flag_restored_when_sdpa_raises(monkeypatch):
    def boom(*a, **kw):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(builtin.F, "scaled_dot_product_attention", boom)
    torch.backends.cuda.enable_cudnn_sdp(True)
    with pytest.raises(RuntimeError, match="kernel failed"):
        builtin.sdpa(_FakeCuda(), None, None)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_user_choice_kept_and_cpu_untouched(monkeypatch):
    seen = []
    monkeypatch.setattr(builtin.F, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    try:
        torch.backends.cuda.enable_cudnn_sdp(False)  # a user who turned cuDNN off keeps it off
        builtin.sdpa(_FakeCuda(), None, None)
        assert seen == [False] and not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    builtin.sdpa(torch.zeros(1), None, None)  # CPU: SDPA as is, flag as the user left it
    assert seen[-1] is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sq", [1, 64])
def test_no_cudnn_kernel_on_a_growing_cache(sq):
    from torch.profiler import ProfilerActivity, profile

    hub = attnhub.Hub()
    q = torch.randn(1, sq, 32, 128, device="cuda", dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for sk in (1024, 1025, 1026):
            k = torch.randn(1, sk, 8, 128, device="cuda", dtype=torch.bfloat16)
            out = hub.attention(q, k, k, causal=True, backend="torch_sdpa")
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2).float(), k.transpose(1, 2).float(), k.transpose(1, 2).float(),
                attn_mask=torch.nn.attention.bias.causal_lower_right(sq, sk),
                enable_gqa=True).transpose(1, 2)
            assert (out.float() - ref).abs().max().item() < 2e-2
    ops = {e.name for e in prof.events()}
    assert not any("cudnn" in name for name in ops), sorted(n for n in ops if "cudnn" in n)
