"""On an sm90 GPU: the Gluon forward (each shipped config) against the fp64 reference by the
FlashAttention rule, LSE included, and the gradients of ``flash_attention`` when the forward
ran on it (the backward recomputes from its output and LSE)."""

from __future__ import annotations

import pytest
import torch
from attnhub_triton_portable import configs
from attnhub_triton_portable.fwd import gluon_missing

from attnhub.plugin import AttnParams
from attnhub.testing import assert_fa_rule, assert_grads_fa_rule, assert_lse, fa_references


_MISSING = gluon_missing(ws=False)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]

CASES = [  # (b, sq, sk, hq, hkv, d), params
    ((2, 256, 256, 8, 2, 128), {}),
    ((1, 256, 512, 4, 4, 128), {"causal": True}),
    ((1, 512, 256, 4, 2, 128), {"causal": True}),  # bottom-right: 256 fully masked rows
    ((2, 512, 512, 4, 1, 128), {"causal": True, "window": (128, 0)}),
    ((1, 384, 384, 4, 2, 64), {"window": (100, 37), "alignment": "top_left"}),
]


@pytest.mark.parametrize("cfg", configs.GLUON_SM90, ids=str)
@pytest.mark.parametrize(("shape", "kw"), CASES, ids=str)
def test_gluon_forward_and_grads(cfg: dict, shape: tuple[int, ...], kw: dict) -> None:
    from attnhub_triton_portable.autograd import flash_attention
    from attnhub_triton_portable.fwd import flash_fwd, gluon_unsupported
    from attnhub_triton_portable.launch import DenseArgs

    b, sq, sk, hq, hkv, d = shape
    torch.manual_seed(sum(shape))
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    params = AttnParams(scale=d ** -0.5, **kw)
    args = DenseArgs.from_params(q.detach(), k.detach(), v.detach(), params, "bshd")
    assert gluon_unsupported(args, cfg) is None
    out, lse = flash_fwd(args, cfg)
    ref64, ref_lse, ref_same = fa_references(q, k, v, params)
    assert_fa_rule(out, ref64, ref_same)
    assert_lse(lse, ref_lse)
    out, _ = flash_attention(q, k, v, params, fwd_cfg=cfg)
    assert_grads_fa_rule(out, ref64, ref_same, (q, k, v))


@pytest.mark.parametrize(("shape", "kw"), CASES, ids=str)
def test_gluon_backward(shape: tuple[int, ...], kw: dict) -> None:
    """The Hopper Gluon backward (dq by TMA reduce-add) by the FlashAttention rule, on every
    mask kind it declares, GQA, Sq != Sk and fully masked rows; the gradients of two runs
    agree to fp32 summation noise, and so do those of its timing variant."""
    from attnhub_triton_portable.autograd import flash_attention
    from attnhub_triton_portable.bwd import gluon_bwd_unsupported
    from attnhub_triton_portable.launch import DenseArgs

    b, sq, sk, hq, hkv, d = shape
    torch.manual_seed(sum(shape) + 1)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    params = AttnParams(scale=d ** -0.5, **kw)
    args = DenseArgs.from_params(q.detach(), k.detach(), v.detach(), params, "bshd")
    assert gluon_bwd_unsupported(args) is None
    ref64, _, ref_same = fa_references(q, k, v, params)
    out, lse = flash_attention(q, k, v, params, bwd_cfg=configs.GLUON_BWD_SM90)
    g = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    assert_grads_fa_rule(out, ref64, ref_same, (q, k, v))
    for a, c in zip(first, second):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), c.float(), atol=1e-2, rtol=1e-2)
    # its timing variants (one dQ buffer; the other step; the step with or without hoisted
    # addresses; the walks in parts, more parts than some walks have tiles included) give the
    # same gradients, so the default can move to any on this evidence
    from attnhub_triton_portable import bwd_gluon

    out = out.detach()
    delta = (out.float() * g.float()).sum(-1).transpose(1, 2).contiguous()  # lse's layout
    for variant in ({"_dq_bufs": 1}, {"_pipe": not bwd_gluon.PIPE},
                    {"_pipe": not bwd_gluon.PIPE, "_dq_bufs": 1},
                    {"_no_hoist": not bwd_gluon.NO_HOIST}, {"_tail_parts": 1},
                    {"_tail_parts": 3}, {"_tail_parts": 5, "_pipe": not bwd_gluon.PIPE},
                    {"_tail_parts": 16}):
        got = bwd_gluon.flash_bwd(args, out, lse, g, delta, **variant)
        for a, c in zip(first, got):
            torch.testing.assert_close(c.float(), a.float(), atol=1e-2, rtol=1e-2,
                                       msg=lambda m, v=variant: f"{v}: {m}")


