"""On an sm90 GPU: the Gluon paged FP8 decode pass (``GLUON_FP8_PAGED``) against the fp64
reference over the values the e4m3 cache holds (``stored * descale``) by the FlashAttention
rule, LSE included, beside the portable FP8 kernel on the same inputs: random page table,
GQA 1..16, empty, short and tile-crossing sequences, one split and several."""

from __future__ import annotations

import pytest
import torch

from attnhub.core.kvquant import dequantize_pages
from attnhub.plugin import AttnParams, paged_to_varlen, reference_attention
from attnhub.testing import assert_fa_rule, assert_lse


def _missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return "the Gluon decode kernel is built for sm90 only"
    return None


_MISSING = _missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]
E4M3 = torch.float8_e4m3fn

CASES = [  # (hq, hkv, lengths, splits, q dtype)
    ((32, 8), [700, 0, 1, 33, 2048], None, torch.bfloat16),
    ((32, 8), [700, 0, 1, 33, 2048], 1, torch.bfloat16),
    ((32, 8), [700, 5, 16, 31, 1000], 7, torch.float16),
    ((16, 16), [64, 300, 0, 129, 17], 3, torch.bfloat16),
    ((64, 4), [511, 512, 513, 2, 0], 4, torch.bfloat16),
    ((12, 4), [0, 0, 0, 0, 0], 2, torch.bfloat16),
]


#: the shipped config and the variants its benchmark times or timed (V a tile ahead; a
#: register cap; 32-key tiles over 16-key pages: two page ids and descale pairs per tile),
#: and 32-key tiles over 8-key pages (page ids and descales per key); the software-pipelined
#: loop (``prefetch_pages``: the next tile in flight) as built, capped at 168 registers, two
#: tiles ahead (with ``fp8_v_ahead``), with 32-key tiles, and over 8-key pages (16-key
#: tiles: two pages a tile; 32-key tiles: per key); the cp.async ring (``fp8_ring``) of 2,
#: 4 and 8 slots, with 32-key tiles, over 8-key pages, and capped at 168 / 128 registers
PRE = {"prefetch_pages": True}
RING = {"fp8_ring": 4}
VARIANTS = [{}, {"fp8_v_ahead": True}, {"maxnreg": 144}, {"block_n": 32},
            {"block_n": 32, "page": 8},
            PRE, {**PRE, "maxnreg": 168}, {**PRE, "fp8_v_ahead": True}, {**PRE, "block_n": 32},
            {**PRE, "page": 8}, {**PRE, "block_n": 32, "page": 8},
            {**PRE, "fp8_v_ahead": True, "page": 8},
            {"fp8_ring": 2}, RING, {"fp8_ring": 8}, {**RING, "block_n": 32}, {**RING, "page": 8},
            {**RING, "block_n": 32, "page": 8}, {**RING, "maxnreg": 168},
            {"fp8_ring": 2, "maxnreg": 128}]


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize(("heads", "lengths", "splits", "dtype"), CASES, ids=str)
def test_gluon_fp8_paged_decode_meets_the_fa_rule(heads, lengths, splits, dtype,
                                                  variant) -> None:
    from attnhub_triton_portable.decode import decode_attention
    from attnhub_triton_portable.decode_configs import GLUON_FP8_PAGED, decode_config

    hq, hkv = heads
    variant = dict(variant)
    b, d, page = len(lengths), 128, variant.pop("page", 16)
    width = max(1, -(-max(lengths) // page))
    npages = b * width + 3
    g = torch.Generator().manual_seed(sum(lengths) + hq)
    q = torch.randn(b, 1, hq, d, generator=g).to("cuda", dtype)
    k8 = (torch.randn(npages, page, hkv, d, generator=g) * 60).to(E4M3).cuda()
    v8 = (torch.randn(npages, page, hkv, d, generator=g) * 60).to(E4M3).cuda()
    kd = (torch.rand(npages, hkv, generator=g) * 0.02 + 0.005).cuda()
    vd = (torch.rand(npages, hkv, generator=g) * 0.02 + 0.005).cuda()
    table = torch.randperm(npages, generator=g)[:b * width].view(b, width)
    table = table.to("cuda", torch.int32)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    kw = {"scale": d ** -0.5, "causal": True, "block_table": table, "seqlens_k": seqlens,
          "k_descale": kd, "v_descale": vd, "num_splits": splits}
    out, lse = decode_attention(q, k8, v8, config=GLUON_FP8_PAGED.with_(**variant), **kw)
    # the portable FP8 row (asked for: with no config, sm90 takes the Gluon pass itself)
    portable = decode_config("sm90", paged=True, kv_fp8=True)
    ported, ported_lse = decode_attention(q, k8, v8, config=portable, **kw)

    full = (npages, hkv)
    kf = dequantize_pages(k8.cpu(), kd.cpu().expand(full))
    vf = dequantize_pages(v8.cpu(), vd.cpu().expand(full))
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q.cpu(), kf, vf, table.cpu(), seqlens.cpu())
    p = AttnParams(scale=d ** -0.5, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref64, ref_lse = reference_attention(qv, kv, vv, p, layout="thd")
    same, _ = reference_attention(qv, kv.to(dtype), vv.to(dtype), p, layout="thd",
                                  compute_dtype=dtype)
    ref64, same = ref64.view(q.shape), same.view(q.shape)
    ref_lse = ref_lse.view(hq, b, 1).transpose(0, 1)
    assert_fa_rule(out.cpu(), ref64, same)
    assert_lse(lse.cpu(), ref_lse, atol=2e-2)
    torch.testing.assert_close(out.float(), ported.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ported_lse, atol=2e-2, rtol=0)
    for i, n in enumerate(lengths):
        if n == 0:  # a sequence with no keys: output 0, LSE -inf
            assert torch.equal(out[i], torch.zeros_like(out[i]))
            assert torch.isneginf(lse[i]).all()
