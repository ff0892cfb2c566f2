"""triton_rocm: triton_portable's kernels with AMD configs, run in Triton's CPU interpreter.

No AMD GPU here: the interpreter executes the same kernels with the tiles each gfx target
would get (BLOCK_M/N, warps, stages); the AMD-only launch options are stripped on the way
(the interpreter would drop them silently), which a spy on the kernel launch checks.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import attnhub
from attnhub.plugin import (
    AttentionSpec,
    AttnParams,
    InputError,
    MaskSpec,
    dtype_name,
    reference_attention,
)
from attnhub.testing import assert_fa_rule, assert_lse
from attnhub_rocm.archs import RocmTarget, rocm_target
from attnhub_rocm.configs import AMD_ONLY_OPTIONS, decode_config, fwd_config
from attnhub_rocm.triton_rocm import TritonRocmBackend, uses_decode_kernel

ARCHS = ["gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201"]

#: These run the kernels on CPU tensors in Triton's interpreter, which the conftest turns on
#: only without a GPU (on a GPU it would make Triton's own library interpreted for the whole
#: pytest process); on a ROCm GPU, test_on_amd_gpu.py runs them for real.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="interpreter tests of the ROCm kernels (CPU tensors); on a GPU the interpreter "
           "is off (see plugins/rocm/tests/conftest.py)")


def _target(arch: str) -> RocmTarget:
    return rocm_target(attnhub.simulate(arch))


def _backend(arch: str) -> TritonRocmBackend:
    b = TritonRocmBackend(_target(arch))
    b.load()
    return b


def _spec(q: torch.Tensor, k: torch.Tensor, params: AttnParams, layout: str = "bshd",
          **kw: Any) -> AttentionSpec:
    mask = MaskSpec(causal=params.causal, alignment=params.alignment, window=params.window,
                    softcap=bool(params.softcap), alibi=params.alibi_slopes is not None,
                    document=layout == "thd")
    return AttentionSpec(dtype=dtype_name(q.dtype), head_dim=q.shape[-1], num_q_heads=q.shape[-2],
                         num_kv_heads=k.shape[-2], layout=layout,  # type: ignore[arg-type]
                         mask=mask,
                         max_seqlen_q=q.shape[-3], max_seqlen_k=k.shape[-3],
                         return_lse=params.return_lse, **kw)


def _check(out: torch.Tensor, lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, params: AttnParams, layout: str = "bshd") -> None:
    ref64, ref_lse = reference_attention(q, k, v, params, layout=layout)
    ref_same, _ = reference_attention(q, k, v, params, layout=layout, compute_dtype=q.dtype)
    assert_fa_rule(out, ref64, ref_same)
    if lse is not None:
        assert_lse(lse, ref_lse)


class LaunchSpy:
    """Wraps a Triton kernel: records each launch's keyword arguments, then runs it."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.launches: list[dict[str, Any]] = []

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sq,sk", [(37, 50), (50, 37)])
def test_forward_bshd_causal_gqa(arch: str, sq: int, sk: int) -> None:
    q = torch.randn(2, sq, 4, 32, dtype=torch.float16)
    k = torch.randn(2, sk, 2, 32, dtype=torch.float16)
    v = torch.randn(2, sk, 2, 32, dtype=torch.float16)
    params = AttnParams(scale=1 / math.sqrt(32), causal=True, return_lse=True)
    out, lse = _backend(arch).forward(q, k, v, _spec(q, k, params), params)
    _check(out, lse, q, k, v, params)  # (50, 37): 13 fully masked rows -> 0 and -inf


@pytest.mark.parametrize("arch", ["gfx942", "gfx1201"])
def test_forward_varlen_fp32_window_softcap_alibi(arch: str) -> None:
    cu = torch.tensor([0, 0, 17, 57], dtype=torch.int32)
    q = torch.randn(57, 4, 16)
    k, v = torch.randn(57, 1, 16), torch.randn(57, 1, 16)
    params = AttnParams(scale=0.25, window=(8, 3), softcap=5.0, alibi_slopes=torch.rand(4),
                        cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True)
    spec = _spec(q, k, params, layout="thd")
    assert not uses_decode_kernel(spec)
    out, lse = _backend(arch).forward(q, k, v, spec, params)
    _check(out, lse, q, k, v, params, layout="thd")


