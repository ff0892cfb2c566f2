"""The Hopper Gluon backward's selection rules, on the CPU. Its gradients are checked on an
sm90 GPU by the FlashAttention rule (test_dense_gluon_gpu.py), its sm90 build offline
(test_dense_gluon.py); here: it is a candidate only where it can serve, never when
``deterministic`` asks for reproducible gradients, and a call it cannot take never reaches
it (the autotuner times what it is handed, not whether the gradients are right)."""

from __future__ import annotations

import pytest
import torch
from attnhub_triton_portable import autograd, autotune, bwd, configs
from attnhub_triton_portable.bwd import flash_bwd, gluon_bwd_unsupported
from attnhub_triton_portable.launch import DenseArgs

from attnhub.plugin import AttnParams, InputError

bwd_gluon = pytest.importorskip("attnhub_triton_portable.bwd_gluon")
GLUON = configs.GLUON_BWD_SM90


def _args(sq: int = 256, sk: int = 256, d: int = 128, dtype: torch.dtype = torch.bfloat16,
          **kw: object) -> DenseArgs:
    g = torch.Generator().manual_seed(sq + sk + d)
    q = torch.randn(2, sq, 4, d, dtype=dtype, generator=g)
    k = torch.randn(2, sk, 2, d, dtype=dtype, generator=g)
    return DenseArgs.from_params(q, k, k.clone(), AttnParams(scale=d ** -0.5, **kw), "bshd")


def test_a_candidate_on_hopper_only_and_never_when_deterministic() -> None:
    for d, causal in ((128, False), (64, True)):
        assert GLUON in configs.bwd_candidates("sm90", d, "bf16", causal, False)
        assert GLUON not in configs.bwd_candidates("sm90", d, "bf16", causal, True)
    for arch, d, dtype in (("sm80", 128, "bf16"), ("gfx942", 128, "bf16"), ("cpu", 128, "bf16"),
                           ("sm90", 128, "fp32"), ("sm90", 96, "bf16")):
        assert GLUON not in configs.bwd_candidates(arch, d, dtype, False, False)


@pytest.mark.parametrize(("kw", "reason"), [
    ({"dtype": torch.float16}, "bf16 only"),
    ({"dtype": torch.float32}, "dtype"),
    ({"d": 96}, "head dim"),
    ({"sq": 200}, "multiple"),
    ({"sk": 192}, "multiple"),
    ({"sq": 0}, "empty query"),
    ({"sk": 0}, "empty key"),
    ({"softcap": 30.0}, "softcap"),
    ({"causal": True, "prefix_lens": torch.tensor([3, 4])}, "prefix-LM"),
])
def test_scope_of_the_kernel(kw: dict, reason: str) -> None:
    assert reason in (bwd_gluon.supports(_args(**kw)) or "")


def test_scope_takes_the_masks_it_declares() -> None:
    for kw in ({}, {"causal": True}, {"causal": True, "alignment": "top_left"},
               {"causal": True, "window": (64, 0)}, {"window": (100, 37)}):
        assert bwd_gluon.supports(_args(**kw)) is None
    assert bwd_gluon.supports(_args(sq=512, sk=256, causal=True)) is None  # Sq != Sk


def test_asked_for_off_hopper_it_names_the_reason_and_the_fix() -> None:
    args = _args()
    assert "sm90" in (gluon_bwd_unsupported(args) or "")
    q = args.q
    out, lse = torch.randn_like(q), torch.randn(2, 4, 256)
    with pytest.raises(InputError, match="GLUON=True.*drop GLUON"):
        flash_bwd(args, out, lse, torch.randn_like(q), GLUON)


@pytest.mark.parametrize(("kw", "deterministic", "offered"), [
    ({}, False, True),
    ({"causal": True}, False, True),
    ({}, True, False),                      # reproducible gradients: no reduce-add
    ({"sq": 200}, False, False),            # outside the kernel's tiles
    ({"dtype": torch.float16}, False, False),
])
def test_the_autotuner_sees_it_only_where_the_call_can_take_it(
        monkeypatch, kw: dict, deterministic: bool, offered: bool) -> None:
    seen: list = []
    for mod in (autograd, bwd):
        monkeypatch.setattr(mod, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(autotune, "pick", lambda key, cands, device, run: seen.append(
        (key, cands)) or cands[0])
    args = _args(**kw)
    out, lse = torch.randn_like(args.q), torch.randn(2, 4, args.seqlen_q)
    autograd.bwd_config_for(args, out, lse, torch.randn_like(out), deterministic)
    (key, cands), = seen
    assert any(c.get("GLUON") for c in cands) is offered
    assert key[-1] is offered  # eligibility is part of the tuning key
    assert all(c.get("dq_mode", "separate") == "separate" for c in cands) or not deterministic

