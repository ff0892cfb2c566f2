"""The Hopper Gluon forward's selection rules (the kernel itself runs only on an sm90 GPU:
benchmarks/triton_dense_sweep.py checks it there by the FlashAttention rule)."""

from __future__ import annotations

import pytest
import torch
from attnhub_triton_portable import autograd, autotune, configs
from attnhub_triton_portable.fwd import flash_fwd, gluon_unsupported
from attnhub_triton_portable.launch import DenseArgs

from attnhub.plugin import AttnParams, InputError

GLUON = configs.GLUON_SM90[0]


def _args(sq: int = 256, sk: int = 256, d: int = 128, dtype: torch.dtype = torch.bfloat16,
          **kw: object) -> DenseArgs:
    q = torch.randn(2, sq, 4, d, dtype=dtype)
    k = torch.randn(2, sk, 2, d, dtype=dtype)
    return DenseArgs.from_params(q, k, k.clone(), AttnParams(scale=d ** -0.5, **kw), "bshd")


def test_candidates_only_where_the_kernel_exists() -> None:
    assert all(c in configs.fwd_candidates("sm90", 128, "bf16", True) for c in configs.GLUON_SM90)
    # the warp-specialised winners are timed too (every one a checked GLUON_WS_SM90 config),
    # at d 64 and 128, the losing pp1 schedule not
    for d in (64, 128):
        cands = configs.fwd_candidates("sm90", d, "bf16", False)
        ws = [c for c in cands if c.get("WS")]
        assert ws == configs.GLUON_WS_WINNERS and all(c in configs.GLUON_WS_SM90 for c in ws)
        assert {c["PINGPONG"] for c in ws} == {0, 2}
    assert all(c.get("GLUON") and c["BLOCK_M"] % 64 == 0 for c in configs.GLUON_SM90)
    for arch, d, dtype in (("sm90", 96, "bf16"), ("sm90", 128, "fp32"), ("sm80", 128, "bf16"),
                           ("gfx942", 128, "bf16"), ("cpu", 128, "bf16")):
        assert not any(c.get("GLUON") for c in configs.fwd_candidates(arch, d, dtype, False))


def test_asking_for_it_off_hopper_names_the_reason() -> None:
    args = _args()
    assert "NVIDIA" in (gluon_unsupported(args, GLUON) or "")
    with pytest.raises(InputError, match="GLUON=True.*NVIDIA"):
        flash_fwd(args, GLUON)


def test_autotuner_never_sees_a_gluon_candidate_the_call_cannot_take(monkeypatch) -> None:
    seen: list = []
    monkeypatch.setattr(autograd, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(autotune, "pick", lambda key, cands, device, run: seen.append(
        (key, cands)) or cands[0])
    autograd.fwd_config_for(_args(causal=True))
    (key, cands), = seen
    assert len(cands) > 1 and not any(c.get("GLUON") for c in cands)
    assert key[-1] == (False,) * len(cands)  # eligibility is part of the tuning key


@pytest.mark.parametrize(("kw", "reason"), [
    ({"dtype": torch.float32}, "dtype"),
    ({"d": 96}, "head dim"),
    ({"sq": 200}, "multiple"),
    ({"sk": 100}, "multiple"),
    ({"sk": 0}, "empty key"),
    ({"softcap": 30.0}, "softcap"),
    ({"causal": True, "prefix_lens": torch.tensor([3, 4])}, "prefix-LM"),
])
def test_scope_of_the_kernel(kw: dict, reason: str) -> None:
    fwd_gluon = pytest.importorskip("attnhub_triton_portable.fwd_gluon")
    assert reason in (fwd_gluon.supports(_args(**kw), GLUON) or "")


def test_scope_takes_masks_gqa_and_rejects_unpacked_heads() -> None:
    fwd_gluon = pytest.importorskip("attnhub_triton_portable.fwd_gluon")
    for kw in ({}, {"causal": True}, {"causal": True, "window": (64, 0)},
               {"window": (100, 37), "alignment": "top_left"}):
        assert fwd_gluon.supports(_args(**kw), GLUON) is None
    q = torch.randn(2, 4, 256, 128, dtype=torch.bfloat16).transpose(1, 2)  # bhsd storage
    args = DenseArgs.from_params(q, q, q, AttnParams(scale=0.1), "bshd")
    assert "packed" in (fwd_gluon.supports(args, GLUON) or "")
    thd = torch.randn(512, 4, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 256, 512], dtype=torch.int32)
    args = DenseArgs.from_params(thd, thd, thd, AttnParams(
        scale=0.1, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=256, max_seqlen_k=256), "thd")
    assert "varlen" in (fwd_gluon.supports(args, GLUON) or "")


