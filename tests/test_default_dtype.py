"""A caller's ``torch.set_default_dtype(torch.float64)`` (common in scientific code and some
test suites) changes nothing attnhub returns: the output keeps q's dtype, the LSE is fp32
(docs/contract.md), gradients keep their inputs' dtypes, and the values equal those of the
same call under the float32 default. Every tensor attnhub creates names its dtype; one that
took ``torch.get_default_dtype()`` gave a float64 LSE (``torch_sdpa``, ``torch_flash_cpu``:
refused by the output check), crashed ``lsh`` ("expected scalar type Double but found
Float") and the FP8 cache's descale update, and drew other random data for one seed (the
conformance kit's inputs, the built-in decoder's weights)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import attnhub
from attnhub.core.kvcache import PagedKVCache

F32 = torch.float32
Both = Callable[[Callable[[], Any]], tuple[Any, Any]]


@pytest.fixture
def both() -> Iterator[Both]:
    """``both(fn)``: fn's result under the float32 default, then under float64. The default
    is put back after the test, failed or not: a float64 default left behind would change
    every later test of the worker."""
    before = torch.get_default_dtype()

    def run(fn: Callable[[], Any]) -> tuple[Any, Any]:
        out = []
        for default in (torch.float32, torch.float64):
            torch.set_default_dtype(default)
            out.append(fn())
        torch.set_default_dtype(before)
        return out[0], out[1]

    try:
        yield run
    finally:
        torch.set_default_dtype(before)


def _i32(*x: int) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def _inputs(layout: str, dtype: torch.dtype, nan: str = "",
            square: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Small seeded q, k, v of ``layout`` (fp32 draws cast to ``dtype``) and its side
    arguments; ``nan``: one NaN in q or k; ``square``: Sq == Sk (the linear backends'
    gradients need it)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=F32).to(dtype)

    sq, sk = (7, 7) if square else (5, 7)
    kw: dict = {}
    if layout in ("bshd", "bhsd"):
        q, k, v = r(1, sq, 4, 16), r(1, sk, 2, 16), r(1, sk, 2, 16)
        if layout == "bhsd":
            q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    elif layout == "thd":  # the second document has no keys for square=False
        q, k, v = r(8, 4, 16), r(8 if square else 4, 2, 16), r(8 if square else 4, 2, 16)
        kw = dict(cu_seqlens_q=_i32(0, 3, 8),
                  cu_seqlens_k=_i32(0, 3, 8) if square else _i32(0, 4, 4))
    else:  # paged
        q, k, v = r(2, 1, 4, 16), r(6, 4, 2, 16), r(6, 4, 2, 16)
        kw = dict(block_table=_i32(0, 1, 2, 3, 4, 5).view(2, 3), seqlens_k=_i32(5, 9))
    if nan:
        x = q if nan == "q" else k
        x.view(-1)[3] = float("nan")
    return q, k, v, kw


def _call(name: str, layout: str, extra: dict, dtype: torch.dtype = F32, grad: bool = False,
          nan: str = "") -> list[torch.Tensor | None]:
    """[q, out, lse, dq, dk, dv] of one hub call (and a backward with ``grad``)."""
    # linear attention reads queries as the context's last tokens: it needs Sq <= Sk
    q, k, v, kw = _inputs(layout, dtype, nan, square=grad or name in LINEAR_FAMILY)
    if grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    extra = dict(extra)
    lse_wanted = extra.pop("return_lse", True)
    res = attnhub.Hub(hardware="cpu").attention(q, k, v, backend=name, layout=layout,
                                                return_lse=lse_wanted, **kw, **extra)
    out, lse = res if lse_wanted else (res, None)
    grads: list[torch.Tensor | None] = [None] * 3
    if grad:
        out.float().square().sum().backward()
        grads = [x.grad for x in (q, k, v)]
    return [q, out, lse, *grads]


def _assert_same(name: str, want: list, got: list) -> None:
    """Contract dtypes under float64, and the float32 default's values."""
    q = got[0]
    assert got[1].dtype == q.dtype, f"{name}: out {got[1].dtype}, q {q.dtype}"
    assert got[2] is None or got[2].dtype == F32, f"{name}: lse {got[2].dtype}"
    for what, g in zip(("dq", "dk", "dv"), got[3:]):
        assert g is None or g.dtype == q.dtype, f"{name}: {what} {g.dtype}"
    for a, b in zip(want[1:], got[1:]):
        if a is not None:
            torch.testing.assert_close(b, a, equal_nan=True, msg=name)


