"""The GLA Triton kernels launch on one grid axis, within CUDA's limits.

CUDA caps a grid's second and third axes at 65535 programs. The kernels launched (V-blocks,
B x H) and (V-blocks, chunks, B x H), so 65536 (sequence, head) pairs, or T / 64 > 65535
chunks (4M tokens), failed at launch with "invalid argument"; the interpreter has no such
limit, so no CPU run saw it. Checked here: the grids (kernels replaced by a recorder), the
flat index keeping the old program order, and the answers against the float64 recurrence.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from attnhub_hybrid_linear import linear_torch
from attnhub_hybrid_linear.metrics import rel_rmse

from attnhub.testing import record_launches

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second and third axes
_flat: Any = None  # linear_triton._flat_program, set by the order test
_KERNELS = ("_scan_kernel", "_chunk_out_kernel", "_chunk_bwd_kernel", "_recurrent_kernel")


def _record(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch
            ) -> list[tuple[str, tuple[int, ...]]]:
    return record_launches(monkeypatch, {kernels: _KERNELS}, named=True)


def _run_all(kernels: ModuleType, b: int, t: int, h: int) -> None:
    """Every launch once: chunked forward and backward, and the recurrent step."""
    q = torch.zeros(b, t, h, 1)
    kd, vd = q.shape[-1], q.shape[-1]
    qp, kp, vp, gc, _ = kernels._prepare(q, q, q, q)
    _, _, states = kernels._forward(qp, kp, vp, gc, 1.0, None, False)
    ctx = SimpleNamespace(scale=1.0, t=t)
    kernels._backward(ctx, qp, kp, vp, gc, states, torch.zeros(b, t, h, vd))
    kernels.recurrent(q[:, :1], q[:, :1], q[:, :1], q[:, :1], 1.0)
    assert kd == vd == 1


@pytest.mark.parametrize("b,t,h", [(257, 1, 256), (1, 64 * 65536 + 1, 1)],
                         ids=["65792-sequence-heads", "65537-chunks"])
def test_grids_fit_cuda(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, b: int, t: int,
                        h: int) -> None:
    """B x H = 65792, or 65537 chunks of 64 tokens: every launch is 1-D (was (1, 65792) and
    (1, 65537, 1)) and keeps all its programs (V-blocks x chunks x B x H)."""
    grids = _record(kernels, monkeypatch)
    _run_all(kernels, b, t, h)
    chunks = -(-t // kernels.BT)
    want = {"_scan_kernel": b * h, "_chunk_out_kernel": chunks * b * h,
            "_chunk_bwd_kernel": chunks * b * h, "_recurrent_kernel": b * h}
    assert sorted({name for name, _ in grids}) == sorted(_KERNELS)
    for name, grid in grids:
        assert len(grid) == 1 and grid[0] <= kernels.MAX_PROGRAMS, (name, grid)
        assert all(g <= MAX_GRID_Y for g in grid[1:])
        assert grid[0] == want[name], (name, grid)


def test_a_grid_past_the_first_axis_is_refused(kernels: ModuleType) -> None:
    """More programs than the first axis takes: refused by name, not a launch error."""
    from attnhub.plugin import InputError

    with pytest.raises(InputError, match="split the batch"):
        kernels._flat_grid(2, 2**16, 2**15)


def _where(out, nc, NV: tl.constexpr):  # type: ignore[no-untyped-def]
    """Each program's (V-block, chunk, row) by ``_flat_program`` (jitted by the test, once the
    interpreter is on; ``_flat`` is set to the module's helper then)."""
    i_v, i_c, i_bh = _flat(NV, nc)
    pid = tl.program_id(0)
    tl.store(out + pid * 3, i_v)
    tl.store(out + pid * 3 + 1, i_c)
    tl.store(out + pid * 3 + 2, i_bh)


def test_flat_index_keeps_the_old_program_order(kernels: ModuleType,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Program p of the flat grid is the p-th of the old (V-blocks, chunks, B*H) grid in
    CUDA's launch order (first axis fastest): V-block, chunk and row for each, all distinct."""
    monkeypatch.setitem(globals(), "_flat", kernels._flat_program)
    nv, nc, bh = 3, 5, 7
    out = torch.full((nv * nc * bh, 3), -1, dtype=torch.int32)
    triton.jit(_where)[kernels._flat_grid(nv, nc, bh)](out, nc, NV=nv)
    old = [(v, c, r) for r in range(bh) for c in range(nc) for v in range(nv)]
    assert out.tolist() == [list(x) for x in old]


def test_flattened_kernels_match_the_float64_recurrence(kernels: ModuleType) -> None:
    """Two V-blocks (vd 80), two chunks (70 tokens), two heads, with an
    initial state: chunked outputs, final state and dq, dk, dv, dg, and the recurrent step,
    against the float64 token-by-token reference. A wrong (V-block, chunk, row) split puts
    another block's state or tokens in place: errors of order 1, not 1e-3."""
    b, t, h, kd, vd = 1, 70, 2, 16, 80
    q, k = torch.randn(b, t, h, kd), torch.randn(b, t, h, kd)
    v = torch.randn(b, t, h, vd)
    g = F.logsigmoid(torch.randn(b, t, h, kd)) / 4
    h0 = torch.randn(b, h, kd, vd)
    ours = [x.clone().requires_grad_() for x in (q, k, v, g)]
    oracle = [x.double().requires_grad_() for x in (q, k, v, g)]
    o, final = kernels.chunked(*ours, 0.3, h0, True)
    o_ref, s_ref = linear_torch.recurrent(*oracle, 0.3, h0.double())
    assert rel_rmse(o, o_ref) < 5e-3 and rel_rmse(final, s_ref) < 5e-3
    do = torch.randn_like(o_ref)
    (o * do.float()).sum().backward()
    (o_ref * do).sum().backward()
    for name, a, r in zip("qkvg", ours, oracle):
        assert rel_rmse(a.grad, r.grad) < 5e-3, f"d{name}: {rel_rmse(a.grad, r.grad):.2e}"
    o_r, s_r = kernels.recurrent(q[:, :3], k[:, :3], v[:, :3], g[:, :3], 0.3, h0)
    want, want_s = linear_torch.recurrent(*(x[:, :3].double() for x in (q, k, v, g)), 0.3,
                                          h0.double())
    assert rel_rmse(o_r, want) < 1e-5 and rel_rmse(s_r, want_s) < 1e-5
