"""Hub-boundary attacks on the numbers: large finite fp16 queries, int64 positions past
int32, loose ``max_seqlen`` bounds, calls without queries or keys, and a given
``max_seqlen_q`` on the growing-cache lookup. Each case once gave a silent wrong answer, a
crash or a hang through the public API."""

from __future__ import annotations

import math

import pytest
import torch

import attnhub
from attnhub.core.reference import reference_attention
from attnhub.core.registry import Registry
from attnhub.core.spec import AttnParams
from attnhub.errors import DTypeMismatchError, SeqlensError
from attnhub.testing import assert_fa_rule, assert_lse, fa_references

from tests.test_contract_memo import Spy

CPU_BACKENDS = ("torch_sdpa", "triton", "flex", "torch_flash_cpu")


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub()


def _spy_hub() -> tuple[attnhub.Hub, Spy]:
    spy = Spy()
    return attnhub.Hub(registry=Registry.of(spy, plugin="spy"), hardware="cpu"), spy


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": 2}, {"return_lse": True}])
def test_large_finite_fp16_query_is_not_nan(hub, kw):
    """A row of fp16 queries around 1e4 sums past fp16's 65504: the NaN-restoring pass of
    the CPU flash kernel must not read that overflow as a NaN input (it made the whole row
    NaN where the answer is finite)."""
    torch.manual_seed(0)
    q = (torch.randn(2, 9, 2, 16) * 1e4).half()
    k, v = torch.randn(2, 9, 2, 16).half(), torch.randn(2, 9, 2, 16).half()
    res = hub.attention(q, k, v, backend="torch_sdpa", **kw)
    out = res[0] if kw.get("return_lse") else res
    window = (2, 2) if "window" in kw else None
    p = AttnParams(scale=0.25, causal=kw.get("causal", False), window=window)
    ref64, ref_lse = reference_attention(q, k, v, p)
    # (the FlashAttention rule has no yardstick here: torch's fp16 maths overflows to NaN)
    assert not bool(out.isnan().any())
    torch.testing.assert_close(out.double(), ref64, atol=1e-2, rtol=0)
    if kw.get("return_lse"):
        assert_lse(res[1], ref_lse, atol=1e-2)


def _positions_case(which: str) -> tuple[dict, AttnParams]:
    big = 2**32 + 2  # wraps to 2 in int32
    if which == "prefix":
        kw = {"causal": True, "prefix_lens": torch.tensor([big, -(2**32) + 3])}
    elif which == "colmask_start":
        kw = {"colmask_start": torch.full((2, 1, 9), big, dtype=torch.int64)}
    else:
        kw = {"colmask_start": torch.full((2, 1, 9), 2, dtype=torch.int64),
              "colmask_end": torch.full((2, 1, 9), big + 3, dtype=torch.int64)}
    return kw, AttnParams(scale=0.25, causal=kw.get("causal", False),
                          prefix_lens=kw.get("prefix_lens"),
                          colmask_start=kw.get("colmask_start"),
                          colmask_end=kw.get("colmask_end"))


