"""Review of torch_sdpa's layout routes (bshd, thd padded/loop, paged gather) on the edges a
wide suite hits: a value head dim other than the key's with the LSE asked for (the CPU
one-pass LSE kernel takes one head dim only), and calls with nothing to attend to (no keys,
no queries) under autograd, whose zero output must still be differentiable (zero
gradients, as the reference gives), not a tensor cut from the graph."""

from __future__ import annotations

import math

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from attnhub import Hub
from attnhub.core import builtin
from attnhub.core.paged import paged_to_varlen
from attnhub.core.spec import AttnParams
from attnhub.testing import assert_fa_rule, assert_lse, fa_references

MASKS = {
    "none": {},
    "causal": {"causal": True},
    "causal_top_left": {"causal": True, "causal_alignment": "top_left"},
    "window": {"window": (2, 1)},
    "alibi": {"alibi_slopes": "rand"},
}


@pytest.fixture(scope="module")
def hub() -> Hub:
    return Hub()


def _params(kw: dict, d: int, **extra: object) -> AttnParams:
    return AttnParams(scale=1 / math.sqrt(d), causal=kw.get("causal", False),
                      alignment=kw.get("causal_alignment", "bottom_right"),
                      window=kw.get("window"), alibi_slopes=kw.get("alibi_slopes"),
                      return_lse=True, **extra)  # type: ignore[arg-type]


