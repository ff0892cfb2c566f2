"""The Gluon paged FP8 decode pass (``config.gluon``): who may take it, why others are
refused, and that it is launched with exactly the split kernel's arguments. The kernel
runs only on an sm90 GPU (test_decode_gluon_gpu.py); here launches are recorded."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # Triton reads this when a kernel is decorated (import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnhub_triton_portable import decode, decode_gluon
from attnhub_triton_portable.decode_configs import GLUON_FP8_PAGED, decode_config

E4M3 = torch.float8_e4m3fn

#: what the kernel serves; each refusal below changes one thing
OK: dict[str, Any] = {
    "arch": "sm90", "interpreted": False, "q_dtype": torch.bfloat16, "seqlen_q": 1,
    "group": 4, "head_dim": 128, "paged": True, "has_seqlens": True, "kv_fp8": True,
    "window": False, "softcap": False, "alibi": False, "fused_merge": False, "block_n": 16,
    "num_warps": 1, "min_block_m": 0, "v_ahead": False}


#: How a refused ``config.gluon`` call starts its error (the reason follows).
ASKS = "config.gluon asks for the Gluon pass 1, but "

def test_never_chosen_by_the_table() -> None:
    """The table holds portable rows only: the Gluon pass is taken per call, where its
    ``supports`` admits the call (``_Shape._gluon_default``)."""
    for arch in ("cpu", "sm80", "sm89", "sm90", "sm100", "gfx942", "other"):
        for paged in (False, True):
            for fp8 in (False, True):
                for programs in (None, (8, 132), (4096, 132)):
                    for dtype in ("bf16", "fp16", "fp32"):
                        assert not decode_config(arch, dtype, paged, fp8, programs).gluon
    assert GLUON_FP8_PAGED.gluon and GLUON_FP8_PAGED.block_n in decode_gluon.BLOCK_NS


def test_supports_the_served_call() -> None:
    assert decode_gluon.supports(**OK) is None
    for change in ({"q_dtype": torch.float16}, {"group": 16}, {"group": 1},
                   {"block_n": 32}, {"min_block_m": 16}, {"v_ahead": True},
                   {"ring": 2}, {"ring": 4}, {"ring": 8, "block_n": 32}):
        assert decode_gluon.supports(**{**OK, **change}) is None, change


@pytest.mark.parametrize(("change", "reason"), [
    ({"interpreted": True}, "interpreter"),
    ({"arch": "cpu"}, "interpreter"),
    ({"arch": "sm80"}, "sm90.*not sm80"),
    ({"arch": "sm100"}, "not sm100"),
    ({"paged": False}, "paged e4m3"),
    ({"kv_fp8": False}, "paged e4m3"),
    ({"has_seqlens": False}, "paged e4m3"),
    ({"q_dtype": torch.float32}, "bf16 or fp16"),
    ({"head_dim": 64}, "head dim 64"),
    ({"seqlen_q": 2}, "Sq = 1"),
    ({"group": 17}, "GQA group 17"),
    ({"window": True}, "window not implemented"),
    ({"softcap": True, "alibi": True}, "softcap, alibi not"),
    ({"fused_merge": True}, "fused_merge"),
    ({"v_ahead": True, "block_n": 32}, "fp8_v_ahead with block_n 32"),
    ({"block_n": 64}, "block_n 64"),
    ({"num_warps": 4}, "num_warps=1"),
    ({"min_block_m": 64}, "min_block_m 64"),
    ({"ring": 3}, "fp8_ring 3: a ring of 2, 4, 8 slots"),
    ({"ring": 1}, "fp8_ring 1"),
    ({"ring": 4, "v_ahead": True}, "fp8_ring with fp8_v_ahead"),
])
def test_refusals_name_their_reason(change: dict[str, Any], reason: str) -> None:
    why = decode_gluon.supports(**{**OK, **change})
    assert why is not None
    assert __import__("re").search(reason, why), why


def _paged_call(d: int = 128, hq: int = 32, hkv: int = 8, sq: int = 1,
                dtype: torch.dtype = torch.bfloat16, b: int = 3
                ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    page, pages = 16, 8 * b
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(pages, page, hkv, d, generator=g).to(E4M3)
    v = torch.randn(pages, page, hkv, d, generator=g).to(E4M3)
    table = torch.randperm(pages, generator=g)[:6 * b].view(b, 6).to(torch.int32)
    kw = {"scale": d ** -0.5, "block_table": table,
          "seqlens_k": torch.tensor([70, 0, 96] * (b // 3), dtype=torch.int32),
          "k_descale": torch.rand(pages, hkv, generator=g) + 0.01,
          "v_descale": torch.rand(pages, hkv, generator=g) + 0.01}
    return (q, k, v), kw


def test_asking_for_it_in_the_interpreter_says_why() -> None:
    if decode._split_kernel.__class__.__name__ != "InterpretedFunction":
        pytest.skip("decode was imported for a GPU")
    (q, k, v), kw = _paged_call()
    with pytest.raises(ValueError,
                       match=ASKS + "Gluon kernels do not run.*drop gluon from the config"):
        decode.decode_attention(q, k, v, config=GLUON_FP8_PAGED, **kw)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr() or (
            a.shape == b.shape and a.dtype == b.dtype)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("splits", [1, 3])
def test_launched_with_the_split_kernels_arguments(recorded: list[tuple[Any, ...]],
                                                   splits: int) -> None:
    """Same argument tuple as ``_split_kernel`` under an equal portable config, but the
    Gluon kernel, one warp, and the merge unchanged."""
    (q, k, v), kw = _paged_call()
    portable = GLUON_FP8_PAGED.with_(gluon=False)
    decode.decode_attention(q, k, v, config=GLUON_FP8_PAGED, num_splits=splits, **kw)
    decode.decode_attention(q, k, v, config=portable, num_splits=splits, **kw)
    n = 2 if splits > 1 else 1
    assert len(recorded) == 2 * n
    (g_fn, g_grid, g_opt, g_args), (p_fn, p_grid, p_opt, p_args) = recorded[0], recorded[n]
    assert g_fn is decode_gluon._fp8_paged_split_kernel and p_fn is decode._split_kernel
    assert g_grid == p_grid == (splits, 3 * 8)
    assert g_opt["num_warps"] == 1 and "maxnreg" not in g_opt
    assert len(g_args) == len(p_args) == len(decode_gluon._fp8_paged_split_kernel.arg_names)
    names = decode_gluon._fp8_paged_split_kernel.arg_names
    assert names == decode._split_kernel.arg_names
    for name, a, b in zip(names, g_args, p_args):
        if name in ("Out", "Lse", "OP", "LP", "Counters"):  # fresh outputs / scratch
            assert _same(a, b) or isinstance(a, torch.Tensor), name
        else:
            assert _same(a, b), name
    got = dict(zip(names, g_args))
    assert (got["HEAD_DIM"], got["PAGE"], got["PAGED"], got["KV_FP8"]) == (128, 16, True, True)
    assert (got["BLOCK_M"], got["BLOCK_N"], got["ONE_SPLIT"]) == (16, 16, splits == 1)
    assert (got["group"], got["m_blocks"], got["num_splits"]) == (4, 1, splits)
    if splits > 1:  # the merge is the portable one
        assert recorded[1][0] is decode._merge_kernel


@pytest.mark.parametrize("b", [3, 18])
def test_sm90_takes_it_by_default_where_it_serves(recorded: list[tuple[Any, ...]],
                                                  b: int) -> None:
    """No config: an e4m3 paged call on sm90 launches the Gluon pass with its two-slot
    cp.async ring, whether the (sequence, KV head) pairs fit one per SM (3 x 8 <= 132) or
    not (18 x 8 > 132)."""
    (q, k, v), kw = _paged_call(b=b)
    decode.decode_attention(q, k, v, **kw)
    fn, _, opt, args = recorded[0]
    got = dict(zip(fn.arg_names, args))
    assert fn is decode_gluon._fp8_paged_split_kernel and opt["num_warps"] == 1
    assert got["BLOCK_N"] == 16 and got["KV_FP8"] and got["RING"] == 2
    assert "maxnreg" not in opt and not got["PREFETCH"]


@pytest.mark.parametrize("call", [{"window": (8, 0)}, {"softcap": 30.0}])
def test_calls_it_does_not_serve_take_the_portable_pass(recorded: list[tuple[Any, ...]],
                                                        call: dict[str, Any]) -> None:
    (q, k, v), kw = _paged_call()
    decode.decode_attention(q, k, v, causal=True, **kw, **call)
    assert recorded[0][0] is decode._split_kernel


@pytest.mark.parametrize(("call", "reason"), [
    ({"d": 64}, "head dim 64"),
    ({"sq": 2}, "Sq = 1"),
    ({"hq": 68, "hkv": 4}, "GQA group 17"),
    ({"dtype": torch.float16}, None),
])
def test_a_refused_call_fails_before_any_launch(recorded: list[tuple[Any, ...]],
                                               call: dict[str, Any], reason: str | None
                                               ) -> None:
    (q, k, v), kw = _paged_call(**call)
    if reason is None:
        decode.decode_attention(q, k, v, config=GLUON_FP8_PAGED, **kw)
        assert recorded and recorded[0][0] is decode_gluon._fp8_paged_split_kernel
        return
    with pytest.raises(ValueError, match=ASKS + f".*{reason}"):
        decode.decode_attention(q, k, v, config=GLUON_FP8_PAGED, **kw)
    assert not recorded


def test_refused_when_not_a_paged_fp8_cache(recorded: list[tuple[Any, ...]]) -> None:
    (q, k, v), kw = _paged_call()
    with pytest.raises(ValueError, match=ASKS + "serves a paged e4m3"):
        decode.decode_attention(q, k.bfloat16(), v.bfloat16(), config=GLUON_FP8_PAGED,
                                scale=kw["scale"], block_table=kw["block_table"],
                                seqlens_k=kw["seqlens_k"])
    with pytest.raises(ValueError, match=ASKS + ".*fused_merge"):
        decode.decode_attention(q, k, v, config=GLUON_FP8_PAGED.with_(fused_merge=True),
                                num_splits=2, **kw)
    assert not recorded


def _launch_tokens(log: list[tuple[Any, ...]]) -> list[Any]:
    """Launches as comparable values: kernel, grid, options, and each argument (tensors by
    dtype, shape, strides, 16-byte alignment and, for the inputs, contents: the hub hands
    backends its checked snapshot of the tables, equal in all of these; outputs and scratch
    are fresh or reused per call, so by dtype and shape only)."""
    fresh = ("Out", "Lse", "OP", "LP", "Counters")

    def token(name: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return (type(x), x)
        meta = (x.dtype, tuple(x.shape))
        if name in fresh:
            return meta
        return (*meta, x.stride(), x.data_ptr() % 16 == 0,
                x.contiguous().view(torch.uint8).numpy().tobytes())

    return [(fn, grid, options, [token(n, a) for n, a in zip(fn.arg_names, args)])
            for fn, grid, options, args in log]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("b", [3, 18])
def test_the_api_launches_what_the_kernel_is_given_directly(recorded: list[tuple[Any, ...]],
                                                            fp8: bool, b: int) -> None:
    """``benchmarks/decode_api_gap.py``'s comparison on the stub sm90: a paged call through
    ``Hub.attention`` (forced backend, no ``max_seqlen_k``: the hub takes the longest length
    from its table check and passes its snapshot of the tables, descales in ``extra``)
    launches the same kernels (the Gluon pass 1 for e4m3, its merge), grids, options and
    arguments as ``decode_attention`` called directly with the caller's tensors and
    ``max_seqlen_k``, on the slow path (first call) and the exact-table path (later ones)."""
    from attnhub import Hub

    (q, k, v), kw = _paged_call(b=b)
    # the longest (33 keys: 3 of the Gluon row's 16-key tiles) well below the tables'
    # capacity (96) and its length bucket (64): a split count from either would differ
    kw["seqlens_k"] = torch.tensor([20, 0, 33] * (b // 3), dtype=torch.int32)
    descales = {"k_descale": kw.pop("k_descale"), "v_descale": kw.pop("v_descale")}
    if not fp8:
        k, v, descales = k.bfloat16(), v.bfloat16(), {}
    longest = int(kw["seqlens_k"].max())
    decode.decode_attention(q, k, v, max_seqlen_k=longest, return_lse=False, **kw, **descales)
    direct = _launch_tokens(recorded)
    want = decode_gluon._fp8_paged_split_kernel if fp8 else decode._split_kernel
    assert direct and direct[0][0] is want
    hub = Hub()
    for call in range(3):
        recorded.clear()
        hub.attention(q, k, v, layout="paged", block_table=kw["block_table"],
                      seqlens_k=kw["seqlens_k"], scale=kw["scale"],
                      backend="triton_decode_fp8" if fp8 else "triton_decode",
                      extra=descales or None)
        assert _launch_tokens(recorded) == direct, call


def _sm90_builds(*args: str) -> list[tuple[str, int, int, int, int, dict[str, int],
                                           dict[str, int]]]:
    """Build the kernel for sm90 offline (stub driver, this machine's Triton and ptxas, in a
    subprocess: the driver switch stays there) with benchmarks/gluon_decode_sm90_offline.py
    ``args``: (tag, registers, stack bytes, local bytes, shared bytes, kernel SASS counts,
    key loop SASS counts) per build; skips without an sm90 toolchain."""
    import ast
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "plugins" / "triton_portable"),
                                         env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable,
                          str(root / "benchmarks" / "gluon_decode_sm90_offline.py"), *args,
                          "--dump", "/tmp/attnhub_gluon_decode_test"],
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    built = re.findall(r"OK (\S+): regs=(\d+) stack=(\d+) local=(\d+) smem=(\d+).*\n"
                       r"\s+kernel: (\{.*\})\n\s+loop:\s+(\{.*\})", run.stdout)
    if not built and ("ptxas" in run.stdout + run.stderr or "cuobjdump" in run.stderr):
        pytest.skip("no sm90 toolchain in this Triton")
    assert built and "FAIL" not in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    return [(tag, int(regs), int(stack), int(local), int(smem), ast.literal_eval(kernel),
             ast.literal_eval(loop)) for tag, regs, stack, local, smem, kernel, loop in built]


def _one_tile_per_iteration(tag: str, body: dict[str, int]) -> None:
    """Per 16-key tile of the loop (page 16: one page per tile): 32 fp16 MMAs, 64 e4m3x2 ->
    f16x2 conversions (every K and V byte once) and 4 of p to fp16, 8 16-byte loads and 3
    scalar loads (page id, two descales) per thread."""
    assert (body["HMMA"], body["LDG.E.128"], body["LDG.E"]) == (32, 8, 3), (tag, body)
    assert body["F2FP.F16.E4M3"] == 64, (tag, body)  # each K and V byte pair once
    assert body["F2FP"] == 64 + 4, (tag, body)  # and p to fp16


def _registers_only(tag: str, stack: int, local: int, smem: int, whole: dict,
                    body: dict) -> None:
    """No shared memory, no spills, one tile's work per loop iteration."""
    assert smem == 0 and whole["LDS"] == whole["STS"] == whole["BAR"] == 0, tag
    assert stack == local == 0 and whole["LDL"] == whole["STL"] == 0, tag
    _one_tile_per_iteration(tag, body)


