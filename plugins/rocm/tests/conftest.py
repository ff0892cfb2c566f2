"""Fixtures for the rocm plugin tests: recording fakes of flash_attn (CK build) and aiter.

The fakes implement the libraries' *documented* semantics independently of attnhub's masking
code (window ``[i + Sk - Sq - left, i + Sk - Sq + right]``, causal forcing ``right = 0``, ALiBi
``-slope * |i + Sk - Sq - j|``, empty rows -> 0 output and +inf LSE, softcap accepted and
ignored as the CK build does), so comparing ``ck_fa`` with ``reference_attention`` tests the
argument translation, not the fake.
"""

from __future__ import annotations

import os

import sys
import types
from typing import Any

import pytest
import torch

# triton_portable's kernels are compiled for the interpreter only if this is set before they
# are first imported (the triton_rocm tests run them on the CPU). Only without a GPU: set
# on a GPU machine, it turns Triton's own library into interpreted functions for the whole
# pytest process, and compiled kernels (Gluon's included) then fail to build.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def fa_semantics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                 window: tuple[int, int], slopes: torch.Tensor | None,
                 clamp_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of flash_attn's maths as CK computes it: q (B,Sq,H,D) -> out (B,Sq,H,Dv), lse.

    ALiBi is ``-slope * |pos - key|``, except under the causal mask (left < 0 and right 0
    once edges >= ``clamp_k``, the key length the entry point clamps by, are unbounded):
    there ck_tile's ``AlibiMode::VERTICAL`` adds ``+slope * key`` (same output, LSE higher
    by ``slope * pos``; ``block_position_encoding.hpp``)."""
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(h // hk, dim=2)
    vv = v.double().repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    left, right = window
    if causal:
        right = 0
    pos = torch.arange(sq).view(sq, 1) + sk - sq
    j = torch.arange(sk).view(1, sk)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= pos - left
    if right >= 0:
        keep &= j <= pos + right
    if slopes is not None:
        sl = slopes.double().view(1, h, 1, 1) if slopes.dim() == 1 else slopes.double().view(
            b, h, 1, 1)
        clamp_k = sk if clamp_k is None else clamp_k
        vertical = (-1 if window[0] >= clamp_k else window[0]) < 0 and (
            causal or window[1] == 0)
        s = s + sl * j.double() if vertical else s - sl * (pos - j).abs().double()
    s = s.masked_fill(~keep, float("-inf"))
    empty = ~keep.any(-1)  # (Sq,)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    lse = torch.where(empty.view(1, 1, sq), torch.full_like(lse, float("inf")), lse)
    return out.to(q.dtype), lse.float()


class Recorder:
    """A fake library module: records every call's keyword arguments and computes FA maths."""

    def __init__(self, name: str, lse_keyword: str, tuple_always: bool) -> None:
        self.module = types.ModuleType(name)
        self.calls: list[dict[str, Any]] = []
        self.lse_keyword = lse_keyword
        self.tuple_always = tuple_always
        self.module.flash_attn_func = self.dense  # type: ignore[attr-defined]
        self.module.flash_attn_varlen_func = self.varlen  # type: ignore[attr-defined]

    def _result(self, out: torch.Tensor, lse: torch.Tensor, want: bool) -> Any:
        if self.lse_keyword == "return_attn_probs":  # flash_attn: (out, lse, S_dmask)
            return (out, lse, None) if want else out
        if want:
            return out, lse
        return (out,) if self.tuple_always else out

    def dense(self, q, k, v, **kw):  # type: ignore[no-untyped-def]
        self.calls.append({"fn": "dense", "k_shape": tuple(k.shape), **kw})
        out, lse = fa_semantics(q, k, v, kw["softmax_scale"], kw["causal"], kw["window_size"],
                                kw["alibi_slopes"])
        return self._result(out, lse, kw[self.lse_keyword])

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, **kw):  # type: ignore[no-untyped-def]
        self.calls.append({"fn": "varlen", "max_q": max_q, "max_k": max_k, **kw})
        outs, lses = [], []
        slopes = kw["alibi_slopes"]
        for i in range(cu_q.numel() - 1):
            qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            sl = slopes[i] if slopes is not None and slopes.dim() == 2 else slopes
            o, l = fa_semantics(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
                                kw["softmax_scale"], kw["causal"], kw["window_size"], sl,
                                clamp_k=max_k)
            outs.append(o[0])
            lses.append(l[0])
        return self._result(torch.cat(outs), torch.cat(lses, -1), kw[self.lse_keyword])


@pytest.fixture
def fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """flash_attn with its CK extension 'installed' (as sys.modules entries)."""
    rec = Recorder("flash_attn", "return_attn_probs", tuple_always=False)
    monkeypatch.setitem(sys.modules, "flash_attn", rec.module)
    monkeypatch.setitem(sys.modules, "flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
    monkeypatch.delenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", raising=False)
    return rec


@pytest.fixture
def fake_aiter(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """AMD's aiter 'installed'; its older releases return a 1-tuple without LSE."""
    rec = Recorder("aiter", "return_lse", tuple_always=True)
    monkeypatch.setitem(sys.modules, "aiter", rec.module)
    return rec
