"""FlashAttention's grid, sixth round (CPU): an inf key where rows cannot see it, learned
ALiBi slopes on kernels whose backward ignores them, fp32 gradients at large scales, Triton's
interpreter under threads, and the message for packed calls without documents."""

from __future__ import annotations

import threading

import pytest
import torch

import attnhub
from attnhub import AttnParams
from attnhub.core.reference import reference_attention
from attnhub.errors import AttnhubError

triton_on_cpu = pytest.mark.skipif(
    not attnhub.Hub(hardware="cpu").registry.backends.get("triton"),
    reason="triton_portable not installed")


def _same_nan_and_values(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (torch.isnan(out), torch.isnan(ref))
    torch.testing.assert_close(torch.nan_to_num(out).double(), torch.nan_to_num(ref),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("case", ["bottom-right", "window", "lse"])
def test_an_inf_key_reaches_only_the_rows_that_see_it(case: str, sign: float) -> None:
    """SDPA adds a boolean mask as -inf, and inf + -inf is NaN: an fp16 cache entry that
    overflowed to inf made every row of its head NaN on the CPU default (torch_sdpa), those
    that cannot see it too. A visible +inf score makes its row NaN, a -inf one weighs 0."""
    g = torch.Generator().manual_seed(3)
    sq, sk = (3, 6) if case == "bottom-right" else (6, 6)
    q, k, v = (torch.randn(1, s, 2, 8, generator=g) for s in (sq, sk, sk))
    q[..., 0] = sign * q[..., 0].abs()
    window = (2, 0) if case == "window" else None
    k[0, 0 if window else sk - 1, 0, 0] = float("inf")
    causal = window is None
    ref, _ = reference_attention(q, k, v, AttnParams(scale=8 ** -0.5, causal=causal,
                                                     window=window))
    if case == "window" and sign < 0:
        ref[0, 0, 0] = 0.0  # row 0 sees only that key at -inf: fully masked, 0 by contract
    for backend in ("torch_sdpa", None):
        out = attnhub.attention(q, k, v, causal=causal, window=window, backend=backend,
                                return_lse=case == "lse")
        _same_nan_and_values(out[0] if case == "lse" else out, ref)


@triton_on_cpu
def test_learned_alibi_slopes_are_never_left_without_a_gradient() -> None:
    """triton's backward gives the slopes no gradient: it refuses them, and the policy's
    next candidate (torch_sdpa) trains them as the reference does."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 4, 16, generator=g, requires_grad=True)
    k, v = torch.randn(1, 8, 4, 16, generator=g), torch.randn(1, 8, 4, 16, generator=g)
    s0 = torch.rand(4, generator=g) * 0.5
    grads = {}
    for name in ("reference", "torch_sdpa"):
        slopes = s0.clone().requires_grad_()
        attnhub.attention(q, k, v, causal=True, alibi_slopes=slopes,
                          backend=name).square().sum().backward()
        grads[name] = slopes.grad
    torch.testing.assert_close(grads["torch_sdpa"], grads["reference"])
    slopes = s0.clone().requires_grad_()
    with pytest.raises(AttnhubError, match="learned ALiBi slopes"):
        attnhub.attention(q, k, v, causal=True, alibi_slopes=slopes, backend="triton")
    fixed = attnhub.attention(q, k, v, causal=True, alibi_slopes=s0, backend="triton")
    assert fixed.requires_grad


@pytest.mark.parametrize("scale", [3.0, 10.0])
def test_fp32_gradients_at_a_large_scale_meet_the_rule(scale: float) -> None:
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(2, 17, h, 64, generator=g).requires_grad_() for h in (4, 2, 2))
        out = attnhub.attention(q, k, v, scale=scale, causal=True)
        dout = torch.randn(out.shape, generator=g)
        p = AttnParams(scale=scale, causal=True)
        r64, _ = reference_attention(q, k, v, p)
        r32, _ = reference_attention(q, k, v, p, compute_dtype=torch.float32)
        for a, b, c in zip(torch.autograd.grad(out, (q, k, v), dout),
                           torch.autograd.grad(r64, (q, k, v), dout.double()),
                           torch.autograd.grad(r32, (q, k, v), dout)):
            err, base = (a.double() - b).abs().max(), (c.double() - b).abs().max()
            assert err <= 3 * base + 1e-6, (seed, float(err), float(base))


@triton_on_cpu
def test_triton_under_the_interpreter_is_safe_from_threads() -> None:
    """The interpreter patches process-wide state: four threads calling the Triton kernels
    got results up to 4e34 off, or InterpreterError."""
    ref, bad = attnhub.Hub(hardware="cpu"), []

    def work(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(4):
            q, k, v = (torch.randn(2, 9, 4, 16, generator=g) for _ in range(3))
            try:
                out = attnhub.attention(q, k, v, causal=True, backend="triton")
                want = ref.attention(q, k, v, causal=True, backend="reference")
                if not torch.allclose(out, want, atol=1e-4):
                    bad.append(float((out - want).abs().max()))
            except Exception as exc:  # noqa: BLE001 - collected and reported below
                bad.append(repr(exc)[:120])

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_packed_call_without_documents_says_so() -> None:
    empty = torch.zeros(0, 2, 8)
    cu = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(AttnhubError, match="B >= 1 documents"):
        attnhub.attention(empty, empty, empty, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu)


@pytest.mark.parametrize("layout", ["thd", "paged"])
def test_an_inf_key_in_packed_and_paged_calls_reaches_its_row_only(layout: str) -> None:
    """The siblings: a document's last key, and the newest key of a paged cache (an fp16
    cache entry that overflowed), are seen by the last query only."""
    g = torch.Generator().manual_seed(1)
    if layout == "thd":
        q, k, v = (torch.randn(8, 2, 8, generator=g) for _ in range(3))
        k[7, 0, 0] = float("inf")
        q[..., 0] = q[..., 0].abs()
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        for lse in (False, True):
            out = attnhub.attention(q, k, v, causal=True, layout="thd", cu_seqlens_q=cu,
                                    cu_seqlens_k=cu, return_lse=lse)
            rows = torch.isnan(out[0] if lse else out).any(-1)[:, 0]
            assert rows.tolist() == [False] * 7 + [True]
        return
    from attnhub.core.kvcache import PagedKVCache

    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8,
                         dtype=torch.float32)
    seq = cache.allocate()
    keys, values = torch.randn(6, 1, 8, generator=g), torch.randn(6, 1, 8, generator=g)
    keys[5, 0, 0] = float("inf")
    cache.write(0, cache.reserve([seq], 6), keys, values)
    q = torch.randn(1, 3, 1, 8, generator=g)
    q[..., 0] = q[..., 0].abs()
    out = attnhub.attention(q, cache.k_cache(0), cache.v_cache(0), causal=True, layout="paged",
                            block_table=cache.block_table([seq]), seqlens_k=cache.seqlens([seq]))
    assert torch.isnan(out).any(-1)[0, :, 0].tolist() == [False, False, True]