def test_sm90_build_keeps_the_key_loop_in_registers() -> None:
    """The kernel built for sm90 offline: no local memory, no shared memory at all, and one
    tile's work per loop iteration (``_one_tile_per_iteration``); V a tile ahead too."""
    built = _sm90_builds("--block-n", "16", "--variants", "base", "ahead")
    assert len(built) == 3, built
    for tag, regs, stack, local, smem, whole, body in built:
        _registers_only(tag, stack, local, smem, whole, body)
        assert regs <= (232 if tag.endswith("_ahead") else 168), tag  # 12 per SM at 168


def test_sm90_prefetch_build_holds_the_next_tiles_in_registers() -> None:
    """``prefetch_pages`` (the next tile's K and V loaded before this one is used; with
    ``fp8_v_ahead`` the next two) built for sm90: no spills, no shared memory, the same
    work per tile as the plain loop, the tiles in flight held as words (byte permutes as
    the plain loop: packing the loaded bytes into words and widening words cost nothing),
    within 8 programs per SM (255 registers; 4 x floor(16384 / (32 x 208)) = 8 from 201 up).
    Capped at 168 registers (``maxnreg``, 12 per SM), it spills only loop invariants."""
    built = _sm90_builds("--block-n", "16", "--variants", "pre", "preahead")
    assert len(built) == 4, built
    for tag, regs, stack, local, smem, whole, body in built:
        _registers_only(tag, stack, local, smem, whole, body)
        assert body["PRMT"] == 32, (tag, body)  # as the plain loop's (V's key pairs)
        assert body["insts"] <= 600, (tag, body)  # plain loop: 447 (Triton 3.6)
        assert regs <= (240 if tag.endswith("_ahead") else 216), tag
    capped = _sm90_builds("--block-n", "16", "--variants", "pre", "--maxnreg", "168")
    assert len(capped) == 2, capped
    for tag, regs, stack, local, smem, whole, body in capped:
        assert regs <= 168 and stack <= 64 and smem == 0, tag
        # nothing stored per tile (Triton 3.6: no reload either; 3.9: 7 of loop invariants)
        assert body["STL"] == 0 and body["LDL"] <= 8, (tag, body)
        _one_tile_per_iteration(tag, body)


