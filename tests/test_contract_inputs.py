"""The input contract (docs/contract.md): every bad argument is a typed InputError naming
the argument, raised before any backend runs, the same on the default path and forced on
every backend that runs on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from attnhub.errors import (
    ArgumentError,
    DeviceMismatchError,
    DTypeMismatchError,
    InputError,
    SeqlensError,
    ShapeError,
)

#: None is the policy's own choice; the rest are forced.
BACKENDS = [None, "reference", "torch_sdpa", "triton", "triton_decode", "flex",
            "sliding_window"]
B, S, HQ, HKV, D = 2, 5, 4, 2, 8


def _qkv(d: int = D, dv: int | None = None):
    return (torch.randn(B, S, HQ, d), torch.randn(B, S, HKV, d),
            torch.randn(B, S, HKV, dv if dv is not None else d))


def _i32(*xs):
    return torch.tensor(xs, dtype=torch.int32)


def _thd(**kw):
    q, k, v = torch.randn(6, HQ, D), torch.randn(6, HKV, D), torch.randn(6, HKV, D)
    kw.setdefault("cu_seqlens_q", _i32(0, 2, 6))
    kw.setdefault("cu_seqlens_k", _i32(0, 3, 6))
    return (q, k, v), dict(layout="thd", **kw)


def _paged(bt, sl, b=2):
    q = torch.randn(b, 1, HQ, D)
    pages = torch.randn(6, 4, HKV, D)
    return (q, pages, pages.clone()), dict(layout="paged", block_table=bt, seqlens_k=sl)


# (label, (args, kwargs), error type, text the message must hold)
CASES = [
    ("seqlens_k with bshd", (_qkv(), dict(seqlens_k=_i32(5, 5))), ArgumentError, "seqlens_k"),
    ("block_table with bshd", (_qkv(), dict(block_table=_i32(0, 1).view(2, 1))),
     ArgumentError, "block_table"),
    ("cu_seqlens_k alone with bshd", (_qkv(), dict(cu_seqlens_k=_i32(0, 5, 10))),
     ArgumentError, "cu_seqlens_k"),
    ("colmask_end alone", (_qkv(), dict(colmask_end=torch.zeros(B, 1, S, dtype=torch.int32))),
     ArgumentError, "colmask_end"),
    ("colmask with thd", _thd(colmask_start=torch.zeros(2, 1, 6, dtype=torch.int32)),
     ArgumentError, "colmask_start"),
    ("block_table with thd", _thd(block_table=_i32(0, 1).view(2, 1)), ArgumentError,
     "block_table"),
    ("head dim 0", (_qkv(d=0), {}), ShapeError, "head dim"),
    ("v head dim 0", (_qkv(dv=0), {}), ShapeError, "head dim"),
    ("window float", (_qkv(), dict(window=2.5)), ArgumentError, "window"),
    ("window float pair", (_qkv(), dict(window=(2.5, 0))), ArgumentError, "window"),
    ("window bool", (_qkv(), dict(window=True)), ArgumentError, "window"),
    ("window triple", (_qkv(), dict(window=(1, 2, 3))), ArgumentError, "window"),
    ("window below -1", (_qkv(), dict(window=(-2, 0))), ArgumentError, "window"),
    *[(f"scale {x}", (_qkv(), dict(scale=x)), ArgumentError, "scale")
      for x in (math.nan, math.inf, 0.0, -0.5, "0.1")],
    *[(f"softcap {x}", (_qkv(), dict(softcap=x)), ArgumentError, "softcap")
      for x in (0.0, -1.0, math.nan, math.inf)],
    ("scale tensor", (_qkv(), dict(scale=torch.tensor(0.3))), ArgumentError, "scale"),
    ("alibi (Hq+1,)", (_qkv(), dict(alibi_slopes=torch.rand(HQ + 1))), ShapeError,
     "alibi_slopes"),
    ("alibi (B+1, Hq)", (_qkv(), dict(alibi_slopes=torch.rand(B + 1, HQ))), ShapeError,
     "alibi_slopes"),
    ("alibi int", (_qkv(), dict(alibi_slopes=torch.ones(HQ, dtype=torch.int32))),
     DTypeMismatchError, "alibi_slopes"),
    ("alibi other device", (_qkv(), dict(alibi_slopes=torch.rand(HQ, device="meta"))),
     DeviceMismatchError, "alibi_slopes"),
    ("alibi (docs+1, Hq) thd", _thd(alibi_slopes=torch.rand(3, HQ)), ShapeError,
     "alibi_slopes"),
    ("prefix_lens shape", (_qkv(), dict(causal=True, prefix_lens=torch.tensor([1, 2, 3]))),
     ShapeError, "prefix_lens"),
    ("prefix_lens float", (_qkv(), dict(causal=True, prefix_lens=torch.tensor([1.0, 2.0]))),
     DTypeMismatchError, "prefix_lens"),
    ("prefix_lens without causal", (_qkv(), dict(prefix_lens=torch.tensor([1, 2]))),
     ArgumentError, "causal=True"),
    ("colmask shape", (_qkv(), dict(colmask_start=torch.zeros(B, 1, S + 1, dtype=torch.int32))),
     ShapeError, "colmask_start"),
    ("colmask heads", (_qkv(), dict(colmask_start=torch.zeros(B, 3, S, dtype=torch.int32))),
     ShapeError, "colmask_start"),
    ("q not a tensor", (([[1.0]], *_qkv()[1:]), {}), ShapeError, "q must be a torch.Tensor"),
    ("v not a tensor", ((*_qkv()[:2], None), {}), ShapeError, "v must be a torch.Tensor"),
    ("causal not bool", (_qkv(), dict(causal="yes")), ArgumentError, "causal"),
    ("phase unknown", (_qkv(), dict(phase="inference")), ArgumentError, "phase"),
    ("max_seqlen_q below true", _thd(max_seqlen_q=3), SeqlensError, "max_seqlen_q"),
    ("max_seqlen_k below true", _thd(max_seqlen_k=2), SeqlensError, "max_seqlen_k"),
    ("max_seqlen_k below true bshd", (_qkv(), dict(max_seqlen_k=4)), SeqlensError,
     "max_seqlen_k"),
    ("cu_seqlens_q short of packed", _thd(cu_seqlens_q=_i32(0, 2, 5)), SeqlensError,
     "cu_seqlens_q"),
    ("cu_seqlens_k short of packed", _thd(cu_seqlens_k=_i32(0, 3, 4)), SeqlensError,
     "cu_seqlens_k"),
    ("cu_seqlens lengths differ", _thd(cu_seqlens_k=_i32(0, 6)), SeqlensError, "B+1"),
    ("paged seqlens_k shorter than batch", _paged(_i32(0, 1, 2, 3, 4, 5).view(2, 3), _i32(9)),
     SeqlensError, "seqlens_k"),
    ("paged seqlens_k 2-D", _paged(_i32(0, 1, 2, 3, 4, 5).view(2, 3), _i32(3, 4).view(2, 1)),
     SeqlensError, "seqlens_k"),
    ("paged negative length", _paged(_i32(0, 1, 2, 3, 4, 5).view(2, 3), _i32(3, -1)),
     SeqlensError, "negative"),
    ("paged past capacity", _paged(_i32(0, 1, 2, 3, 4, 5).view(2, 3), _i32(3, 13)),
     SeqlensError, "capacity"),
    ("paged page out of range", _paged(_i32(0, 1, 2, 3, 6, 5).view(2, 3), _i32(3, 6)),
     SeqlensError, "outside"),
    ("paged negative page", _paged(_i32(0, 1, 2, -3, 4, 5).view(2, 3), _i32(3, 6)),
     SeqlensError, "outside"),
    ("paged table int64", _paged(torch.arange(6).view(2, 3), _i32(3, 6)), SeqlensError,
     "int32"),
    ("paged table rows", _paged(_i32(0, 1, 2).view(1, 3), _i32(3, 6)), SeqlensError,
     "block_table"),
    ("paged cu_seqlens", ((_paged(_i32(0, 1).view(2, 1), _i32(1, 1))[0]),
                          dict(layout="paged", block_table=_i32(0, 1).view(2, 1),
                               seqlens_k=_i32(1, 1), cu_seqlens_q=_i32(0, 1, 2))),
     ArgumentError, "cu_seqlens_q"),
]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b or "default")
@pytest.mark.parametrize("label,call,exc,text", CASES, ids=[c[0] for c in CASES])
def test_bad_argument_is_a_typed_error(hub, backend, label, call, exc, text):
    (q, k, v), kw = call
    with pytest.raises(exc, match=text.replace("(", r"\(").replace("+", r"\+")) as info:
        hub.attention(q, k, v, backend=backend, **kw)
    assert isinstance(info.value, InputError)
    assert not hub.fallback_counts


def test_fast_path_checks_what_its_key_does_not_hold(hub):
    """A call that hits the exact-shape table still has its scale/softcap values and its
    side-tensor shapes checked; a layout-foreign argument never reaches the table."""
    q, k, v = _qkv()
    slopes = torch.rand(HQ)
    hub.attention(q, k, v, alibi_slopes=slopes, softcap=5.0, scale=0.3)
    with pytest.raises(ArgumentError, match="scale"):
        hub.attention(q, k, v, alibi_slopes=slopes, softcap=5.0, scale=math.nan)
    with pytest.raises(ArgumentError, match="softcap"):
        hub.attention(q, k, v, alibi_slopes=slopes, softcap=-5.0, scale=0.3)
    with pytest.raises(ShapeError, match="alibi_slopes"):
        hub.attention(q, k, v, alibi_slopes=torch.rand(B + 1, HQ), softcap=5.0, scale=0.3)
    hub.attention(q, k, v)
    with pytest.raises(ArgumentError, match="seqlens_k"):
        hub.attention(q, k, v, seqlens_k=_i32(5, 5))
    with pytest.raises(ArgumentError, match="colmask_end"):
        hub.attention(q, k, v, colmask_end=torch.zeros(B, 1, S, dtype=torch.int32))



def test_module_level_attention_keeps_the_contract():
    """``attnhub.attention`` (the process-wide hub) checks the same contract."""
    import attnhub

    q, k, v = _qkv()
    with pytest.raises(ArgumentError, match="seqlens_k"):
        attnhub.attention(q, k, v, seqlens_k=_i32(5, 5))
    with pytest.raises(SeqlensError, match="max_seqlen_q"):
        (q, k, v), kw = _thd(max_seqlen_q=1)
        attnhub.attention(q, k, v, **kw)