def _mask(name: str, b: int, hq: int) -> dict:
    kw = dict(MASKS[name])
    if kw.get("alibi_slopes") == "rand":
        kw["alibi_slopes"] = torch.rand(b, hq) * 0.3
    return kw


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_head_dim_with_lse_bshd_and_thd(hub: Hub, mask: str, dtype: torch.dtype) -> None:
    """torch_sdpa declares ``different_v_dim``: Dv != D with ``return_lse`` is served (it
    raised on the CPU, and a policy silently fell back to the reference), exactly."""
    torch.manual_seed(len(mask))
    b, sq, sk, hq, hkv, d, dv = 2, 5, 7, 4, 2, 16, 24
    kw = _mask(mask, b, hq)
    q = torch.randn(b, sq, hq, d, dtype=dtype)
    k, v = torch.randn(b, sk, hkv, d, dtype=dtype), torch.randn(b, sk, hkv, dv, dtype=dtype)
    out, lse = hub.attention(q, k, v, backend="torch_sdpa", return_lse=True, **kw)
    ref64, ref_lse, same = fa_references(q, k, v, _params(kw, d))
    assert_fa_rule(out, ref64, same, what=f"bshd {mask}")
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    assert_lse(lse, ref_lse, atol=tol)
    # the same documents packed (thd), one document shorter
    lq, lk = [sq, sq - 2], [sk, sk - 3]
    qt = torch.cat([q[0], q[1, :lq[1]]])
    kt, vt = torch.cat([k[0], k[1, :lk[1]]]), torch.cat([v[0], v[1, :lk[1]]])
    cu_q = torch.tensor([0, lq[0], sum(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, lk[0], sum(lk)], dtype=torch.int32)
    out, lse = hub.attention(qt, kt, vt, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             backend="torch_sdpa", return_lse=True, **kw)
    ref64, ref_lse, same = fa_references(
        qt, kt, vt, _params(kw, d, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), layout="thd")
    assert_fa_rule(out, ref64, same, what=f"thd {mask}")
    assert_lse(lse, ref_lse, atol=tol)


@pytest.mark.parametrize("gather", [False, True])
def test_value_head_dim_with_lse_paged(hub: Hub, monkeypatch, gather: bool) -> None:
    """Paged Dv != D with the LSE, on the varlen route and on the accelerator's gather route
    (forced on the CPU)."""
    if gather:
        monkeypatch.setattr(builtin, "_paged_gather_serves", lambda q, p: True)
    torch.manual_seed(3)
    b, sq, hq, hkv, d, dv, page = 3, 2, 4, 2, 16, 8, 4
    kc, vc = torch.randn(9, page, hkv, d), torch.randn(9, page, hkv, dv)
    table = torch.randperm(9)[:6].view(b, 2).to(torch.int32)
    lens = torch.tensor([0, 5, 8], dtype=torch.int32)
    q = torch.randn(b, sq, hq, d)
    out, lse = hub.attention(q, kc, vc, layout="paged", block_table=table, seqlens_k=lens,
                             causal=True, backend="torch_sdpa", return_lse=True)
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, kc, vc, table, lens)
    ref64, ref_lse, same = fa_references(
        qv, kv, vv, _params({"causal": True}, d, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
        layout="thd")
    assert_fa_rule(out.reshape(b * sq, hq, dv), ref64, same)
    assert_lse(lse.transpose(0, 1).reshape(hq, b * sq), ref_lse)


def _grads_match_reference(out: torch.Tensor, ref64: torch.Tensor,
                           inputs: tuple[torch.Tensor, ...]) -> None:
    """``out`` is in the graph of every input, and its gradients equal the reference's
    (zeros where nothing is attended to)."""
    assert out.requires_grad and out.grad_fn is not None
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(ref64, inputs, g.double())
    for name, a, r in zip("qkv", got, want):
        assert a.shape == r.shape and torch.allclose(a.double(), r.double(), atol=1e-5), f"d{name}"


@pytest.mark.parametrize("sq,sk", [(3, 0), (0, 4)])
def test_nothing_to_attend_is_differentiable_bshd(hub: Hub, sq: int, sk: int) -> None:
    b, hq, hkv, d = 2, 4, 2, 8
    q = torch.randn(b, sq, hq, d, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, requires_grad=True)
    v = torch.randn(b, sk, hkv, d, requires_grad=True)
    out = hub.attention(q, k, v, causal=True, backend="torch_sdpa")
    ref64, _, _ = fa_references(q, k, v, _params({"causal": True}, d))
    assert out.shape == (b, sq, hq, d) and not out.any()
    _grads_match_reference(out, ref64, (q, k, v))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("lq,lk", [([3, 3], [0, 0]), ([0, 3], [3, 0]), ([0, 0], [2, 5])])
def test_nothing_to_attend_is_differentiable_thd(hub: Hub, monkeypatch, padded: bool,
                                                 lq: list[int], lk: list[int]) -> None:
    """Packed documents none of which sees a key (or holds a query): the loop (CPU) and the
    padded (accelerator, forced) routes."""
    if padded:
        monkeypatch.setattr(builtin, "_padded_fits", lambda device, n: True)
    hq, hkv, d = 2, 1, 8
    q = torch.randn(sum(lq), hq, d, requires_grad=True)
    k = torch.randn(sum(lk), hkv, d, requires_grad=True)
    v = torch.randn(sum(lk), hkv, d, requires_grad=True)
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    out, lse = hub.attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             backend="torch_sdpa", return_lse=True)
    ref64, ref_lse, _ = fa_references(
        q, k, v, _params({}, d, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), layout="thd")
    assert not out.any() and torch.isneginf(lse).all()
    _grads_match_reference(out, ref64, (q, k, v))


