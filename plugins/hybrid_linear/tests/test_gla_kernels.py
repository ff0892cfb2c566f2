"""Our Triton GLA kernels (chunked fwd/bwd, recurrent step, scan) against the torch oracle.

Under the Triton interpreter on the CPU: fp32 and fp16 only (the interpreter's bf16 dot is
not faithful). Shapes are small but cover a partial last chunk, several chunks, an initial
state and decays strong enough to overflow any exp(-cumsum) formulation.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from attnhub_hybrid_linear import linear_torch
from attnhub_hybrid_linear.metrics import rel_rmse

TOL = 5e-3  # FLA's relative-RMSE tolerance for GLA outputs and gradients


def _inputs(b: int, t: int, h: int, kd: int, vd: int, strong: bool = False,
            dtype: torch.dtype = torch.float32):
    q, k = torch.randn(b, t, h, kd), torch.randn(b, t, h, kd)
    v = torch.randn(b, t, h, vd)
    g = -8 * torch.rand(b, t, h, kd) if strong else F.logsigmoid(torch.randn(b, t, h, kd)) / 4
    h0 = torch.randn(b, h, kd, vd)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, h0


@pytest.mark.parametrize("strong", [False, True], ids=["mild", "strong-decay"])
def test_chunked_and_recurrent_forms_agree(kernels: ModuleType, strong: bool) -> None:
    q, k, v, g, h0 = _inputs(1, 70, 1 if strong else 2, 16, 32, strong)
    o_c, s_c = kernels.chunked(q, k, v, g, 0.25, h0, True)
    o_r, s_r = kernels.recurrent(q, k, v, g, 0.25, h0)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert rel_rmse(o_c, o_r) < TOL
    assert rel_rmse(s_c, s_r) < TOL
    ref, ref_s = linear_torch.recurrent(q.double(), k.double(), v.double(), g.double(), 0.25,
                                        h0.double())
    assert rel_rmse(o_c, ref) < TOL and rel_rmse(o_r, ref) < TOL and rel_rmse(s_c, ref_s) < TOL


def test_fp16_inputs_stay_close(kernels: ModuleType) -> None:
    q, k, v, g, _ = _inputs(1, 40, 1, 16, 16, dtype=torch.float16)
    ref, _ = linear_torch.recurrent(q.double(), k.double(), v.double(), g.double(), 0.25)
    o_c, _ = kernels.chunked(q, k, v, g, 0.25)
    o_r, _ = kernels.recurrent(q, k, v, g, 0.25)
    assert o_c.dtype == torch.float16
    assert rel_rmse(o_c, ref) < 1e-2 and rel_rmse(o_r, ref) < 1e-2


def test_scan_gives_the_state_a_prefix_leaves(kernels: ModuleType) -> None:
    _, k, v, g, h0 = _inputs(2, 70, 1, 16, 16)
    want = linear_torch.state_after(k.double(), v.double(), g.double(), h0.double())
    assert rel_rmse(kernels.state_after(k, v, g, h0), want) < 1e-5


@pytest.mark.parametrize("strong", [False, True], ids=["mild", "strong-decay"])
def test_gradients_match_the_torch_reference(kernels: ModuleType, strong: bool) -> None:
    q, k, v, g, h0 = _inputs(1, 70, 1, 16, 16, strong)
    ours = [x.clone().requires_grad_() for x in (q, k, v, g)]
    oracle = [x.double().requires_grad_() for x in (q, k, v, g)]
    o, _ = kernels.chunked(*ours, 0.3, h0)
    o_ref, _ = linear_torch.recurrent(*oracle, 0.3, h0.double())
    do = torch.randn_like(o_ref)
    (o * do.float()).sum().backward()
    (o_ref * do).sum().backward()
    for name, a, b in zip("qkvg", ours, oracle):
        assert torch.isfinite(a.grad).all(), f"d{name}: not finite"
        assert rel_rmse(a.grad, b.grad) < TOL, f"d{name}: {rel_rmse(a.grad, b.grad):.2e}"


def test_second_order_through_the_chunk_kernel_is_refused(kernels: ModuleType) -> None:
    """create_graph=True: the first-order gradients are the oracle's, and differentiating
    them raises (the fused backward has no derivative; they used to count as constants)."""
    from attnhub.errors import InputError

    q, k, v, g, _ = _inputs(1, 20, 1, 16, 16)
    ours = [x.clone().requires_grad_() for x in (q, k, v, g)]
    oracle = [x.double().requires_grad_() for x in (q, k, v, g)]
    o, _ = kernels.chunked(*ours, 0.3)
    (gq,) = torch.autograd.grad(o.square().sum(), ours[0], create_graph=True)
    o_ref, _ = linear_torch.recurrent(*oracle, 0.3)
    (want,) = torch.autograd.grad(o_ref.square().sum(), oracle[0])
    assert rel_rmse(gq.detach(), want) < TOL
    with pytest.raises(InputError, match="second-order"):
        gq.square().sum().backward()
