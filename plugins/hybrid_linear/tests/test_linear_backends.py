"""gla / linear / retention through the hub: the torch forms, the gates, every layout, and
decode through the recurrent state cache against the full-sequence oracle."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from attnhub_hybrid_linear import RecurrentStateCache, linear_torch
from attnhub_hybrid_linear.linear_backends import default_gate, retention_decay
from attnhub_hybrid_linear.metrics import rel_rmse

import attnhub
from attnhub.plugin import InputError

B, S, HQ, HKV, D = 2, 37, 4, 2, 8
SCALE = 1 / math.sqrt(D)
TOL = 5e-3


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub(hardware="cpu")


def _qkv(s: int = S):
    return torch.randn(B, s, HQ, D), torch.randn(B, s, HKV, D), torch.randn(B, s, HKV, D)


def _oracle(q, k, v, g, scale=SCALE):  # type: ignore[no-untyped-def]
    """fp64 token-by-token GLA with k, v, g expanded to the query heads."""
    k, v = (x.repeat_interleave(HQ // x.shape[2], dim=2) for x in (k, v))
    if g.shape[2] != HQ:
        g = g.repeat_interleave(HQ // g.shape[2], dim=2)
    return linear_torch.recurrent(q.double(), k.double(), v.double(), g.double(), scale)[0]


def test_torch_chunked_form_agrees_with_recurrent_and_its_gradients() -> None:
    q, k, v = torch.randn(2, 45, 2, 8), torch.randn(2, 45, 2, 8), torch.randn(2, 45, 2, 16)
    g = -6 * torch.rand(2, 45, 2, 8)  # strong decays: pairwise in-chunk decays stay finite
    xs = [x.clone().requires_grad_() for x in (q, k, v, g)]
    ref = [x.double().requires_grad_() for x in (q, k, v, g)]
    o, s = linear_torch.chunked(*xs, 0.3)
    o_ref, s_ref = linear_torch.recurrent(*ref, 0.3)
    assert rel_rmse(o, o_ref) < TOL and rel_rmse(s, s_ref) < TOL
    do = torch.randn_like(o_ref)
    (o * do.float()).sum().backward()
    (o_ref * do).sum().backward()
    for name, a, b in zip("qkvg", xs, ref):
        assert rel_rmse(a.grad, b.grad) < TOL, name


@pytest.mark.usefixtures("torch_impl")
@pytest.mark.parametrize("gate_shape", ["default", "per-channel-kv", "per-head-q"])
def test_gla_gates(hub: attnhub.Hub, gate_shape: str) -> None:
    q, k, v = _qkv()
    if gate_shape == "default":
        extra, g = {}, default_gate(k)
    elif gate_shape == "per-channel-kv":
        g = F.logsigmoid(torch.randn(B, S, HKV, D))
        extra = {"gla_gate": g}
    else:
        g3 = F.logsigmoid(torch.randn(B, S, HQ))
        extra, g = {"gla_gate": g3}, g3.unsqueeze(-1).expand(B, S, HQ, D)
    out = hub.attention(q, k, v, causal=True, backend="gla", extra=extra)
    assert rel_rmse(out, _oracle(q, k, v, g)) < TOL


@pytest.mark.usefixtures("torch_impl")
def test_linear_and_retention_are_the_same_recurrence_with_fixed_decays(
        hub: attnhub.Hub) -> None:
    q, k, v = _qkv()
    zero = torch.zeros(B, S, HQ, D)
    assert rel_rmse(hub.attention(q, k, v, causal=True, backend="linear"),
                    _oracle(q, k, v, zero)) < TOL
    ret = retention_decay(HQ, q.device).view(1, 1, HQ, 1).expand(B, S, HQ, D)
    assert rel_rmse(hub.attention(q, k, v, causal=True, backend="retention"),
                    _oracle(q, k, v, ret)) < TOL
    with pytest.raises(InputError, match="gla_gate"):
        hub.attention(q, k, v, causal=True, backend="linear", extra={"gla_gate": zero})


@pytest.mark.usefixtures("torch_impl")
def test_decode_through_the_state_cache_continues_the_prefill(hub: attnhub.Hub) -> None:
    q, k, v = _qkv()
    want = _oracle(q, k, v, default_gate(k))
    cache = RecurrentStateCache(layers=[5], num_heads=HQ, key_dim=D, max_seqs=4)
    cache.allocate(7)
    cache.allocate(9)
    extra = {"recurrent_state": cache, "seq_ids": [7, 9], "layer": 5}
    p = S - 4
    outs = [hub.attention(q[:, :p], k[:, :p], v[:, :p], causal=True, backend="gla",
                          extra=extra)]
    for t in range(p, S):  # decode: one query over the whole context so far
        outs.append(hub.attention(q[:, t:t + 1], k[:, :t + 1], v[:, :t + 1], causal=True,
                                  backend="gla", extra=extra))
    assert rel_rmse(torch.cat(outs, dim=1), want) < TOL
    assert cache.position(7, 5) == S and cache.position(9, 5) == S
    # a step replayed (its first run aborted): the state is rebuilt from the context
    again = hub.attention(q[:, -1:], k, v, causal=True, backend="gla", extra=extra)
    assert rel_rmse(again, want[:, -1:]) < TOL and cache.position(7, 5) == S
    with pytest.raises(InputError, match="consumed 37 tokens"):  # no gate for the prefix
        hub.attention(q[:, -1:], k, v, causal=True, backend="gla",
                      extra={**extra, "gla_gate": default_gate(k)[:, -1:]})


@pytest.mark.usefixtures("torch_impl")
def test_decode_without_state_recomputes_the_prefix(hub: attnhub.Hub) -> None:
    q, k, v = _qkv()
    want = _oracle(q, k, v, default_gate(k))
    # one query at the end of its context: causal may be omitted (it changes nothing)
    out = hub.attention(q[:, -1:], k, v, causal=False, backend="gla")
    assert rel_rmse(out, want[:, -1:]) < TOL
    with pytest.raises(attnhub.BackendUnavailableError, match="causal"):
        hub.attention(q, k, v, causal=False, backend="gla")


def _paged(k: torch.Tensor, v: torch.Tensor, page: int = 4):
    """Scatter (B, S, H, D) k/v into shuffled pages; returns caches, block table, lengths."""
    b, s = k.shape[:2]
    per = -(-s // page)
    order = torch.randperm(b * per)
    kc = torch.zeros(b * per, page, *k.shape[2:])
    vc = torch.zeros(b * per, page, *v.shape[2:])
    table = order.view(b, per).to(torch.int32)
    for i in range(b):
        for j in range(per):
            rows = slice(j * page, min((j + 1) * page, s))
            n = rows.stop - rows.start
            kc[table[i, j], :n] = k[i, rows]
            vc[table[i, j], :n] = v[i, rows]
    return kc, vc, table, torch.full((b,), s, dtype=torch.int32)


@pytest.mark.usefixtures("torch_impl")
def test_paged_decode_with_and_without_states(hub: attnhub.Hub) -> None:
    q, k, v = _qkv()
    want = _oracle(q, k, v, default_gate(k))[:, -1:]
    kc, vc, table, lens = _paged(k, v)
    kw = dict(layout="paged", block_table=table, seqlens_k=lens, causal=True, backend="gla")
    assert rel_rmse(hub.attention(q[:, -1:], kc, vc, **kw), want) < TOL
    cache = RecurrentStateCache(layers=1, num_heads=HQ, key_dim=D, max_seqs=2)
    for sid in (0, 1):
        cache.allocate(sid)
    extra = {"recurrent_state": cache, "seq_ids": [0, 1], "layer": 0}
    hub.attention(q[:, :-1], k[:, :-1], v[:, :-1], causal=True, backend="gla", extra=extra)
    assert rel_rmse(hub.attention(q[:, -1:], kc, vc, extra=extra, **kw), want) < TOL


@pytest.mark.usefixtures("torch_impl")
def test_varlen_sequences_are_independent(hub: attnhub.Hub) -> None:
    lens = [5, 19, 11]
    qs = [torch.randn(1, n, HQ, D) for n in lens]
    ks = [torch.randn(1, n, HKV, D) for n in lens]
    vs = [torch.randn(1, n, HKV, D) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out = hub.attention(torch.cat(qs, 1)[0], torch.cat(ks, 1)[0], torch.cat(vs, 1)[0],
                        layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                        backend="retention")
    for i, (q, k, v) in enumerate(zip(qs, ks, vs)):
        dec = retention_decay(HQ, q.device).view(1, 1, HQ, 1).expand(1, lens[i], HQ, D)
        k2, v2 = (x.repeat_interleave(HQ // HKV, dim=2) for x in (k, v))
        ref, _ = linear_torch.recurrent(q.double(), k2.double(), v2.double(), dec.double(),
                                        1 / math.sqrt(D))
        assert rel_rmse(out[cu[i]:cu[i + 1]], ref[0]) < TOL


def test_triton_path_through_the_backend(hub: attnhub.Hub, kernels: object,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's Triton path (interpreted here): prefill chunked, decode recurrent."""
    monkeypatch.setenv("ATTNHUB_LINEAR_IMPL", "triton")
    q, k, v = (torch.randn(1, 20, 2, 16) for _ in range(3))
    want = _oracle_heads(q, k, v)
    cache = RecurrentStateCache(layers=1, num_heads=2, key_dim=16, max_seqs=1)
    cache.allocate(0)
    extra = {"recurrent_state": cache, "seq_ids": [0], "layer": 0}
    pre = hub.attention(q[:, :19], k[:, :19], v[:, :19], causal=True, backend="gla",
                        extra=extra, phase="prefill")
    step = hub.attention(q[:, 19:], k, v, causal=True, backend="gla", extra=extra)
    assert rel_rmse(torch.cat([pre, step], 1), want) < TOL