WS = configs.GLUON_WS_SM90[0]


def test_warp_specialised_variant_scope() -> None:
    ws = pytest.importorskip("attnhub_triton_portable.fwd_gluon_ws")
    assert all(c.get("GLUON") and c.get("WS") and c["BLOCK_M"] == ws.BLOCK_M
               for c in configs.GLUON_WS_SM90)
    for kw in ({}, {"causal": True}, {"causal": True, "alignment": "top_left"},
               {"causal": True, "window": (64, 0)}, {"window": (100, 37)}):
        assert ws.supports(_args(**kw), WS) is None
    assert "multiple of 128" in (ws.supports(_args(sq=192), WS) or "")
    assert "BLOCK_M" in (ws.supports(_args(), {**WS, "BLOCK_M": 64}) or "")
    assert "head dim" in (ws.supports(_args(d=96), WS) or "")
    meta = ws.launch_meta(WS)  # 12 warps x maxnreg must fit the register file
    assert meta["num_warps"] == 4 and meta["maxnreg"] * 12 * 32 <= 65536


def test_warp_specialised_variant_off_hopper_names_the_reason() -> None:
    args = _args()
    assert "NVIDIA" in (gluon_unsupported(args, WS) or "")
    with pytest.raises(InputError, match="GLUON=True.*NVIDIA"):
        flash_fwd(args, WS)


@pytest.mark.parametrize("ws", [False, True])
def test_both_gluon_forwards_launch_with_the_same_arguments(monkeypatch, ws) -> None:
    """The two Hopper forwards share one host launcher: q/k/v descriptors of their tile
    rows, the output strides, lengths, head counts, scale in log2 units, window bounds and
    mask constants, then each kernel's own meta (recorded on a fake kernel, no GPU)."""
    from attnhub_triton_portable import fwd_gluon, fwd_gluon_ws

    calls: list = []

    class Fake:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    monkeypatch.setattr(fwd_gluon, "_desc", lambda t, rows, d: (t.data_ptr(), rows, d))
    args = _args(sq=300, sk=200, causal=True)
    if ws:
        monkeypatch.setattr(fwd_gluon_ws, "_fwd_ws_kernel", Fake())
        config = configs.GLUON_WS_SM90[0]
        out, lse = fwd_gluon_ws.flash_fwd(args, config)
        rows, q_rows = fwd_gluon_ws.BLOCK_M, fwd_gluon_ws.HALF_M
        meta = fwd_gluon_ws.launch_meta(config)
    else:
        monkeypatch.setattr(fwd_gluon, "_fwd_kernel", Fake())
        config = GLUON
        out, lse = fwd_gluon.flash_fwd(args, config)
        rows = q_rows = config["BLOCK_M"]
        meta = {"BLOCK_M": rows, "NUM_WARPS": config["num_warps"],
                "P_SMEM": bool(config.get("P_SMEM", True)), "num_warps": config["num_warps"],
                "num_stages": 1}
    (grid, a, kw), = calls
    bn = config["BLOCK_N"]
    assert grid == (-(-300 // rows), 2 * 4)
    assert a[:3] == ((args.q.data_ptr(), q_rows, 128), (args.k.data_ptr(), bn, 128),
                     (args.v.data_ptr(), bn, 128))
    assert a[3] is out and a[4] is lse and out.shape == args.q.shape
    assert a[-7:] == (300, 200, 4, 2, args.scale * fwd_gluon._LOG2E, args.left, args.right)
    assert kw == {"HEAD_DIM": 128, "BLOCK_N": bn, "CAUSAL": True, "BOTTOM_RIGHT": True,
                  "WIN_LEFT": args.left >= 0, "WIN_RIGHT": args.right >= 0, **meta}
