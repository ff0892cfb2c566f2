"""Paged decode grids of FlashAttention (kvcache, block-table bounds) and FlashInfer (batch
decode, page sizes 1/5/16/256) against the hub's ``layout="paged"`` on the CPU backends.

Every case: random caches, a ``randperm`` block table (pages scattered) whose unused trailing
entries hold garbage page ids (out of range, negative), lengths 0..capacity; the answer is
compared per sequence with the fp64 reference over the gathered contiguous KV (FA rule, 3x
as FA's kvcache test, 5x with ALiBi); an empty sequence gives 0 and LSE -inf."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import attnhub
from attnhub.core.paged import paged_to_varlen
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.errors import SeqlensError, ShapeError
from attnhub.testing import assert_fa_rule

BACKENDS = ("reference", "torch_sdpa")
GARBAGE = (10**6, -1, -(2**31), 2**31 - 1)


def paged_case(g: torch.Generator, b: int, sq: int, heads: tuple[int, int], d: int, page: int,
               lens: list[int], dtype: torch.dtype = torch.float32, shared: bool = False,
               ) -> tuple[torch.Tensor, ...]:
    """q, k/v caches, an int32 table (scattered pages, garbage past each length) and lens."""
    hq, hkv = heads
    used = [-(-n // page) for n in lens]
    npages = sum(used) + 2  # two pages no sequence owns
    width = max(used) + 2
    kc = torch.randn(npages, page, hkv, d, generator=g, dtype=dtype)
    vc = torch.randn(npages, page, hkv, d, generator=g, dtype=dtype)
    perm = torch.randperm(npages, generator=g).tolist()
    table = torch.tensor([GARBAGE[(i + j) % len(GARBAGE)] for i in range(b)
                          for j in range(width)], dtype=torch.int64).view(b, width)
    for i, n in enumerate(used):
        table[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int64)
    if shared and b > 1 and used[0] and used[1]:
        table[1, 0] = table[0, 0]  # a shared prefix page (fork)
    q = torch.randn(b, sq, hq, d, generator=g, dtype=dtype)
    return q, kc, vc, table.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def check_paged(out: torch.Tensor, lse: torch.Tensor | None, q: torch.Tensor, kc: torch.Tensor,
                vc: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                mult: float = 3.0, **kw: Any) -> None:
    """Per sequence: fp64 reference over the gathered KV (FA rule); LSE within 1e-3 (fp32)
    or 2e-2, -inf exactly where the reference's is; empty rows exactly 0."""
    page = kc.shape[1]
    alibi = kw.pop("alibi_slopes", None)
    for i, n in enumerate(lens.tolist()):
        ids = table[i, : -(-n // page)].long()
        k, v = kc[ids].flatten(0, 1)[None, :n], vc[ids].flatten(0, 1)[None, :n]
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[i:i + 1])
        p = AttnParams(scale=kw.get("scale") or 1 / math.sqrt(q.shape[-1]), alibi_slopes=slopes,
                       return_lse=True, **{x: y for x, y in kw.items() if x != "scale"})
        ref, ref_lse = reference_attention(q[i:i + 1], k, v, p, layout="bshd")
        same, _ = reference_attention(q[i:i + 1], k, v, p, layout="bshd", compute_dtype=q.dtype)
        assert_fa_rule(out[i:i + 1], ref, same, mult=mult, what=f"sequence {i} (len {n})")
        empty = torch.isneginf(ref_lse[0])  # (Hq, Sq): rows with no key
        assert (out[i].transpose(0, 1)[empty] == 0).all(), f"sequence {i}: empty row not 0"
        if lse is not None:
            assert torch.equal(torch.isneginf(lse[i]), empty), f"sequence {i}: LSE -inf"
            tol = 1e-3 if q.dtype == torch.float32 else 2e-2
            diff = (lse[i] - ref_lse[0].float())[~empty].abs()
            assert not diff.numel() or float(diff.max()) <= tol, f"sequence {i}: LSE {diff.max()}"


def run_paged(backend: str | None, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
              table: torch.Tensor, lens: torch.Tensor, hub: attnhub.Hub | None = None,
              **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    hub = hub or attnhub.Hub(hardware="cpu")
    return hub.attention(q, kc, vc, layout="paged", block_table=table, seqlens_k=lens,
                         backend=backend, return_lse=True, **kw)


# (batch, Sq, (Hq, Hkv), D, page, lengths, dtype, call flags)
GRID = [
    (3, 1, (4, 2), 16, 1, [7, 0, 23], torch.float32, {}),
    (3, 1, (4, 2), 16, 5, [11, 0, 10], torch.float32, {}),  # odd page, exactly 2 pages
    (2, 1, (4, 2), 16, 16, [40, 16], torch.bfloat16, {}),
    (2, 1, (2, 1), 16, 256, [300, 5], torch.float32, {}),
    (1, 1, (32, 8), 64, 4, [13], torch.float16, {}),  # GQA 32:8
    (2, 1, (6, 1), 128, 4, [9, 3], torch.float32, {}),  # MQA, d 128
    (2, 1, (4, 2), 59, 5, [12, 7], torch.float32, {}),  # odd head dim
    (2, 3, (4, 2), 16, 4, [9, 2], torch.float32, {"causal": True}),  # append, Sq > Sk
    (2, 4, (4, 2), 16, 5, [23, 4], torch.float16, {"causal": True}),
    (2, 3, (4, 2), 16, 4, [9, 6], torch.float32, {"causal": True, "alignment": "top_left"}),
    (2, 1, (4, 2), 16, 4, [9, 13], torch.float32, {"causal": True, "window": (3, 0)}),
    (2, 2, (4, 2), 16, 5, [19, 1], torch.float32, {"causal": True, "window": (4, 0)}),
    (2, 5, (4, 2), 16, 5, [40, 9], torch.float32, {"window": (3, 2)}),
    (4, 1, (2, 1), 16, 5, [1, 300, 0, 57], torch.float32, {}),  # very different lengths
    (2, 1, (4, 2), 16, 5, [12, 13], torch.float32, {"alibi": True}),
    (3, 2, (4, 2), 16, 1, [8, 0, 12], torch.float32, {"alibi": True, "causal": True}),
]


def _flags(flags: dict[str, Any], b: int, hq: int, g: torch.Generator) -> dict[str, Any]:
    kw = {x: y for x, y in flags.items() if x != "alibi"}
    if flags.get("alibi"):
        kw["alibi_slopes"] = torch.rand(b, hq, generator=g) * 0.3
    return kw


def _call_kw(kw: dict[str, Any]) -> dict[str, Any]:
    return {("causal_alignment" if x == "alignment" else x): y for x, y in kw.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(GRID)))
def test_paged_grid_matches_the_gathered_reference(backend: str, case: int) -> None:
    b, sq, heads, d, page, lens, dtype, flags = GRID[case]
    g = torch.Generator().manual_seed(case)
    q, kc, vc, table, sl = paged_case(g, b, sq, heads, d, page, lens, dtype, shared=case % 2 == 0)
    kw = _flags(flags, b, heads[0], g)
    out, lse = run_paged(backend, q, kc, vc, table, sl, **_call_kw(kw))
    check_paged(out, lse, q, kc, vc, table, sl, mult=5.0 if "alibi_slopes" in kw else 3.0, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_on_the_reference(backend: str) -> None:
    """softcap over a paged cache: served exactly or refused by name, never ignored."""
    g = torch.Generator().manual_seed(7)
    q, kc, vc, table, sl = paged_case(g, 2, 1, (4, 2), 16, 5, [12, 3])
    try:
        out, lse = run_paged(backend, q, kc, vc, table, sl, softcap=0.7)
    except attnhub.errors.BackendUnavailableError as exc:
        assert "softcap" in str(exc)
        return
    check_paged(out, lse, q, kc, vc, table, sl, softcap=0.7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_capacity_exact_works_and_one_past_names_the_block_table(backend: str) -> None:
    """FA's ``test_flash_attn_kvcache_paged_block_table_bounds``."""
    g = torch.Generator().manual_seed(3)
    q, kc, vc, table, _ = paged_case(g, 2, 1, (2, 2), 16, 5, [10, 7])
    cap = table.shape[1] * 5
    table[:] = torch.randint(0, kc.shape[0], table.shape, generator=g)  # every entry used
    full = torch.tensor([cap, 3], dtype=torch.int32)
    out, lse = run_paged(backend, q, kc, vc, table, full)
    check_paged(out, lse, q, kc, vc, table, full)
    with pytest.raises(SeqlensError, match="block_table"):
        run_paged(backend, q, kc, vc, table, torch.tensor([cap + 1, 3], dtype=torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_table_edited_in_place_between_calls_is_never_served_stale(backend: str) -> None:
    """One hub, one pair of table tensors edited in place (and through ``.data``) between
    calls: every call answers for the table as it is now."""
    g = torch.Generator().manual_seed(11)
    hub = attnhub.Hub(hardware="cpu")
    q, kc, vc, table, sl = paged_case(g, 2, 1, (4, 2), 16, 4, [9, 13])
    for step in range(4):
        out, lse = run_paged(backend, q, kc, vc, table, sl, hub=hub)
        check_paged(out, lse, q, kc, vc, table, sl)
        row = step % 2
        n = -(-int(sl[row]) // 4)
        perm = torch.randperm(n, generator=g)
        if step == 2:
            table.data[row, :n] = table[row, :n][perm].clone()  # no version bump
        else:
            table[row, :n] = table[row, :n][perm].clone()
        sl[1 - row] = int(torch.randint(0, int(sl[1 - row]) + 1, (1,), generator=g))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_tables_are_refused_by_name(backend: str) -> None:
    g = torch.Generator().manual_seed(5)
    q, kc, vc, table, sl = paged_case(g, 2, 1, (2, 1), 16, 4, [5, 6])
    with pytest.raises(SeqlensError, match="block_table .*int32"):
        run_paged(backend, q, kc, vc, table.long(), sl)
    with pytest.raises(SeqlensError, match="seqlens_k .*int32"):
        run_paged(backend, q, kc, vc, table, sl.long())


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_caches_match_contiguous(backend: str) -> None:
    """HND storage viewed as NHD, a storage offset with a padded head dim, a transposed q,
    strided tables."""
    g = torch.Generator().manual_seed(9)
    q, kc, vc, table, sl = paged_case(g, 2, 1, (4, 2), 16, 5, [12, 4])
    hnd_k, hnd_v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (kc, vc))
    pad = torch.randn(kc.shape[0] + 1, 5, 2, 24, generator=g)
    off_k = pad[1:, :, :, 3:19]
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    for qq, k, v in ((q, hnd_k, hnd_v), (q, off_k, vc), (qt, kc, hnd_v)):
        out, lse = run_paged(backend, qq, k, v, table, sl)
        check_paged(out, lse, qq, k, v, table, sl)
    # tables: column-major storage, and one row expanded over the batch (stride 0)
    for t, n in ((table.t().contiguous().t(), sl), (table[:1].expand(2, -1), sl[:1].expand(2))):
        out, lse = run_paged(backend, q, kc, vc, t, n)
        check_paged(out, lse, q, kc, vc, t, n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_sequences_empty_give_zero_and_minus_inf(backend: str) -> None:
    g = torch.Generator().manual_seed(4)
    q, kc, vc, table, _ = paged_case(g, 2, 2, (4, 2), 16, 4, [5, 1])
    zero = torch.zeros(2, dtype=torch.int32)
    for t in (table, table[:, :0]):
        out, lse = run_paged(backend, q, kc, vc, t, zero)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_page_size_zero_is_a_shape_error(backend: str) -> None:
    """A (pages, 0, H, D) cache once reached ``(len + page - 1) // page`` (ZeroDivisionError)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 1, 2, 16, generator=g)
    empty = torch.randn(4, 0, 2, 16, generator=g)
    table, sl = torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ShapeError, match="page_size"):
        run_paged(backend, q, empty, empty, table, sl)


def test_paged_to_varlen_refuses_page_size_zero() -> None:
    empty = torch.randn(4, 0, 2, 16)
    with pytest.raises(SeqlensError, match="page_size"):
        paged_to_varlen(torch.randn(2, 1, 2, 16), empty, empty,
                        torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("backend", (*BACKENDS, None))
def test_descales_with_a_16_bit_cache_are_refused(backend: str | None) -> None:
    """FP8 descales in ``extra`` beside a 16/32-bit cache were silently dropped (the
    caller's cache read unscaled); an error names them."""
    g = torch.Generator().manual_seed(6)
    q, kc, vc, table, sl = paged_case(g, 2, 1, (4, 2), 16, 4, [9, 5])
    scales = torch.rand(kc.shape[0], 2, generator=g) + 0.5
    for extra in ({"k_descale": scales, "v_descale": scales}, {"v_descale": scales}):
        with pytest.raises(attnhub.InputError, match="descale"):
            run_paged(backend, q, kc, vc, table, sl, extra=extra)
    out, lse = run_paged(backend, q, kc, vc, table, sl, extra={"unrelated": 1})
    check_paged(out, lse, q, kc, vc, table, sl)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_reach_shared_pages_once_per_reader(backend: str) -> None:
    """dq, dk_cache, dv_cache of a paged call (a page shared by two sequences, an empty one,
    append with Sq > 1) equal autograd through the per-sequence gather of bshd calls."""
    g = torch.Generator().manual_seed(12)
    q, kc, vc, table, sl = paged_case(g, 3, 2, (4, 2), 16, 5, [30, 0, 12], shared=True)
    w = torch.randn(q.shape, generator=g)
    paged = [x.clone().requires_grad_(True) for x in (q, kc, vc)]
    out, _ = run_paged(backend, *paged, table, sl, causal=True)
    (out * w).sum().backward()
    dense = [x.clone().requires_grad_(True) for x in (q, kc, vc)]
    hub = attnhub.Hub(hardware="cpu")
    for i, n in enumerate(sl.tolist()):
        if n:
            ids = table[i, : -(-n // 5)].long()
            k, v = (c[ids].flatten(0, 1)[None, :n] for c in dense[1:])
            o = hub.attention(dense[0][i:i + 1], k, v, causal=True, backend="reference")
            (o * w[i:i + 1]).sum().backward()
    for name, a, b in zip(("dq", "dk_cache", "dv_cache"), paged, dense):
        ga = a.grad if a.grad is not None else torch.zeros_like(a)
        gb = b.grad if b.grad is not None else torch.zeros_like(b)
        assert torch.allclose(ga, gb, atol=1e-5, rtol=1e-4), f"{name}: {(ga - gb).abs().max()}"


def poison_unowned(kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                   value: float) -> None:
    """Fill every slot no sequence owns (free pages, tails of last pages) with ``value``, as
    an ``empty``-made cache may hold."""
    page = kc.shape[1]
    owned = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for i, n in enumerate(lens.tolist()):
        j = torch.arange(n)
        owned[table[i, j // page].long(), j % page] = True
    kc[~owned] = value
    vc[~owned] = value


@pytest.mark.parametrize("route", ["reference", "torch_sdpa", "torch_sdpa_gather"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_unowned_slots_never_reach_the_output(route: str, value: float, alignment: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN/inf in slots past each length (and in free pages) is not attended: the answer is
    the reference's. ``torch_sdpa_gather`` is SDPA's accelerator route (one padded batch by
    index ops), forced on the CPU: it read masked positions from the unwritten tail of the
    last page, and ``0 * NaN`` made the rows NaN under top-left alignment."""
    backend = route.removesuffix("_gather")
    if route.endswith("_gather"):
        from attnhub.core import builtin
        monkeypatch.setattr(builtin, "_paged_gather_serves",
                            lambda q, p: p.max_seqlen_k is not None and p.mask_mod is None)
    g = torch.Generator().manual_seed(21)
    for page, lens in ((5, [12, 0, 3]), (16, [5, 0, 17]), (1, [4, 0, 9])):
        q, kc, vc, table, sl = paged_case(g, 3, 2, (4, 2), 16, page, lens, shared=True)
        poison_unowned(kc, vc, table, sl, value)
        kw = {"causal": True, "alignment": alignment}
        out, lse = run_paged(backend, q, kc, vc, table, sl, **_call_kw(kw))
        check_paged(out, lse, q, kc, vc, table, sl, **kw)
