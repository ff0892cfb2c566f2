"""FlashAttention's test grid through the public API, third pass: cases the first two left out.

Random inputs on every exact CPU backend that takes the call (``flex`` forward only: no
backward on the CPU; ``triton``'s cases, slow under the interpreter, are in
plugins/triton_portable/tests/test_adversarial_triton_grid.py), each against the fp64
reference by the FlashAttention rule (2x forward, 3x gradients). What it found:

- ``torch_flash_cpu`` refused a packed (thd) causal call whose only documents with Sq != Sk
  were empty (0 queries or 0 keys: nothing to align), at run time, after its spec check
  had accepted it: a forced call failed, a policy call fell back.
- ``torch_sdpa`` on the CPU: a NaN in k reached rows that cannot see that key (SDPA adds a
  boolean mask as -inf, NaN + -inf = NaN), for every explicit mask and the
  ``causal_lower_right`` form: silent NaN where the answer is finite.
- ``reference``: a fully masked row gave NaN, not 0, when a value held NaN (its zero weights
  times NaN), against the contract (0 and -inf for a row that sees no key).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnhub
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.errors import BackendUnavailableError, NoBackendError
from attnhub.testing import assert_fa_rule, assert_lse, fa_references

CPU_GRAD_BACKENDS = ("reference", "torch_sdpa", "torch_flash_cpu", "sliding_window")


def _grid(cases: list, flex_case: object) -> list[tuple[str, object]]:
    """``(backend, case)`` pairs: each CPU backend on every case, flex (which builds a
    kernel per mask, seconds on the CPU) on ``flex_case`` only."""
    return [(b, c) for b in CPU_GRAD_BACKENDS for c in cases] + [("flex", flex_case)]


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub(hardware="cpu")


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def _call(hub: attnhub.Hub, backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` from ``backend``; a backend that declines the call (its spec check)
    skips the case with its reasons, never passes it silently."""
    try:
        return hub.attention(q, k, v, backend=backend, return_lse=True, **kw)
    except BackendUnavailableError as exc:
        pytest.skip(f"{backend} declines: {'; '.join(exc.reasons)}")


