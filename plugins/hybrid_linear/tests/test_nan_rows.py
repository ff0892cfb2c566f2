"""NaN in means NaN out on the sparse backends (longformer, lsh), which share sliding_window's
``attend`` and ``merge`` (docs/contract.md): a row that sees no key stays 0 with LSE -inf
even where a value holds NaN, and a row whose output is NaN has a NaN LSE. Before the fix
``attend`` multiplied a dead row's zero weights by the NaN value (0 x NaN), and counted a NaN
row sum as "no key seen" (LSE -inf beside a NaN output); ``merge`` (lsh's rounds) did both.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnhub
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams

#: backend -> (mask kwargs, extra): each leaves rows 0-4 of a 9 x 4 call keyless (causal,
#: bottom-right: no global key precedes them either)
CASES = {
    "longformer": ({"window": (1, 0), "causal": True}, {"longformer_global": [3]}),
    "lsh": ({"causal": True}, {"lsh_buckets": 2, "lsh_rounds": 3}),
}


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub(hardware="cpu")


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, s, h, 16, generator=g) for s, h in ((9, 4), (4, 2), (4, 2)))


@pytest.mark.parametrize("backend", sorted(CASES))
def test_keyless_rows_stay_zero_under_nan_values(hub, backend):
    mask, extra = CASES[backend]
    q, k, v = _inputs(11)
    params = AttnParams(scale=0.25, causal=mask.get("causal", False), window=mask.get("window"))
    dead = torch.isneginf(reference_attention(q, k, v, params)[1])  # (B, H, Sq)
    assert bool(dead.any()) and not bool(dead.all())
    v[:, 0, :, 5] = math.nan
    out, lse = hub.attention(q, k, v, backend=backend, return_lse=True, extra=extra, **mask)
    rows = out.transpose(1, 2)[dead]
    assert not bool(rows.isnan().any()) and not bool(rows.any())
    assert bool(torch.isneginf(lse[dead]).all())


@pytest.mark.parametrize("backend", sorted(CASES))
def test_nan_output_rows_have_nan_lse(hub, backend):
    mask, extra = CASES[backend]
    q, k, v = _inputs(12)
    k[1, 3, 0, 2] = math.nan  # the last key, seen by the live rows of batch 1, kv head 0
    out, lse = hub.attention(q, k, v, backend=backend, return_lse=True, extra=extra, **mask)
    nan_rows = out.isnan().any(-1).transpose(1, 2)  # (B, H, Sq)
    assert bool(nan_rows.any()) and not bool(nan_rows[0].any())
    assert torch.equal(torch.isnan(lse), nan_rows)
