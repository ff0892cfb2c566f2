"""Regressions found by the CPU differential fuzzer (benchmarks/fuzz_cpu.py, review 9c)."""

from __future__ import annotations

import math

import torch

import attnhub
from attnhub import AttnParams
from attnhub.testing import assert_fa_rule, fa_references


def test_reference_casts_a_score_mod_result_of_another_dtype() -> None:
    """A score_mod that captures an fp32 tensor returns fp32 scores for fp16 inputs; the
    same-precision reference (``fa_references``) multiplied them with fp16 values and raised
    (``expected m1 and m2 to have the same dtype``). The contract casts another floating
    dtype, as flex does."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 2, 16, generator=gen).half()
    k, v = (torch.randn(1, 7, 2, 16, generator=gen).half() for _ in range(2))
    bias = torch.randn(2, generator=gen)  # fp32

    def head_bias(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + bias[h]

    params = AttnParams(scale=1 / math.sqrt(16), causal=True, score_mod=head_bias)
    ref64, _, same = fa_references(q, k, v, params)
    assert same.dtype == torch.float16
    out = attnhub.attention(q, k, v, causal=True, score_mod=head_bias, backend="reference")
    assert_fa_rule(out, ref64, same)
