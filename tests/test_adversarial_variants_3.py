"""Adversarial score/mask variants and FlashMask-style sparse masks at the hub (round 3).

* A score/mask argument that cannot be what its slot needs (an unregistered name, a callable
  of the other kind) is the caller's error: ``ArgumentError`` before any backend runs, never
  a backend's ``TypeError`` retried on the next candidate and counted as a fallback.
* Column-sparse ranges (``colmask_start/end``) and prefix-LM (``prefix_lens``) on every
  backend that declares them, forward and backward, against an fp64 oracle written here
  from the definition (not from ``attnhub.core.masking``): start > end, ranges outside
  [0, Sq], per-KV-head and shared shapes, every integer dtype the contract takes.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from attnhub import Hub
from attnhub.errors import ArgumentError

B, HQ, HKV, D = 2, 4, 2, 8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv(sq: int, sk: int, g: torch.Generator, grad: bool = False) -> list[torch.Tensor]:
    shapes = ((B, sq, HQ, D), (B, sk, HKV, D), (B, sk, HKV, D))
    return [torch.randn(s, generator=g).requires_grad_(grad) for s in shapes]


@pytest.fixture(scope="module")
def hub() -> Hub:
    return Hub()


# -- arguments that cannot fill their slot ---------------------------------------------------
def _score(score, b, h, q_idx, kv_idx):
    return score * 2


def _mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("kwargs,needle", [
    ({"score_mod": "softcap31"}, "score_mod='softcap31': no variant"),
    ({"mask_mod": "window99"}, "mask_mod='window99': no variant"),
    ({"mask_mod": _score}, "pass it as score_mod="),
    ({"score_mod": _mask}, "pass it as mask_mod="),
])
def test_a_slot_filled_with_the_wrong_thing_is_an_argument_error(hub, kwargs, needle) -> None:
    q, k, v = _qkv(7, 9, _gen(1))
    before = dict(hub.fallback_counts)
    with pytest.raises(ArgumentError, match=needle):
        hub.attention(q, k, v, **kwargs)
    assert dict(hub.fallback_counts) == before  # no backend ran and failed


def test_a_same_named_lambda_of_the_other_kind_is_refused_on_the_hot_path(hub) -> None:
    """The exact-shape table keys callables by name: two lambdas share ``<lambda>``."""
    g = _gen(2)
    q, k, v = _qkv(6, 6, g)
    shift = float(torch.rand((), generator=g))
    first = hub.attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + shift * (qi - kv))
    assert torch.isfinite(first).all()
    before = dict(hub.fallback_counts)
    with pytest.raises(ArgumentError, match="pass it as mask_mod="):
        hub.attention(q, k, v, score_mod=lambda b, h, qi, kv: qi >= kv)
    assert dict(hub.fallback_counts) == before


# -- column-sparse and prefix-LM on every backend that declares them -------------------------
def _oracle(q, k, v, start, end, prefix, causal: bool):
    """fp64 attention with the mask written from the contract: rows [start, end) of key
    column j masked (per KV head or shared), causal bottom-right, prefix keys always seen."""
    sq, sk = q.shape[1], k.shape[1]
    qi = torch.arange(sq).view(sq, 1) + sk - sq
    kj = torch.arange(sk).view(1, sk)
    seen = torch.ones(B, HQ, sq, sk, dtype=torch.bool)
    if causal:
        c = (kj <= qi).view(1, 1, sq, sk)
        if prefix is not None:
            c = c | (kj.view(1, 1, 1, sk) < prefix.long().view(B, 1, 1, 1))
        seen &= c
    rep = HQ // start.shape[1]
    st, en = (x.long().repeat_interleave(rep, 1).unsqueeze(2) for x in (start, end))
    rows = torch.arange(sq).view(1, 1, sq, 1)
    seen &= ~((rows >= st) & (rows < en))
    kk, vv = (x.double().repeat_interleave(HQ // HKV, 2).transpose(1, 2) for x in (k, v))
    s = (q.double().transpose(1, 2) @ kk.transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(~seen, float("-inf"))
    row = seen.any(-1, keepdim=True)
    p = torch.softmax(torch.where(row, s, 0.0), -1) * row
    lse = torch.where(row[..., 0], torch.logsumexp(torch.where(row, s, 0.0), -1),
                      float("-inf"))
    return (p @ vv).transpose(1, 2), lse, row[..., 0]


CASES = [  # backend, dtype, heads of the ranges, causal, prefix-LM
    ("reference", torch.int64, HKV, True, True),
    ("reference", torch.uint8, 1, False, False),
    ("torch_sdpa", torch.int32, HKV, True, False),
    ("torch_sdpa", torch.int64, 1, True, True),
    ("torch_sdpa", torch.int8, HKV, False, False),
    ("triton", torch.int64, HKV, True, True),
    ("triton", torch.int32, 1, False, False),
    ("triton", torch.int16, HKV, True, False),
]


@pytest.mark.parametrize("backend,dtype,heads,causal,prefix", CASES)
def test_column_sparse_and_prefix_forward_backward(hub, backend, dtype, heads, causal,
                                                   prefix) -> None:
    g = _gen(zlib.crc32(f"{backend}{dtype}{heads}{causal}{prefix}".encode()))
    sq, sk = 9, 13
    q, k, v = _qkv(sq, sk, g, grad=True)
    low = 0 if dtype == torch.uint8 else -5
    start, end = (torch.randint(low, sq + 6, (B, heads, sk), generator=g).to(dtype)
                  for _ in range(2))  # start > end and outside [0, Sq] occur
    start[:, :, 0] = end[:, :, 0] + 2  # an inverted range (nothing masked) in every head
    end[:, :, 1] = sq + 4  # a range past the last query
    lens = torch.randint(low, sk + 5, (B,), generator=g).to(dtype) if prefix else None
    out, lse = hub.attention(q, k, v, backend=backend, causal=causal, colmask_start=start,
                             colmask_end=end, prefix_lens=lens, return_lse=True)
    ref, ref_lse, row = _oracle(q, k, v, start, end, lens, causal)
    assert (out.detach().double() - ref).abs().max() < 1e-5
    assert torch.equal(torch.isneginf(lse), ~row)
    assert (lse.double() - ref_lse)[row].abs().max() < 1e-5
    go = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), go)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(_oracle(q64, k64, v64, start, end, lens, causal)[0],
                               (q64, k64, v64), go.double())
    for name, got, exp in zip("qkv", grads, want):
        assert (got.double() - exp).abs().max() < 1e-4, f"{backend}: d{name}"
    assert not grads[0].transpose(1, 2)[~row].any()  # fully masked rows: zero dq


# -- fully masked rows of a mask_mod, with gradients ------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "torch_sdpa"])
def test_fully_masked_mask_mod_rows_are_zero_with_zero_grads(hub, backend) -> None:
    g = _gen(5)
    q, k, v = _qkv(11, 7, g, grad=True)
    cut = int(torch.randint(2, 9, (), generator=g))
    out, lse = hub.attention(q, k, v, backend=backend, return_lse=True,
                             mask_mod=lambda b, h, qi, kv: qi >= cut)
    assert torch.equal(out[:, :cut].detach(), torch.zeros_like(out[:, :cut]))
    assert torch.isneginf(lse[:, :, :cut]).all() and torch.isfinite(lse[:, :, cut:]).all()
    dq, = torch.autograd.grad(out, (q,), torch.randn(out.shape, generator=g))
    assert torch.equal(dq[:, :cut], torch.zeros_like(dq[:, :cut]))
    assert dq[:, cut:].abs().sum() > 0


def test_reference_rows_whose_score_mod_is_all_minus_inf_are_fully_masked(hub) -> None:
    """A score_mod masking by -inf (FlexAttention's _inverse_causal) empties rows as a mask
    does: 0 out, -inf LSE, zero and finite gradients (the reference gave NaN there)."""
    g = _gen(6)
    q, k, v = _qkv(12, 7, g)  # Sq > Sk: top-left inverse causal leaves rows q >= Sk empty
    q.requires_grad_()
    out, lse = hub.attention(q, k, v, backend="reference", return_lse=True,
                             score_mod=lambda s, b, h, qi, kv: torch.where(
                                 qi <= kv, s, float("-inf")))
    assert not out.isnan().any()
    assert torch.equal(out[:, 7:].detach(), torch.zeros_like(out[:, 7:]))
    assert torch.isneginf(lse[:, :, 7:]).all() and torch.isfinite(lse[:, :, :7]).all()
    dq, = torch.autograd.grad(out, (q,), torch.randn(out.shape, generator=g))
    assert torch.isfinite(dq).all() and torch.equal(dq[:, 7:], torch.zeros_like(dq[:, 7:]))
    assert dq[:, :7].abs().sum() > 0


# -- mask_mod gradients against the fp64 reference --------------------------------------------
@pytest.mark.parametrize("name", ["causal", "inverse_causal", "windowed", "per_head"])
def test_mask_mod_gradients_follow_the_fa_rule(hub, name) -> None:
    """torch_sdpa (the CPU's mask_mod backend with gradients), GQA, Sq != Sk, random masks."""
    from attnhub.plugin import AttnParams, reference_attention
    from attnhub.testing import assert_fa_rule

    g = _gen(zlib.crc32(name.encode()))
    off = torch.randint(-6, 6, (HQ,), generator=g)
    mods = {"causal": lambda b, h, qi, kv: qi >= kv,
            "inverse_causal": lambda b, h, qi, kv: qi <= kv,
            "windowed": lambda b, h, qi, kv: (qi + off[0] >= kv) & (qi - kv <= 4),
            "per_head": lambda b, h, qi, kv: qi + off[h] >= kv}
    sq, sk = (13, 8) if name == "inverse_causal" else (8, 13)  # some rows see no key
    q, k, v = _qkv(sq, sk, g, grad=True)
    out = hub.attention(q, k, v, backend="torch_sdpa", mask_mod=mods[name])
    go = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (q, k, v), go)
    p = AttnParams(scale=D ** -0.5, mask_mod=mods[name])
    refs = []
    for dtype in (torch.float64, torch.float32):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        ref = reference_attention(*xs, p, compute_dtype=dtype)[0]
        refs.append(torch.autograd.grad(ref, xs, go.to(dtype)))
    for i in range(3):
        assert_fa_rule(got[i], refs[0][i], refs[1][i], mult=3.0, what=f"d{'qkv'[i]}")
