"""Review round 7 of the linear layers: a GLA gate with a hard reset (-inf, -1e30) gave NaN
or a wrong output; a long prefix rebuilt without the state cache lost digits (total - cumsum);
a training call stored a state carrying its graph in the state pool (the next backward went
through it twice; decode grew the graph a node per step); a cache of another geometry failed
with torch's shape error."""

from __future__ import annotations

import pytest
import torch
from attnhub_hybrid_linear import RecurrentStateCache

import attnhub
from attnhub.errors import InputError

B, S, H, K = 1, 20, 2, 8


def _recurrence(q, k, v, g, scale):  # type: ignore[no-untyped-def]
    st = torch.zeros(q.shape[0], q.shape[2], k.shape[-1], v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(q.shape[1]):
        st = st * g[:, t].double().exp().unsqueeze(-1) + (
            k[:, t].double().unsqueeze(-1) * v[:, t].double().unsqueeze(-2))
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t].double(), st))
    return torch.stack(outs, 1)


@pytest.mark.parametrize("reset", [float("-inf"), -1e30, -1e8, -200.0])
def test_a_gla_gate_with_a_hard_reset_is_exact(reset: float) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, K) for _ in range(3))
    gate = torch.full((B, S, H, K), -0.5)
    gate[:, 5] = reset  # a document boundary at token 5
    want = _recurrence(q, k, v, gate, K ** -0.5)
    hub = attnhub.Hub(hardware="cpu")
    prefill = hub.attention(q, k, v, causal=True, backend="gla", extra={"gla_gate": gate})
    decode = hub.attention(q[:, -1:], k, v, causal=True, backend="gla",
                           extra={"gla_gate": gate})
    assert float((prefill.double() - want).abs().max()) < 1e-5
    assert float((decode.double() - want[:, -1:]).abs().max()) < 1e-5


def test_a_long_prefix_rebuilt_without_state_keeps_its_digits() -> None:
    from attnhub_hybrid_linear import linear_torch

    torch.manual_seed(1)
    n = 50_000
    k, v = torch.randn(1, n, 1, 4), torch.randn(1, n, 1, 4)
    g = torch.nn.functional.logsigmoid(torch.randn(1, n, 1, 4)) / 4
    got = linear_torch.state_after(k, v, g)
    st = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    for t in range(n - 400, n):  # the decay before these tokens is below 1e-30
        st = st * g[:, t].double().exp().unsqueeze(-1) + (
            k[:, t].double().unsqueeze(-1) * v[:, t].double().unsqueeze(-2))
    assert float((got.double() - st).abs().max() / st.abs().max()) < 1e-5


def test_a_training_call_stores_values_not_its_graph() -> None:
    torch.manual_seed(0)
    st = RecurrentStateCache(layers=[0], num_heads=2, key_dim=4, max_seqs=2)
    st.allocate(0)
    extra = {"recurrent_state": st, "seq_ids": [0], "layer": 0}
    hub = attnhub.Hub(hardware="cpu")
    q, k, v = (torch.randn(1, 6, h, 4, requires_grad=True) for h in (2, 1, 1))
    hub.attention(q, k, v, causal=True, backend="gla", extra=extra).sum().backward()
    assert not st._pool.requires_grad and st.read([0], 0)[0].grad_fn is None
    q2, k2, v2 = (torch.randn(1, 3, h, 4, requires_grad=True) for h in (2, 1, 1))
    out = hub.attention(q2, torch.cat([k.detach(), k2], 1), torch.cat([v.detach(), v2], 1),
                        causal=True, backend="gla", extra=extra)
    out.sum().backward()  # raised "backward through the graph a second time"
    assert q2.grad is not None


def test_a_state_cache_of_another_geometry_is_named() -> None:
    st = RecurrentStateCache(layers=[0], num_heads=2, key_dim=8, max_seqs=1)
    st.allocate(0)
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8)
    v = torch.randn(1, 4, 1, 4)  # value dim 4, the cache's 8
    with pytest.raises(InputError, match=r"holds states of .*\(2, 8, 8\).*\(2, 8, 4\)"):
        attnhub.Hub(hardware="cpu").attention(
            q, k, v, causal=True, backend="gla",
            extra={"recurrent_state": st, "seq_ids": [0], "layer": 0})
