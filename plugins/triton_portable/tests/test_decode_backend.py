"""The ``triton_decode`` backend through the hub: what it serves, what it refuses and why, and
how ``choose_splits`` sizes the grid."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton reads this when a kernel is decorated (import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnhub_triton_portable.backend_decode import TritonDecodeBackend
from attnhub_triton_portable.decode_configs import (
    choose_splits,
    decode_config,
)

from attnhub import AttentionSpec, Hub, InputError, MaskSpec, simulate
from attnhub.plugin import AttnParams, paged_to_varlen, reference_attention
from attnhub.testing import assert_fa_rule, assert_lse

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def hub() -> Hub:
    return Hub()


def test_paged_call_through_hub_matches_reference(hub: Hub):
    """A paged decode call (GQA 6/2, 2 speculative tokens, a zero-length sequence) forced
    onto triton_decode agrees with the reference backend on the very same call."""
    g = torch.Generator().manual_seed(0)
    b, sq, hq, hkv, d, page = 3, 2, 6, 2, 32, 5
    q = torch.randn(b, sq, hq, d, generator=g).to(DEV, torch.bfloat16)
    kc = torch.randn(20, page, hkv, d, generator=g).to(DEV, torch.bfloat16)
    vc = torch.randn(20, page, hkv, d, generator=g).to(DEV, torch.bfloat16)
    table = torch.randperm(20, generator=g)[:18].view(b, 6).to(DEV, torch.int32)
    seqlens = torch.tensor([29, 0, 17], dtype=torch.int32, device=DEV)
    kw = {"layout": "paged", "block_table": table, "seqlens_k": seqlens, "causal": True,
              "return_lse": True}
    out, lse = hub.attention(q, kc, vc, backend="triton_decode", **kw)
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q.cpu(), kc.cpu(), vc.cpu(), table.cpu(),
                                             seqlens.cpu())
    p = AttnParams(scale=d ** -0.5, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref64, ref_lse = reference_attention(qv, kv, vv, p, layout="thd")
    ref_same, _ = reference_attention(qv, kv, vv, p, layout="thd", compute_dtype=q.dtype)
    ref64, ref_same = ref64.view(out.shape), ref_same.view(out.shape)
    ref_lse = ref_lse.view(hq, b, sq).transpose(0, 1)
    assert_fa_rule(out.cpu(), ref64, ref_same)
    assert_lse(lse.cpu(), ref_lse, atol=2e-2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("backend_name", ["triton_decode", "triton_decode_fp8"])
def test_lse_returned_when_asked_only(hub: Hub, backend_name: str):
    """``return_lse`` decides: asked, the LSE comes back (and the hub checks it); not
    asked, the backend returns none (its kernels write it to scratch), with the same out."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 4, 16, generator=g).to(DEV, torch.bfloat16)
    kc = torch.randn(6, 8, 2, 16, generator=g).to(DEV, torch.bfloat16)
    table = torch.arange(6, dtype=torch.int32, device=DEV).view(2, 3)
    seqlens = torch.tensor([20, 7], dtype=torch.int32, device=DEV)
    extra = {}
    if backend_name.endswith("fp8"):
        kc = kc.to(torch.float8_e4m3fn)
        extra = {"k_descale": torch.ones(6, 2, device=DEV), "v_descale": torch.ones(6, 2,
                                                                                  device=DEV)}
    backend = hub.registry.get(backend_name)
    backend.load()
    spec = AttentionSpec(phase="decode", dtype="bf16", head_dim=16, num_q_heads=4,
                         num_kv_heads=2, layout="paged", max_seqlen_q=1, max_seqlen_k=24,
                         batch=2, page_size=8, kv_dtype="fp8_e4m3" if extra else None)
    outs = []
    for asked in (True, False):
        p = AttnParams(scale=0.25, block_table=table, seqlens_k=seqlens, max_seqlen_q=1,
                       max_seqlen_k=24, return_lse=asked, extra=extra)
        out, lse = backend.forward(q, kc, kc, spec, p)
        assert (lse is not None) == asked
        if asked:
            assert lse.shape == (2, 4, 1) and lse.dtype == torch.float32
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_bshd_with_seqlens_is_refused(hub: Hub):
    q = torch.randn(1, 1, 4, 16, device=DEV)
    k = torch.randn(1, 9, 2, 16, device=DEV)
    with pytest.raises(InputError, match="layout='paged'"):
        hub.attention(q, k, k, backend="triton_decode",
                      seqlens_k=torch.tensor([4], dtype=torch.int32, device=DEV))


