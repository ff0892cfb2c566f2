"""Every bad input gets its named error, naming the argument and the fix."""

from __future__ import annotations

import pytest
import torch

from attnhub.errors import (
    DeviceMismatchError,
    DTypeMismatchError,
    InputError,
    LayoutError,
    SeqlensError,
    ShapeError,
)


def _qkv(hq=4, hkv=2, d=16, sq=5, sk=7, dtype=torch.float32):
    return (torch.randn(2, sq, hq, d, dtype=dtype), torch.randn(2, sk, hkv, d, dtype=dtype),
            torch.randn(2, sk, hkv, d, dtype=dtype))


def _thd(hub, cu_q, cu_k, tq=6, tk=6):
    q, k, v = torch.randn(tq, 2, 8), torch.randn(tk, 2, 8), torch.randn(tk, 2, 8)
    return hub.attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         backend="reference")


CASES = [
    ("wrong rank", lambda h: h.attention(torch.randn(5, 4, 16), *_qkv()[1:], backend="reference"),
     ShapeError, "rank 3"),
    ("head dim", lambda h: h.attention(_qkv(d=16)[0], *_qkv(d=32)[1:], backend="reference"),
     ShapeError, "head dim"),
    ("hq % hkv", lambda h: h.attention(*_qkv(hq=6, hkv=4), backend="reference"),
     ShapeError, "Hq % Hkv"),
    ("dtype mismatch", lambda h: h.attention(_qkv()[0].half(), *_qkv()[1:], backend="reference"),
     DTypeMismatchError, "cast"),
    ("int dtype", lambda h: h.attention(*(t.int() for t in _qkv()), backend="reference"),
     DTypeMismatchError, "fp16, bf16 or fp32"),
    ("device mismatch", lambda h: h.attention(_qkv()[0].to("meta"), *_qkv()[1:],
                                              backend="reference"),
     DeviceMismatchError, "one device"),
    ("unknown layout", lambda h: h.attention(*_qkv(), layout="sbhd", backend="reference"),
     LayoutError, "bshd"),
    ("cu_seqlens int64", lambda h: _thd(h, torch.tensor([0, 3, 6]),
                                        torch.tensor([0, 3, 6], dtype=torch.int32)),
     SeqlensError, "torch.int32"),
    ("cu_seqlens not monotonic", lambda h: _thd(h, torch.tensor([0, 4, 3], dtype=torch.int32),
                                                torch.tensor([0, 3, 6], dtype=torch.int32)),
     SeqlensError, "monotonic"),
    ("cu_seqlens out of bounds", lambda h: _thd(h, torch.tensor([0, 3, 9], dtype=torch.int32),
                                                torch.tensor([0, 3, 6], dtype=torch.int32)),
     SeqlensError, "past the 6 tokens"),
    ("thd without cu_seqlens", lambda h: h.attention(
        torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8), layout="thd"),
     InputError, "cu_seqlens_q"),
    ("cu_seqlens with bshd", lambda h: h.attention(
        *_qkv(), cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32), backend="reference"),
     InputError, "layout='thd'"),
    ("bad alignment", lambda h: h.attention(*_qkv(), causal=True, causal_alignment="left",
                                            backend="reference"),
     InputError, "bottom_right"),
    ("batch mismatch", lambda h: h.attention(_qkv()[0][:1], *_qkv()[1:], backend="reference"),
     ShapeError, "batch"),
    ("paged without table", lambda h: h.attention(
        torch.randn(2, 1, 4, 16), torch.randn(3, 4, 2, 16), torch.randn(3, 4, 2, 16),
        layout="paged", backend="reference"),
     SeqlensError, "block_table"),
    ("paged over capacity", lambda h: h.attention(
        torch.randn(1, 1, 4, 16), torch.randn(3, 4, 2, 16), torch.randn(3, 4, 2, 16),
        layout="paged", block_table=torch.tensor([[0, 1]], dtype=torch.int32),
        seqlens_k=torch.tensor([9], dtype=torch.int32), backend="reference"),
     SeqlensError, "capacity"),
    ("paged bad page", lambda h: h.attention(
        torch.randn(1, 1, 4, 16), torch.randn(3, 4, 2, 16), torch.randn(3, 4, 2, 16),
        layout="paged", block_table=torch.tensor([[0, 7]], dtype=torch.int32),
        seqlens_k=torch.tensor([6], dtype=torch.int32), backend="reference"),
     SeqlensError, "outside"),
    ("bad window", lambda h: h.attention(*_qkv(), window=(-5, 2), backend="reference"),
     InputError, "unbounded"),
]


@pytest.mark.parametrize("label,call,exc,text", CASES, ids=[c[0] for c in CASES])
def test_bad_input_named_error(hub, label, call, exc, text):
    with pytest.raises(exc, match=text.replace("(", r"\(").replace(")", r"\)")):
        call(hub)


def test_unknown_backend_lists_known(hub):
    from attnhub.errors import UnknownBackendError

    with pytest.raises(UnknownBackendError) as info:
        hub.attention(*_qkv(), backend="flash9000")
    assert "torch_sdpa" in str(info.value) and "attnhub backends" in str(info.value)
