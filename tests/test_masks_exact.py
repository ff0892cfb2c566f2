"""The exact causal masks under both alignments (FlashAttention's convention)."""

from __future__ import annotations

import pytest
import torch

from attnhub.core.masking import allowed_mask
from attnhub.core.spec import AttnParams

# Rows are queries, columns keys; 1 = visible.
EXPECTED = {
    ("bottom_right", 2, 5): [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
    ("top_left", 2, 5): [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]],
    ("bottom_right", 5, 2): [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]],
    ("top_left", 5, 2): [[1, 0], [1, 1], [1, 1], [1, 1], [1, 1]],
    ("bottom_right", 3, 4): [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]],
    ("top_left", 3, 4): [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]],
}


@pytest.mark.parametrize("alignment,sq,sk", list(EXPECTED))
def test_causal_alignment(alignment, sq, sk):
    p = AttnParams(scale=1.0, causal=True, alignment=alignment)
    m = allowed_mask(p, 1, 1, sq, sk, torch.device("cpu"))[0, 0]
    assert m.int().tolist() == EXPECTED[(alignment, sq, sk)]


def test_window_is_relative_to_aligned_position():
    p = AttnParams(scale=1.0, window=(1, 0))
    m = allowed_mask(p, 1, 1, 2, 4, torch.device("cpu"))[0, 0]
    assert m.int().tolist() == [[0, 1, 1, 0], [0, 0, 1, 1]]


def test_prefix_lm_sees_whole_prefix():
    p = AttnParams(scale=1.0, causal=True, prefix_lens=torch.tensor([3]))
    m = allowed_mask(p, 1, 1, 4, 4, torch.device("cpu"))[0, 0]
    assert m.int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_column_sparse_masks_row_ranges_per_key():
    start = torch.tensor([[[1, 0, 3]]], dtype=torch.int32)
    end = torch.tensor([[[3, 0, 4]]], dtype=torch.int32)
    p = AttnParams(scale=1.0, colmask_start=start, colmask_end=end)
    m = allowed_mask(p, 1, 1, 4, 3, torch.device("cpu"))[0, 0]
    assert m.int().tolist() == [[1, 1, 1], [0, 1, 1], [0, 1, 1], [1, 1, 0]]
