"""FlashAttention's test grid through the public API, fourth pass: the hub boundary.

Random inputs, each answer against the fp64 reference by the FlashAttention rule. What it
found (each test failed before its fix):

- FP8 descales (``extra`` ``k_descale``/``v_descale``) beside a 16/32-bit k/v were refused
  by ``reference``, ``torch_sdpa`` and ``triton_decode`` only: ``torch_flash_cpu``, ``flex``,
  ``triton`` (and every GPU backend) read the cache unscaled, silently; ``q_descale`` and
  ``dropout_p`` were ignored by every backend. Now the contract (``check_extra``) refuses
  them for every backend, on the hot path too (``extra`` is not in its key).
- k/v of float64 (or an FP8 dtype no backend names) beside fp32 queries passed the dtype
  check and failed later as a bare ``ValueError`` of the spec, not a ``DTypeMismatchError``.
- ``scale``/``softcap`` above float32's largest (1e39, 1e300: finite Python floats) became
  inf in every kernel: NaN outputs, silently; a softcap below its smallest (1e-50) became 0:
  NaN for a zero score (``flex``).
- ``triton``'s backward under ``create_graph=True`` returned gradients outside the graph, so
  a gradient penalty (first-order loss + a term of the gradients) silently lost the
  penalty's gradient; now differentiating them raises, naming the fix.
- Under ``torch.autocast`` (CPU, bf16) ``torch_sdpa`` and ``flex`` returned bf16 for fp32
  queries: a contract failure on every call (forced: ``NoBackendError``; policy: a fallback
  per call); ``sliding_window`` computed in bf16 and cast back to fp32, silently.
"""

from __future__ import annotations

import pytest
import torch

import attnhub
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.errors import ArgumentError, DTypeMismatchError, InputError
from attnhub.testing import assert_fa_rule, assert_lse, fa_references

#: Exact backends that run on this CPU (triton under the interpreter, tiny shapes).
CPU_BACKENDS = ("reference", "torch_sdpa", "torch_flash_cpu", "flex", "triton")


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub(hardware="cpu")


def _qkv(seed: int, b: int = 2, sq: int = 5, sk: int = 6, hq: int = 4, hkv: int = 2,
         d: int = 16, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g).to(dtype)
                 for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d)))


def _check(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           **kw: object) -> None:
    ref64, _, same = fa_references(q, k, v, AttnParams(scale=q.shape[-1] ** -0.5, **kw))
    assert out.dtype == q.dtype
    assert_fa_rule(out, ref64, same)


# --- extra: what every backend would ignore ------------------------------------------------

def _descales(b: int, hkv: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.rand(b, hkv, generator=g) + 0.5 for n in ("k_descale", "v_descale")}


IGNORED = [("k_descale",), ("v_descale",), ("k_descale", "v_descale"), ("q_descale",),
           ("dropout_p",), ("softmax_scale",)]


@pytest.mark.parametrize("names", IGNORED, ids="+".join)
def test_ignored_extra_is_refused_for_every_backend(hub, names):
    """Every registered backend (GPU ones too: the contract runs before any binding) gets
    the same error, naming the argument."""
    q, k, v = _qkv(1)
    scales = _descales(2, 2, 2)
    extra = {n: scales.get(n, 0.25) for n in names}
    for backend in sorted(hub.registry.names()):
        with pytest.raises(ArgumentError, match=names[0]):
            hub.attention(q, k, v, backend=backend, extra=extra)


@pytest.mark.parametrize("backend", (*CPU_BACKENDS, None))
def test_ignored_extra_is_refused_on_the_hot_path(hub, backend):
    """A binding made without ``extra`` serves the next call of the same key from the hot
    path: descales or dropout there are refused too, and an unknown key still runs."""
    q, k, v = _qkv(3, sq=6)
    _check(hub.attention(q, k, v, backend=backend, causal=True), q, k, v, causal=True)
    for extra in (_descales(2, 2, 4), {"v_descale": torch.ones(2, 2)}, {"dropout_p": 0.1},
                  {"q_descale": torch.ones(2, 4)}):
        with pytest.raises(ArgumentError, match="descale|dropout"):
            hub.attention(q, k, v, backend=backend, causal=True, extra=extra)
    out = hub.attention(q, k, v, backend=backend, causal=True, extra={"unrelated": 1})
    _check(out, q, k, v, causal=True)


def test_fp8_cache_needs_both_descales(hub):
    q, k, v = _qkv(5, dtype=torch.bfloat16)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    with pytest.raises(ArgumentError, match="v_descale"):
        hub.attention(q, k8, v8, extra={"k_descale": torch.ones(2, 2)})
    with pytest.raises(ArgumentError, match="extra=\\[1\\]|pass a dict"):
        hub.attention(q, k, v, extra=[1])


# --- dtypes --------------------------------------------------------------------------------

