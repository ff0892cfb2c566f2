"""Review 9b, the hub after review 9: the hot path and the slow path answer one call alike
(``extra=`` an array or tensor, ``backend=`` a ``str`` subclass, a backend raising
``GeneratorExit`` once it is on the hot path), a registry tells every hub of a change even
when one listener raises, and window edges normalised per length bucket never let a
binding made for an unbounded window serve a call whose window bounds its keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import attnhub
from attnhub import AttentionOutput, Backend, Capabilities
from attnhub.core.capabilities import ALL_MASKS
from attnhub.core.registry import Registry
from attnhub.errors import ArgumentError
from tests.test_review_9_registry_policy import Spy

from attnhub.testing import plugin_of


def _qkv(s: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return tuple(torch.randn(1, s, 2, 8) for _ in range(3))  # type: ignore[return-value]


def _policy(tmp_path: Path, use: str) -> Path:
    p = tmp_path / "p.yaml"
    p.write_text(f"name: t\nrules:\n  - {{name: r, use: [{use}], on_failure: next}}\n")
    return p


# -- the hot path answers as the slow path ---------------------------------------------------
@pytest.mark.parametrize("kind", ["ndarray", "tensor"])
def test_extra_an_array_is_refused_on_the_hot_path_too(kind: str) -> None:
    """``extra=np.array([1, 2])`` after a warm call raised numpy's ValueError (a tensor:
    RuntimeError) from the hot path's truth test, where the slow path says ArgumentError."""
    if kind == "ndarray":
        extra: Any = pytest.importorskip("numpy").array([1, 2])
    else:
        extra = torch.tensor([1.0, 2.0])
    q, k, v = _qkv()
    hub = attnhub.Hub(hardware="cpu")
    for _ in range(3):
        hub.attention(q, k, v)
    with pytest.raises(ArgumentError, match="extra="):
        hub.attention(q, k, v, extra=extra)  # hot path
    with pytest.raises(ArgumentError, match="extra="):
        attnhub.Hub(hardware="cpu").attention(q, k, v, extra=extra)  # slow path


class _Name(str):
    """A ``str`` subclass (as ``numpy.str_``): equal to, and hashed as, the plain name."""


def test_a_str_subclass_backend_name_is_taken_on_both_paths() -> None:
    """``backend=numpy.str_("reference")`` was refused by the slow path but served by the hot
    path after a call with the plain name (the key compares by ==): what a call got hung on
    what ran before. Both take it now, and the binding holds a plain str."""
    q, k, v = _qkv()
    want = attnhub.Hub(hardware="cpu").attention(q, k, v, backend="reference")
    fresh = attnhub.Hub(hardware="cpu")
    torch.testing.assert_close(fresh.attention(q, k, v, backend=_Name("reference")), want)
    assert [type(r.decision.backend) for r in fresh.bound()] == [str]
    warm = attnhub.Hub(hardware="cpu")
    for _ in range(3):
        warm.attention(q, k, v, backend="reference")
    torch.testing.assert_close(warm.attention(q, k, v, backend=_Name("reference")), want)
    for bad in ("", _Name(""), 0):
        with pytest.raises(ArgumentError, match="backend="):
            fresh.attention(q, k, v, backend=bad)


class _ExitsLater(Backend):
    """The reference's answer for ``good`` calls, then ``GeneratorExit`` (a kernel library
    closing a generator it does not own) on every later call."""

    name, tier = "exits9b", "portable"
    capabilities = Capabilities(vendors=frozenset({"cpu"}), dtypes=frozenset({"fp32"}),
                                gqa=True, masks=ALL_MASKS)

    def __init__(self, good: int) -> None:
        super().__init__()
        self.good, self.calls = good, 0

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        self.calls += 1
        if self.calls > self.good:
            raise GeneratorExit("closed")
        return AttentionOutput(attnhub.attention(q, k, v, backend="reference"), None)


def test_generator_exit_on_the_hot_path_is_that_backend_failing(tmp_path: Path) -> None:
    """The slow lane took ``GeneratorExit`` from forward() as the backend failing (review 9);
    the hot path's inlined first candidate caught ``Exception, SystemExit`` only, so once the
    backend was admitted there the same raise escaped ``hub.attention`` and no fallback ran."""
    b = _ExitsLater(good=2)  # two good slow-lane calls admit it to the hot path
    hub = attnhub.Hub(policy=_policy(tmp_path, "exits9b, reference"), hardware="cpu",
                      registry=Registry.of(b, plugin="exits9b"))
    q, k, v = _qkv()
    want = attnhub.Hub(hardware="cpu").attention(q, k, v, backend="reference")
    for _ in range(2):
        hub.attention(q, k, v)
    assert hub.bound()[-1].first is b  # on the hot path now
    torch.testing.assert_close(hub.attention(q, k, v), want)  # escaped GeneratorExit
    assert b.calls == 3 and hub.fallback_counts[("exits9b", "reference")] == 1
    torch.testing.assert_close(hub.attention(q, k, v), want)


# -- a registry tells every hub ----------------------------------------------------------------
class _Raises:
    def changed(self, registry: Registry) -> None:
        raise RuntimeError("listener failed")


