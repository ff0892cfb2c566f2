"""The Hopper Gluon forward's selection rules (the kernel itself runs only on an sm90 GPU:
benchmarks/triton_dense_sweep.py checks it there by the FlashAttention rule)."""

from __future__ import annotations

import pytest
import torch
from attnhub_triton_portable import autograd, autotune, configs, fwd
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
    monkeypatch.setattr(autograd, "_FWD_CHOICE", {})  # the choice memo: no earlier call's
    monkeypatch.setattr(autograd, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(autotune, "pick", lambda key, cands, device, run: seen.append(
        (key, cands)) or cands[0])
    autograd.fwd_config_for(_args(causal=True))
    (key, cands), = seen
    assert len(cands) > 1 and not any(c.get("GLUON") for c in cands)
    assert key[-1] == (False,) * len(cands)  # eligibility is part of the tuning key


def test_the_config_is_chosen_once_per_call_signature(monkeypatch) -> None:
    """The filter and tuning run once per exact signature; another geometry, alignment or
    mask choosing again (a memo that ignored one would hand a Gluon config to a call the
    kernel cannot take)."""
    pytest.importorskip("attnhub_triton_portable.fwd_gluon")
    seen: list = []
    monkeypatch.setattr(autograd, "_FWD_CHOICE", {})
    monkeypatch.setattr(autograd, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(fwd, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(autotune, "pick", lambda key, cands, device, run: seen.append(
        (key, cands)) or cands[-1])
    q = torch.randn(2, 256, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 256, 2, 128, dtype=torch.bfloat16)
    base = torch.randn(2 * 256 * 4 * 128 + 1, dtype=torch.bfloat16)
    shifted = base[1:].view(2, 256, 4, 128)  # the same geometry, 2 bytes off alignment

    def choose(q: torch.Tensor, **kw: object) -> dict:
        args = DenseArgs.from_params(q, k, k.clone(), AttnParams(scale=0.1, **kw), "bshd")
        return autograd.fwd_config_for(args)

    first = choose(q)
    assert choose(torch.randn_like(q)) is first and len(seen) == 1  # new tensors, same call
    choose(q, causal=True)
    choose(q, window=(64, 0))
    choose(q[:, :128])
    choose(shifted)
    assert len(seen) == 5
    assert any(c.get("GLUON") for c in seen[0][1])  # the aligned call may take one
    assert not any(c.get("GLUON") for c in seen[-1][1])  # the misaligned one never


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


class _Recording:
    """Stands in for ``fastlaunch.Launcher``: records each launch's arguments by name."""

    def __init__(self, made: list, kernel) -> None:
        self.made, self.kernel = made, kernel

    def __call__(self, fn, grid, options):  # the Launcher's constructor
        rec = self

        class One:
            def __init__(self) -> None:
                self.grid, self.options, self.calls = grid, options, []
                rec.made.append(self)

            def __call__(self, device, stream, direct, args) -> None:
                self.calls.append(dict(zip(rec.kernel.arg_names, args, strict=True)))

        return One()


def _recording(monkeypatch, kernel, table) -> list:
    from attnhub_triton_portable import fastlaunch

    made: list = []
    monkeypatch.setattr(fastlaunch, "Launcher", _Recording(made, kernel))
    monkeypatch.setattr(fastlaunch, "launch_state", lambda index: (0, 0, True))
    monkeypatch.setattr(table, "entries", {})
    return made


@pytest.mark.parametrize("ws", [False, True])
def test_the_launch_binds_every_parameter_in_order_once_per_key(monkeypatch, ws: bool) -> None:
    """The launch skips Triton's dispatch after its first call, so it passes every kernel
    parameter positionally itself: each must land on its name (the binary would otherwise
    read a stride as a length), and one launch serves one specialization only."""
    fwd_gluon = pytest.importorskip("attnhub_triton_portable.fwd_gluon")
    mod = pytest.importorskip("attnhub_triton_portable.fwd_gluon_ws") if ws else fwd_gluon
    kernel = mod._fwd_ws_kernel if ws else mod._fwd_kernel
    made = _recording(monkeypatch, kernel, fwd_gluon._LAUNCHES)
    cfg = configs.GLUON_WS_WINNERS[0] if ws else GLUON
    run = mod.flash_fwd
    args = _args(sq=256, sk=512, causal=True, window=(100, 0))
    out, lse = run(args, cfg)
    got = made[0].calls[0]
    assert got["O"] is out and got["LSE"] is lse
    assert (got["sob"], got["sos"], got["soh"]) == args.bsh_strides(out)
    assert (got["slb"], got["slh"]) == args.lse_strides(lse)
    assert (got["seqlen_q"], got["seqlen_k"], got["num_heads"], got["group"]) == (256, 512, 4, 2)
    assert (got["left"], got["right"]) == (100, 0)
    assert got["scale2"] == pytest.approx(args.scale * 1.4426950408889634)
    assert got["q_desc"].base is args.q and got["k_desc"].base is args.k
    assert got["v_desc"].base is args.v and got["HEAD_DIM"] == 128
    assert got["CAUSAL"] is True and got["WIN_LEFT"] is True and got["WIN_RIGHT"] is True
    assert got["BLOCK_N"] == cfg["BLOCK_N"] and "num_warps" in made[0].options
    rows, q_rows = (mod.BLOCK_M, mod.HALF_M) if ws else (cfg["BLOCK_M"], cfg["BLOCK_M"])
    assert made[0].grid == (-(-256 // rows), 2 * 4)
    assert list(got["q_desc"].block_shape) == [q_rows, 128]
    assert list(got["k_desc"].block_shape) == [cfg["BLOCK_N"], 128]
    run(_args(sq=256, sk=512, causal=True, window=(100, 0)), cfg)  # new tensors, same key
    assert len(made) == 1 and len(made[0].calls) == 2
    run(_args(sq=256, sk=256, causal=True, window=(100, 0)), cfg)  # another key length
    run(_args(sq=256, sk=512, causal=True, window=(200, 0)), cfg)  # another window
    assert len(made) == 3


def test_the_backward_launch_binds_every_parameter_in_order_once_per_key(monkeypatch) -> None:
    """The Gluon backward launches the same way (Triton's dispatch on a key's first call
    only): every parameter lands on its name, its variants and shapes are keys of their own,
    and the gradients' buffers are fresh each call."""
    bwd_gluon = pytest.importorskip("attnhub_triton_portable.bwd_gluon")
    made = _recording(monkeypatch, bwd_gluon._bwd_kernel, bwd_gluon._LAUNCHES)

    def run(args, **kw):
        out = torch.randn_like(args.q)
        lse = torch.randn(args.batch, args.num_heads, args.seqlen_q)
        return bwd_gluon.flash_bwd(args, out, lse, torch.randn_like(out), lse.clone(), **kw)

    args = _args(sq=256, sk=512, causal=True, window=(100, 0))
    dq, dk, dv = run(args)
    got = made[0].calls[0]
    assert got["DK"] is dk and got["DV"] is dv and dq.shape == args.q.shape
    assert (got["sdkb"], got["sdks"], got["sdkh"]) == args.bsh_strides(dk)
    assert (got["sdvb"], got["sdvs"], got["sdvh"]) == args.bsh_strides(dv)
    assert (got["seqlen_q"], got["seqlen_k"], got["num_heads"], got["num_kv_heads"],
            got["group"]) == (256, 512, 4, 2, 2)
    assert (got["left"], got["right"]) == (100, 0)
    assert got["scale"] == pytest.approx(args.scale)
    assert got["scale2"] == pytest.approx(args.scale * 1.4426950408889634)
    assert got["q_desc"].base is args.q and got["k_desc"].base is args.k
    assert got["v_desc"].base is args.v and got["dq_desc"].base.dtype == torch.float32
    assert list(got["do_desc"].block_shape) == [bwd_gluon.BLOCK_M, 128]
    assert got["CAUSAL"] is True and got["WIN_LEFT"] is True and got["HEAD_DIM"] == 128
    assert got["NO_HOIST"] is bwd_gluon.NO_HOIST and got["STAGES"] == bwd_gluon.STAGES
    units = 512 // bwd_gluon.BLOCK_N * 2 * 2  # key tiles x batch x KV heads
    assert made[0].grid == (units, ) and got["n_key_tiles"] == 512 // bwd_gluon.BLOCK_N
    assert (got["full_units"], got["tail_parts"]) == (units, 1)  # masked: never in parts
    assert got["key_desc"] == int(bwd_gluon.KEY_DESC)
    assert made[0].options == {"num_warps": bwd_gluon.NUM_WARPS, "num_stages": 1}
    again = run(_args(sq=256, sk=512, causal=True, window=(100, 0)))  # same key
    assert len(made) == 1 and len(made[0].calls) == 2
    assert made[0].calls[1]["DK"] is again[1] and again[1] is not dk
    run(_args(sq=256, sk=256, causal=True, window=(100, 0)))  # another key length
    run(_args(sq=256, sk=512, causal=True, window=(200, 0)))  # another window
    run(args, _no_hoist=not bwd_gluon.NO_HOIST)  # a timing variant
    assert len(made) == 4 and made[3].calls[0]["NO_HOIST"] is not bwd_gluon.NO_HOIST


def test_the_backward_last_wave_in_parts_gets_slots_and_is_combined(monkeypatch) -> None:
    """An unmasked call whose programs leave a partial last wave: those programs run in
    parts (more programs in the grid, each part its scratch slot), and the parts' slots are
    summed into exactly the gradients the kernel was handed."""
    bwd_gluon = pytest.importorskip("attnhub_triton_portable.bwd_gluon")
    from attnhub_triton_portable import bwd_tail

    made = _recording(monkeypatch, bwd_gluon._bwd_kernel, bwd_gluon._LAUNCHES)
    combined = []
    monkeypatch.setattr(bwd_tail, "combine", lambda *a: combined.append(a))
    monkeypatch.setattr(bwd_gluon, "STUB_SMS", 6)
    args = _args(sq=1024, sk=512)  # 4 key tiles x 2 x 2 = 16 programs: 12 whole, 4 left
    walk = args.group * 1024 // bwd_gluon.BLOCK_M
    parts = bwd_tail.tail_parts(16, 6, walk)
    assert parts > 1
    out = torch.randn_like(args.q)
    lse = torch.randn(args.batch, args.num_heads, args.seqlen_q)
    _, dk, dv = bwd_gluon.flash_bwd(args, out, lse, torch.randn_like(out), lse.clone())
    got = made[0].calls[0]
    assert made[0].grid == (12 + 4 * parts, )
    assert (got["full_units"], got["tail_parts"], got["n_key_tiles"]) == (12, parts, 4)
    slots = got["Slots"]
    assert slots.dtype == torch.float32 and slots.shape == (4 * parts, 2, 128, 128)
    assert len(combined) == 1
    assert combined[0][0] is slots and combined[0][1] is dk and combined[0][2] is dv
    assert combined[0][3:] == (12, 4, parts, int(bwd_gluon.KEY_DESC))
    bwd_gluon.flash_bwd(args, out, lse, torch.randn_like(out), lse.clone(), _tail_parts=1)
    assert made[-1].grid == (16, ) and len(combined) == 1  # asked whole: no parts
    with pytest.raises(ValueError, match="_tail_parts=0"):
        bwd_gluon.flash_bwd(args, out, lse, torch.randn_like(out), lse.clone(), _tail_parts=0)


def test_a_launch_missing_a_constexpr_names_the_place_and_the_fix(monkeypatch) -> None:
    """Positional launches cannot leave a constexpr to Triton's binder: one the kernel
    takes and the launch lacks is an error naming both lists, before anything runs."""
    fwd_gluon = pytest.importorskip("attnhub_triton_portable.fwd_gluon")
    class Kernel:  # hashable, as a JIT function is (the launch key holds it)
        __name__ = "_fake_kernel"
        arg_names = [*fwd_gluon._fwd_kernel.arg_names, "EXTRA"]

    kernel = Kernel()
    monkeypatch.setattr(fwd_gluon._LAUNCHES, "entries", {})
    with pytest.raises(TypeError, match="fwd_gluon.launch: _fake_kernel.*EXTRA.*pass every"):
        fwd_gluon.launch(kernel, _args(), 64, 64, 64, BLOCK_M=64, NUM_WARPS=4, P_SMEM=True,
                         num_warps=4)


@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_every_hopper_kernel_builds_for_sm90_with_this_triton(kernel: str) -> None:
    """Every Gluon forward config (warp-specialised and not) and mask form, and the backward
    with its timing variants, compiled for sm90 offline with the installed Triton
    (benchmarks/gluon_sm90_offline.py, in a subprocess: the stub driver stays there).
    Triton 3.8/3.9 renamed the TMA load and the CTA barrier, whose old names raise only when
    a kernel compiles (``gluon_compat`` binds them); the shared memory of each build fits
    sm90's 227 KB and the SASS has its wgmmas."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "plugins" / "triton_portable"),
                                         env.get("PYTHONPATH", "")])
    flags = ["--bwd"] if kernel == "backward" else []
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "gluon_sm90_offline.py"),
                          "--dump", f"/tmp/attnhub_gluon_{kernel}_test", *flags],
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    built = re.findall(r"^OK .* smem=(\d+) .*HGMMA=(\d+)", run.stdout, re.M)
    if not built and "ptxas" in run.stdout + run.stderr:
        pytest.skip("no sm90 toolchain in this Triton")
    assert "FAIL" not in run.stdout and run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    # the backward: the shipped build, the pipelined step, and that step with one dQ buffer
    builds = 3 if kernel == "backward" else len(configs.GLUON_WS_SM90) + len(configs.GLUON_SM90)
    assert len(built) == 4 * builds, run.stdout
    assert all(int(smem) <= 227 * 1024 and int(hgmma) > 0 for smem, hgmma in built), built
