"""Review round 8, the hub boundary: results a backend hands back that broke the contract
unseen (an LSE in a static buffer, an output whose strides overlap, NaN in the LSE under
debug mode, a sparse output refused for the wrong reason), and inputs that are not dense
strided tensors (sparse, mkldnn, nested, a lazily negated view), which failed inside the hub
or were charged to the backends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import attnhub
from attnhub.core.registry import Registry
from attnhub.errors import InputError
from attnhub.plugin import AttentionOutput, Backend, Capabilities

CAPS = Capabilities(vendors=frozenset({"cpu"}), dtypes=frozenset({"fp32"}), gqa=True,
                    returns_lse=True)
Spoil = Callable[[Any, torch.Tensor, Any], AttentionOutput]


class _Spoils(Backend):
    """The reference's answer, then ``spoil(self, out, lse)``."""

    name, plugin = "spoils8", "adv8"
    capabilities = CAPS
    spoil: Spoil = staticmethod(lambda self, out, lse: AttentionOutput(out, lse))
    buf: torch.Tensor | None = None

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        out, lse = attnhub.attention(q, k, v, backend="reference", return_lse=True)
        return self.spoil(self, out, lse if params.return_lse else None)


def _hub(spoil: Spoil, tmp_path: Path, debug: bool = False) -> attnhub.Hub:
    b = _Spoils()
    b.spoil = spoil  # type: ignore[assignment]
    p = tmp_path / "p.yaml"
    p.write_text("name: t\nrules:\n  - {name: r, use: [spoils8, reference], on_failure: next}\n")
    return attnhub.Hub(policy=p, hardware="cpu", registry=Registry.of(b, plugin="adv8"),
                       debug=debug)


def _qkv() -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(1, 4, 2, 8) for _ in range(3))


def _static_lse(self, out, lse):  # type: ignore[no-untyped-def]
    if self.buf is None:
        self.buf = torch.empty_like(lse)
    self.buf.copy_(lse)
    return AttentionOutput(out, self.buf)


def test_an_lse_returned_in_the_previous_calls_memory_is_caught(tmp_path: Path) -> None:
    hub = _hub(_static_lse, tmp_path)
    _, lse1 = hub.attention(*_qkv(), return_lse=True)
    _, lse2 = hub.attention(*_qkv(), return_lse=True)
    assert sum(hub.fallback_counts.values()) == 1  # the reuse: distrusted, reference served
    assert lse1.data_ptr() != lse2.data_ptr()


