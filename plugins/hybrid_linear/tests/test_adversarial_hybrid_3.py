"""Adversarial hybrid-layer tests (round 3), on random inputs against plain references
written here: an fp64 token-by-token recurrence for gla / linear / retention, and dense fp64
softmax with the Longformer mask built from its definition.

* one recurrence, many forms: chunked vs recurrent (torch and our Triton kernels), prefill in
  one shot vs a prefill then decode steps through the state cache (GQA, fp32/fp16/bf16),
  varlen documents (empty and one-token ones), gradients (q, k, v and the gate);
* a gate that requires grad gets its gradient, q, k and v frozen;
* longformer's declared guarantee on any input: exact for its mask, and per element
  ``|o - o_dense| <= 2 eps max|v|`` with eps the dense mass the mask drops.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
from attnhub_hybrid_linear import RecurrentStateCache, linear_torch
from attnhub_hybrid_linear.linear_backends import GATE_TEMPERATURE, retention_decay
from attnhub_hybrid_linear.metrics import rel_rmse

import attnhub

B, HQ, HKV, K, V = 2, 4, 2, 8, 6
#: relative RMSE against the fp64 recurrence: rounding of the input dtype, summed over a
#: few dozen tokens (measured 1e-7 fp32, 2e-4 fp16, 1.7e-3 bf16)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor,
           scale: float) -> torch.Tensor:
    """fp64 ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``, token by
    token; k, v (B, S, Hkv, .) shared by each group of query heads; gate (B, S, Hq, K)."""
    rep = q.shape[2] // k.shape[2]
    k, v = (x.double().repeat_interleave(rep, 2) for x in (k, v))
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(q.shape[1]):
        state = state * gate[:, t].double().exp().unsqueeze(-1) + \
            k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        outs.append(scale * (q[:, t].double().unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outs, 1)


def _gate(name: str, k: torch.Tensor) -> torch.Tensor:
    """Each backend's log-decay, (B, S, Hq, K), from its stated definition."""
    b, s = k.shape[:2]
    if name == "gla":
        return (F.logsigmoid(k.double()) / GATE_TEMPERATURE).repeat_interleave(HQ // HKV, 2)
    if name == "retention":
        return retention_decay(HQ, k.device).double().view(1, 1, HQ, 1).expand(b, s, HQ, K)
    return torch.zeros(b, s, HQ, K, dtype=torch.float64)


def _qkv(s: int, g: torch.Generator, dtype: torch.dtype = torch.float32):
    return (torch.randn(B, s, HQ, K, generator=g).to(dtype),
            torch.randn(B, s, HKV, K, generator=g).to(dtype),
            torch.randn(B, s, HKV, V, generator=g).to(dtype))


# -- one recurrence, many forms ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["gla", "linear", "retention"])
def test_prefill_then_decode_through_the_state_equals_one_shot(hub, name, dtype) -> None:
    g = _gen(zlib.crc32(f"{name}{dtype}".encode()))
    s = 29
    split = int(torch.randint(17, 26, (), generator=g))  # prefill > RECURRENT_MAX: chunked
    q, k, v = _qkv(s, g, dtype)
    ref = _plain(q, k, v, _gate(name, k), K ** -0.5)
    one = hub.attention(q, k, v, causal=True, backend=name)
    states = RecurrentStateCache(layers=[0], num_heads=HQ, key_dim=K, value_dim=V, max_seqs=4)
    ids = [3, 1]
    for i in ids:
        states.allocate(i)
    extra = {"recurrent_state": states, "seq_ids": ids, "layer": 0}
    parts = [hub.attention(q[:, :split], k[:, :split], v[:, :split], causal=True,
                           backend=name, extra=extra)]
    for t in range(split, s):  # one token per step, the whole context passed as keys
        parts.append(hub.attention(q[:, t:t + 1], k[:, :t + 1], v[:, :t + 1], causal=True,
                                   backend=name, extra=extra))
    steps = torch.cat(parts, 1)
    assert rel_rmse(one, ref) <= TOL[dtype]
    assert rel_rmse(steps, ref) <= TOL[dtype]
    assert states.read(ids, 0)[1] == [s, s]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_chunked_equals_recurrent_under_strong_decay_and_a_start_state(impl, request) -> None:
    """Decays of up to 40 nats per token (a chunk's total far past exp's range) and a random
    initial state: the chunked form (train/prefill) equals the token-by-token one."""
    if impl == "triton":
        mod = request.getfixturevalue("kernels")
        chunked = lambda *a: mod.chunked(*a, True)  # noqa: E731
    else:
        chunked = linear_torch.chunked
    g = _gen(7)
    t = 37
    q, k, v = (torch.randn(1, t, 2, d, generator=g) for d in (16, 16, 16))
    gate = torch.rand(1, t, 2, 16, generator=g) * -40.0
    h0 = torch.randn(1, 2, 16, 16, generator=g)
    want, want_state = linear_torch.recurrent(*(x.double() for x in (q, k, v, gate)), 0.25,
                                              h0.double())
    got, state = chunked(q, k, v, gate, 0.25, h0)
    assert rel_rmse(got, want) <= 1e-5 and rel_rmse(state, want_state) <= 1e-4


def test_varlen_documents_equal_each_document_alone(hub) -> None:
    g = _gen(11)
    lens = [int(x) for x in torch.randint(2, 24, (3,), generator=g)] + [0, 1]
    lens = [lens[i] for i in torch.randperm(len(lens), generator=g).tolist()]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, HQ, K, generator=g)
    k = torch.randn(total, HKV, K, generator=g)
    v = torch.randn(total, HKV, V, generator=g)
    gate = -torch.rand(total, HKV, generator=g) * 2  # (T, Hkv): per KV head, every channel
    out = hub.attention(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                        backend="gla", extra={"gla_gate": gate})
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b == a:
            continue
        full = gate[a:b].repeat_interleave(HQ // HKV, 1).unsqueeze(-1).expand(-1, HQ, K)
        ref = _plain(q[None, a:b], k[None, a:b], v[None, a:b], full[None], K ** -0.5)[0]
        assert rel_rmse(out[a:b], ref) <= 1e-5, f"document [{a}, {b})"


@pytest.mark.parametrize("name", ["gla", "retention"])
def test_gradients_equal_autograd_of_the_plain_recurrence(hub, name) -> None:
    g = _gen(13)
    q, k, v = (x.requires_grad_() for x in _qkv(23, g))
    extra = {}
    if name == "gla":
        gate = (-torch.rand(B, 23, HKV, K, generator=g)).requires_grad_()
        extra = {"gla_gate": gate}
    out = hub.attention(q, k, v, causal=True, backend=name, extra=extra)
    go = torch.randn(out.shape, generator=g)
    inputs = (q, k, v, *extra.values())
    got = torch.autograd.grad(out, inputs, go)
    ref_in = [x.detach().double().requires_grad_() for x in inputs]
    full = ref_in[3].repeat_interleave(HQ // HKV, 2) if name == "gla" else _gate(name, k)
    ref = _plain(*ref_in[:3], full, K ** -0.5)
    want = torch.autograd.grad(ref, ref_in, go.double())
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_rmse(a, b) <= 1e-5, f"gradient of input {i}"


def test_a_gate_requiring_grad_with_frozen_qkv_gets_its_gradient(hub) -> None:
    """Only the gate learns (q, k, v frozen): the output is in the gate's graph and the gate's
    gradient matches the plain recurrence's (the hub once refused such an output)."""
    g = _gen(17)
    q, k, v = _qkv(9, g)
    gate = (-torch.rand(B, 9, HKV, K, generator=g)).requires_grad_()
    out = hub.attention(q, k, v, causal=True, backend="gla", extra={"gla_gate": gate})
    go = torch.randn(out.shape, generator=g)
    got, = torch.autograd.grad(out, (gate,), go)
    ref_gate = gate.detach().double().requires_grad_()
    ref = _plain(q.double(), k.double(), v.double(),
                 ref_gate.repeat_interleave(HQ // HKV, 2), K ** -0.5)
    want, = torch.autograd.grad(ref, (ref_gate,), go.double())
    assert rel_rmse(out, ref) <= 1e-5 and rel_rmse(got, want) <= 1e-5


# -- longformer: its stated guarantee on random inputs ---------------------------------------
def _dense(q, k, v, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kk, vv = (x.double().repeat_interleave(HQ // HKV, 2).transpose(1, 2) for x in (k, v))
    s = (q.double().transpose(1, 2) @ kk.transpose(-1, -2)) * K ** -0.5
    s = s.masked_fill(~allowed, float("-inf"))
    row = allowed.any(-1, keepdim=True)
    p = torch.softmax(torch.where(row, s, 0.0), -1) * row
    return (p @ vv).transpose(1, 2), p


@pytest.mark.parametrize("seed", range(6))
def test_longformer_is_exact_for_its_mask_and_within_its_bound(hub, seed) -> None:
    g = _gen(100 + seed)
    sq = int(torch.randint(1, 30, (), generator=g))
    sk = sq + int(torch.randint(0, 12, (), generator=g))
    causal, align = seed % 2 == 0, ("top_left" if seed % 3 == 0 else "bottom_right")
    left, right = (int(x) for x in torch.randint(0, 9, (2,), generator=g))
    glob = sorted(set(torch.randint(0, sk, (int(seed % 3) + 1,), generator=g).tolist()))
    q, k, v = (x * 2 for x in _qkv(sk, g))
    q = q[:, :sq]
    out = hub.attention(q, k, v, backend="longformer", causal=causal, causal_alignment=align,
                        window=(left, right), extra={"longformer_global": glob,
                                                     "block": int(seed) + 3})
    off = sk - sq if align == "bottom_right" else 0
    qi, kj = torch.arange(sq).view(sq, 1) + off, torch.arange(sk).view(1, sk)
    in_g = torch.zeros(sk, dtype=torch.bool)
    in_g[glob] = True
    mask = (kj >= qi - left) & (kj <= qi + right) | in_g.view(1, sk)
    mask |= in_g[qi.view(sq)].view(sq, 1)  # a global query sees every key (Sq <= Sk)
    full = kj <= qi if causal else torch.ones(sq, sk, dtype=torch.bool)
    mask &= full
    ref, _ = _dense(q, k, v, mask.expand(B, HQ, sq, sk))
    assert (out.double() - ref).abs().max() <= 1e-5
    dense, p = _dense(q, k, v, full.expand(B, HQ, sq, sk))
    eps = (p * ~mask).sum(-1).transpose(1, 2).unsqueeze(-1)  # (B, Sq, Hq, 1) mass dropped
    assert ((out.double() - dense).abs() <= 2 * eps * v.abs().max() + 1e-5).all()  # + fp32
