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
