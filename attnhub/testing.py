"""Test helpers for backends: the FlashAttention rule against an fp64 reference.

A backend's error against the fp64 reference may be at most ``mult`` times the error of the
same-precision torch reference (same maths, input dtype), plus a rounding floor. This is the
rule FlashAttention's own tests use (2x forward, 3x gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .core.spec import AttnParams
    from .hub import Hub


def rounding_floor(ref: torch.Tensor) -> float:
    """FA3's floor: the error of adding and removing 0.3 in the output dtype (used 2x)."""
    ref = ref.detach()
    return float(((ref + 0.3 - 0.3) - ref).abs().max()) if ref.numel() else 0.0


def fa_rule_error(out: torch.Tensor, ref64: torch.Tensor, ref_same: torch.Tensor,
                  mult: float = 2.0, atol: float = 1e-5) -> tuple[float, float]:
    """Return (error, allowed) for the FlashAttention rule; the caller asserts error <= allowed."""
    if not out.numel():
        return 0.0, atol
    out, ref, ref_same = out.detach(), ref64.detach().double(), ref_same.detach()
    err = float((out.double() - ref).abs().max())
    base = float((ref_same.double() - ref).abs().max())
    return err, mult * base + 2 * rounding_floor(ref_same) + atol


def assert_fa_rule(out: torch.Tensor, ref64: torch.Tensor, ref_same: torch.Tensor,
                   mult: float = 2.0, atol: float = 1e-5, what: str = "output") -> None:
    """Assert the FlashAttention rule, with a message that shows the numbers."""
    assert not torch.isnan(out).any(), f"{what}: NaN in result"
    err, allowed = fa_rule_error(out, ref64, ref_same, mult, atol)
    assert err <= allowed, (
        f"{what}: max error {err:.3e} vs fp64 exceeds {mult}x same-precision error + floor "
        f"= {allowed:.3e}")


def assert_lse(lse: torch.Tensor, ref_lse: torch.Tensor, atol: float = 1e-3) -> None:
    """LSE equal to the reference within atol, -inf exactly where the reference is -inf."""
    inf_ref = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf_ref), "LSE -inf pattern differs from reference"
    diff = (lse.detach().float() - ref_lse.detach().float())[~inf_ref].abs()
    assert diff.numel() == 0 or float(diff.max()) <= atol, f"LSE error {float(diff.max()):.3e}"


def flash_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                    dropout_p: float = 0.0, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """What a FlashAttention-convention kernel returns for bshd inputs, for recording fakes in
    plugin tests: bottom-right masks, output in q's dtype, LSE (B, H, Sq) with +inf on fully
    masked rows (FA's marker, which backends must turn into -inf). Like the real kernels, a
    window edge >= Sk counts as unbounded (FlashAttention's ``mha_fwd`` clamps it). Dropout
    draws as eager does, from torch's generator; the LSE stays the undropped one."""
    from .core.reference import reference_attention
    from .core.spec import AttnParams

    sk = k.shape[1]
    window_size = tuple(-1 if w >= sk else w for w in window_size)
    window = None if window_size == (-1, -1) else window_size
    params = AttnParams(scale=softmax_scale, causal=causal, window=window,  # type: ignore[arg-type]
                        softcap=softcap or None, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    out, lse = reference_attention(q, k, v, params, compute_dtype=torch.float32)
    return out.to(q.dtype), lse.masked_fill(lse == float("-inf"), float("inf"))


def fa_references(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttnParams,
                  layout: str = "bshd") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp64 output, fp64 LSE, same-precision output): the two references the FlashAttention
    rule compares a backend with. Both outputs keep the autograd graph of q, k, v."""
    from .core.reference import reference_attention

    ref64, ref_lse = reference_attention(q, k, v, params, layout=layout)
    ref_same, _ = reference_attention(q, k, v, params, layout=layout, compute_dtype=q.dtype)
    return ref64, ref_lse, ref_same


def assert_grads_fa_rule(out: torch.Tensor, ref64: torch.Tensor, ref_same: torch.Tensor,
                         inputs: Sequence[torch.Tensor], mult: float = 3.0, *,
                         ref_inputs: Sequence[torch.Tensor] | None = None,
                         dout: torch.Tensor | None = None) -> None:
    """Gradients of ``out`` with respect to ``inputs`` (q, k, v) by the FlashAttention rule
    (3x for gradients), for one output gradient (``dout``, default random), against those
    of the references from :func:`fa_references` (computed from ``ref_inputs`` when they are
    other leaves than ``inputs``)."""
    dout = torch.randn_like(out) if dout is None else dout
    refs = inputs if ref_inputs is None else ref_inputs
    grads = torch.autograd.grad(out, inputs, dout)
    grads64 = torch.autograd.grad(ref64, refs, dout.double(), retain_graph=True)
    grads_same = torch.autograd.grad(ref_same, refs, dout)
    for what, g, r64, rs in zip("qkv", grads, grads64, grads_same):
        assert_fa_rule(g, r64, rs, mult=mult, what=f"d{what}")


def attention_or_skip(hub: Hub, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      **kw: Any) -> Any:
    """``hub.attention`` forced to backend ``name``; when the backend declines the call, the
    test is skipped with the backend's own reasons (never passed silently)."""
    import pytest

    from .errors import BackendUnavailableError

    try:
        return hub.attention(q, k, v, backend=name, **kw)
    except BackendUnavailableError as exc:
        pytest.skip(f"{name} declines: {'; '.join(exc.reasons)}")


