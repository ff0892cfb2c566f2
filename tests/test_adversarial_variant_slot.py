"""A named variant passed in the slot it does not define (``mask_mod="softcap30"``, which has
only a score_mod) is refused with the fix, not silently ignored (it gave the unmasked answer);
in its own slot it still changes the answer."""

from __future__ import annotations

import pytest
import torch

import attnhub
from attnhub.errors import ArgumentError


def test_a_variant_in_the_wrong_slot_is_refused() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=g) * 3 for _ in range(3))
    with pytest.raises(ArgumentError, match="pass it as score_mod='softcap30'"):
        attnhub.attention(q, k, v, mask_mod="softcap30")
    plain = attnhub.attention(q, k, v)
    capped = attnhub.attention(q, k, v, score_mod="softcap30")
    assert not torch.allclose(plain, capped)
