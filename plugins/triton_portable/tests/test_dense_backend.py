"""The ``triton`` backend's contract: registration, declared capabilities, refusals with
reasons, the tile tables, and an end-to-end call through the hub (interpreter on the CPU)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from attnhub_triton_portable import configs
from attnhub_triton_portable.backend_dense import CPU_REASON, TritonDenseBackend
from attnhub_triton_portable.launch import DenseArgs

import attnhub
from attnhub.plugin import (
    AttentionSpec,
    AttnParams,
    InputError,
    MaskSpec,
    reference_attention,
)
from attnhub.testing import assert_fa_rule

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _spec(**kw: object) -> AttentionSpec:
    base: dict = {"phase": "train", "dtype": "bf16", "head_dim": 128, "num_q_heads": 16,
                  "num_kv_heads": 4, "layout": "bshd", "max_seqlen_q": 4096,
                  "max_seqlen_k": 4096, "needs_grad": True}
    base.update(kw)
    return AttentionSpec(**base)


def test_registered_by_the_plugin() -> None:
    backend = attnhub.Hub().registry.get("triton")
    assert isinstance(backend, TritonDenseBackend) and backend.tier == "portable"


@pytest.mark.parametrize("mask", [
    MaskSpec(causal=True), MaskSpec(causal=True, alignment="top_left"),
    MaskSpec(window=(128, 0), softcap=True, alibi=True),
    MaskSpec(causal=True, prefix_lm=True), MaskSpec(column_sparse=True)])
def test_serves_the_dense_cells_on_sm90_and_gfx942(mask: MaskSpec) -> None:
    backend = TritonDenseBackend()
    for hw in ("sm90", "sm80", "gfx942"):
        assert backend.check(_spec(mask=mask, deterministic=True), attnhub.simulate(hw)) == []
    thd = _spec(layout="thd", mask=MaskSpec(causal=True, document=True))
    assert backend.check(thd, attnhub.simulate("sm90")) == []


@pytest.mark.parametrize("change, reason", [
    ({"head_dim": 320, "head_dim_v": 320}, "head dim 320"),
    ({"head_dim_v": 64}, "value head dim 64"),
    ({"mask": MaskSpec(mask_mod="doc")}, "mask mask_mod"),
    ({"mask": MaskSpec(score_mod="rel")}, "mask score_mod"),
    ({"layout": "paged"}, "layout paged"),
    ({"dtype": "fp8_e4m3"}, "dtype fp8_e4m3"),
    ({"layout": "thd", "mask": MaskSpec(column_sparse=True, document=True)}, "use the bshd"),
    ({"mask": MaskSpec(prefix_lm=True)}, "prefix-LM needs causal"),
])
def test_refuses_what_the_kernels_do_not_do(change: dict, reason: str) -> None:
    reasons = TritonDenseBackend().check(_spec(**change), attnhub.simulate("sm90"))
    assert any(reason in r for r in reasons), reasons


def test_refuses_old_gpus_and_the_cpu_without_the_interpreter(monkeypatch) -> None:
    backend = TritonDenseBackend()
    assert any("compute capability" in r for r in backend.check(_spec(), attnhub.simulate("sm75")))
    cpu = attnhub.DeviceInfo(vendor="cpu", arch="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert CPU_REASON in backend.check(_spec(), cpu)
    assert CPU_REASON in backend.available(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.check(_spec(), cpu) == []


@pytest.mark.parametrize("arch", ["cpu", "sm80", "sm86", "sm90", "sm100", "gfx90a", "gfx942",
                                  "gfx950", "gfx1100"])
@pytest.mark.parametrize("head_dim", [40, 64, 96, 128, 256])
def test_tile_tables_cover_every_arch_and_head_dim(arch: str, head_dim: int) -> None:
    for dtype in ("fp16", "bf16", "fp32"):
        fwd = configs.fwd_config(arch, head_dim, dtype, causal=True)
        bwd = configs.bwd_config(arch, head_dim, dtype, causal=False)
        for cfg in (fwd, bwd["dkdv"], bwd["dq"]):
            for key in ("BLOCK_M", "BLOCK_N"):
                assert cfg[key] >= 16 and cfg[key] & (cfg[key] - 1) == 0
            assert cfg["num_warps"] >= 1 and cfg["num_stages"] >= 1
        assert bwd["dq_mode"] == "separate"
        if arch in configs.AMD_ARCHS:
            assert {"waves_per_eu", "matrix_instr_nonkdim"} <= set(fwd)
    with pytest.raises(ValueError, match="256"):
        configs.fwd_config(arch, 320, "bf16", causal=False)


def test_autotune_candidates_respect_determinism() -> None:
    fwd = configs.fwd_candidates("sm90", 128, "bf16", causal=True)
    assert fwd[0] == configs.fwd_config("sm90", 128, "bf16", True) and len(fwd) > 1
    det = configs.bwd_candidates("sm90", 128, "bf16", True, deterministic=True)
    free = configs.bwd_candidates("sm90", 128, "bf16", True, deterministic=False)
    assert all(c["dq_mode"] == "separate" for c in det)
    assert any(c["dq_mode"] == "atomic" for c in free)
    consts, launch = configs.split_config(configs.fwd_config("gfx942", 128, "bf16", False))
    assert set(consts) == {"BLOCK_M", "BLOCK_N"} and "waves_per_eu" in launch


def test_bad_side_tensors_are_named() -> None:
    q = torch.randn(2, 5, 4, 16)
    k = v = torch.randn(2, 5, 2, 16)
    with pytest.raises(InputError, match="alibi_slopes"):
        DenseArgs.from_params(q, k, v, AttnParams(scale=1.0, alibi_slopes=torch.rand(3)), "bshd")
    with pytest.raises(InputError, match="colmask_start"):
        DenseArgs.from_params(q, k, v, AttnParams(
            scale=1.0, colmask_start=torch.zeros(2, 3, 5, dtype=torch.int32)), "bshd")
    with pytest.raises(InputError, match="prefix_lens needs causal"):
        DenseArgs.from_params(q, k, v, AttnParams(scale=1.0, prefix_lens=torch.tensor([1, 2])),
                              "bshd")
    with pytest.raises(InputError, match="BLOCK_M"):
        from attnhub_triton_portable.fwd import flash_fwd

        flash_fwd(DenseArgs.from_params(q, k, v, AttnParams(scale=1.0), "bshd"),
                  {"BLOCK_M": 24, "BLOCK_N": 16})


def test_column_sparse_tile_bounds_skip_only_fully_masked_tiles() -> None:
    start = torch.tensor([[[0, 0, 3, 9, 2]]], dtype=torch.int32)
    end = torch.tensor([[[9, 8, 9, 9, 9]]], dtype=torch.int32)
    q = torch.randn(1, 9, 1, 16)
    args = DenseArgs.from_params(q, q[:, :5], q[:, :5], AttnParams(
        scale=1.0, colmask_start=start, colmask_end=end), "bshd")
    *_, tmax, tmin, _, _ = args.colmask_tiles(16)
    assert tmax.tolist() == [[[9]]] and tmin.tolist() == [[[8]]]


def test_hub_call_with_bhsd_tensors_and_lse() -> None:
    """Through ``attnhub.attention``: a bhsd view, GQA, bottom-right causal, LSE returned."""
    torch.manual_seed(1)
    q = torch.randn(2, 4, 17, 16, device=DEV, requires_grad=True)
    k = torch.randn(2, 2, 29, 16, device=DEV, requires_grad=True)
    v = torch.randn(2, 2, 29, 16, device=DEV, requires_grad=True)
    hub = attnhub.Hub()
    out, lse = hub.attention(q, k, v, layout="bhsd", causal=True, backend="triton",
                             return_lse=True)
    out.sum().backward()
    params = AttnParams(scale=0.25, causal=True)
    qb, kb, vb = (t.detach().transpose(1, 2) for t in (q, k, v))
    ref, ref_lse = reference_attention(qb, kb, vb, params)
    same, _ = reference_attention(qb, kb, vb, params, compute_dtype=torch.float32)
    assert_fa_rule(out.transpose(1, 2), ref, same)
    assert torch.allclose(lse, ref_lse, atol=1e-4)
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())