@pytest.mark.parametrize("arch", ["gfx942", "gfx1100"])
def test_backward_matches_reference_and_is_deterministic(arch: str) -> None:
    q = torch.randn(1, 33, 4, 32, dtype=torch.float16, requires_grad=True)
    k = torch.randn(1, 40, 2, 32, dtype=torch.float16, requires_grad=True)
    v = torch.randn(1, 40, 2, 32, dtype=torch.float16, requires_grad=True)
    params = AttnParams(scale=1 / math.sqrt(32), causal=True, deterministic=True)
    spec = _spec(q, k, params, phase="train", needs_grad=True, deterministic=True)
    backend = _backend(arch)
    assert backend.check(spec, attnhub.simulate(arch)) == []
    dout = torch.randn(1, 33, 4, 32, dtype=torch.float16)
    grads = []
    for _ in range(2):
        out, _ = backend.forward(q, k, v, spec, params)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    assert all(torch.equal(a, b) for a, b in zip(*grads))  # bitwise equal run to run

    def ref_grads(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        qs, ks, vs = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        o, _ = reference_attention(qs, ks, vs, params, compute_dtype=dtype)
        return torch.autograd.grad(o, (qs, ks, vs), dout.to(dtype))

    for g, g64, g16, name in zip(grads[0], ref_grads(torch.float64),
                                 ref_grads(torch.float16), "qkv"):
        assert_fa_rule(g, g64, g16, mult=3, what=f"d{name}")


def test_amd_options_never_reach_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnhub_triton_portable import fwd

    spy = LaunchSpy(fwd._fwd_kernel)
    monkeypatch.setattr(fwd, "_fwd_kernel", spy)
    q = torch.randn(1, 20, 2, 32, dtype=torch.float16)
    params = AttnParams(scale=0.2)
    _backend("gfx942").forward(q, q, q, _spec(q, q, params), params)
    want = fwd_config(_target("gfx942"), 32, "fp16")
    assert want["waves_per_eu"] and want["matrix_instr_nonkdim"]  # the config has them...
    (launch,) = spy.launches
    assert not AMD_ONLY_OPTIONS & set(launch)  # ...but the interpreter launch does not
    assert (launch["BLOCK_M"], launch["BLOCK_N"], launch["num_warps"]) == (
        want["BLOCK_M"], want["BLOCK_N"], want["num_warps"])


@pytest.mark.parametrize("arch", ["gfx942", "gfx1100"])
def test_decode_contiguous_uses_split_kv_with_amd_tiles(arch: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _backend(arch)
    seen: list[Any] = []
    real = backend._decode
    monkeypatch.setattr(backend, "_decode", lambda *a, **kw: seen.append(kw["config"]) or
                        real(*a, **kw))
    q = torch.randn(3, 1, 8, 32, dtype=torch.float16)
    k = torch.randn(3, 45, 2, 32, dtype=torch.float16)
    v = torch.randn(3, 45, 2, 32, dtype=torch.float16)
    params = AttnParams(scale=1 / math.sqrt(32), causal=True, window=(20, -1), return_lse=True)
    spec = _spec(q, k, params, phase="decode")
    assert uses_decode_kernel(spec)
    out, lse = backend.forward(q, k, v, spec, params)
    assert seen == [decode_config(_target(arch), "fp16")]
    _check(out, lse, q, k, v, params)


def test_decode_paged_shuffled_pages_match_contiguous() -> None:
    page, lens = 5, [12, 23]
    b, hkv, d = 2, 2, 16
    q = torch.randn(b, 2, 4, d, dtype=torch.float16)  # 2 query tokens (speculative)
    k = torch.randn(b, 25, hkv, d, dtype=torch.float16)
    v = torch.randn(b, 25, hkv, d, dtype=torch.float16)
    pages = torch.randperm(b * 5)
    table = pages.view(b, 5).to(torch.int32)
    k_cache = torch.zeros(b * 5, page, hkv, d, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    for i in range(b):
        for p in range(5):
            k_cache[table[i, p]] = k[i, p * page:(p + 1) * page]
            v_cache[table[i, p]] = v[i, p * page:(p + 1) * page]
    params = AttnParams(scale=0.25, causal=True, block_table=table,
                        seqlens_k=torch.tensor(lens, dtype=torch.int32), return_lse=True)
    spec = AttentionSpec(phase="decode", dtype="fp16", head_dim=d, num_q_heads=4,
                         num_kv_heads=hkv, layout="paged", mask=MaskSpec(causal=True),
                         max_seqlen_q=2, max_seqlen_k=32, return_lse=True, page_size=page)
    assert _backend("gfx950").check(spec, attnhub.simulate("gfx950")) == []
    out, lse = _backend("gfx950").forward(q, k_cache, v_cache, spec, params)
    for i, n in enumerate(lens):
        p_i = AttnParams(scale=0.25, causal=True, return_lse=True)
        qi, ki, vi = q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n]
        _check(out[i:i + 1], lse[i:i + 1] if lse is not None else None, qi, ki, vi, p_i)


@pytest.mark.parametrize("change,needle", [
    ({"layout": "paged", "phase": "prefill", "max_seqlen_q": 64}, "paged KV"),
    ({"layout": "paged", "phase": "decode", "mask": MaskSpec(prefix_lm=True, causal=True)},
     "paged KV"),
    ({"mask": MaskSpec(score_mod="x")}, "score_mod"),
    ({"layout": "thd", "mask": MaskSpec(column_sparse=True)}, "column-sparse"),
])
def test_refusals(change: dict, needle: str) -> None:
    spec = AttentionSpec(**{"dtype": "bf16", "head_dim": 64, **change})  # type: ignore[arg-type]
    reasons = TritonRocmBackend().check(spec, attnhub.simulate("gfx942"))
    assert any(needle in r for r in reasons), reasons


def test_serves_what_ck_refuses_and_only_on_rocm() -> None:
    softcap = AttentionSpec(dtype="bf16", head_dim=128, mask=MaskSpec(causal=True, softcap=True))
    backend = TritonRocmBackend()
    for arch in ARCHS:
        assert backend.check(softcap, attnhub.simulate(arch)) == []
    for arch in ("sm90", "cpu"):
        assert any("runs on rocm" in r for r in backend.check(softcap, attnhub.simulate(arch)))


def test_cpu_tensors_need_a_rocm_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATTNHUB_HARDWARE", raising=False)
    backend = TritonRocmBackend()
    with pytest.raises(InputError, match="ATTNHUB_HARDWARE=gfx942"):
        backend.target_for(torch.device("cpu"))
    monkeypatch.setenv("ATTNHUB_HARDWARE", "gfx1100")
    assert backend.target_for(torch.device("cpu")).name == "gfx1100"
