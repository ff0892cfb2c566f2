"""Block tables to FlashInfer CSR arrays, and the measured tensor-core decode choice."""

from __future__ import annotations

import pytest
import torch
from attnhub_sm80_fa2 import decode_choice
from attnhub_sm80_fa2.paged_csr import block_table_to_csr, kv_layout_of
from hypothesis import given, settings
from hypothesis import strategies as st

from attnhub.plugin import paged_to_varlen


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=5), page=st.sampled_from([1, 3, 8]),
       seed=st.integers(0, 2**16))
def test_csr_selects_the_same_tokens_as_the_block_table(lens, page, seed):
    g = torch.Generator().manual_seed(seed)
    need = [(n + page - 1) // page for n in lens]
    total = sum(need) + 2
    cache = torch.randn(total, page, 1, 2, generator=g)
    perm = torch.randperm(total, generator=g).to(torch.int32)
    table = torch.full((len(lens), max(need + [1]) + 1), -7, dtype=torch.int32)  # junk tail
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at:at + n]
        at += n
    seqlens = torch.tensor(lens, dtype=torch.int32)
    csr = block_table_to_csr(table, seqlens, page)
    assert csr.indptr.dtype == csr.indices.dtype == csr.last_page_len.dtype == torch.int32
    assert csr.indptr.tolist()[-1] == csr.indices.numel() == sum(need)
    ind, ptr, last = csr.indices.tolist(), csr.indptr.tolist(), csr.last_page_len.tolist()
    got = []
    for i, n in enumerate(lens):
        pages = ind[ptr[i]:ptr[i + 1]]
        assert (1 <= last[i] <= page) if n else last[i] == 0
        got.append(cache[pages].flatten(0, 1)[: (len(pages) - 1) * page + last[i]] if pages
                   else cache[:0].flatten(0, 1))
    want = paged_to_varlen(torch.zeros(len(lens), 1, 1, 2), cache, cache, table, seqlens)[1]
    assert torch.equal(torch.cat(got), want)
    assert (csr.empty is None) == (0 not in lens)


def test_kv_layout_detection_and_native_view():
    nhd = torch.randn(4, 16, 2, 8)
    hnd_storage = torch.randn(4, 2, 16, 8)
    assert kv_layout_of(nhd) == "NHD"
    view = hnd_storage.transpose(1, 2)
    assert kv_layout_of(view) == "HND" and view.transpose(1, 2).is_contiguous()


ROWS = decode_choice.parse_measurements({"source": "bench", "rows": [
    {"gqa": 4, "batch": 1, "seqlen_k": 32768, "tensor_cores_us": 445, "cuda_cores_us": 60},
    {"gqa": 8, "batch": 64, "seqlen_k": 4096, "tensor_cores_us": 50, "cuda_cores_us": 80},
]})


@pytest.mark.parametrize("gqa,batch,seqlen,want", [
    (4, 1, 32768, False), (4, 2, 16384, False), (8, 64, 4096, True), (8, 32, 8192, True)])
def test_choice_takes_the_nearest_measurement(gqa, batch, seqlen, want, monkeypatch):
    monkeypatch.delenv(decode_choice.ENV_FORCE, raising=False)
    use, why = decode_choice.choose_tensor_cores(gqa, batch, seqlen, ROWS)
    assert use is want and "bench" in why


def test_choice_forced_or_unmeasured(monkeypatch):
    monkeypatch.setenv(decode_choice.ENV_FORCE, "1")
    assert decode_choice.choose_tensor_cores(4, 1, 32768, ROWS)[0] is True
    monkeypatch.delenv(decode_choice.ENV_FORCE)
    empty = decode_choice.Measurements("none", ())
    assert decode_choice.choose_tensor_cores(8, 64, 4096, empty)[0] is False
    packaged = decode_choice.packaged_measurements()
    assert packaged.rows and all(r.cuda_cores_us > 0 for r in packaged.rows)
