"""On an sm90 GPU: the warp-specialised Gluon forward (:mod:`.fwd_gluon_ws`, each config of
``configs.GLUON_WS_SM90``) against the fp64 reference by the FlashAttention rule, LSE
included, every output element written (poisoned first), the same bits on a second run (a
moving result would be a race between the partitions), and the gradients of
``flash_attention`` when the forward ran on it."""

from __future__ import annotations

import pytest
import torch
from attnhub_triton_portable import configs
from attnhub_triton_portable.fwd import gluon_missing

from attnhub.plugin import AttnParams
from attnhub.testing import assert_fa_rule, assert_grads_fa_rule, assert_lse, fa_references


_MISSING = gluon_missing(ws=True)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]

#: (b, sq, sk, hq, hkv, d), params: full, both causal alignments (bottom-right with fully
#: masked rows), windows, GQA, d 64, and more key tiles than K/V stages.
CASES = [
    ((2, 256, 256, 8, 2, 128), {}),
    ((1, 256, 512, 4, 4, 128), {"causal": True}),
    ((1, 512, 256, 4, 2, 128), {"causal": True}),  # bottom-right: 256 fully masked rows
    ((1, 256, 512, 4, 2, 128), {"causal": True, "alignment": "top_left"}),
    ((2, 512, 512, 4, 1, 128), {"causal": True, "window": (128, 0)}),
    ((1, 384, 384, 4, 2, 64), {"window": (100, 37), "alignment": "top_left"}),
    ((1, 1024, 1024, 8, 2, 128), {"causal": True, "window": (300, 0)}),
]


def run_case(cfg: dict, shape: tuple[int, ...], kw: dict, grads: bool = True) -> dict:
    """Check one case; returns the errors (also used by benchmarks/gluon_ws.py)."""
    from attnhub_triton_portable.autograd import flash_attention
    from attnhub_triton_portable.fwd import flash_fwd, gluon_unsupported
    from attnhub_triton_portable.launch import DenseArgs

    from attnhub.testing import fa_rule_error

    b, sq, sk, hq, hkv, d = shape
    torch.manual_seed(sum(shape) + len(kw))
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    params = AttnParams(scale=d ** -0.5, **kw)
    args = DenseArgs.from_params(q.detach(), k.detach(), v.detach(), params, "bshd")
    assert gluon_unsupported(args, cfg) is None, gluon_unsupported(args, cfg)
    torch.cuda.empty_cache()
    outs = []
    for _ in range(2):
        # poison what torch.empty_like hands out next: NaN left behind would fail the rule
        torch.full((b, sq, hq, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        out, lse = flash_fwd(args, cfg)
        outs.append((out, lse))
    (out, lse), (out2, lse2) = outs
    ref64, ref_lse, ref_same = fa_references(q, k, v, params)
    assert not torch.isnan(out).any(), "NaN in output (an unwritten element?)"
    assert_fa_rule(out, ref64, ref_same)
    assert_lse(lse, ref_lse)
    same = torch.equal(out, out2) and torch.equal(lse, lse2)
    assert same, "second run differs: a race between partitions"
    err, allowed = fa_rule_error(out, ref64, ref_same)
    fin = ~torch.isinf(ref_lse)
    lse_err = float((lse.float() - ref_lse.detach().float())[fin].abs().max()) if fin.any() else 0.0
    if grads:
        out, _ = flash_attention(q, k, v, params, fwd_cfg=cfg)
        assert_grads_fa_rule(out, ref64, ref_same, (q, k, v))
    return {"err": err, "allowed": allowed, "lse_err": lse_err, "bitwise_rerun": same}


def _cfg_id(c: dict) -> str:
    return f"pp{c['PINGPONG']}kv{c['KV_STAGES']}"


def _case_id(case: object) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in str(case)).strip("_")


@pytest.mark.parametrize("cfg", configs.GLUON_WS_SM90, ids=_cfg_id)
@pytest.mark.parametrize(("shape", "kw"), CASES, ids=_case_id)
def test_gluon_ws_forward_and_grads(cfg: dict, shape: tuple[int, ...], kw: dict) -> None:
    run_case(cfg, shape, kw)


def test_gluon_ws_scope() -> None:
    from attnhub_triton_portable.fwd import gluon_unsupported
    from attnhub_triton_portable.launch import DenseArgs

    cfg = configs.GLUON_WS_SM90[0]
    q = torch.randn(1, 192, 4, 128, device="cuda", dtype=torch.bfloat16)
    args = DenseArgs.from_params(q, q, q, AttnParams(scale=0.1), "bshd")
    assert "multiple of 128" in (gluon_unsupported(args, cfg) or "")
    assert gluon_unsupported(args, {**cfg, "BLOCK_M": 64}) is not None


@pytest.mark.parametrize("cfg", [configs.GLUON_WS_WINNERS[0], configs.GLUON_SM90[0]],
                         ids=["ws", "plain"])
def test_later_launches_read_their_own_tensors(cfg: dict) -> None:
    """After its first call a key launches the binary directly (``fwd_gluon.launch``):
    calls with fresh tensors of the same shape must each compute their own attention."""
    from attnhub_triton_portable.fwd import flash_fwd
    from attnhub_triton_portable.launch import DenseArgs

    params = AttnParams(scale=128 ** -0.5, causal=True)
    for seed in range(3):
        torch.manual_seed(seed)
        q = torch.randn(2, 512, 8, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 512, 2, 128, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        out, lse = flash_fwd(DenseArgs.from_params(q, k, v, params, "bshd"), cfg)
        ref64, ref_lse, ref_same = fa_references(q, k, v, params)
        assert_fa_rule(out, ref64, ref_same)
        assert_lse(lse, ref_lse)