def test_sm90_ring_build_stages_tiles_in_shared_memory_without_spills() -> None:
    """The shipped sm90 FP8 row (``fp8_ring=2``) built for sm90 offline with this Triton
    (its cp.async and barrier builtins are bound by name in ``gluon_compat``): two 16-key
    K and V e4m3 tiles of shared memory (2 x 16 x 128 x 2 bytes), no spills, and per loop
    iteration one tile's MMAs and widenings, within 12 programs per SM (168 registers)."""
    built = _sm90_builds("--block-n", "16", "--ring", "2")
    assert len(built) == 2, built
    for tag, regs, stack, local, smem, whole, body in built:
        assert smem == 2 * 16 * 128 * 2, (tag, smem)
        assert stack == local == 0 and whole["LDL"] == whole["STL"] == 0, tag
        assert body["HMMA"] == 32 and body["F2FP.F16.E4M3"] == 64, (tag, body)
        assert body["BAR"] >= 1, (tag, body)  # the slot refilled is past every lane's read
        assert regs <= 168, tag


def test_register_cap_reaches_the_launch(recorded: list[tuple[Any, ...]]) -> None:
    (q, k, v), kw = _paged_call()
    decode.decode_attention(q, k, v, config=GLUON_FP8_PAGED.with_(maxnreg=144), **kw)
    assert recorded[0][2]["maxnreg"] == 144


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_the_ring_reaches_the_gluon_pass(recorded: list[tuple[Any, ...]], ring: int) -> None:
    """``fp8_ring`` is the Gluon pass 1's ``RING``; the portable kernel, which shares the
    argument list, gets 0 (its pipeline is the compiler's)."""
    (q, k, v), kw = _paged_call()
    decode.decode_attention(q, k, v, config=GLUON_FP8_PAGED.with_(fp8_ring=ring),
                            num_splits=1, **kw)
    decode.decode_attention(q, k, v, config=GLUON_FP8_PAGED.with_(gluon=False), num_splits=1,
                            **kw)
    (g_fn, _, _, g_args), (p_fn, _, _, p_args) = recorded
    assert g_fn is decode_gluon._fp8_paged_split_kernel and p_fn is decode._split_kernel
    assert dict(zip(g_fn.arg_names, g_args))["RING"] == ring
    assert dict(zip(p_fn.arg_names, p_args))["RING"] == 0


@pytest.mark.parametrize(("change", "reason"), [
    ({"fp8_ring": 3}, "fp8_ring=3; use 0 .* 2, 4 or 8"),
    ({"fp8_ring": 16}, "fp8_ring=16"),
    ({"fp8_ring": 2, "gluon": False}, "fp8_ring=2 without gluon=True"),
])
def test_a_ring_that_cannot_run_is_refused_at_once(change: dict[str, Any], reason: str
                                                  ) -> None:
    """Never ignored: a ring the Gluon pass cannot build, or one asked of the portable
    kernel, is an error where the config is made."""
    with pytest.raises(ValueError, match=reason):
        GLUON_FP8_PAGED.with_(**change)