def _oracle_heads(q, k, v):  # type: ignore[no-untyped-def]
    return linear_torch.recurrent(q.double(), k.double(), v.double(),
                                  default_gate(k).double(), 1 / math.sqrt(q.shape[-1]))[0]


@pytest.mark.usefixtures("torch_impl")
def test_paged_gate_is_packed_like_k_with_and_without_states(hub: attnhub.Hub) -> None:
    """A paged call takes the gate packed like its context's keys (as thd does), with a state
    cache too; there also (B, Sq, H, K) for the new tokens. Wrong row counts are refused."""
    q, k, v = _qkv()
    g = F.logsigmoid(torch.randn(B, S, HKV, D)) / 4
    want = _oracle(q, k, v, g)[:, -1:]
    kc, vc, table, lens = _paged(k, v)
    kw = dict(layout="paged", block_table=table, seqlens_k=lens, causal=True, backend="gla")
    packed = g.reshape(B * S, HKV, D)
    assert rel_rmse(hub.attention(q[:, -1:], kc, vc, extra={"gla_gate": packed}, **kw),
                    want) < TOL
    cache = RecurrentStateCache(layers=1, num_heads=HQ, key_dim=D, max_seqs=2)
    for sid in (0, 1):
        cache.allocate(sid)
    state = {"recurrent_state": cache, "seq_ids": [0, 1], "layer": 0}
    hub.attention(q[:, :-1], k[:, :-1], v[:, :-1], causal=True, backend="gla",
                  extra={**state, "gla_gate": g[:, :-1]})
    before = cache.read([0, 1], 0)[0].clone()
    for gate in (packed, g[:, -1:]):  # packed context, or the new tokens only
        got = hub.attention(q[:, -1:], kc, vc, extra={**state, "gla_gate": gate}, **kw)
        assert rel_rmse(got, want) < TOL
        for sid in (0, 1):  # rewind: the same step again
            cache.restore(sid, 0, before[sid], S - 1)
    # a state behind the context is rebuilt from the packed gate's prefix rows
    fresh = RecurrentStateCache(layers=1, num_heads=HQ, key_dim=D, max_seqs=2)
    for sid in (0, 1):
        fresh.allocate(sid)
    got = hub.attention(q[:, -1:], kc, vc, extra={"recurrent_state": fresh, "seq_ids": [0, 1],
                                                   "layer": 0, "gla_gate": packed}, **kw)
    assert rel_rmse(got, want) < TOL
    for bad, extra in ((packed[1:], {}), (g[:, -1:], {})):
        with pytest.raises(InputError, match=r"packed like its context's keys"):
            hub.attention(q[:, -1:], kc, vc, extra={**extra, "gla_gate": bad}, **kw)
