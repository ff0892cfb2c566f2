"""The ``flex`` backend: every attnhub mask kind written as score_mod/mask_mod meets the fp64
reference (FlashAttention rule), BlockMasks are cached per (mask data, shape), decode and
the CPU's compile limits are refused with their reasons.

Mask translation is tested through eager flex (``FlexBackend(compiled=False)``: the same
callables and BlockMask, without Inductor's minutes of compiling); test_flex_cache.py runs the
compiled path on the CPU (two static shapes, then the recompile limit).
"""

from __future__ import annotations

import pytest
import torch
from attnhub_triton_portable.backend_flex import FlexBackend

from attnhub import AttentionSpec, MaskSpec, simulate
from attnhub.plugin import AttnParams, DeviceInfo, reference_attention
from attnhub.testing import assert_fa_rule, assert_lse

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def eager() -> FlexBackend:
    b = FlexBackend(compiled=False)
    b.load()
    return b


def _rand(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def _spec(q: torch.Tensor, k: torch.Tensor, layout: str = "bshd", **mask) -> AttentionSpec:
    return AttentionSpec(phase="prefill", dtype="fp32", head_dim=q.shape[-1],
                         num_q_heads=q.shape[-2], num_kv_heads=k.shape[-2], layout=layout,
                         mask=MaskSpec(**mask), return_lse=True)


def _run_and_check(backend: FlexBackend, q, k, v, params: AttnParams, layout: str = "bshd",
                   **mask) -> tuple[torch.Tensor, torch.Tensor]:
    params.return_lse = True
    out, lse = backend.forward(q, k, v, _spec(q, k, layout, **mask), params)
    ref64, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), _cpu(params),
                                         layout=layout)
    ref_same, _ = reference_attention(q.cpu(), k.cpu(), v.cpu(), _cpu(params), layout=layout,
                                      compute_dtype=q.dtype)
    n = ref64.shape[0] if layout == "thd" else out.shape[0]
    assert_fa_rule(out[:n].cpu(), ref64, ref_same)
    assert_lse(lse[..., :ref_lse.shape[-1]].cpu(), ref_lse)
    return out, lse


def _cpu(p: AttnParams) -> AttnParams:
    from dataclasses import fields, replace

    return replace(p, **{f.name: getattr(p, f.name).cpu() for f in fields(p)
                         if isinstance(getattr(p, f.name), torch.Tensor)})


def _qkv(b: int, sq: int, sk: int, hq: int = 4, hkv: int = 2, d: int = 16, seed: int = 0):
    return (_rand(b, sq, hq, d, seed=seed), _rand(b, sk, hkv, d, seed=seed + 1),
            _rand(b, sk, hkv, d, seed=seed + 2))


@pytest.mark.parametrize("sq,sk,alignment", [(13, 40, "bottom_right"), (40, 13, "bottom_right"),
                                             (13, 40, "top_left"), (40, 13, "top_left")])
def test_causal_both_alignments(eager, sq, sk, alignment):
    """Sq > Sk bottom-right leaves the first rows fully masked: 0 output, -inf LSE."""
    q, k, v = _qkv(2, sq, sk)
    out, lse = _run_and_check(eager, q, k, v,
                              AttnParams(scale=0.25, causal=True, alignment=alignment),
                              causal=True, alignment=alignment)
    if sq > sk and alignment == "bottom_right":
        assert torch.equal(out[:, : sq - sk], torch.zeros_like(out[:, : sq - sk]))
        assert torch.isneginf(lse[..., : sq - sk]).all()


def test_window_prefix_alibi_softcap_together(eager):
    q, k, v = _qkv(2, 30, 37, hq=6, hkv=2, seed=3)
    params = AttnParams(scale=0.25, causal=True, window=(9, 0), softcap=3.0,
                        alibi_slopes=_rand(2, 6, seed=9).abs(),
                        prefix_lens=torch.tensor([5, 20], device=DEV))
    _run_and_check(eager, q, k, v, params, causal=True, window=(9, 0), softcap=True,
                   alibi=True, prefix_lm=True)


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_column_sparse(eager, heads):
    """Column-sparse ranges given per batch, per KV head (2) or per query head (4)."""
    b, sq, sk = 2, 24, 24
    q, k, v = _qkv(b, sq, sk, hq=4, hkv=2, seed=4)
    g = torch.Generator().manual_seed(5)
    start = torch.randint(0, sq, (b, heads, sk), generator=g, dtype=torch.int32)
    end = torch.minimum(start + torch.randint(0, 12, (b, heads, sk), generator=g,
                                              dtype=torch.int32), torch.tensor(sq))
    params = AttnParams(scale=0.25, causal=True, colmask_start=start.to(DEV),
                        colmask_end=end.to(DEV))
    _run_and_check(eager, q, k, v, params, causal=True, column_sparse=True)


def test_user_score_and_mask_mods(eager):
    q, k, v = _qkv(2, 19, 19, seed=6)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + 0.1 * (q_idx - kv_idx) - 0.2 * h

    def even_keys(b, h, q_idx, kv_idx):
        return (kv_idx % 2 == 0) | (b == 1)

    params = AttnParams(scale=0.25, score_mod=rel_bias, mask_mod=even_keys)
    _run_and_check(eager, q, k, v, params, score_mod="rel_bias", mask_mod="even_keys")


