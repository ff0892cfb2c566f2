"""fa3's direct call of FA3's forward op (no autograd) against its interface path: the same
numbers and the arguments the interface would pass, per entry point; the interface wherever
autograd is needed or the op's schema lacks an argument."""

from __future__ import annotations

import pytest
import torch
from attnhub_sm90_fa3.fa3 import OP_ARGS, Fa3Backend
from attnhub_sm90_fa3.fa3_fp8 import Fa3Fp8Backend
from attnhub_sm90_fa3.fp8 import quantize

from attnhub.plugin import AttnParams, paged_to_varlen
from attnhub.plugin import reference_attention as ref_attn

from .conftest import FA3_FWD_FLAGS
from .test_translation import qkv


def dense(spec_of, sq, sk, causal=True, align="bottom_right", softcap=None, window=None,
          phase="prefill"):
    q, k, v = qkv(2, sq, sk, seed=sq * 31 + sk)
    p = AttnParams(scale=0.3, causal=causal, alignment=align, softcap=softcap, window=window,
                   return_lse=True)
    spec = spec_of(q, k, causal=causal, alignment=align, softcap=bool(softcap), window=window,
                   phase=phase)
    return Fa3Backend, (q, k, v), spec, p


def paged(spec_of, **_):
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(9, 3, 2, 16, generator=g), torch.randn(9, 3, 2, 16, generator=g)
    table = torch.tensor([[4, 0, 7, 0], [1, 2, 3, 5]], dtype=torch.int32)
    lens = torch.tensor([7, 11], dtype=torch.int32)
    q = torch.randn(2, 2, 4, 16, generator=g)
    p = AttnParams(scale=0.3, causal=True, block_table=table, seqlens_k=lens, return_lse=True)
    return Fa3Backend, (q, kc, vc), spec_of(q, kc, "paged", phase="decode", causal=True), p


def varlen(spec_of, **_):
    q, kc, vc = paged(spec_of)[1]
    _, _, _, p = paged(spec_of)
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, kc, vc, p.block_table, p.seqlens_k)
    pv = AttnParams(scale=0.3, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=2, max_seqlen_k=11, return_lse=True)
    return Fa3Backend, (qv, kv, vv), spec_of(qv, kv, "thd", causal=True), pv


def fp8_cache(spec_of, **_):
    q, k, v = qkv(1, 8, 32, dtype=torch.bfloat16)
    (k8, kd), (v8, vd) = quantize(k, 2), quantize(v, 2)
    p = AttnParams(scale=0.25, causal=True, extra={"k_descale": kd, "v_descale": vd})
    return Fa3Fp8Backend, (q, k8, v8), spec_of(q, k8, causal=True), p


