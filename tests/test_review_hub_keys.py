"""Review: the hub's binding tables never hand a call a binding checked for another call.

* The runner table (the slow path's key) must hold everything the backends' checks and the
  policy read from the spec. A backend's ``check`` reads the window's *values* (FlashInfer
  bounds windows on the left only, CK aligns them bottom-right only, the banded backends
  refuse windows that bound nothing), so two calls that differ only in the window's values
  must not share a runner: the second would run on a backend that refused it.
* The exact-shape table (the hot path's key) compares flags by ``==``, under which
  ``True == 1 == 1.0``: a key hit must not accept a value the slow path refuses
  (``causal=1``, ``window=True``, ``max_seqlen_q=4.0``...), or a call's validity would depend
  on what ran before it.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

import attnhub
from attnhub.core.builtin import ReferenceBackend
from attnhub.core.registry import Registry
from attnhub.core.spec import AttnParams
from attnhub.errors import ArgumentError
from attnhub.testing import assert_fa_rule, fa_references


class LeftOnlyWindow(ReferenceBackend):
    """A kernel that bounds windows on the left only, as FlashInfer's: it refuses a window
    with a right bound (its check says so) and, given one anyway, ignores it."""

    name = "left_only"
    tier = "portable"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def extra_checks(self, spec, device):  # type: ignore[no-untyped-def, override]
        w = spec.mask.window
        if w is not None and not spec.mask.causal and w[1] >= 0:
            return [f"window {w}: bounds windows on the left only (right must be -1)"]
        return []

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        self.calls += 1
        if params.window is not None:
            from dataclasses import replace

            params = replace(params, window=(params.window[0], -1))
        return super().forward(q, k, v, spec, params)


POLICY = """
    name: left-only
    rules:
      - name: windows
        use: [left_only, reference]
    """


def _hub(tmp_path) -> tuple[attnhub.Hub, LeftOnlyWindow]:
    backend = LeftOnlyWindow()
    reg = Registry.of(backend, plugin="left_only")
    path = tmp_path / "left_only.yaml"
    path.write_text(textwrap.dedent(POLICY).lstrip(), encoding="utf-8")
    return attnhub.Hub(policy=str(path), hardware="cpu", registry=reg), backend


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_window_values_never_share_a_runner(tmp_path, layout):
    hub, backend = _hub(tmp_path)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 12, 2, 8), torch.randn(1, 12, 2, 8), torch.randn(1, 12, 2, 8)
    if layout == "bhsd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    hub.attention(q, k, v, window=(2, -1), layout=layout)  # left only: left_only serves
    assert backend.calls == 1
    out = hub.attention(q, k, v, window=(2, 1), layout=layout)  # refused by left_only
    assert backend.calls == 1, "a window left_only refused ran on it (runner reused)"
    assert [r.decision.backend for r in hub.bound()] == ["left_only", "reference"]
    assert [r.decision.spec.mask.window for r in hub.bound()] == [(2, -1), (2, 1)]
    if layout == "bhsd":
        q, k, v, out = (t.transpose(1, 2) for t in (q, k, v, out))
    p = AttnParams(scale=8 ** -0.5, window=(2, 1))
    ref64, _, same = fa_references(q, k, v, p)
    assert_fa_rule(out, ref64, same)


def test_window_int_and_tuple_of_the_same_values_share_a_runner(tmp_path):
    """The runner key holds the window as checked: window=3 with causal is (3, 0)."""
    hub, _ = _hub(tmp_path)
    q = torch.randn(1, 6, 2, 8)
    hub.attention(q, q, q, causal=True, window=3)
    hub.attention(q, q, q, causal=True, window=(3, 0))
    assert len(hub.bound()) == 1


#: Values the slow path refuses that compare equal to values it accepts (True == 1 == 1.0).
LOOKALIKES = [
    ({"causal": True}, {"causal": 1}),
    ({"causal": True}, {"causal": 1.0}),
    ({"causal": False}, {"causal": 0}),
    ({"return_lse": False}, {"return_lse": 0}),
    ({"deterministic": False}, {"deterministic": 0}),
    ({"window": 1}, {"window": True}),
    ({"window": 1}, {"window": 1.0}),
    ({"window": (1, 0)}, {"window": (True, 0)}),
    ({"window": (1, 0)}, {"window": (1.0, 0)}),
    ({"max_seqlen_q": 4}, {"max_seqlen_q": 4.0}),
    ({"max_seqlen_k": 6}, {"max_seqlen_k": 6.0}),
]


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("good,bad", LOOKALIKES)
def test_exact_table_refuses_what_the_slow_path_refuses(good, bad, layout):
    hub = attnhub.Hub(hardware="cpu")
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 6, 2, 8)
    if layout == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    with pytest.raises(ArgumentError):
        attnhub.Hub(hardware="cpu").attention(q, k, k, layout=layout, **bad)  # slow path
    hub.attention(q, k, k, layout=layout, **good)
    with pytest.raises(ArgumentError):
        hub.attention(q, k, k, layout=layout, **bad)  # the same key under ==


def test_growing_cache_refuses_lookalikes():
    """The key-length bucket lookup (a growing cache) takes the same flags."""
    hub = attnhub.Hub(hardware="cpu")
    q = torch.randn(1, 1, 2, 8)
    hub.attention(q, torch.randn(1, 20, 2, 8), torch.randn(1, 20, 2, 8), causal=True)
    k = torch.randn(1, 21, 2, 8)
    with pytest.raises(ArgumentError):
        hub.attention(q, k, k, causal=1)
    hub.attention(q, k, k, causal=True)  # and the valid call still hits


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_growing_cache_layers_then_next_length(layout):
    """A step's layers at one length (the last-key compare after a bucket hit), then the
    next length, then a shape that is not 4-D: each gets its own exact answer or the
    contract's error, never the previous call's binding."""
    hub = attnhub.Hub(hardware="cpu")
    g = torch.Generator().manual_seed(7)
    axis = 1 if layout == "bshd" else 2
    q = torch.randn(1, 1, 4, 8, generator=g)
    if layout == "bhsd":
        q = q.transpose(1, 2)
    for s in (20, 21, 21, 21, 22, 23):  # a bind, then bucket hits, repeated per "layer"
        shape = [1, 2, 8]
        shape.insert(axis, s)
        k, v = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        out = hub.attention(q, k, v, causal=True, layout=layout)
        if layout == "bhsd":
            qd, kd, vd, od = (t.transpose(1, 2) for t in (q, k, v, out))
        else:
            qd, kd, vd, od = q, k, v, out
        ref64, _, same = fa_references(qd, kd, vd, AttnParams(scale=8 ** -0.5, causal=True))
        assert_fa_rule(od, ref64, same)
    with pytest.raises(attnhub.errors.ShapeError):
        hub.attention(q[0], k[0], v[0], causal=True, layout=layout)  # 3-D: the contract says


def test_two_growing_caches_and_a_bucket_edge_keep_their_own_bindings():
    """Two caches of different head counts grow in turn (each step's bucket lookup misses
    the other's last key), one crosses a length bucket (32 -> 33 keys: bound anew), and a
    v one key short of k is refused: every call gets its own exact answer or the error."""
    hub = attnhub.Hub(hardware="cpu")
    g = torch.Generator().manual_seed(3)
    qa, qb = torch.randn(1, 1, 4, 8, generator=g), torch.randn(1, 1, 6, 8, generator=g)
    for s in range(28, 37):
        for q, hkv in ((qa, 2), (qb, 3)):
            k, v = (torch.randn(1, s, hkv, 8, generator=g) for _ in range(2))
            out = hub.attention(q, k, v, causal=True)
            ref64, _, same = fa_references(q, k, v, AttnParams(scale=8 ** -0.5, causal=True))
            assert_fa_rule(out, ref64, same)
    buckets = {r.decision.spec.max_seqlen_k for r in hub.bound()}
    assert buckets == {32, 64}
    k = torch.randn(1, 37, 2, 8, generator=g)
    with pytest.raises(attnhub.errors.ShapeError):
        hub.attention(qa, k, k[:, :36], causal=True)