def test_gluon_backward_last_wave_in_parts() -> None:
    """More programs than SMs: the last wave's key tiles walk their queries in parts (its
    default for an unmasked call, bwd_tail) and the gradients meet the FlashAttention rule
    and equal those of the walk in one piece to fp32 summation noise."""
    from attnhub_triton_portable import bwd_gluon, bwd_tail
    from attnhub_triton_portable.autograd import flash_attention
    from attnhub_triton_portable.launch import DenseArgs, sm_count

    sms = sm_count(0)
    b, sq, hq, hkv, d = 1, 512, 32, 16, 128
    sk = bwd_gluon.BLOCK_N * (sms // hkv + 1)  # a wave and a partial one
    units = sk // bwd_gluon.BLOCK_N * hkv
    assert units % sms and bwd_tail.tail_parts(units, sms, 2 * sq // bwd_gluon.BLOCK_M) > 1
    torch.manual_seed(7)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    params = AttnParams(scale=d ** -0.5)
    ref64, _, ref_same = fa_references(q, k, v, params)
    out, lse = flash_attention(q, k, v, params, bwd_cfg=configs.GLUON_BWD_SM90)
    assert_grads_fa_rule(out, ref64, ref_same, (q, k, v))
    args = DenseArgs.from_params(q.detach(), k.detach(), v.detach(), params, "bshd")
    g = torch.randn_like(out)
    out = out.detach()
    delta = (out.float() * g.float()).sum(-1).transpose(1, 2).contiguous()
    split = bwd_gluon.flash_bwd(args, out, lse, g, delta)
    whole = bwd_gluon.flash_bwd(args, out, lse, g, delta, _tail_parts=1)
    for a, c in zip(whole, split):
        assert torch.isfinite(c).all()
        torch.testing.assert_close(c.float(), a.float(), atol=1e-2, rtol=1e-2)


#: top-left window (100, 37), Sq 512 > Sk 256: rows 356.. see no key yet share a query tile
#: (and its key tiles) with rows that do; v's key 250 (seen by rows 213..350) holds NaN
_DEAD_SHAPE, _DEAD_KW, _NAN_KEY = (1, 512, 256, 4, 2, 128), {"window": (100, 37),
                                                             "alignment": "top_left"}, 250


def _dead_rows_case(seed: int) -> tuple:
    """(q, k, v with NaN at _NAN_KEY, the same v with 0 there, params, dead-row mask (Sq,),
    rows that see the NaN key (Sq,))."""
    b, sq, sk, hq, hkv, d = _DEAD_SHAPE
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    clean = v.clone()
    clean[:, _NAN_KEY] = 0
    v[:, _NAN_KEY] = float("nan")
    left, right = _DEAD_KW["window"]
    i = torch.arange(sq, device="cuda")
    dead = i - left > sk - 1
    sees = (i - left <= _NAN_KEY) & (_NAN_KEY <= i + right)
    return q, k, v, clean, AttnParams(scale=d ** -0.5, **_DEAD_KW), dead, sees


@pytest.mark.parametrize("cfg", configs.GLUON_SM90 + configs.GLUON_WS_SM90, ids=str)
def test_gluon_forward_dead_rows_stay_zero_under_nan_values(cfg: dict) -> None:
    """A row that sees no key, in a tile that loads a NaN value: output 0 and LSE -inf
    (its acc is zero weights times NaN = NaN; the epilogue divided it by a guarded 1)."""
    from attnhub_triton_portable.fwd import flash_fwd, gluon_missing, gluon_unsupported
    from attnhub_triton_portable.launch import DenseArgs

    if cfg.get("WS") and gluon_missing(ws=True) is not None:
        pytest.skip(gluon_missing(ws=True))
    q, k, v, _, params, dead, _ = _dead_rows_case(7)
    args = DenseArgs.from_params(q, k, v, params, "bshd")
    assert gluon_unsupported(args, cfg) is None
    out, lse = flash_fwd(args, cfg)
    assert bool(dead.any()) and not bool(dead.all())
    assert not bool(out[:, dead].isnan().any()) and not bool(out[:, dead].any())
    assert bool(torch.isneginf(lse[..., dead]).all())


def test_gluon_backward_nan_value_stays_in_rows_that_see_it() -> None:
    """NaN in the value of one key: dQ of the rows that do not see it (dead rows: exactly 0),
    and dK / dV of every other key, equal those of the same call with 0 there (dS took
    0 x NaN from that key's dP^T row for every query of its tile)."""
    from attnhub_triton_portable import bwd_gluon
    from attnhub_triton_portable.fwd import flash_fwd, gluon_unsupported
    from attnhub_triton_portable.launch import DenseArgs

    q, k, v, clean, params, dead, sees = _dead_rows_case(11)
    cfg = configs.GLUON_SM90[0]
    args_clean = DenseArgs.from_params(q, k, clean, params, "bshd")
    assert gluon_unsupported(args_clean, cfg) is None and bwd_gluon.supports(args_clean) is None
    out, lse = flash_fwd(args_clean, cfg)
    g = torch.randn_like(out)
    delta = (out.float() * g.float()).sum(-1).transpose(1, 2).contiguous()
    args_nan = DenseArgs.from_params(q, k, v, params, "bshd")
    keys = torch.arange(k.shape[1], device="cuda") != _NAN_KEY
    for variant in ({}, {"_pipe": not bwd_gluon.PIPE}, {"_no_hoist": not bwd_gluon.NO_HOIST}):
        want = bwd_gluon.flash_bwd(args_clean, out, lse, g, delta, **variant)
        dq, dk, dv = bwd_gluon.flash_bwd(args_nan, out, lse, g, delta, **variant)
        assert not bool(dq[:, dead].isnan().any()) and not bool(dq[:, dead].any()), variant
        close = dict(atol=1e-2, rtol=1e-2, msg=lambda m, v=variant: f"{v}: {m}")
        torch.testing.assert_close(dq[:, ~sees].float(), want[0][:, ~sees].float(), **close)
        torch.testing.assert_close(dk[:, keys].float(), want[1][:, keys].float(), **close)
        torch.testing.assert_close(dv[:, keys].float(), want[2][:, keys].float(), **close)
