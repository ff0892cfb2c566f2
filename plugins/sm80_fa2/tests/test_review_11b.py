"""Review 11b: FlashInfer's rows without keys (review 11) cost decode one more host read per
plan: ``rows_without_keys`` read ``empty.any()`` back although a decode row (one query) or a
non-causal row sees no key only in an empty sequence, which the CSR conversion had already
found. A plan is made once per decode step (the lengths change), before the layers reuse it;
it now reads no more than the CSR conversion does. Prefill (causal, Sq > 1) keeps its one
read per plan."""

from __future__ import annotations

import pytest
import torch
from attnhub_sm80_fa2 import flashinfer_paged
from attnhub_sm80_fa2.flashinfer_paged import FlashInferDecodeBackend, rows_without_keys
from torch.overrides import TorchFunctionMode

from attnhub.plugin import AttnParams

_READS = {"__bool__", "item", "__int__", "__float__", "__index__", "tolist"}


class _HostReads(TorchFunctionMode):
    """Counts reads of tensor values back to the host (a sync on an accelerator)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in _READS:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("lens", [[20, 9], [20, 0]])
@pytest.mark.parametrize("causal", [False, True])
def test_a_decode_plan_reads_nothing_for_its_empty_rows(fake_flashinfer, helpers, monkeypatch,
                                                       lens, causal):
    """(The CSR conversion and FlashInfer's own plan read the tables anyway.)"""
    kc, vc, table, seqlens = helpers.paged(2, lens, 8, 2, 16)
    q = torch.randn(2, 1, 4, 16)
    p = AttnParams(scale=0.3, causal=causal, block_table=table, seqlens_k=seqlens,
                   max_seqlen_k=20)
    backend = FlashInferDecodeBackend()
    backend.workspace_bytes = 64
    backend.load()
    reads = _HostReads()

    def counted(*a, **kw):  # type: ignore[no-untyped-def]
        with reads:
            return rows_without_keys(*a, **kw)

    monkeypatch.setattr(flashinfer_paged, "rows_without_keys", counted)
    plan = backend.plan(q, kc, p)
    assert reads.n == 0
    want = rows_without_keys(seqlens, 1, causal)  # computed in full
    if want is None:
        assert plan.empty_rows is None
    else:
        assert torch.equal(plan.empty_rows, want)
    out, _ = backend.forward(q, kc, vc, helpers.spec(q, kc, "paged", phase="decode"), p)
    if 0 in lens:
        assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq", [1, 4])
def test_the_csr_shortcut_agrees_with_the_full_pattern(causal, sq):
    lens = torch.tensor([0, 1, 3, 8], dtype=torch.int32)
    empty = lens == 0
    full = rows_without_keys(lens, sq, causal)
    short = rows_without_keys(lens, sq, causal, empty)
    assert torch.equal(short, full)
    nonempty = torch.tensor([2, 5], dtype=torch.int32)
    a, b = rows_without_keys(nonempty, sq, causal, None), rows_without_keys(nonempty, sq, causal)
    assert (a is None and b is None) or torch.equal(a, b)