def test_documents_thd(eager):
    """Packed documents (one empty, one with more queries than keys) plus padding rows:
    masks and ALiBi per document, padding rows 0 with -inf LSE."""
    cu_q = torch.tensor([0, 7, 7, 20, 26], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 11, 14, 18, 33], dtype=torch.int32, device=DEV)
    q, k, v = _rand(29, 4, 16, seed=7), _rand(33, 2, 16, seed=8), _rand(33, 2, 16, seed=9)
    params = AttnParams(scale=0.25, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                        alibi_slopes=_rand(4, 4, seed=10).abs(),
                        prefix_lens=torch.tensor([2, 0, 1, 3], device=DEV))
    out, lse = _run_and_check(eager, q, k, v, params, layout="thd", causal=True, alibi=True,
                              document=True, prefix_lm=True)
    assert torch.equal(out[26:], torch.zeros_like(out[26:]))
    assert torch.isneginf(lse[:, 26:]).all()


def test_block_mask_is_cached_per_mask_and_shape(eager):
    q, k, v = _qkv(1, 20, 20, seed=11)
    prefix = torch.tensor([4], device=DEV)
    params = AttnParams(scale=0.25, causal=True, prefix_lens=prefix)
    spec = _spec(q, k, causal=True, prefix_lm=True)
    before = eager.mask_builds
    first = eager.forward(q, k, v, spec, params).out
    eager.forward(q, k, v, spec, params)
    assert eager.mask_builds == before + 1  # the second call built nothing
    prefix.fill_(15)  # in place: the version counter moves, the mask is rebuilt
    changed = eager.forward(q, k, v, spec, params).out
    assert eager.mask_builds == before + 2
    assert not torch.allclose(first, changed)
    q2, k2, v2 = _qkv(1, 24, 24, seed=12)  # a new shape: a new mask
    eager.forward(q2, k2, v2, _spec(q2, k2, causal=True, prefix_lm=True), params)
    assert eager.mask_builds == before + 3


def test_refuses_decode_with_the_measured_reason():
    spec = AttentionSpec(phase="decode", dtype="bf16", head_dim=128, num_q_heads=32,
                         num_kv_heads=8, max_seqlen_q=1, max_seqlen_k=32768)
    reasons = FlexBackend().check(spec, simulate("sm90"))
    assert any("10-40x slower than SDPA" in r for r in reasons), reasons
    assert FlexBackend().check(spec.with_(phase="prefill"), simulate("sm90")) == []


def test_cpu_limits_are_reasons():
    """On the CPU flex has no backward (eager or compiled); compiled flex has no LSE there,
    and the default runs eagerly on the CPU (compiled: wrong outputs, CPU_EAGER_REASON)."""
    cpu = DeviceInfo(vendor="cpu", arch="cpu")
    spec = AttentionSpec(phase="train", dtype="fp32", head_dim=64, needs_grad=True,
                         return_lse=True)
    reasons = " | ".join(FlexBackend(compiled=True).check(spec, cpu))
    assert "inference-only" in reasons and "cannot return the LSE" in reasons
    for eager in (FlexBackend(), FlexBackend(compiled=False)):
        assert not eager.compiles("cpu")
        reasons = " | ".join(eager.check(spec, cpu))
        assert "inference-only" in reasons and "LSE" not in reasons
        assert eager.check(spec.with_(phase="prefill", needs_grad=False), cpu) == []
    assert FlexBackend().compiles("cuda") and not FlexBackend(compiled=False).compiles("cuda")


def test_default_backend_is_exact_on_the_cpu_where_compiled_flex_was_not():
    """Key lengths of 8 mod 16 with a small head dim: compiled CPU flex (torch 2.13) gave
    wrong outputs there; the default backend runs eagerly on the CPU and meets the rule."""
    backend = FlexBackend()
    backend.load()
    for sk in (8, 24):
        q, k, v = _qkv(4, sk, sk, seed=sk)
        params = AttnParams(scale=0.25)
        spec = _spec(q, k)
        out = backend.forward(q, k, v, spec, params).out
        ref64, _ = reference_attention(q, k, v, params)
        same, _ = reference_attention(q, k, v, params, compute_dtype=q.dtype)
        assert_fa_rule(out, ref64, same)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [16, 64])
def test_compiled_flex_on_the_gpu_at_the_cpu_template_s_bad_lengths(d: int) -> None:
    """Compiled flex on a GPU at the key lengths where Inductor's CPU template was wrong
    (8 mod 16, CPU_EAGER_REASON): the GPU keeps the compiled default only if it is exact."""
    backend = FlexBackend()
    backend.load()
    assert backend.compiles("cuda")
    for sk in (8, 24, 40):
        q, k, v = (x.cuda() for x in _qkv(2, sk, sk, d=d, seed=sk))
        params = AttnParams(scale=d ** -0.5)
        out = backend.forward(q, k, v, _spec(q, k), params).out
        ref64, _ = reference_attention(q, k, v, params)
        same, _ = reference_attention(q, k, v, params, compute_dtype=q.dtype)
        assert_fa_rule(out, ref64, same)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flex_on_the_gpu_takes_a_strided_head_dim() -> None:
    """q/k/v views whose head dim has stride 2: compiled flex on the H200 read them as dense
    (error 3.06 in the kit) until ``unit_head_stride`` copied them."""
    backend = FlexBackend()
    backend.load()
    q, k, v = (x.cuda() for x in _qkv(2, 21, 21, d=32, seed=5))
    q, k, v = (x.new_zeros(*x.shape[:-1], 64)[..., ::2].copy_(x) for x in (q, k, v))
    params = AttnParams(scale=32 ** -0.5, causal=True)
    out = backend.forward(q, k, v, _spec(q, k, causal=True), params).out
    ref64, _ = reference_attention(q, k, v, params)
    same, _ = reference_attention(q, k, v, params, compute_dtype=q.dtype)
    assert_fa_rule(out, ref64, same)
