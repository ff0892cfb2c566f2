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


@pytest.mark.parametrize("message", [
    "No available kernel. Aborting execution.",
    "No viable backend for scaled_dot_product_attention was found. This is likely due to "
    "turning off both the math kernel and the fused kernels.",  # CUDA, torch 2.11 (H200)
])
def test_cudnn_kept_where_no_other_sdpa_kernel_can_run(monkeypatch, message):
    """A caller who left SDPA only cuDNN (``sdpa_kernel([CUDNN_ATTENTION])``, or cuDNN and
    a kernel that cannot take this call) gets cuDNN, not SDPA's "No available kernel": the
    call is redone with cuDNN on when turning it off left SDPA nothing to run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    calls = []

    def fake_sdpa(*a, **kw):
        on = torch.backends.cuda.cudnn_sdp_enabled()
        calls.append(on)
        if not (on or torch.backends.cuda.flash_sdp_enabled()
                or torch.backends.cuda.mem_efficient_sdp_enabled()
                or torch.backends.cuda.math_sdp_enabled()):
            raise RuntimeError(message)
        return "out"

    monkeypatch.setattr(builtin.F, "scaled_dot_product_attention", fake_sdpa)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        assert builtin.sdpa(_FakeCuda(), None, None) == "out"
        assert calls[-1] is True and torch.backends.cuda.cudnn_sdp_enabled()
        assert not torch.backends.cuda.math_sdp_enabled()  # the caller's choice stands
    assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()


def test_other_failures_are_not_redone(monkeypatch):
    calls = []

    def oom(*a, **kw):
        calls.append(1)
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(builtin.F, "scaled_dot_product_attention", oom)
    with pytest.raises(RuntimeError, match="out of memory"):
        builtin.sdpa(_FakeCuda(), None, None)
    assert calls == [1] and torch.backends.cuda.cudnn_sdp_enabled()


def test_compiled_callers_get_sdpa_untouched(monkeypatch):
    """Under torch.compile the flags are not toggled: Dynamo cannot trace
    ``cudnn_sdp_enabled()`` (a torch.* call returning a bool), so ``fullgraph=True`` failed
    with ``Unsupported`` on CUDA (seen on the H200, torch 2.11) where plain SDPA compiles."""
    calls = []
    monkeypatch.setattr(builtin.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(kw) or "out")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)

    def no_flags(*a):
        raise AssertionError("a flag was read or set while compiling")

    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", no_flags)
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", no_flags)
    assert builtin.sdpa(_FakeCuda(), None, None, scale=0.5) == "out"
    assert calls == [{"scale": 0.5}]
