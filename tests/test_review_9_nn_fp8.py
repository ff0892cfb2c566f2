"""``attnhub.nn.Attention`` over an FP8 (e4m3) paged KV cache.

Gather mode: ``cache.gather`` dequantizes to fp32, which next to 16-bit queries raised
``DTypeMismatchError``; the gathered values are now read in q's dtype (an e4m3 code times a
power-of-two descale: exact in bf16, and in fp16 at these magnitudes). Binding:
``spec``/``call_spec`` reported ``kv_dtype = dtype`` for every call, so a paged decode of an
FP8 cache was bound (and explained) as a 16-bit one, and on the CPU the bound paged call then
found no backend; the spec now carries the cache's dtype for the paged layout, and a gathered
decode its dequantized dtype (never an FP8 kernel).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

import attnhub
from attnhub.bind import decode_buckets
from attnhub.core.kvcache import PagedKVCache
from attnhub.nn import Attention, attention_layers, call_spec

E4M3 = torch.float8_e4m3fn
HQ, HKV, D, PAGE = 4, 2, 16, 4


class _Model(nn.Module):
    """Two attention layers and a bf16 weight (the model dtype ``bind`` reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.ModuleList(Attention(HQ, HKV, D, layer_idx=i) for i in range(2))
        self.w = nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp64 attention of one query per sequence q (B, 1, Hq, D) over k/v (B, S, Hkv, D)."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(HQ // HKV, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_decode_over_an_fp8_cache_matches_fp64_of_the_dequantized_cache(
        dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(num_layers=2, num_pages=8, page_size=PAGE, num_kv_heads=HKV,
                         head_dim=D, dtype=E4M3)
    seqs = [cache.allocate(), cache.allocate()]
    layer = Attention(HQ, HKV, D, layer_idx=1)
    layer.decode_layout = "gather"

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    with cache.step(seqs, 5) as step:  # a fresh prefill: attends on the new k/v directly
        k = rnd(2, 5, HKV, D, scale=3.0)
        layer(rnd(2, 5, HQ, D), k, rnd(2, 5, HKV, D), step)
    for _ in range(3):  # decodes: the last page partly filled, then a new one
        q, k, v = rnd(2, 1, HQ, D), rnd(2, 1, HKV, D, scale=8.0), rnd(2, 1, HKV, D)
        with cache.step(seqs, 1) as step:
            out = layer(q, k, v, step)
        assert out.dtype == dtype and out.shape == (2, 1, HQ, D)
        kc = torch.stack([cache.read(1, s)[0] for s in seqs])  # dequantized, fp32
        vc = torch.stack([cache.read(1, s)[1] for s in seqs])
        want = _reference(q, kc, vc)
        tol = 8e-3 if dtype == torch.bfloat16 else 1e-3  # one rounding of the output
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    assert cache.length(seqs[0]) == 8


def test_spec_reports_the_cache_dtype_for_paged_reads_and_q_dtype_for_gathered() -> None:
    layer = Attention(HQ, HKV, D, layer_idx=0)
    kw = {"batch": 2, "seqlen_q": 1, "seqlen_k": 64, "dtype": torch.bfloat16}
    assert layer.spec("decode", layout="paged", kv_dtype=E4M3, **kw).kv_dtype == "fp8_e4m3"
    assert layer.spec("decode", layout="bshd", kv_dtype=E4M3, **kw).kv_dtype == "bf16"
    assert layer.spec("decode", layout="paged", **kw).kv_dtype == "bf16"  # no FP8 cache named
    layer.kv_cache_dtype = E4M3  # what bind reads
    assert layer.spec("decode", layout="paged", **kw).kv_dtype == "fp8_e4m3"
    layer.decode_layout = "gather"
    assert layer.spec("decode", **kw).kv_dtype == "bf16"
    assert layer.spec("prefill", **{**kw, "seqlen_q": 64}).kv_dtype == "bf16"  # fresh k/v
    spec = call_spec("decode", num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, head_dim_v=D,
                     causal=False, window=None, softcap=False, batch=2, seqlen_q=1,
                     seqlen_k=64, dtype=torch.float16, layout="paged", page_size=16,
                     kv_dtype=E4M3)
    assert (spec.dtype, spec.kv_dtype) == ("fp16", "fp8_e4m3")


def test_bind_on_the_cpu_gathers_an_fp8_cache_and_the_bound_decode_runs() -> None:
    """No CPU backend reads e4m3 pages: bind explains that and gathers (bf16, torch_sdpa);
    before, it bound a bf16 paged decode that the FP8 call then found no backend for."""
    model = _Model()
    for _, m in attention_layers(model):
        m.kv_cache_dtype = E4M3
    hub = attnhub.Hub()
    table = hub.bind(model, batch=2, prompt_len=6, max_len=16, page_size=PAGE)
    decode = [r for r in table if r.phase == "decode"]
    assert decode and all(r.decode_layout == "gather" and r.backend for r in decode)
    assert all(r.decision.spec.kv_dtype == "bf16" for r in decode)
    cache = PagedKVCache(num_layers=2, num_pages=8, page_size=PAGE, num_kv_heads=HKV,
                         head_dim=D, dtype=E4M3)
    seqs = [cache.allocate(), cache.allocate()]
    bf = torch.bfloat16
    with cache.step(seqs, 6) as step:
        for m in model.attn:
            m(torch.randn(2, 6, HQ, D).to(bf), torch.randn(2, 6, HKV, D).to(bf),
              torch.randn(2, 6, HKV, D).to(bf), step)
    q = torch.randn(2, 1, HQ, D).to(bf)
    with cache.step(seqs, 1) as step:
        outs = [m(q, torch.randn(2, 1, HKV, D).to(bf), torch.randn(2, 1, HKV, D).to(bf), step)
                for m in model.attn]
    for i, out in enumerate(outs):
        kc = torch.stack([cache.read(i, s)[0] for s in seqs])
        vc = torch.stack([cache.read(i, s)[1] for s in seqs])
        torch.testing.assert_close(out.double(), _reference(q, kc, vc), rtol=8e-3, atol=8e-3)


def test_bind_on_a_gpu_binds_the_fp8_paged_kernel_only_behind_its_record(tmp_path) -> None:
    """Planning for an sm90: the paged decode of an e4m3 cache goes to the FP8 rule (its
    kernel refused without an accuracy record, the reason shown, a 16-bit gathered decode
    bound instead); with a passing record the paged decode binds triton_decode_fp8."""
    from attnhub.policy import load_policy
    from attnhub.policy.profile import ProfileStore

    store = ProfileStore(tmp_path / "profile.json")
    hub = attnhub.Hub(policy=load_policy(profile=store), hardware="sm90")
    model = _Model()
    for _, m in attention_layers(model):
        m.kv_cache_dtype = E4M3
    shapes = {"batch": 2, "prompt_len": 6, "max_len": 16, "page_size": PAGE}
    table = hub.bind(model, **shapes)
    decode = [r for r in table if r.phase == "decode"]
    assert all(r.decode_layout == "gather" and r.decision.spec.kv_dtype == "bf16"
               and r.backend not in ("triton_decode_fp8", "fa3_fp8") for r in decode)
    paged = model.attn[0].spec("decode", batch=2, seqlen_q=1, seqlen_k=16,
                               dtype=torch.bfloat16, layout="paged", page_size=PAGE)
    d = hub.decide(paged)
    assert d.rule == "fp8-kv-cache-decode" and d.backend is None
    assert any(r.backend == "triton_decode_fp8" and "accuracy record" in " ".join(r.reasons)
               for r in d.rejected)
    for sk in decode_buckets(6, 16):  # every decode bucket bind resolves
        spec = replace(paged, max_seqlen_k=sk).bucketed()
        store.record_accuracy(hub.device, spec, "triton_decode_fp8", True, {"rel_error": 0.04})
    hub = attnhub.Hub(policy=load_policy(profile=store), hardware="sm90")
    table = hub.bind(model, **shapes)
    decode = [r for r in table if r.phase == "decode"]
    assert decode and all(r.decode_layout == "paged" and r.backend == "triton_decode_fp8"
                          and r.decision.spec.kv_dtype == "fp8_e4m3" for r in decode)


def test_bind_takes_the_cache_dtype_as_an_argument() -> None:
    """``bind(..., kv_dtype=)`` names the cache's dtype without setting each layer's
    ``kv_cache_dtype``: the decode binds gather as above, the layers stay unchanged."""
    model = _Model()
    table = attnhub.Hub().bind(model, batch=2, prompt_len=6, max_len=16, page_size=PAGE,
                               kv_dtype=E4M3)
    decode = [r for r in table if r.phase == "decode"]
    assert decode and all(r.decode_layout == "gather" and r.backend for r in decode)
    assert all(m.kv_cache_dtype is None for _, m in attention_layers(model))
    plain = attnhub.Hub().bind(_Model(), batch=2, prompt_len=6, max_len=16, page_size=PAGE)
    assert all(r.decode_layout == "paged" for r in plain if r.phase == "decode")


def test_gather_into_fp16_saturates_what_e4m3_rounding_pushed_past_its_range() -> None:
    """An fp16 65504 is stored as e4m3 256 x descale 256 = 65536, which a plain cast to fp16
    makes inf (NaN attention); the gathered copy saturates at 65504, within the cache's own
    rounding of the value written."""
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=PAGE, num_kv_heads=HKV,
                         head_dim=D, dtype=E4M3)
    seq = cache.allocate()
    layer = Attention(HQ, HKV, D, layer_idx=0)
    layer.decode_layout = "gather"
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(1, 3, HKV, D, generator=gen).half()
    v = torch.randn(1, 3, HKV, D, generator=gen).half()
    v[0, 1, 0, 3] = 65504.0
    with cache.step([seq], 3) as step:
        layer(torch.randn(1, 3, HQ, D, generator=gen).half(), k, v, step)
    assert cache.gather(0, [seq])[1].abs().max() > 65504  # the cache's own rounding
    q = torch.randn(1, 1, HQ, D, generator=gen).half()
    with cache.step([seq], 1) as step:
        out = layer(q, torch.zeros(1, 1, HKV, D).half(), torch.zeros(1, 1, HKV, D).half(),
                    step)
    assert torch.isfinite(out).all()
    kc, vc = (t.clamp(-65504, 65504) for t in cache.gather(0, [seq]))
    torch.testing.assert_close(out.double(), _reference(q, kc, vc), rtol=2e-2, atol=2e-2)