WIN = {"window": (2, 1)}
LINEAR = {"causal": True, "return_lse": False}
LINEAR_FAMILY = ("linear", "gla", "retention")
CALLS = [  # (backend, layout, arguments): every backend that runs on the CPU
    *[("torch_sdpa", lay, {}) for lay in ("bshd", "bhsd", "thd", "paged")],
    ("torch_sdpa", "bshd", {"causal": True}),
    *[("reference", lay, {}) for lay in ("bshd", "thd", "paged")],
    *[("torch_flash_cpu", lay, {}) for lay in ("bshd", "bhsd", "thd")],
    *[("lsh", lay, {}) for lay in ("bshd", "thd", "paged")],
    ("lsh", "bshd", {"causal": True}),
    *[(name, lay, WIN) for name in ("sliding_window", "longformer") for lay in ("bshd", "thd")],
    *[(name, lay, LINEAR) for name in LINEAR_FAMILY for lay in ("bshd", "thd")],
    ("triton", "bshd", {"causal": True}),
    ("flex", "bshd", {}),
    ("triton_decode", "paged", {}),
]


@pytest.mark.parametrize("name,layout,extra", CALLS,
                         ids=[f"{n}-{lay}-{'-'.join(e) or 'plain'}" for n, lay, e in CALLS])
def test_a_float64_default_changes_no_result(both: Both, name: str, layout: str,
                                              extra: dict) -> None:
    want, got = both(lambda: _call(name, layout, extra))
    _assert_same(name, want, got)


@pytest.mark.parametrize("name,nan,extra", [
    ("torch_sdpa", "q", {}), ("torch_sdpa", "k", {"causal": True}),
    ("torch_flash_cpu", "q", {}), ("lsh", "q", {"causal": True})])
def test_nan_rows_keep_an_fp32_lse(both: Both, name: str, nan: str, extra: dict) -> None:
    """The NaN poison added to NaN rows (documented fp32) must not promote the LSE; a NaN
    key takes the masked-key path only under a mask, hence causal."""
    want, got = both(lambda: _call(name, "bshd", extra, nan=nan))
    _assert_same(name, want, got)


@pytest.mark.parametrize("name,layout,extra", [
    ("torch_sdpa", "bshd", {"causal": True}), ("reference", "thd", {}),
    ("torch_flash_cpu", "bshd", {"causal": True}), ("lsh", "bshd", {}),
    ("sliding_window", "bshd", WIN), ("linear", "bshd", LINEAR), ("gla", "thd", LINEAR)])
def test_gradients_keep_their_inputs_dtype(both: Both, name: str, layout: str,
                                           extra: dict) -> None:
    want, got = both(lambda: _call(name, layout, extra, grad=True))
    _assert_same(name, want, got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["torch_sdpa", "torch_flash_cpu", "lsh"])
def test_half_inputs_under_a_float64_default(both: Both, name: str,
                                             dtype: torch.dtype) -> None:
    want, got = both(lambda: _call(name, "bshd", {}, dtype=dtype))
    _assert_same(name, want, got)


def test_fp8_cache_writes_and_reads_as_under_float32(both: Both) -> None:
    """The descale update reduced fp32 maxima into a default-dtype buffer: a float64 one
    made ``scatter_reduce_`` raise on every append."""

    def run() -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        cache = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=2,
                             head_dim=8, dtype=torch.float8_e4m3fn)
        s = cache.allocate()
        for n in (6, 1):  # a prefill, then a decode step growing a page's descale
            cache.append(s, [4 * torch.randn(n, 2, 8, generator=g, dtype=F32)],
                         [torch.randn(n, 2, 8, generator=g, dtype=F32)])
        q = torch.randn(1, 1, 4, 8, generator=g, dtype=F32).to(torch.bfloat16)
        scales = cache.scales.descales(0)
        out, lse = attnhub.Hub(hardware="cpu").attention(
            q, cache.k_cache(0), cache.v_cache(0), layout="paged", extra=scales,
            block_table=cache.block_table([s]), seqlens_k=cache.seqlens([s]),
            backend="triton_decode_fp8", return_lse=True)
        return [*cache.read(0, s), *scales.values(), out, lse]

    want, got = both(run)
    assert [t.dtype for t in got] == [F32] * 4 + [torch.bfloat16, F32]
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_seeded_data_is_drawn_as_under_float32(both: Both) -> None:
    """One seed, one draw: the conformance kit's inputs and the built-in decoder's weights
    (a float64 draw of a seed is other numbers, and the kit's error budgets were set on the
    float32 ones)."""
    from attnhub.conformance.cases import Case
    from attnhub.conformance.inputs import build
    from attnhub.models.decoder import Decoder, DecoderConfig
    from attnhub.testing import nan_case

    cfg = DecoderConfig(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8,
                        vocab_size=16, seed=3)
    cases = [Case("basic", alibi=True), Case("paged", layout="paged", page_size=4),
             Case("clustered", budget_inputs="clustered"),
             Case("local", budget_inputs="local", window=(2, 0), causal=True)]

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)  # nan_case draws from the global generator: first
        data = list(nan_case("q")[:3])
        made = [build(c, torch.device("cpu")) for c in cases]
        data += [t for i in made for t in (i.q, i.k, i.v, *i.params.extra.values(),
                                           i.params.alibi_slopes)
                 if isinstance(t, torch.Tensor)]
        return data + list(Decoder(cfg).state_dict().values())

    want, got = both(run)
    for a, b in zip(want, got, strict=True):
        assert b.dtype == a.dtype
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
