"""FlashAttention's grid, eighth round (CPU): an inf or NaN key that only later rows can see
made the earlier rows NaN on the CPU default (torch_sdpa) when the call needed gradients or
dropout (SDPA's math kernel adds ``is_causal`` as -inf, and inf + -inf is NaN); without
either the flash kernel skipped the masked block and the answer was right."""

from __future__ import annotations

import pytest
import torch

import attnhub


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("mode", ["grad", "dropout"])
@pytest.mark.parametrize("shape", [(6, 6), (3, 6)])  # square causal; top-left Sq < Sk
def test_a_non_finite_key_stays_out_of_the_rows_that_cannot_see_it(
        bad: float, mode: str, shape: tuple[int, int]) -> None:
    sq, sk = shape
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, s, 2, 8, generator=g) for s in (sq, sk, sk))
    k[0, sk - 1, 0, 0] = bad  # seen by the last row of a square causal call only
    align = "bottom_right" if sq == sk else "top_left"
    blind = sq - 1 if sq == sk else sq  # rows that cannot see the last key
    for backend in ("torch_sdpa", None):
        qq, kk, vv = (t.clone().requires_grad_(mode == "grad") for t in (q, k, v))
        torch.manual_seed(0)
        out = attnhub.attention(qq, kk, vv, causal=True, causal_alignment=align,
                                backend=backend, dropout_p=0.3 if mode == "dropout" else 0.0)
        assert torch.isfinite(out[0, :blind]).all(), (backend, torch.isnan(out[0]).any(-1))
        if mode == "grad":
            want = attnhub.attention(q[:, :blind], k[:, :sk - 1], v[:, :sk - 1], causal=True,
                                     causal_alignment=align, backend="reference")
            torch.testing.assert_close(out[:, :blind].detach(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["dv", "strided", "flash off"])
def test_the_math_kernel_without_gradients_keeps_a_non_finite_key_out_too(case: str) -> None:
    """SDPA's math kernel also serves inference calls (Dv != D, a strided last dim, the
    flash switch off): a scan of k only with gradients or dropout let NaN through again."""
    g = torch.Generator().manual_seed(9)
    q, k = (torch.randn(1, 6, 2, 32 if case == "strided" else 16, generator=g) for _ in "qk")
    v = torch.randn(1, 6, 2, 8 if case == "dv" else q.shape[-1], generator=g)
    if case == "strided":
        q, k, v = q[..., ::2], k[..., ::2], v[..., ::2]
    k[0, 5, 0, 0] = float("nan")  # only the last row sees it
    flash = torch.backends.cuda.flash_sdp_enabled()
    try:
        torch.backends.cuda.enable_flash_sdp(case != "flash off")
        out = attnhub.attention(q, k, v, causal=True, backend="torch_sdpa")
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)
    assert torch.isfinite(out[0, :5]).all() and torch.isnan(out[0, 5, 0]).any()