@pytest.mark.parametrize("which", ["prefix", "colmask_start", "colmask_end"])
def test_int64_positions_past_int32_are_exact(hub, which):
    """int64 ``prefix_lens``/``colmask_*`` past int32 wrapped in the Triton kernels (a
    prefix of 2**32 + 2 read as 2: error 2.7); the hub hands kernels positions clamped to
    the sequence, which mean the same."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 9, 2, 16) for _ in range(3))
    kw, p = _positions_case(which)
    ref64, _, ref_same = fa_references(q, k, v, p)
    for _ in range(2):  # the slow path, then the exact-shape table
        assert_fa_rule(hub.attention(q, k, v, backend="triton", **kw), ref64, ref_same)


@pytest.mark.parametrize("which", ["prefix", "colmask_start", "colmask_end"])
def test_backends_get_positions_within_the_sequence(which):
    hub, spy = _spy_hub()
    q, k, v = (torch.randn(2, 9, 2, 8) for _ in range(3))
    kw, _ = _positions_case(which)
    for _ in range(2):
        hub.attention(q, k, v, backend="spy", **kw)
    for p in spy.seen:
        for t in (p.prefix_lens, p.colmask_start, p.colmask_end):
            assert t is None or (int(t.min()) >= 0 and int(t.max()) <= 9)


def test_unsigned_wide_positions_are_refused(hub):
    q = torch.randn(2, 5, 2, 8)
    with pytest.raises(DTypeMismatchError, match="prefix_lens.*int32"):
        hub.attention(q, q, q, causal=True, backend="torch_sdpa",
                      prefix_lens=torch.tensor([2, 3], dtype=torch.uint32))


@pytest.mark.parametrize("bound", [1000, 2**31, 2**40])
def test_loose_max_seqlen_is_clamped_to_the_tokens(bound):
    """A loose (legal) upper bound sized kernels' grids: Triton under the interpreter ran
    for hours at 2**31, and past the grid limit a GPU launch fails. Backends now get at
    most the packed length (thd), the tables' capacity (paged) or the length (bshd)."""
    hub, spy = _spy_hub()
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = torch.randn(8, 2, 8)
    for _ in range(2):
        hub.attention(q, q, q, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu,
                      max_seqlen_q=bound, max_seqlen_k=bound, backend="spy")
    qb = torch.randn(2, 5, 2, 8)
    hub.attention(qb, qb, qb, max_seqlen_q=bound, max_seqlen_k=bound, backend="spy")
    kc = torch.randn(4, 4, 2, 8)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    sl = torch.tensor([3, 8], dtype=torch.int32)
    for _ in range(2):
        hub.attention(torch.randn(2, 1, 2, 8), kc, kc, layout="paged", block_table=bt,
                      seqlens_k=sl, max_seqlen_k=bound, backend="spy")
    caps = [(8, 8)] * 2 + [(5, 5)] + [(1, 8)] * 2
    assert [(p.max_seqlen_q, p.max_seqlen_k) for p in spy.seen] == caps


def test_loose_max_seqlen_triton_answers(hub):
    q, k = torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    p = AttnParams(scale=0.25, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref64, _, ref_same = fa_references(q, k, k, p, layout="thd")
    out = hub.attention(q, k, k, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                        max_seqlen_q=2**31, max_seqlen_k=2**31, backend="triton")
    assert_fa_rule(out, ref64, ref_same)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", [(0, 4, 4), (1, 0, 4), (2, 3, 0)],
                         ids=["batch0", "sq0", "sk0"])
def test_nothing_to_attend_every_backend(hub, backend, shape):
    """No query or no key: 0 out in the graph of q, k, v (zero gradients) and -inf LSE on
    every backend (flex failed its output contract at batch 0 with return_lse)."""
    b, sq, sk = shape
    grad = backend != "flex"  # flex is inference-only on the CPU
    q = torch.randn(b, sq, 4, 8, requires_grad=grad)
    k = torch.randn(b, sk, 2, 8, requires_grad=grad)
    v = torch.randn(b, sk, 2, 8, requires_grad=grad)
    for _ in range(2):
        out, lse = hub.attention(q, k, v, backend=backend, return_lse=True)
        assert out.shape == (b, sq, 4, 8) and lse.shape == (b, 4, sq)
        assert lse.dtype == torch.float32 and bool(torch.isneginf(lse).all())
        assert not bool(out.any())
        if not grad:
            continue
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(not bool(g.any()) for g in grads)


def test_nothing_to_attend_thd_and_bhsd(hub):
    cu = torch.tensor([0, 0], dtype=torch.int32)
    e = torch.randn(0, 2, 8)
    out, lse = hub.attention(e, e, e, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu,
                             return_lse=True, backend="flex")
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    q = torch.randn(0, 2, 3, 8)
    out, lse = hub.attention(q, q, q, layout="bhsd", return_lse=True, backend="flex")
    assert out.shape == (0, 2, 3, 8) and lse.shape == (0, 2, 3)


def test_growing_lookup_checks_a_given_max_seqlen_q():
    """The bucketed lookup (a new length in the same buckets) took a ``max_seqlen_q`` below
    the call's Sq that a fresh hub refuses: an answer that depended on what ran before."""
    hub, _ = _spy_hub()
    k = torch.randn(1, 8, 2, 8)
    hub.attention(torch.randn(1, 5, 2, 8), k, k, max_seqlen_q=6, backend="spy")
    with pytest.raises(SeqlensError, match="max_seqlen_q=6"):
        hub.attention(torch.randn(1, 7, 2, 8), k, k, max_seqlen_q=6, backend="spy")
    assert math.isfinite(float(hub.attention(torch.randn(1, 7, 2, 8), k, k, max_seqlen_q=7,
                                             backend="spy").sum()))