def nan_case(where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(q, k, v, causal): fp32 bshd inputs (B=2, 7 tokens, 4:2 heads, d=16) with one NaN in
    ``where`` ("q", "k" or "v") placed where some query sees it; a NaN value under a masked key
    is skipped by kernels but not by the maths, so the v case is not causal."""
    import math

    q, k, v = (torch.randn(*s, dtype=torch.float32) for s in ((2, 7, 4, 16), (2, 7, 2, 16),
                                                              (2, 7, 2, 16)))
    if where == "q":
        q[0, 3, 1, 5] = math.nan
    elif where == "k":
        k[1, 0, 0, 2] = math.nan  # the first key: row 0 of batch 1 sees nothing else
    else:
        v[1, 2, 1, 0] = math.nan
    return q, k, v, where != "v"


def assert_nan_pattern(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       params: AttnParams) -> None:
    """NaN in means NaN out: NaN in exactly the rows where the fp64 reference has it, every
    other row by the FlashAttention rule."""
    ref64, _, same = fa_references(q, k, v, params)
    want = torch.isnan(ref64).any(-1)
    assert want.any(), "the case must put a NaN where some query sees it"
    assert torch.equal(torch.isnan(out).any(-1), want)
    keep = ~want
    assert_fa_rule(out[keep], ref64[keep], same[keep])


#: FlashAttention's GPU test shapes with attnhub's mask conventions, (b, sq, sk, hq, hkv, d,
#: causal, causal alignment): GQA/MHA heads, Sq < Sk and Sq > Sk, top-left, an odd
#: non-causal length, one-query decode. A plugin's GPU grid appends its own feature column
#: (a window, a softcap) and the rows that exercise it.
FA_GPU_SHAPES: tuple[tuple[int, int, int, int, int, int, bool, str], ...] = (
    (2, 128, 128, 8, 2, 128, True, "bottom_right"),
    (1, 64, 200, 8, 8, 64, True, "bottom_right"),
    (1, 200, 64, 8, 2, 128, True, "bottom_right"),
    (1, 96, 160, 4, 4, 128, True, "top_left"),
    (2, 77, 77, 8, 4, 128, False, "bottom_right"),
    (3, 1, 300, 8, 2, 128, True, "bottom_right"),
)


def grid_id(case: tuple[Any, ...]) -> str:
    """pytest id of a grid case: its shape and alignment (``2x128x128x8x2x128-top_left``)."""
    return "x".join(map(str, case[:6])) + f"-{case[7]}"


def gpu_marks() -> list[Any]:
    """``pytestmark`` of a module that needs a CUDA GPU: marked ``gpu``, skipped without one."""
    import pytest

    return [pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class DictStateStore:
    """A per-sequence state store (``attnhub.core.seqstate.SequenceStore``) for tests of the
    KV cache's sequence bookkeeping: one random tensor per sequence, room for ``slots``; a
    failing call changes nothing, as the protocol asks."""

    def __init__(self, slots: int = 8) -> None:
        self.slots = slots
        self.states: dict[int, torch.Tensor] = {}

    def allocate(self, seq_id: int) -> None:
        self._room(seq_id)
        self.states[seq_id] = torch.randn(3, dtype=torch.float32)

    def fork(self, src: int, dst: int) -> None:
        self._room(dst)
        self.states[dst] = self.states[src].clone()

    def free(self, seq_id: int) -> None:
        from .errors import InputError

        if seq_id not in self.states:
            raise InputError(f"DictStateStore: unknown sequence id {seq_id}")
        del self.states[seq_id]

    def _room(self, seq_id: int) -> None:
        from .errors import CacheFullError, InputError

        if seq_id in self.states:
            raise InputError(f"DictStateStore: sequence {seq_id} already has a state")
        if len(self.states) >= self.slots:
            raise CacheFullError(f"DictStateStore: full at sequence {seq_id}")


class CtrlCAt:
    """Fault injection for stores that promise all-or-nothing changes: a KeyboardInterrupt at
    the ``n``-th point of the code in files whose names end with ``files``, either as a C call
    returns (``mode="c"``: where CPython delivers a real Ctrl-C) or as a line starts
    (``mode="line"``, stricter). Sweep ``n`` from 1 until ``fired`` stays False, checking the
    store's invariants after each :meth:`run`."""

    def __init__(self, n: int, mode: str, files: tuple[str, ...]) -> None:
        if mode not in ("c", "line"):
            raise ValueError(f"CtrlCAt(mode={mode!r}): 'c' or 'line'")
        self.n, self.mode, self.files, self.count, self.fired = n, mode, files, 0, False

    def _tick(self) -> None:
        self.count += 1
        if self.count == self.n:
            self.fired = True
            raise KeyboardInterrupt(f"Ctrl-C at point {self.n}")

    def _ours(self, frame: Any) -> bool:
        code = frame.f_code  # never the injector's own lines (this file may be watched)
        return code.co_filename.endswith(self.files) and code.co_qualname[:8] != "CtrlCAt."

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_return" and self._ours(frame):
            self._tick()

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        if not self._ours(frame):
            return None
        if event in ("call", "line"):
            self._tick()
        return self._trace

    def run(self, op: Any) -> None:
        """``op()`` under the injector; the injected KeyboardInterrupt is swallowed.

        Line mode also fires on the line event CPython 3.11 emits for a ``with`` line just
        before calling ``__exit__``, which then never runs: a ``torch.no_grad()`` there would
        leave gradients off for the rest of the process. torch's grad mode is put back."""
        import sys

        grad = torch.is_grad_enabled()
        if self.mode == "c":
            sys.setprofile(self._profile)
        else:
            sys.settrace(self._trace)
        try:
            op()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
            sys.setprofile(None)
            torch.set_grad_enabled(grad)


class LaunchRecorder:
    """Stands in for a Triton kernel (``kernel[grid](...)``): records each launch's grid,
    tagged with ``name`` when given, and runs nothing. CUDA caps a grid's second and third
    axes at 65535 programs, a limit the CPU interpreter does not have: a test checks a
    plugin's grids against it on a machine without a GPU."""

    def __init__(self, grids: list[Any], name: str | None = None) -> None:
        self.grids, self.name = grids, name

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.grids.append(tuple(grid) if self.name is None else (self.name, tuple(grid)))
        return lambda *args, **kwargs: None


def record_launches(monkeypatch: Any, kernels: dict[Any, Sequence[str]],
                    named: bool = False) -> list[Any]:
    """Replace each ``module.name`` of ``kernels`` ({module: names}) with a
    :class:`LaunchRecorder`; returns the list their grids go to (``(name, grid)`` pairs with
    ``named``)."""
    grids: list[Any] = []
    for module, names in kernels.items():
        for name in names:
            monkeypatch.setattr(module, name, LaunchRecorder(grids, name if named else None))
    return grids


def plugin_of(*backends: Any) -> object:
    """A plugin object whose hook registers ``backends`` (for ``Registry.add_plugin``)."""
    from .hookspecs import hookimpl

    class Plugin:
        @hookimpl
        def attnhub_register_backends(self, register: Any) -> None:
            for b in backends:
                register(b)

    return Plugin()