def _check(hub: attnhub.Hub, backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           params: AttnParams, layout: str = "bshd", dout: torch.Tensor | None = None,
           **kw: object) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Forward, LSE and (where the backend has a backward) dq, dk, dv of ``q, k, v`` as given
    (strides kept) against the fp64 reference of contiguous copies; returns what it got."""
    grad = backend in CPU_GRAD_BACKENDS  # flex: no backward on the CPU
    leaves = tuple(t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    ins = tuple(t.detach().requires_grad_(grad) if t.is_leaf else t for t in (q, k, v))
    out, lse = _call(hub, backend, *ins, layout=layout, **kw)
    ref64, ref_lse, same = fa_references(*leaves, params, layout=layout)
    assert_fa_rule(out, ref64, same)
    assert_lse(lse, ref_lse, atol=1e-4 if q.dtype == torch.float32 else 2e-2)
    if not grad:
        return out, lse, ()
    if dout is None:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    got = torch.autograd.grad(out, ins, dout)
    want = torch.autograd.grad(ref64, leaves, dout.double(), retain_graph=True)
    want_same = torch.autograd.grad(same, leaves, dout.contiguous())
    for what, a, r64, rs in zip("qkv", got, want, want_same):
        assert_fa_rule(a, r64, rs, mult=3.0, what=f"d{what}")
    return out, lse, got


# --- packed documents: empty ones among them ---------------------------------------------

#: doc 0: 0 queries, 4 keys; doc 1: 3 x 3; doc 2: 2 queries, no key; doc 3: 5 x 5
EMPTY_DOCS = ([0, 0, 3, 5, 10], [0, 4, 7, 7, 12])


THD_CASES = [(m, dt) for m in ({"causal": True}, {"causal": True, "window": (1, 0)},
                                {"window": (0, 2)}) for dt in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("backend,case", _grid(THD_CASES, THD_CASES[0]))
def test_thd_empty_documents(hub, backend, case):
    """Empty documents (no queries, or queries without keys) beside square ones: the square
    ones by the FlashAttention rule, the keyless one's rows 0 with LSE -inf and zero dq.
    torch_flash_cpu refused the causal call at run time (an empty document has Sq != Sk)."""
    mask, dtype = case
    if backend == "sliding_window" and "window" not in mask:
        pytest.skip("sliding_window serves windows only")
    g = torch.Generator().manual_seed(3)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in EMPTY_DOCS)
    q = _randn(g, 10, 6, 24, dtype=dtype)
    k, v = _randn(g, 12, 2, 24, dtype=dtype), _randn(g, 12, 2, 24, dtype=dtype)
    params = AttnParams(scale=1 / math.sqrt(24), causal=mask.get("causal", False),
                        window=mask.get("window"), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse, grads = _check(hub, backend, q, k, v, params, layout="thd", cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, **mask)
    keyless = slice(3, 5)
    assert not bool(out[keyless].any()) and bool(torch.isneginf(lse[:, keyless]).all())
    if grads:
        assert not bool(grads[0][keyless].any())
        assert all(bool(torch.isfinite(t).all()) for t in grads)


#: doc 0: 0 queries, 4 keys; doc 1: 3 queries, no key: no document attends at all
NO_PAIR_DOCS = ([0, 0, 3], [0, 4, 4])

NO_PAIR_CASES = [(b, m) for b in ("reference", "torch_sdpa", "sliding_window", "longformer")
                 for m in ({"window": (1, 0)}, {"window": (0, 2), "causal": True})] + [
    (b, {"causal": True}) for b in ("reference", "torch_sdpa", "torch_flash_cpu", "lsh")]


@pytest.mark.parametrize("backend,mask", NO_PAIR_CASES)
def test_thd_no_document_attends_keeps_the_graph(hub, backend, mask):
    """A packed call whose documents each lack queries or keys: 0 out with LSE -inf, in the
    autograd graph (zero gradients). sliding_window and longformer returned a bare
    ``new_zeros`` for a keyless document: OutputContractError (output cut from the graph)."""
    g = torch.Generator().manual_seed(5)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in NO_PAIR_DOCS)
    q = _randn(g, 3, 4, 8).requires_grad_()
    k, v = (_randn(g, 4, 2, 8).requires_grad_() for _ in range(2))
    out, lse = _call(hub, backend, q, k, v, layout="thd", cu_seqlens_q=cu_q,
                     cu_seqlens_k=cu_k, **mask)
    assert out.requires_grad and not bool(out.any())
    assert bool(torch.isneginf(lse).all())
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=g))
    assert all(t.shape == x.shape and not bool(t.any()) for t, x in zip(grads, (q, k, v)))


# --- strides: the output gradient and the side tensors ---------------------------------

def _dout_strided(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A non-contiguous output gradient (FlashAttention#355): transposed, every other
    element of the last dim, or expanded over the batch (stride 0)."""
    g = torch.Generator().manual_seed(11)
    b, s, h, d = shape
    if kind == "transposed":
        return _randn(g, b, h, s, d, dtype=dtype).transpose(1, 2)
    if kind == "last_dim":
        return _randn(g, b, s, h, 2 * d, dtype=dtype)[..., ::2]
    return _randn(g, 1, s, h, d, dtype=dtype).expand(b, s, h, d)


@pytest.mark.parametrize("backend", CPU_GRAD_BACKENDS)
@pytest.mark.parametrize("kind", ["transposed", "last_dim", "expanded"])
def test_non_contiguous_output_gradient(hub, backend, kind):
    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16
    q = _randn(g, 2, 7, 6, 40, dtype=dtype)
    k, v = _randn(g, 2, 7, 2, 40, dtype=dtype), _randn(g, 2, 7, 2, 40, dtype=dtype)
    kw = {"window": (2, 0), "causal": True}
    params = AttnParams(scale=1 / math.sqrt(40), causal=True, window=(2, 0))
    _check(hub, backend, q, k, v, params, dout=_dout_strided(kind, (2, 7, 6, 40), dtype), **kw)


def _slopes(kind: str, b: int, h: int) -> torch.Tensor:
    """ALiBi slopes of unusual layout or dtype: strided, transposed, expanded, fp64, bf16."""
    g = torch.Generator().manual_seed(17)
    r = torch.rand(b, 2 * h, generator=g) * 0.5 + 0.05
    return {"strided_h": r[0, ::2], "strided_bh": r[:, ::2], "transposed": r[:, :h].t()
            .contiguous().t(), "expanded": r[0, :h].expand(b, h), "fp64": r[0, :h].double(),
            "bf16": r[0, :h].bfloat16()}[kind]


@pytest.mark.parametrize("backend,kind", _grid(
    ["strided_h", "strided_bh", "transposed", "expanded", "fp64", "bf16"], "strided_bh"))