class _LargestTensor(TorchDispatchMode):
    """Records the most elements any op's output holds."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def test_gather_route_reads_a_strided_cache_without_copying_it(monkeypatch) -> None:
    """K and V views of one interleaved (pages, 2, page, H, D) cache: the gather route gives
    the reference's answer and no op materialises a tensor of the cache's size (it copied
    the whole cache per call to flatten it)."""
    torch.manual_seed(4)
    b, sq, hq, hkv, d, page, pages = 2, 1, 4, 2, 8, 4, 64
    kv = torch.randn(pages, 2, page, hkv, d)
    kc, vc = kv[:, 0], kv[:, 1]
    table = torch.tensor([[5, 9, 0], [60, 2, 33]], dtype=torch.int32)
    lens = torch.tensor([7, 12], dtype=torch.int32)
    q = torch.randn(b, sq, hq, d)
    p = AttnParams(scale=1 / math.sqrt(d), causal=True, block_table=table, seqlens_k=lens,
                   max_seqlen_q=sq, max_seqlen_k=12)
    with _LargestTensor() as seen:
        out, _ = builtin._sdpa_paged(q, kc, vc, p)
    assert seen.most < kc.numel(), seen.most
    qv, kv_, vv, cu_q, cu_k = paged_to_varlen(q, kc, vc, table, lens)
    ref64, _, same = fa_references(
        qv, kv_, vv, _params({"causal": True}, d, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
        layout="thd")
    assert_fa_rule(out.reshape(b * sq, hq, d), ref64, same)


@pytest.mark.parametrize("gather", [False, True])
def test_table_without_pages(hub: Hub, monkeypatch, gather: bool) -> None:
    """A (B, 0) block table with zero lengths (a batch before its first token): every row
    sees nothing, 0 out and -inf LSE, on both routes."""
    if gather:
        monkeypatch.setattr(builtin, "_paged_gather_serves", lambda q, p: True)
    q = torch.randn(2, 3, 4, 8)
    kc, vc = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
    out, lse = hub.attention(q, kc, vc, layout="paged", causal=True, return_lse=True,
                             block_table=torch.zeros(2, 0, dtype=torch.int32),
                             seqlens_k=torch.zeros(2, dtype=torch.int32), backend="torch_sdpa")
    assert not out.any() and torch.isneginf(lse).all()


@pytest.mark.parametrize("backend", ["torch_sdpa", "reference", "torch_sdpa gather"])
def test_paged_batch_of_none(hub: Hub, monkeypatch, backend: str) -> None:
    """B=0 paged, as bshd takes it: an empty output (and LSE), not a backend crash (torch.cat
    of no sequences) that a policy then falls back from."""
    if backend.endswith("gather"):
        monkeypatch.setattr(builtin, "_paged_gather_serves", lambda q, p: True)
    kc, vc = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 16)
    out, lse = hub.attention(torch.randn(0, 2, 4, 8), kc, vc, layout="paged", return_lse=True,
                             block_table=torch.zeros(0, 2, dtype=torch.int32),
                             seqlens_k=torch.zeros(0, dtype=torch.int32),
                             backend=backend.split()[0])
    assert out.shape == (0, 2, 4, 16) and lse.shape == (0, 4, 2)


def _strided(*shape: int) -> torch.Tensor:
    """A view whose last dimension has stride 2 (every other element of a wider tensor)."""
    return torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("mask", ["none", "causal", "alibi"])
def test_last_dim_stride_is_not_garbage(hub: Hub, which: str, mask: str) -> None:
    """A last-dim stride != 1 (checklist: copied or refused, never garbage) with the LSE
    asked for on the CPU: the one-pass LSE kernel reads such a tensor as if it were dense
    (errors ~2.7 vs fp64 in fp32); bshd, thd (per document) and a strided paged cache."""
    torch.manual_seed(5)
    b, sq, sk, hq, hkv, d = 2, 5, 7, 4, 2, 16
    t = {"q": torch.randn(b, sq, hq, d), "k": torch.randn(b, sk, hkv, d),
         "v": torch.randn(b, sk, hkv, d)}
    t[which] = _strided(*t[which].shape)
    q, k, v = t["q"], t["k"], t["v"]
    kw = _mask(mask, b, hq)
    out, lse = hub.attention(q, k, v, backend="torch_sdpa", return_lse=True, **kw)
    ref64, ref_lse, same = fa_references(q, k, v, _params(kw, d))
    assert_fa_rule(out, ref64, same, what=f"bshd {which}")
    assert_lse(lse, ref_lse)
    cu = torch.tensor([0, sq, 2 * sq], dtype=torch.int32)
    cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32)
    qt, kt, vt = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)  # views, stride kept
    out, lse = hub.attention(qt, kt, vt, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu_k,
                             max_seqlen_q=sq + 1, backend="torch_sdpa", return_lse=True, **kw)
    ref64, ref_lse, same = fa_references(
        qt, kt, vt, _params(kw, d, cu_seqlens_q=cu, cu_seqlens_k=cu_k), layout="thd")
    assert_fa_rule(out, ref64, same, what=f"thd {which}")
    assert_lse(lse, ref_lse)


def test_strided_paged_cache_varlen_route(hub: Hub) -> None:
    torch.manual_seed(6)
    kc, vc = _strided(6, 4, 2, 16), _strided(6, 4, 2, 16)
    q = torch.randn(2, 3, 4, 16)
    table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    lens = torch.tensor([6, 8], dtype=torch.int32)
    out, lse = hub.attention(q, kc, vc, layout="paged", block_table=table, seqlens_k=lens,
                             causal=True, backend="torch_sdpa", return_lse=True)
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, kc, vc, table, lens)
    ref64, ref_lse, same = fa_references(
        qv, kv, vv, _params({"causal": True}, 16, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
        layout="thd")
    assert_fa_rule(out.reshape(6, 4, 16), ref64, same)
    assert_lse(lse.transpose(0, 1).reshape(4, 6), ref_lse)


def test_torch_flash_cpu_last_dim_stride(hub: Hub) -> None:
    if "torch_flash_cpu" not in hub.registry.backends:
        pytest.skip("ring plugin not installed")
    torch.manual_seed(7)
    q, k, v = _strided(2, 5, 4, 16), torch.randn(2, 5, 2, 16), torch.randn(2, 5, 2, 16)
    out = hub.attention(q, k, v, causal=True, backend="torch_flash_cpu")
    ref64, _, same = fa_references(q, k, v, _params({"causal": True}, 16))
    assert_fa_rule(out, ref64, same)
    # the backward reads the same strided tensors (saved for it): gradients vs fp64
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    views = [x.detach().new_zeros(*x.shape[:-1], 32)[..., ::2] for x in leaves]
    for view, leaf in zip(views, leaves):
        view.copy_(leaf.detach())
    views = [view.requires_grad_() for view in views]
    dout = torch.randn_like(out)
    (hub.attention(*views, causal=True, backend="torch_flash_cpu") * dout).sum().backward()
    q64, k64, v64 = (x.double().transpose(1, 2) for x in leaves)
    k64, v64 = k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    (ref.transpose(1, 2) * dout.double()).sum().backward()
    for view, leaf in zip(views, leaves):
        err = (view.grad - leaf.grad).abs().max()
        assert err < 1e-4, err


def test_gather_route_pads_to_the_tables_capacity_at_most(hub: Hub, monkeypatch) -> None:
    """``max_seqlen_k`` is allowed to be a loose upper bound; the gather pads every sequence
    to it, so a bound far past the tables' capacity must not size the padded batch (it would
    allocate B x bound keys per call: an out-of-memory from a legal argument)."""
    monkeypatch.setattr(builtin, "_paged_gather_serves", lambda q, p: True)
    torch.manual_seed(8)
    kc, vc = torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)
    q = torch.randn(2, 1, 4, 8)
    table = torch.tensor([[1, 3], [5, 0]], dtype=torch.int32)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    with _LargestTensor() as seen:
        out = hub.attention(q, kc, vc, layout="paged", block_table=table, seqlens_k=lens,
                            max_seqlen_k=100_000, backend="torch_sdpa")
    assert seen.most <= 2 * 8 * 4 * 8, seen.most  # B x capacity x Hq x D
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, kc, vc, table, lens)
    ref64, _, same = fa_references(
        qv, kv, vv, _params({}, 8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), layout="thd")
    assert_fa_rule(out.reshape(2, 4, 8), ref64, same)


def test_thd_padded_route_is_not_sized_by_a_loose_bound(hub: Hub, monkeypatch) -> None:
    """The same for packed documents: ``max_seqlen_q`` far past the packed total must not
    size the padded batch (the budget check multiplies it with a short max_seqlen_k)."""
    monkeypatch.setattr(builtin, "_padded_fits", lambda device, n: True)
    torch.manual_seed(9)
    q, k, v = torch.randn(7, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cu_q = torch.tensor([0, 4, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 1, 3], dtype=torch.int32)
    with _LargestTensor() as seen:
        out = hub.attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            max_seqlen_q=100_000, causal=True, backend="torch_sdpa")
    assert seen.most <= 2 * 7 * 4 * 8, seen.most
    ref64, _, same = fa_references(
        q, k, v, _params({"causal": True}, 8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
        layout="thd")
    assert_fa_rule(out, ref64, same)