KV_DTYPES = [torch.float64, torch.float16, torch.complex64, torch.int32,
             *(getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz")
               if hasattr(torch, n))]


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ("bshd", "bhsd"))
def test_kv_of_another_dtype_is_a_dtype_error(hub, dtype, layout):
    q, k, v = _qkv(6)
    if layout == "bhsd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with pytest.raises(DTypeMismatchError, match="cast them to q's dtype"):
        hub.attention(q, k.to(dtype), v.to(dtype), layout=layout)


# --- scale and softcap beyond float32 ------------------------------------------------------

@pytest.mark.parametrize("name", ("scale", "softcap"))
@pytest.mark.parametrize("backend", (*CPU_BACKENDS, None))
def test_scalars_float32_cannot_hold_are_refused(hub, backend, name):
    """Outside float32's normal range: refused on the slow path and on the hot path (a
    binding made with a valid value); 1e30 and 1e-30 still give the reference's answer."""
    q, k, v = _qkv(7)
    q[0, 1] = 0.0  # a zero score: 0/0 = NaN under a softcap float32 holds as 0
    outside = (1e39, 1e300, 3.5e38, 1e-39, 1e-50, 5e-324)
    for bad in outside:
        with pytest.raises(ArgumentError, match=f"{name}=.*float32"):
            hub.attention(q, k, v, backend=backend, **{name: bad})
    for good in (1e30, 1e-30):
        try:
            out, lse = hub.attention(q, k, v, backend=backend, return_lse=True, **{name: good})
        except attnhub.BackendUnavailableError as exc:
            pytest.skip(f"{backend} declines: {exc.reasons}")
        p = AttnParams(scale=good if name == "scale" else 0.25,
                       softcap=good if name == "softcap" else None)
        ref, ref_lse = reference_attention(q, k, v, p)
        same, _ = reference_attention(q, k, v, p, compute_dtype=torch.float32)
        assert_fa_rule(out, ref, same)
        assert_lse(lse, ref_lse, atol=1e-5 * max(1.0, float(ref_lse.abs().max())))
    for bad in outside:  # the hot path (this key is bound now)
        with pytest.raises(ArgumentError, match=f"{name}=.*float32"):
            hub.attention(q, k, v, backend=backend, return_lse=True, **{name: bad})


# --- second order: a gradient penalty ------------------------------------------------------

def _penalty_grads(attn, q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attn(*leaves)
    gq, = torch.autograd.grad((out * dout).sum(), leaves[0], create_graph=True)
    return torch.autograd.grad((out * dout).sum() + gq.pow(2).sum(), leaves)


@pytest.mark.parametrize("backend", ("reference", "torch_sdpa", "torch_flash_cpu", "triton"))
def test_gradient_penalty_is_exact_or_refused(hub, backend):
    """Second-order terms are exact (reference) or raise; never silently dropped (triton
    returned its first-order gradients as constants)."""
    q, k, v = _qkv(9, b=1, sq=4, sk=4, hq=2, hkv=2, d=8)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(10))
    p = AttnParams(scale=8 ** -0.5, causal=True)
    want = _penalty_grads(lambda *t: reference_attention(*t, p)[0],
                          q.double(), k.double(), v.double(), dout.double())
    try:
        got = _penalty_grads(lambda *t: hub.attention(*t, backend=backend, causal=True),
                             q, k, v, dout)
    except (InputError, RuntimeError) as exc:  # torch's own "derivative ... not implemented"
        assert "second-order" in str(exc) or "not implemented" in str(exc)
        return
    for a, r in zip(got, want):
        assert float((a.double() - r).abs().max()) < 1e-4


# --- autocast ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ("bshd", "thd"))
@pytest.mark.parametrize("backend", (*CPU_BACKENDS, "sliding_window", None))
def test_autocast_keeps_q_dtype_and_precision(backend, layout):
    """Under CPU autocast (bf16) attention still computes in q's dtype, with no fallback,
    on the binding's first call and on the hot path (sliding_window computed in bf16 there
    and cast back: a silently less precise answer)."""
    hub = attnhub.Hub(hardware="cpu")
    q, k, v = _qkv(11, b=1, sq=6, sk=6)
    kw: dict = {"causal": True}
    if backend == "sliding_window":
        kw["window"] = (3, 0)
    params = AttnParams(scale=0.25, **kw)
    if layout == "thd":
        cu = torch.tensor([0, 2, 6], dtype=torch.int32)
        q, k, v = q[0], k[0], v[0]
        params = AttnParams(scale=0.25, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
        kw.update(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref64, _, same = fa_references(q, k, v, params, layout=layout)
    for _ in range(2):  # the binding's first call (slow lane), then the hot path
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = hub.attention(q, k, v, backend=backend, **kw)
        except attnhub.BackendUnavailableError as exc:
            pytest.skip(f"{backend} declines: {exc.reasons}")
        assert out.dtype == torch.float32
        assert_fa_rule(out, ref64, same)
    assert not hub.fallback_counts, dict(hub.fallback_counts)