def test_alibi_slopes_of_any_layout(hub, backend, kind):
    """Slopes read through their strides and dtype (kernels index them by pointer)."""
    g = torch.Generator().manual_seed(19)
    q, k, v = _randn(g, 2, 5, 4, 16), _randn(g, 2, 9, 2, 16), _randn(g, 2, 9, 2, 16)
    slopes = _slopes(kind, 2, 4)
    params = AttnParams(scale=0.25, window=(3, 1), alibi_slopes=slopes)
    _check(hub, backend, q, k, v, params, alibi_slopes=slopes, window=(3, 1))


@pytest.mark.parametrize("backend,case", _grid(
    ["padded_head_dim", "transposed", "last_dim", "offset"], "transposed"))
def test_strided_qkv_with_masks(hub, backend, case):
    """FlexAttention's ``test_strides`` inputs with a top-left window, GQA 6:2, odd head dim
    59 and fp16: same answer as contiguous inputs."""
    g = torch.Generator().manual_seed(23)
    d, dt = 59, torch.float16
    dims = ((2, 6, 6), (2, 9, 2), (2, 9, 2))  # (B, S, H)
    if case == "padded_head_dim":
        qkv = [_randn(g, b, s, h, d + 5, dtype=dt)[..., 2:2 + d] for b, s, h in dims]
    elif case == "transposed":
        qkv = [_randn(g, b, h, s, d, dtype=dt).transpose(1, 2) for b, s, h in dims]
    elif case == "last_dim":
        qkv = [_randn(g, b, s, d, h, dtype=dt).transpose(-1, -2) for b, s, h in dims]
    else:
        flat = _randn(g, 997 + sum(b * s * h * d for b, s, h in dims), dtype=dt)
        qkv, o = [], 997
        for b, s, h in dims:
            qkv.append(flat[o:o + b * s * h * d].view(b, s, h, d))
            o += b * s * h * d
    kw = {"window": (1, 3), "causal_alignment": "top_left"}
    params = AttnParams(scale=1 / math.sqrt(d), window=(1, 3), alignment="top_left")
    _check(hub, backend, *qkv, params, **kw)


# --- fully masked rows from every mask kind ------------------------------------------

MASKED = {
    "causal_9x4": ((9, 4), {"causal": True}),
    "window_tl_9x4": ((9, 4), {"window": (1, 0), "causal_alignment": "top_left"}),
    "window_br_9x4": ((9, 4), {"window": (1, 0)}),
    "window_br_9x3": ((9, 3), {"window": (1, 2)}),
    "prefix_9x4": ((9, 4), {"causal": True, "prefix_lens": torch.tensor([0, 2])}),
    "softcap_alibi_9x4": ((9, 4), {"causal": True, "softcap": 2.0, "window": (1, 0),
                                    "alibi_slopes": torch.tensor([0.1, 0.2, 0.3, 0.4])}),
}


