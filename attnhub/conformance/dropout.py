"""Declared attention dropout, judged per probability (dense layouts).

A draw has no reference value, but it can be read: with v made of identity blocks, the
output's columns are the dropped probabilities themselves, one block of ``Dv`` keys per call,
each call under the same seed. So the kit sees every probability of one draw and checks the
law exactly: each is either 0 or the exact one scaled by 1/(1 - p), zeros come at rate p, the
output with the real v is that dropped matrix times v (dropout on the probabilities, not on
the output), and the gradients are those of that same matrix (the backward replays the
forward's draw instead of drawing again).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..core.reference import reference_attention
from .inputs import Inputs

#: Seeds whose draws are read: their zero counts are pooled for the rate test.
SEEDS = (11, 12, 13, 14)


def identity_blocks(v: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """(first key, keys, v) per block: ``v``'s shape and strides, zero but for a 1 at
    (key ``first + i``, channel ``i``) in every KV head."""
    _, sk, _, dv = v.shape
    out = []
    for first in range(0, sk, dv):
        n = min(dv, sk - first)
        block = torch.zeros_like(v)
        i = torch.arange(n, device=v.device)
        block[:, first + i, :, i] = 1
        out.append((first, n, block))
    return out


def read_draw(call: Callable[[torch.Tensor], torch.Tensor], v: torch.Tensor,
              seed: int) -> torch.Tensor:
    """The dropped probabilities (B, Hq, Sq, Sk) of the draw ``call`` makes under ``seed``
    (``call(v)``: the backend's output (B, Sq, Hq, Dv) for these values)."""
    cols = []
    for _, n, block in identity_blocks(v):
        torch.manual_seed(seed)
        cols.append(call(block)[..., :n].detach().double())
    return torch.cat(cols, -1).permute(0, 2, 1, 3)


def exact_probabilities(inp: Inputs, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The undropped probabilities (B, Hq, Sq, Sk) in fp64, differentiable in ``q`` and
    ``k``, read the same way from the reference."""
    cols = []
    for _, n, block in identity_blocks(inp.v):
        out, _ = reference_attention(q, k, block, inp.ref_params, layout="bshd")
        cols.append(out[..., :n])
    return torch.cat(cols, -1).permute(0, 2, 1, 3)


def tolerance(dtype: torch.dtype) -> float:
    """Relative rounding allowed on one probability: a few units of the dtype's precision
    (a kernel rounds P to it before P @ V)."""
    return max(4 * torch.finfo(dtype).eps, 1e-5)


def entry_problem(dropped: torch.Tensor, exact: torch.Tensor, p: float,
                  dtype: torch.dtype) -> tuple[str | None, int, int]:
    """(what is wrong or None, zeros, entries counted) for one draw: every probability must
    be 0 or exact / (1 - p); the rate counts entries large enough to tell the two apart."""
    rel, atol = tolerance(dtype), 1e-6
    kept = exact / (1 - p)
    is_kept = (dropped - kept).abs() <= rel * kept + atol
    is_zero = dropped.abs() <= atol
    bad = ~(is_kept | is_zero)
    if bad.any():
        i = tuple(int(x) for x in bad.nonzero()[0])
        return (f"probability {i} (b, h, query, key) is {float(dropped[i]):.6g} after dropout "
                f"where the exact one is {float(exact[i]):.6g}: each must be dropped (0) or "
                f"scaled by 1/(1 - {p:g}) to {float(kept[i]):.6g}", 0, 0)
    counted = kept > 20 * (rel * kept + atol)
    return None, int((is_zero & counted).sum()), int(counted.sum())


def rate_problem(zeros: int, counted: int, p: float) -> str | None:
    """Whether ``zeros`` of ``counted`` independent probabilities is a rate p could give
    (6 standard errors of a binomial)."""
    if counted == 0:
        return None
    rate, se = zeros / counted, math.sqrt(p * (1 - p) / counted)
    if abs(rate - p) > 6 * se + 1 / counted:
        return (f"{zeros} of {counted} probabilities dropped ({rate:.3f}) where dropout_p="
                f"{p:g} was asked (6 standard errors allow {6 * se:.3f}): drop each with "
                "probability dropout_p")
    return None


def output_problem(out: torch.Tensor, dropped: torch.Tensor, v: torch.Tensor,
                   dtype: torch.dtype) -> str | None:
    """The output under the draw's seed must be the dropped probabilities times v."""
    vv = v.detach().double()
    if vv.shape[2] != dropped.shape[1]:  # GQA: each KV head serves Hq / Hkv query heads
        vv = vv.repeat_interleave(dropped.shape[1] // vv.shape[2], dim=2)
    want = torch.einsum("bhqk,bkhd->bqhd", dropped, vv)
    scale = torch.einsum("bhqk,bkhd->bqhd", dropped.abs(), vv.abs())
    err = (out.detach().double() - want).abs() - (4 * tolerance(dtype) * scale + 1e-5)
    if (err > 0).any():
        return (f"the output is off the dropped probabilities times v by "
                f"{float((out.detach().double() - want).abs().max()):.3g}: apply dropout to "
                "the attention probabilities before P @ V, not to the output")
    return None
