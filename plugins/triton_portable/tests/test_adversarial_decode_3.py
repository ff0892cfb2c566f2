"""``triton_decode`` (and ``triton_decode_fp8``) over the paged grid of
``tests/test_adversarial_paged_3.py`` (FlashAttention kvcache / FlashInfer batch decode):
scattered pages, garbage past each length, shared pages, page sizes 1/5/16/256, GQA/MQA,
odd head dims, appends, windows, ALiBi, softcap, empty sequences, in-place table edits.
CPU: Triton's interpreter, tiny shapes."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton reads this when a kernel is decorated (import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attnhub

_spec = importlib.util.spec_from_file_location(
    "paged_grid_3", Path(__file__).parents[3] / "tests" / "test_adversarial_paged_3.py")
grid = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grid)  # type: ignore[union-attr]

E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("case", range(len(grid.GRID)))
def test_decode_paged_grid(case: int) -> None:
    b, sq, heads, d, page, lens, dtype, flags = grid.GRID[case]
    g = torch.Generator().manual_seed(100 + case)
    q, kc, vc, table, sl = grid.paged_case(g, b, sq, heads, d, page, lens, dtype,
                                           shared=case % 2 == 1)
    kw = grid._flags(flags, b, heads[0], g)
    out, lse = grid.run_paged("triton_decode", q, kc, vc, table, sl, **grid._call_kw(kw))
    grid.check_paged(out, lse, q, kc, vc, table, sl,
                     mult=5.0 if "alibi_slopes" in kw else 3.0, **kw)


@pytest.mark.parametrize("flags", [{"softcap": 0.7},
                                   {"softcap": 1.3, "causal": True, "window": (6, 0)}])
def test_decode_softcap(flags: dict) -> None:
    g = torch.Generator().manual_seed(3)
    q, kc, vc, table, sl = grid.paged_case(g, 3, 2, (4, 2), 16, 5, [23, 0, 7], shared=True)
    out, lse = grid.run_paged("triton_decode", q, kc, vc, table, sl, **flags)
    grid.check_paged(out, lse, q, kc, vc, table, sl, **flags)


def test_decode_bounds_edits_and_stray_descales() -> None:
    """Exactly at capacity works, one past names the block table; the table edited in
    place between calls is never served stale; descales with a 16-bit cache are refused."""
    g = torch.Generator().manual_seed(8)
    hub = attnhub.Hub(hardware="cpu")
    q, kc, vc, table, _ = grid.paged_case(g, 2, 1, (4, 2), 16, 5, [10, 7])
    table[:] = torch.randint(0, kc.shape[0], table.shape, generator=g)
    sl = torch.tensor([table.shape[1] * 5, 3], dtype=torch.int32)
    for _ in range(3):
        out, lse = grid.run_paged("triton_decode", q, kc, vc, table, sl, hub=hub)
        grid.check_paged(out, lse, q, kc, vc, table, sl)
        table[0] = table[0][torch.randperm(table.shape[1], generator=g)].clone()
    with pytest.raises(attnhub.errors.SeqlensError, match="block_table"):
        grid.run_paged("triton_decode", q, kc, vc, table, sl + 1, hub=hub)
    scales = torch.rand(kc.shape[0], 2, generator=g) + 0.5
    with pytest.raises(attnhub.InputError, match="descale"):
        grid.run_paged("triton_decode", q, kc, vc, table, sl, hub=hub,
                       extra={"k_descale": scales, "v_descale": scales})


@pytest.mark.parametrize("page,lens,flags", [
    (1, [7, 0, 12], {}),
    (5, [11, 9, 1], {"causal": True, "window": (4, 0)}),
    (16, [31, 0, 17], {"softcap": 0.5}),
])
def test_fp8_paged_grid(page: int, lens: list, flags: dict) -> None:
    """e4m3 pages with per-(page, KV head) descales, scattered table with garbage tails and
    a shared page: FA rule against fp64 over ``stored * descale``."""
    g = torch.Generator().manual_seed(page)
    q, kc, vc, table, sl = grid.paged_case(g, 3, 2 if flags.get("causal") else 1, (4, 2), 32,
                                           page, lens, shared=True)
    q = q.bfloat16()
    k8, v8 = (kc * 60).to(E4M3), (vc * 60).to(E4M3)
    kd, vd = (torch.rand(kc.shape[0], 2, generator=g) * 0.02 + 0.005 for _ in range(2))
    out, lse = grid.run_paged("triton_decode_fp8", q, k8, v8, table, sl,
                              extra={"k_descale": kd, "v_descale": vd}, **flags)
    kf, vf = (x.float() * s[:, None, :, None] for x, s in ((k8, kd), (v8, vd)))
    # the same computation in bf16 over bf16 copies of the dequantized cache sets the bound
    grid.check_paged(out, lse, q, kf.bfloat16(), vf.bfloat16(), table, sl, **flags)


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("fp8", [False, True])
def test_decode_never_reads_unowned_slots(alignment: str, fp8: bool) -> None:
    """NaN in free pages and in the unwritten tails of last pages (an ``empty``-made cache)
    never reaches the output (masked lanes load 0, not ``0 * NaN``)."""
    g = torch.Generator().manual_seed(31)
    for page, lens in ((5, [12, 0, 3]), (16, [5, 0, 17])):
        q, kc, vc, table, sl = grid.paged_case(g, 3, 2, (4, 2), 16, page, lens, shared=True)
        kw = {"causal": True, "alignment": alignment}
        grid.poison_unowned(kc, vc, table, sl, float("nan"))  # e4m3 keeps NaN
        extra: dict = {}
        if fp8:
            q = q.bfloat16()
            kd, vd = (torch.rand(kc.shape[0], 2, generator=g) * 0.02 + 0.005 for _ in range(2))
            kc, vc = (kc * 60).to(E4M3), (vc * 60).to(E4M3)
            extra = {"extra": {"k_descale": kd, "v_descale": vd}}
        out, lse = grid.run_paged("triton_decode_fp8" if fp8 else "triton_decode", q, kc, vc,
                                  table, sl, **grid._call_kw(kw), **extra)
        if fp8:  # the reference reads the dequantized values (bf16, as q)
            kc, vc = (x.float() * s[:, None, :, None] for x, s in ((kc, kd), (vc, vd)))
            kc, vc = kc.bfloat16(), vc.bfloat16()
        grid.check_paged(out, lse, q, kc, vc, table, sl, **kw)