def _spec(**kw) -> AttentionSpec:
    base = {"phase": "decode", "dtype": "bf16", "head_dim": 128, "num_q_heads": 32, "num_kv_heads": 8,
                "layout": "paged", "max_seqlen_q": 1, "max_seqlen_k": 32768, "batch": 1}
    return AttentionSpec(**{**base, **kw})


@pytest.mark.parametrize("change,expected", [
    ({"phase": "prefill"}, "phase prefill"),
    ({"max_seqlen_q": 32}, "32 query tokens"),
    ({"needs_grad": True, "phase": "decode"}, "no backward"),
    ({"mask": MaskSpec(prefix_lm=True, causal=True)}, "prefix_lm"),
    ({"head_dim": 512}, "head dim 512"),
    ({"layout": "thd"}, "layout thd"),
])
def test_refusals_name_the_reason(change, expected):
    reasons = TritonDecodeBackend().check(_spec(**change), simulate("sm90"))
    assert any(expected in r for r in reasons), reasons


def test_serves_decode_on_hopper_and_ampere_not_turing():
    backend = TritonDecodeBackend()
    spec = _spec(mask=MaskSpec(causal=True, window=(4096, 0), softcap=True, alibi=True))
    assert backend.check(spec, simulate("sm90")) == []
    assert backend.check(spec, simulate("sm80")) == []
    assert any("compute capability" in r for r in backend.check(spec, simulate("sm75")))


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = simulate("cpu").__class__(vendor="cpu", arch="cpu")  # a real (not simulated) CPU
    reasons = TritonDecodeBackend().check(_spec(), cpu)
    assert any("TRITON_INTERPRET=1" in r for r in reasons), reasons


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("batch,ctx", [(1, 32768), (1, 131072), (16, 8192), (64, 4096),
                                       (64, 32768), (3, 1000)])
def test_choose_splits_fills_the_machine_once(batch, ctx, paged):
    """Splits fill one round of programs when batch x heads cannot, and stay at 1 when it
    already does; never more splits than key tiles."""
    cfg = decode_config("sm90", paged=paged)
    sms, heads = 132, 8
    s = choose_splits(batch, heads, ctx, sms, cfg)
    capacity = sms * cfg.ctas_per_sm
    tiles = -(-ctx // cfg.block_n)
    assert 1 <= s <= min(tiles, cfg.max_splits)
    if batch * heads >= capacity:
        assert s == 1
    else:
        assert batch * heads * s <= capacity  # one round of programs
        assert batch * heads * s * 2 > capacity  # and at least half the slots busy


def test_paged_caches_get_more_programs():
    """A paged program waits on its block table: the table asks for 4 programs per SM."""
    contiguous, paged = decode_config("sm90"), decode_config("sm90", paged=True)
    assert paged.ctas_per_sm > contiguous.ctas_per_sm
    assert choose_splits(1, 8, 32768, 132, paged) > choose_splits(1, 8, 32768, 132, contiguous)


def test_choose_splits_small_cases():
    cfg = decode_config("sm90")
    assert choose_splits(1, 8, 64, 132, cfg) == 1  # a single key tile is never split
    assert choose_splits(1, 8, 0, 132, cfg) == 1
    assert choose_splits(4, 8, 32768, 0, cfg) == 1  # unknown SM count: no split


def test_few_sequences_take_the_few_programs_paged_row():
    """A 16-bit paged cache whose (sequence, KV head) pairs fit in one round of two programs
    per SM takes the 3-stage row, split to fill that round; bigger grids, contiguous and FP8
    caches keep theirs."""
    from attnhub_triton_portable.decode_configs import choose_splits, decode_config

    few = decode_config("sm90", paged=True, programs=(8, 132))
    assert few.num_stages == 3 and choose_splits(1, 8, 32768, 132, few) == 33
    assert choose_splits(1, 8, 131072, 132, few) == 33  # 264 programs: one round of 2 per SM
    assert choose_splits(32, 8, 4096, 132, few) == 1  # 256 pairs already fill the round
    assert decode_config("sm90", paged=True, programs=(264, 132)) == few
    assert decode_config("sm90", paged=True, programs=(265, 132)) == decode_config(
        "sm90", paged=True)
    assert decode_config("sm90", programs=(8, 132)) == decode_config("sm90")
    assert decode_config("sm90", paged=True, kv_fp8=True, programs=(8, 132)).fp8_dot == "fp16"
