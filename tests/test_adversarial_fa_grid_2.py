"""FlashAttention's test grid through the public API, second pass: what it found on the CPU.

- GQA/MQA gradients in fp16/bf16 (torch_sdpa, torch_flash_cpu): torch's CPU flash backward
  summed a KV head's gradient over its query heads in the input precision, 3-5x the error of
  the same-precision maths at 32:1 heads (outside the FlashAttention rule).
- A gradient through the returned LSE: torch_sdpa's CPU LSE (the fused op's) carried none,
  so a loss using it silently got none; a backend whose LSE is outside the graph now raises
  at ``backward()`` (the hub's guard) instead.
- torch_flash_cpu's refusal of a bottom-right causal call named its length buckets as the
  call's lengths (``Sq=128 != Sk=256`` for a call of 113 and 203).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnhub
from attnhub.core.backend import AttentionOutput
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.errors import BackendUnavailableError, InputError
from attnhub.testing import assert_grads_fa_rule, fa_references


def _qkv(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype: torch.dtype,
         seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).to(dtype).requires_grad_()
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


@pytest.mark.parametrize("backend", ["torch_sdpa", "torch_flash_cpu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mqa_half_gradients_meet_the_fa_rule(backend: str, dtype: torch.dtype) -> None:
    """MQA 32:1 in fp16/bf16: dK and dV within 3x the same-precision maths' error."""
    for seed in range(3):
        q, k, v = _qkv(1, 64, 64, 32, 1, 64, dtype, seed)
        torch.manual_seed(seed)  # the rule's random output gradient
        out = attnhub.attention(q, k, v, backend=backend, causal=True)
        ref64, _, same = fa_references(q, k, v, AttnParams(scale=1 / 8, causal=True))
        assert_grads_fa_rule(out, ref64, same, (q, k, v))


def _lse_loss_grads(lse: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                    weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    loss = (torch.nan_to_num(lse.double(), neginf=0.0) * weight).sum()
    return torch.autograd.grad(loss, inputs[:2])


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("window", [None, (3, 3)])
def test_torch_sdpa_lse_carries_its_gradient(layout: str, window: tuple | None) -> None:
    """dLSE/dq and dLSE/dk equal the fp64 maths' (they were silently 0 on the CPU)."""
    g = torch.Generator().manual_seed(0)
    if layout == "bshd":
        shapes, kw = [(2, 13, 4, 32), (2, 29, 2, 32), (2, 29, 2, 32)], {}
    else:
        shapes = [(20, 4, 32), (30, 2, 32), (30, 2, 32)]
        kw = {"layout": "thd", "cu_seqlens_q": torch.tensor([0, 7, 7, 20], dtype=torch.int32),
              "cu_seqlens_k": torch.tensor([0, 10, 12, 30], dtype=torch.int32)}
    qkv = tuple(torch.randn(*s, generator=g).requires_grad_() for s in shapes)
    out, lse = attnhub.attention(*qkv, backend="torch_sdpa", causal=True, window=window,
                                 return_lse=True, **kw)
    weight = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    got = _lse_loss_grads(lse, qkv, weight)
    params = AttnParams(scale=1 / math.sqrt(32), causal=True, window=window,
                        cu_seqlens_q=kw.get("cu_seqlens_q"), cu_seqlens_k=kw.get("cu_seqlens_k"))
    leaves = tuple(t.detach().double().requires_grad_() for t in qkv)
    _, ref_lse = reference_attention(*leaves, params, layout=layout)
    want = _lse_loss_grads(ref_lse, leaves, weight)
    for a, b in zip(got, want):
        assert float(b.abs().max()) > 0.1
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


def test_a_detached_lse_raises_when_differentiated(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend whose LSE is outside the graph: a loss through the output alone works; one
    through the LSE raises naming the backend, never gets a silent zero."""
    hub = attnhub.Hub(hardware="cpu")
    backend = hub.registry.get("torch_sdpa")
    forward = backend.forward

    def detached(*args, **kwargs):  # type: ignore[no-untyped-def]
        res = forward(*args, **kwargs)
        return AttentionOutput(res.out, None if res.lse is None else res.lse.detach())

    monkeypatch.setattr(backend, "forward", detached)
    q, k, v = _qkv(1, 8, 8, 2, 2, 16, torch.float32, 0)
    out, lse = hub.attention(q, k, v, backend="torch_sdpa", return_lse=True)
    out.sum().backward()
    assert q.grad is not None and bool(q.grad.ne(0).any())
    out, lse = hub.attention(q, k, v, backend="torch_sdpa", return_lse=True)
    with pytest.raises(InputError, match="torch_sdpa.*LSE without a gradient"):
        (out.sum() + lse.sum()).backward()
    # no gradients asked for: the LSE is handed on as the backend returned it
    with torch.no_grad():
        _, lse = hub.attention(q, k, v, backend="torch_sdpa", return_lse=True)
    assert lse.grad_fn is None


def test_torch_flash_cpu_refusal_names_buckets_not_lengths() -> None:
    q, k, v = (t.detach() for t in _qkv(1, 113, 203, 2, 2, 16, torch.float32, 0))
    with pytest.raises(BackendUnavailableError) as info:
        attnhub.attention(q, k, v, backend="torch_flash_cpu", causal=True)
    text = str(info.value)
    assert "Sq (<= 128) != Sk (<= 256)" in text and "Sq=128" not in text