CASES = {
    "top-left causal Sq < Sk": lambda s: dense(s, 5, 9, align="top_left"),
    "bottom-right causal Sq > Sk": lambda s: dense(s, 9, 5),
    "full, softcap": lambda s: dense(s, 6, 6, causal=False, softcap=4.0),
    "window": lambda s: dense(s, 7, 12, window=(3, 0)),
    "decode": lambda s: dense(s, 1, 40, phase="decode"),
    "paged": paged,
    "varlen": varlen,
    "fp8 KV cache": fp8_cache,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_path_matches_the_interface_path(install, spec_of, case):
    results = {}
    for op in (None, OP_ARGS):
        fake = install({}, op_arguments=op)  # every feature compiled in
        cls, (q, k, v), spec, p = CASES[case](spec_of)
        backend = cls()
        backend.load()
        out, lse = backend.forward(q, k, v, spec, p)
        used = [name for name, _ in fake.calls]
        assert used[-1] == ("op" if op else used[-1]) and len(used) == 1, used
        results[op is not None] = out, lse, fake.calls[-1][1]
    (out_i, lse_i, _), (out_o, lse_o, kw) = results[False], results[True]
    torch.testing.assert_close(out_o, out_i, atol=0, rtol=0)
    if lse_i is not None:
        torch.testing.assert_close(lse_o, lse_i, atol=0, rtol=0)
    assert kw["softmax_scale"] == p.scale


def test_op_path_passes_what_the_interface_would(install, spec_of):
    fake = install({}, op_arguments=OP_ARGS)
    _, (q, k, v), spec, p = dense(spec_of, 1, 40, phase="decode")
    b = Fa3Backend()
    b.load()
    b.forward(q, k, v, spec, p)
    assert fake.last("op")["num_splits"] == 0  # the split-KV heuristic, as with_kvcache
    _, (q, k, v), spec, p = dense(spec_of, 7, 12, window=(3, 0))
    b.forward(q, k, v, spec, p)
    kw = fake.last("op")
    assert kw["num_splits"] == 1 and kw["window"] == (3, 0) and kw["is_causal"] is True
    _, (qp, kc, vc), spec, p = paged(spec_of)
    b.forward(qp, kc, vc, spec, p)
    kw = fake.last("op")
    assert kw["page_table"] is p.block_table and kw["seqused_k"] is p.seqlens_k


def test_autograd_and_a_short_schema_take_the_interface(install, spec_of):
    fake = install(FA3_FWD_FLAGS, op_arguments=OP_ARGS)
    _, (q, k, v), spec, p = dense(spec_of, 6, 6)
    b = Fa3Backend()
    b.load()
    b.forward(q, k, v, spec_of(q, k, causal=True, needs_grad=True), p)
    assert fake.calls[-1][0] == "flash_attn_func"  # the autograd Function
    fake = install(FA3_FWD_FLAGS, op_arguments=OP_ARGS - {"seqused_k"})
    b = Fa3Backend()
    b.load()
    assert b._run.op is None and "seqused_k" in b._run.op_note
    b.forward(q, k, v, spec, p)
    assert fake.calls[-1][0] == "flash_attn_func"


def test_op_arguments_memo_never_serves_another_call(install, spec_of):
    """One runner, calls that differ in one value each (scale, softcap, mask, window,
    lengths): every call gets its own arguments (the memo is keyed by all of them)."""
    fake = install({}, op_arguments=OP_ARGS)
    b = Fa3Backend()
    b.load()
    calls = [dict(sq=6, sk=9, scale=0.3), dict(sq=6, sk=9, scale=0.2),
             dict(sq=6, sk=9, scale=0.2, softcap=3.0), dict(sq=6, sk=9, scale=0.2, causal=False),
             dict(sq=6, sk=9, scale=0.2, window=(2, 0)), dict(sq=6, sk=9, scale=0.2,
                                                                 align="top_left"),
             dict(sq=7, sk=9, scale=0.2), dict(sq=6, sk=9, scale=0.3)]
    for c in calls * 2:
        q, k, v = qkv(1, c["sq"], c["sk"], seed=c["sq"])
        causal, align = c.get("causal", True), c.get("align", "bottom_right")
        p = AttnParams(scale=c["scale"], causal=causal, alignment=align,
                       softcap=c.get("softcap"), window=c.get("window"))
        spec = spec_of(q, k, causal=causal, alignment=align, softcap="softcap" in c,
                       window=c.get("window"))
        out, _ = b.forward(q, k, v, spec, p)
        kw = fake.last("op")
        assert kw["softmax_scale"] == c["scale"] and kw["softcap"] == c.get("softcap", 0.0)
        ref, _ = ref_attn(q, k, v, p, compute_dtype=torch.float32)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_op_arguments_memo_stays_small_over_a_walk(install, spec_of):
    """Prompts of a new length each call: the memo keeps its last ``DENSE_MEMO`` entries
    (oldest out), and a length met again after it was dropped gets its own arguments."""
    from attnhub_sm90_fa3 import fa3

    fake = install({}, op_arguments=OP_ARGS)
    b = Fa3Backend()
    b.load()
    for n in [*range(4, 4 + fa3.DENSE_MEMO + 40), 5]:
        q, k, v = qkv(1, n, n, seed=n)
        p = AttnParams(scale=0.25, causal=True)
        out, _ = b.forward(q, k, v, spec_of(q, k, causal=True), p)
        assert len(b._run._dense) <= fa3.DENSE_MEMO
        assert fake.last("op")["softmax_scale"] == 0.25
    ref, _ = ref_attn(q, k, v, p, compute_dtype=torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    kept = [key[:2] for key in b._run._dense]
    assert kept[-1] == (5, 5)  # re-added, as the newest
    last = 4 + fa3.DENSE_MEMO + 39
    assert kept[:-1] == [(n, n) for n in range(last - fa3.DENSE_MEMO + 2, last + 1)]