MASKED_CASES = [(c, dt) for c in sorted(MASKED) for dt in (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("backend,case", _grid(MASKED_CASES, ("prefix_9x4", torch.float16)))
def test_fully_masked_rows(hub, backend, case):
    """Rows that see no key: 0 output, LSE -inf, zero dq and finite gradients, twice (the
    slow path, then the exact-shape table)."""
    name, dtype = case
    (sq, sk), kw = MASKED[name]
    g = torch.Generator().manual_seed(29)
    q, k, v = (_randn(g, 2, s, h, 16, dtype=dtype) for s, h in ((sq, 4), (sk, 2), (sk, 2)))
    params = AttnParams(scale=0.25, causal=kw.get("causal", False), window=kw.get("window"),
                        alignment=kw.get("causal_alignment", "bottom_right"),
                        prefix_lens=kw.get("prefix_lens"), softcap=kw.get("softcap"),
                        alibi_slopes=kw.get("alibi_slopes"))
    dead = torch.isneginf(reference_attention(q, k, v, params)[1]).transpose(1, 2)
    assert bool(dead.any()) and not bool(dead.all())
    for _ in range(2):
        out, lse, grads = _check(hub, backend, q, k, v, params, **kw)
        assert not bool(out[dead].any())
        if grads:
            assert not bool(grads[0][dead].any())
            assert all(bool(torch.isfinite(t).all()) for t in grads)


# --- the exact-shape table: the same shapes with other values -------------------------

SEQUENCE = [{}, {"softcap": 5.0}, {"softcap": 0.5, "scale": 0.9}, {"scale": 0.1},
            {"causal": True}, {"causal": True, "causal_alignment": "top_left"},
            {"window": 1}, {"window": 1, "causal": True}, {"window": (0, 0)}, {"window": (40, 40)}]


@pytest.mark.parametrize("backend", [None, "torch_sdpa", "sliding_window"])
def test_one_shape_many_masks(backend):
    """One shape, calls that differ in scale, softcap, causal, alignment and window values
    (and contiguous or strided inputs): each answer is its own call's, whatever the hub
    learnt from the calls before (a backend that lacks a mask refuses it, never drops it)."""
    hub = attnhub.Hub(hardware="cpu")
    g = torch.Generator().manual_seed(31)
    for kw in SEQUENCE:
        for strided in (False, True):
            if strided:
                q = _randn(g, 2, 5, 4, 32)[..., ::2]
                k, v = _randn(g, 2, 2, 9, 16).transpose(1, 2), _randn(g, 2, 9, 32, 2)
                v = v.transpose(-1, -2)[..., :16]
            else:
                q, k, v = _randn(g, 2, 5, 4, 16), _randn(g, 2, 9, 2, 16), _randn(g, 2, 9, 2, 16)
            try:
                out = hub.attention(q, k, v, backend=backend, **kw)
            except (BackendUnavailableError, NoBackendError):
                assert backend is not None
                continue
            w = kw.get("window")
            w = (w, 0 if kw.get("causal") else w) if isinstance(w, int) else w
            p = AttnParams(scale=kw.get("scale", 0.25), causal=kw.get("causal", False),
                           alignment=kw.get("causal_alignment", "bottom_right"), window=w,
                           softcap=kw.get("softcap"))
            torch.testing.assert_close(out.double(), reference_attention(q, k, v, p)[0],
                                       atol=2e-5, rtol=0)


# --- head dims and GQA in half precision with every mask kind --------------------------

@pytest.mark.parametrize("backend", CPU_GRAD_BACKENDS)
@pytest.mark.parametrize("d,hkv,sq,sk", [(40, 6, 1, 23), (72, 2, 23, 3), (111, 1, 3, 17)])
def test_odd_dims_gqa_swapped_lengths(hub, backend, d, hkv, sq, sk):
    """Odd head dims, GQA 6:6/6:2/6:1, (1, Sk)-style lengths and swapped, bf16, causal
    bottom-right with a window, softcap and per-batch ALiBi: every backend that takes the
    call by the FlashAttention rule (forward, LSE, dq/dk/dv)."""
    g = torch.Generator().manual_seed(d)
    dt = torch.bfloat16
    q = _randn(g, 2, sq, 6, d, dtype=dt)
    k, v = _randn(g, 2, sk, hkv, d, dtype=dt), _randn(g, 2, sk, hkv, d, dtype=dt)
    slopes = torch.rand(2, 6, generator=g) * 0.3
    kw = {"causal": True, "window": (4, 0), "softcap": 30.0, "alibi_slopes": slopes}
    params = AttnParams(scale=1 / math.sqrt(d), causal=True, window=(4, 0), softcap=30.0,
                        alibi_slopes=slopes)
    _check(hub, backend, q, k, v, params, **kw)


# --- gradients through the returned LSE -------------------------------------------------

LSE_MASKS = [{"window": (2, 1)}, {"window": (1, 0), "causal": True, "softcap": 3.0},
             {"window": (3, 3), "alibi_slopes": torch.tensor([[0.1, 0.5, 0.2, 0.3],
                                                              [0.4, 0.05, 0.25, 0.15]])},
             {"window": (2, 0), "causal": True, "causal_alignment": "top_left"}]


@pytest.mark.parametrize("backend", ["torch_sdpa", "sliding_window"])
@pytest.mark.parametrize("mask", LSE_MASKS)
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5)])
def test_lse_gradient_with_masks(hub, backend, mask, sq, sk):
    """A loss of out and LSE (fully masked rows' -inf left out): dq, dk, dv equal the fp64
    maths' on every backend whose LSE the contract calls differentiable."""
    g = torch.Generator().manual_seed(sq * 10 + sk)
    base = [_randn(g, 2, s, h, 16) for s, h in ((sq, 4), (sk, 2), (sk, 2))]
    ins = [t.clone().requires_grad_() for t in base]
    out, lse = _call(hub, backend, *ins, **mask)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)

    def loss(o: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
        return (o.double() * w_out).sum() + (torch.nan_to_num(l.double(), neginf=0.0)
                                             * w_lse).sum()

    leaves = [t.double().requires_grad_() for t in base]
    params = AttnParams(scale=0.25, causal=mask.get("causal", False), window=mask["window"],
                        alignment=mask.get("causal_alignment", "bottom_right"),
                        softcap=mask.get("softcap"), alibi_slopes=mask.get("alibi_slopes"))
    got = torch.autograd.grad(loss(out, lse), ins)
    want = torch.autograd.grad(loss(*reference_attention(*leaves, params)), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


# --- NaN in means NaN out, and only there ------------------------------------------------

NAN_MASKS = {
    "causal_4x9": ((4, 9), {"causal": True}),
    "causal_9x4": ((9, 4), {"causal": True}),
    "window_5x9": ((5, 9), {"window": (1, 1)}),
    "window_tl_9x4": ((9, 4), {"window": (1, 0), "causal_alignment": "top_left"}),
    "window_br_9x4": ((9, 4), {"window": (1, 0)}),
    "prefix_alibi_6x6": ((6, 6), {"causal": True, "prefix_lens": torch.tensor([1, 2]),
                                  "alibi_slopes": torch.tensor([0.2, 0.1, 0.4, 0.3])}),
}


def _nan_params(kw: dict) -> AttnParams:
    return AttnParams(scale=0.25, causal=kw.get("causal", False), window=kw.get("window"),
                      alignment=kw.get("causal_alignment", "bottom_right"),
                      prefix_lens=kw.get("prefix_lens"), alibi_slopes=kw.get("alibi_slopes"))


@pytest.mark.parametrize("backend", ["reference", "torch_sdpa", "sliding_window", "flex"])
@pytest.mark.parametrize("case", sorted(NAN_MASKS))
@pytest.mark.parametrize("return_lse", [False, True])
def test_nan_key_reaches_only_the_rows_that_see_it(hub, backend, case, return_lse):
    """A NaN in k at the last key: NaN in exactly the rows that see that key (and their
    LSE), every other row exact. torch_sdpa applied its boolean mask as an additive -inf
    (NaN + -inf = NaN) and put NaN in rows that cannot see the key; sliding_window gave
    such a row LSE -inf, not NaN (its NaN row sum counted as "no key seen")."""
    (sq, sk), kw = NAN_MASKS[case]
    g = torch.Generator().manual_seed(37)
    q, k, v = (_randn(g, 2, s, h, 16) for s, h in ((sq, 4), (sk, 2), (sk, 2)))
    k[1, sk - 1, 0, 3] = math.nan
    try:
        res = hub.attention(q, k, v, backend=backend, return_lse=return_lse, **kw)
    except BackendUnavailableError as exc:
        pytest.skip(f"{backend} declines: {'; '.join(exc.reasons)}")
    out = res[0] if return_lse else res
    ref64, ref_lse, same = fa_references(q, k, v, _nan_params(kw))
    want = torch.isnan(ref64).any(-1)
    assert bool(want.any()) and not bool(want[1, :, :2].all())
    assert torch.equal(torch.isnan(out).any(-1), want)
    assert_fa_rule(out[~want], ref64[~want], same[~want])
    if return_lse:
        assert torch.equal(torch.isnan(res[1]), torch.isnan(ref_lse))


DEAD_NAN_CASES = [(b, c) for b in ("reference", "torch_sdpa", "flex")
                  for c in ("causal_9x4", "window_tl_9x4", "window_br_9x4")] + [
    ("sliding_window", c) for c in ("window_tl_9x4", "window_br_9x4")]


@pytest.mark.parametrize("backend,case", DEAD_NAN_CASES)
def test_fully_masked_rows_stay_zero_under_nan_values(hub, backend, case):
    """NaN in v (and q) of a row's keys: rows that see no key still give 0 and LSE -inf
    (the reference, sliding_window and eager flex on the CPU multiplied their zero weights
    by the NaN: 0 x NaN = NaN)."""
    (sq, sk), kw = NAN_MASKS[case]
    g = torch.Generator().manual_seed(53)
    q, k, v = (_randn(g, 2, s, h, 16) for s, h in ((sq, 4), (sk, 2), (sk, 2)))
    params = _nan_params(kw)
    dead = torch.isneginf(reference_attention(q, k, v, params)[1])
    v[:, 0, :, 5] = math.nan
    q[:, 0, :, 1] = math.nan
    out, lse = _call(hub, backend, q, k, v, **kw)
    alone = hub.attention(q, k, v, backend=backend, **kw)  # eager flex: no LSE asked for
    assert bool(dead.any())
    for o in (out, alone):
        assert not bool(o.transpose(1, 2)[dead].isnan().any())
        assert not bool(o.transpose(1, 2)[dead].any())
    assert bool(torch.isneginf(lse[dead]).all())