def _overlapping(self, out, lse):  # type: ignore[no-untyped-def]
    b, s, h, d = out.shape
    strides = (s * h * (d // 2) + d, h * (d // 2), d // 2, 1)  # a head stride of D/2
    flat = torch.zeros(sum((n - 1) * st for n, st in zip(out.shape, strides)) + 1)
    view = flat.as_strided(out.shape, strides)
    view.copy_(out)  # later elements overwrite earlier ones
    return AttentionOutput(view, lse)


def test_an_output_whose_strides_overlap_is_refused(tmp_path: Path) -> None:
    hub = _hub(_overlapping, tmp_path)
    q, k, v = _qkv()
    for _ in range(3):
        out = hub.attention(q, k, v)
        torch.testing.assert_close(out, attnhub.attention(q, k, v, backend="reference"))
    assert sum(hub.fallback_counts.values()) >= 1


@pytest.mark.parametrize("shape, strides", [((2, 3, 4), (12, 4, 1)), ((2, 3, 4), (1, 8, 2)),
                                            ((2, 1, 4), (4, 99, 1)), ((2, 3, 4), (16, 4, 1))])
def test_dense_permuted_and_padded_outputs_are_not_overlapping(shape, strides) -> None:  # type: ignore[no-untyped-def]
    from attnhub.core.outputs import _self_overlapping

    t = torch.zeros(400).as_strided(shape, strides)
    assert not _self_overlapping(t)
    assert _self_overlapping(torch.zeros(400).as_strided((2, 3, 4), (6, 2, 1)))


def test_debug_mode_checks_the_lse_for_nan(tmp_path: Path) -> None:
    hub = _hub(lambda self, out, lse: AttentionOutput(out, torch.full_like(lse, float("nan"))),
               tmp_path, debug=True)
    _, lse = hub.attention(*_qkv(), return_lse=True)
    assert not lse.isnan().any() and sum(hub.fallback_counts.values()) == 1


def test_a_sparse_output_is_refused_as_sparse(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    hub = _hub(lambda self, out, lse: AttentionOutput(out.to_sparse(), lse), tmp_path)
    with caplog.at_level("WARNING", logger="attnhub"):
        out = hub.attention(*_qkv())
    assert out.layout is torch.strided and sum(hub.fallback_counts.values()) == 1
    assert "as a sparse_coo tensor" in caplog.text and "expanded" not in caplog.text


_ODD: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sparse": lambda t: t.to_sparse(),
    "mkldnn": lambda t: t.to_mkldnn(),
    "nested": lambda t: torch.nested.nested_tensor(list(t)),
    "negative bit": lambda t: torch.complex(torch.zeros_like(t), -t).conj().imag,
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("kind", list(_ODD))
@pytest.mark.parametrize("which", ["q", "k", "alibi_slopes"])
def test_inputs_that_are_not_dense_strided_are_refused_by_name(kind: str, which: str) -> None:
    hub = attnhub.Hub(hardware="cpu")
    q, k, v = _qkv()
    slopes = torch.tensor([0.5, 0.25])
    for _ in range(2):  # the hot path too: the exact-shape table holds this binding
        hub.attention(q, k, v, causal=True, alibi_slopes=slopes)
    args = {"q": q, "k": k, "alibi_slopes": slopes}
    if kind == "nested" and which == "alibi_slopes":
        pytest.skip("a nested tensor of one row is not a slope vector")
    args[which] = _ODD[kind](args[which])
    if kind == "negative bit":
        assert args[which].is_neg()
    with pytest.raises(InputError, match=which):
        hub.attention(args["q"], args["k"], v, causal=True, alibi_slopes=args["alibi_slopes"])
    assert not hub.fallback_counts


class _Duck:
    """Looks like a tensor to the hot path's key (shape, dtype, device, layout, is_neg)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype, self.device, self.layout = t.shape, t.dtype, t.device, t.layout

    def is_neg(self) -> bool:
        return False


def test_a_tensor_look_alike_side_argument_is_refused_on_the_hot_path_too() -> None:
    hub = attnhub.Hub(hardware="cpu")
    q, k, v = _qkv()
    slopes = torch.tensor([0.5, 0.25])
    for _ in range(2):
        hub.attention(q, k, v, causal=True, alibi_slopes=slopes)
    with pytest.raises(InputError, match="alibi_slopes must be a torch.Tensor"):
        hub.attention(q, k, v, causal=True, alibi_slopes=_Duck(slopes))
    assert not hub.fallback_counts


@pytest.mark.parametrize("which", ["cu_seqlens_q", "seqlens_k", "block_table"])
def test_sparse_tables_are_refused_by_name(which: str) -> None:
    from attnhub.core.kvcache import PagedKVCache

    hub = attnhub.Hub(hardware="cpu")
    if which == "cu_seqlens_q":
        t = torch.randn(8, 2, 8)
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        with pytest.raises(InputError, match="cu_seqlens_q is a sparse"):
            hub.attention(t, t, t, layout="thd", cu_seqlens_q=cu.to_sparse(), cu_seqlens_k=cu)
        return
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8)
    s = cache.allocate()
    cache.append(s, [torch.randn(5, 2, 8)], [torch.randn(5, 2, 8)])
    tables = {"block_table": cache.block_table([s]), "seqlens_k": cache.seqlens([s])}
    tables[which] = tables[which].to_sparse()
    with pytest.raises(InputError, match=f"{which} is a sparse"):
        hub.attention(torch.randn(1, 1, 2, 8), cache.k_cache(0), cache.v_cache(0),
                      layout="paged", **tables)
