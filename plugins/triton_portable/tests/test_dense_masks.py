"""The dense Triton kernels against the fp64 reference: every mask kind, forward, LSE, grads.

Runs in Triton's CPU interpreter (switched on here, before the kernels are imported) on tiny
shapes: 16x16 tiles, so lengths 17..113 cross several tiles, partial tiles and the
masked/unmasked tile bands. Each case checks the FlashAttention rule (2x the same-precision
reference's error for outputs, 3x for gradients, plus a rounding floor) and the LSE.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from attnhub_triton_portable.autograd import flash_attention
from attnhub_triton_portable.configs import bwd_config

from attnhub.plugin import AttnParams, InputError, reference_attention
from attnhub.testing import assert_fa_rule, assert_lse

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=DEV).to(dtype).requires_grad_()


def _grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], dout: torch.Tensor
           ) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, inputs, dout.to(out.dtype))


def _leaves(ts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().to(dtype).requires_grad_() for t in ts)


def check_against_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            params: AttnParams, layout: str = "bshd",
                            ref_params: AttnParams | None = None, **cfg: dict) -> None:
    """FlashAttention rule for out, LSE, dq, dk, dv; rows past cu_seqlens[-1] must be 0."""
    out, lse = flash_attention(q, k, v, params, layout, **cfg)
    dout = torch.randn(out.shape, device=DEV)
    grads = _grads(out, (q, k, v), dout)
    rp = ref_params or params
    q64 = _leaves((q, k, v), torch.float64)
    ref64, ref_lse = reference_attention(*q64, rp, layout=layout)
    same = _leaves((q, k, v), q.dtype)
    ref_same, _ = reference_attention(*same, rp, layout=layout, compute_dtype=q.dtype)
    n = ref64.shape[0] if layout == "thd" else out.shape[0]
    if layout == "thd":  # padding rows after the last sequence: zero output, -inf LSE
        assert torch.equal(out[n:], torch.zeros_like(out[n:]))
        assert bool(torch.isneginf(lse[:, n:]).all())
        assert torch.equal(grads[0][n:], torch.zeros_like(grads[0][n:]))
    assert_fa_rule(out[:n], ref64, ref_same, mult=2, what="out")
    lse_n = lse[:, :n] if layout == "thd" else lse
    assert_lse(lse_n, ref_lse, atol=2e-3 if q.dtype != torch.float32 else 1e-4)
    g64 = _grads(ref64, q64, dout[:n].double())
    g_same = _grads(ref_same, same, dout[:n])
    for name, g, r64, rs in zip(("dq", "dk", "dv"), grads, g64, g_same):
        assert_fa_rule(g, r64, rs, mult=3, what=name)


# (batch, Sq, Sk, Hq, Hkv, head dim, dtype, params)
CASES = {
    "none_gqa4": (2, 17, 17, 4, 1, 32, "bf16", {}),
    "causal_br_sq<sk": (1, 17, 113, 2, 2, 16, "fp32", {"causal": True}),
    "causal_br_sq>sk_gqa6/2": (1, 113, 17, 6, 2, 16, "bf16", {"causal": True}),
    "causal_tl_sq>sk_d24": (2, 33, 17, 2, 1, 24, "fp16",
                            {"causal": True, "alignment": "top_left"}),
    "causal_tl_sq<sk": (1, 17, 40, 2, 1, 16, "fp32", {"causal": True, "alignment": "top_left"}),
    "window_7_3": (1, 113, 113, 2, 1, 32, "bf16", {"window": (7, 3)}),
    "window_causal_sq!=sk": (2, 17, 40, 2, 2, 16, "fp32", {"causal": True, "window": (8, 0)}),
    "window_left_only_tl": (1, 40, 17, 2, 1, 16, "fp32",
                            {"window": (5, -1), "causal": True, "alignment": "top_left"}),
    "softcap": (1, 33, 33, 2, 1, 32, "fp32", {"softcap": 5.0, "scale": 1.0}),
    "alibi_per_batch": (2, 17, 33, 4, 2, 16, "bf16", {"alibi": True}),
    "prefix_lm": (2, 33, 33, 2, 1, 16, "fp32", {"causal": True, "prefix": [5, 20]}),
    "length_1": (3, 1, 17, 4, 1, 16, "fp32", {"causal": True}),
    "length_1_1": (2, 1, 1, 2, 2, 16, "bf16", {}),
}


def _params(b: int, hq: int, d: int, spec: dict) -> AttnParams:
    kw = {k: v for k, v in spec.items() if k not in ("alibi", "prefix")}
    kw.setdefault("scale", d ** -0.5)
    if spec.get("alibi"):
        kw["alibi_slopes"] = torch.rand(b, hq, device=DEV) * 0.3
    if "prefix" in spec:
        kw["prefix_lens"] = torch.tensor(spec["prefix"], device=DEV)
    return AttnParams(**kw)


@pytest.mark.parametrize("case", list(CASES))
def test_masks_match_reference(case: str) -> None:
    torch.manual_seed(list(CASES).index(case))
    b, sq, sk, hq, hkv, d, dt, spec = CASES[case]
    dtype = DT[dt]
    q, k, v = _rand(b, sq, hq, d, dtype=dtype), _rand(b, sk, hkv, d, dtype=dtype), \
        _rand(b, sk, hkv, d, dtype=dtype)
    check_against_reference(q, k, v, _params(b, hq, d, spec))


def test_column_sparse_with_skipped_tiles() -> None:
    """FlashMask-style ranges per KV head; key tile 0 masks every row, so it is skipped."""
    torch.manual_seed(3)
    b, s, hq, hkv, d = 2, 40, 4, 2, 16
    start = torch.randint(0, s, (b, hkv, s), device=DEV, dtype=torch.int32)
    end = (start + torch.randint(0, s, (b, hkv, s), device=DEV, dtype=torch.int32)).clamp(max=s)
    start[:, :, :16], end[:, :, :16] = 0, s
    params = AttnParams(scale=d ** -0.5, causal=True, colmask_start=start, colmask_end=end)
    q, k, v = (_rand(b, s, h, d, dtype=torch.float32) for h in (hq, hkv, hkv))
    check_against_reference(q, k, v, params)


def test_varlen_documents_with_empty_sequence() -> None:
    """thd with a zero-length document and padding rows after cu_seqlens[-1]."""
    torch.manual_seed(4)
    cu_q = torch.tensor([0, 17, 17, 30], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 21, 21, 40], dtype=torch.int32, device=DEV)
    q, k, v = (_rand(t, h, 32, dtype=torch.bfloat16) for t, h in ((33, 4), (41, 2), (41, 2)))
    params = AttnParams(scale=32 ** -0.5, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                        max_seqlen_q=17, max_seqlen_k=21, alibi_slopes=torch.rand(4, device=DEV))
    # The fp64 oracle cannot take an empty key sequence; the empty document adds nothing.
    ref = AttnParams(scale=params.scale, causal=True, cu_seqlens_q=cu_q[[0, 1, 3]],
                     cu_seqlens_k=cu_k[[0, 1, 3]], alibi_slopes=params.alibi_slopes)
    check_against_reference(q, k, v, params, "thd", ref_params=ref)


def test_fully_masked_rows_are_zero_without_nan() -> None:
    """Bottom-right causal with Sq > Sk: the first Sq - Sk rows see nothing."""
    torch.manual_seed(5)
    q, k, v = _rand(2, 40, 2, 16, dtype=torch.float32), _rand(2, 7, 1, 16, dtype=torch.float32), \
        _rand(2, 7, 1, 16, dtype=torch.float32)
    out, lse = flash_attention(q, k, v, AttnParams(scale=0.25, causal=True))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(out[:, :33], torch.zeros_like(out[:, :33]))
    assert bool(torch.isneginf(lse[:, :, :33]).all()) and bool(torch.isfinite(lse[:, :, 33:]).all())
    assert torch.equal(dq[:, :33], torch.zeros_like(dq[:, :33]))
    assert all(bool(torch.isfinite(g).all()) for g in (dq, dk, dv))
    assert float(dk.abs().max()) > 0  # the visible rows still produce gradients


def test_deterministic_backward_is_bitwise_repeatable() -> None:
    torch.manual_seed(6)
    q, k, v = _rand(2, 33, 4, 16, dtype=torch.bfloat16), _rand(2, 33, 2, 16, dtype=torch.bfloat16), \
        _rand(2, 33, 2, 16, dtype=torch.bfloat16)
    params = AttnParams(scale=0.25, causal=True, deterministic=True)
    dout = torch.randn(2, 33, 4, 16, device=DEV, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        out, _ = flash_attention(q, k, v, params)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_atomic_dq_mode_meets_the_rule() -> None:
    torch.manual_seed(7)
    cfg = bwd_config("cpu", 16, "fp32", True) | {"dq_mode": "atomic"}
    q, k, v = _rand(1, 33, 4, 16, dtype=torch.float32), _rand(1, 33, 1, 16, dtype=torch.float32), \
        _rand(1, 33, 1, 16, dtype=torch.float32)
    check_against_reference(q, k, v, AttnParams(scale=0.25, causal=True), bwd_cfg=cfg)
    with pytest.raises(InputError, match="dq_mode"):
        flash_attention(q, k, v, AttnParams(scale=0.25, deterministic=True), bwd_cfg=cfg)


def test_tma_descriptor_path() -> None:
    """The sm90 path (tensor descriptors for every tile) computes the same as the pointer path;
    the interpreter runs it too, so it is checked here, forward and backward."""
    from attnhub_triton_portable.bwd import flash_bwd
    from attnhub_triton_portable.fwd import flash_fwd
    from attnhub_triton_portable.launch import DenseArgs

    torch.manual_seed(8)
    q, k, v = (torch.randn(2, s, h, 32, device=DEV, dtype=torch.bfloat16)
               for s, h in ((33, 2), (40, 1), (40, 1)))
    params = AttnParams(scale=32 ** -0.5, causal=True)
    fwd_cfg = {"BLOCK_M": 16, "BLOCK_N": 16}
    bwd_cfg = {"dkdv": fwd_cfg, "dq": fwd_cfg, "dq_mode": "separate"}
    results = []
    for tma in (False, True):
        args = DenseArgs.from_params(q, k, v, params, "bshd")
        args.tma_ok = lambda consts, *extra, tma=tma: tma  # type: ignore[method-assign]
        out, lse = flash_fwd(args, fwd_cfg)
        dout = torch.ones_like(out)
        results.append((out, lse, *flash_bwd(args, out, lse, dout, bwd_cfg)))
    for a, b in zip(*results):
        assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=0), float((a - b).abs().max())
    ref64, ref_lse = reference_attention(q, k, v, params)
    ref_same, _ = reference_attention(q, k, v, params, compute_dtype=torch.bfloat16)
    assert_fa_rule(results[1][0], ref64, ref_same)
    assert_lse(results[1][1], ref_lse, atol=2e-3)