def test_a_listener_that_raises_does_not_keep_later_hubs_stale(tmp_path: Path) -> None:
    """``Registry.on_change`` is public: a callback registered before a hub that raised ended
    ``_changed`` there, so that hub was never told and its hot path (which reads nothing of
    the registry) served the old backend for good. Every listener is told now, then the
    first exception is raised."""
    reg = Registry.load(entry_points=False, modules=[])
    bad = _Raises()
    reg.on_change(bad.changed)
    hub = attnhub.Hub(policy=_policy(tmp_path, "late9b, torch_sdpa"), hardware="cpu",
                      registry=reg)
    q, k, v = _qkv()
    for _ in range(3):
        hub.attention(q, k, v)
    assert hub.bound()[-1].decision.backend == "torch_sdpa"
    late = Spy("late9b")
    with pytest.raises(RuntimeError, match="listener failed"):
        reg.add_plugin(plugin_of(late), "late9b")
    hub.attention(q, k, v)  # the hot path: its bindings were dropped when told
    assert late.calls == 1


# -- window edges normalised per bucket ------------------------------------------------------
def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, left: int,
           lens: list[int] | None = None) -> torch.Tensor:
    """Causal (bottom-right) attention with a left window, fp64, per sequence (``lens``: the
    keys each sequence has)."""
    out = []
    for b in range(q.shape[0]):
        sk = k.shape[1] if lens is None else lens[b]
        sq = q.shape[1]
        qb, kb, vb = (x[b].double().transpose(0, 1) for x in (q, k[:, :sk], v[:, :sk]))
        s = qb @ kb.transpose(-1, -2) / q.shape[-1] ** 0.5
        pos = torch.arange(sq)[:, None] + sk - sq
        j = torch.arange(sk)[None, :]
        s = s.masked_fill(~((j <= pos) & (j >= pos - left)), float("-inf"))
        out.append((s.softmax(-1) @ vb).transpose(0, 1))
    return torch.stack(out).to(q.dtype)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_a_growing_cache_never_reuses_an_unbounded_window_where_it_bounds(layout: str) -> None:
    """Keys grow one per call across the 64-bucket edge with ``window=(w, 0)`` for ``w`` at
    the edge: a binding whose edge was normalised to "unbounded" (w >= the bucket) must not
    serve the next bucket's calls, where ``w`` bounds the keys."""
    torch.manual_seed(1)
    hub = attnhub.Hub(hardware="cpu")
    q = torch.randn(1, 1, 2, 8)
    k, v = torch.randn(1, 140, 2, 8), torch.randn(1, 140, 2, 8)
    for sk in range(50, 140, 3):
        for w in (63, 64, 65, 128):
            kk, vv = k[:, :sk], v[:, :sk]
            args = (q, kk, vv) if layout == "bshd" else tuple(
                x.transpose(1, 2) for x in (q, kk, vv))
            out = hub.attention(*args, causal=True, window=(w, 0), layout=layout)
            if layout == "bhsd":
                out = out.transpose(1, 2)
            torch.testing.assert_close(out, _naive(q, kk, vv, w), msg=f"sk={sk} w={w}")


def test_paged_calls_of_one_key_with_other_table_widths_stay_exact() -> None:
    """A paged call's edges are bounded by the table's capacity, which the hot path's key
    does not hold: a binding made with a narrow table (the edge normalised away) serves a
    wide table's call of the same length bucket only where the edge still reaches past
    every key of it."""
    torch.manual_seed(2)
    page, pages = 4, 32
    hub = attnhub.Hub(hardware="cpu")
    kc, vc = torch.randn(pages, page, 2, 8), torch.randn(pages, page, 2, 8)
    q = torch.randn(2, 1, 2, 8)
    for width, lens, w in [(2, [7, 8], 8), (8, [7, 8], 8), (8, [20, 30], 8), (2, [5, 6], 8),
                           (16, [60, 33], 40), (8, [30, 17], 40)]:
        table = torch.arange(2 * width, dtype=torch.int32).view(2, width)
        sl = torch.tensor(lens, dtype=torch.int32)
        out = hub.attention(q, kc, vc, causal=True, window=(w, 0), layout="paged",
                            block_table=table, seqlens_k=sl)
        k = kc[table.long()].reshape(2, width * page, 2, 8)
        v = vc[table.long()].reshape(2, width * page, 2, 8)
        torch.testing.assert_close(out, _naive(q, k, v, w, lens), msg=f"{width} {lens} {w}")


def test_bind_resolves_a_sentinel_window_as_the_calls_do() -> None:
    """``Attention(window=2**31 - 1)``: bind's spec drops the edge as the calls' check does
    (an edge past every key is unbounded), so the decision explained is the one that runs."""
    from attnhub.nn import call_spec

    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, head_dim_v=16, causal=True,
              softcap=False, batch=1, seqlen_q=64, seqlen_k=64, dtype=torch.float32,
              layout="bshd")
    assert call_spec("prefill", window=2**31 - 1, **kw).mask.window is None
    assert call_spec("prefill", window=(2**31 - 1, 5), **kw).mask.window is None  # causal
    kw["causal"] = False
    assert call_spec("prefill", window=(2**31 - 1, 5), **kw).mask.window == (-1, 5)
    assert call_spec("prefill", window=(8, 0), **kw).mask.window == (8, 0)


def test_a_bind_context_takes_numpy_and_torch_integers() -> None:
    """A layer index from numpy or torch is the int it holds (``operator.index``); floats,
    bools and many-valued tensors stay refused."""
    import numpy as np

    from attnhub import BindContext
    from attnhub.errors import ArgumentError

    c = BindContext(layer=np.int64(3), world_size=torch.tensor(2))
    assert c == BindContext(layer=3, world_size=2) and type(c.layer) is int
    for bad in ({"layer": np.float64(3.0)}, {"layer": True},
                {"world_size": torch.tensor([1, 2])}):
        with pytest.raises(ArgumentError):
            BindContext(**bad)
