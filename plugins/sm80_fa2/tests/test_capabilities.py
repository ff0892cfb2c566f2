"""What sm80_fa2's backends declare, and the reasons check() gives on simulated devices."""

from __future__ import annotations

import pytest
from attnhub_sm80_fa2.fa2 import FlashAttn2Backend
from attnhub_sm80_fa2.fa2_torch import TorchFlashBackend, torch_flash_capabilities
from attnhub_sm80_fa2.flashinfer_paged import FlashInferDecodeBackend, FlashInferPrefillBackend

import attnhub
from attnhub.plugin import AttentionSpec, MaskSpec

SM80 = attnhub.simulate("sm80")


def spec(**kw) -> AttentionSpec:
    base = dict(phase="prefill", dtype="bf16", head_dim=128, num_q_heads=32, num_kv_heads=8,
                max_seqlen_q=1024, max_seqlen_k=1024)
    base.update(kw)
    return AttentionSpec(**base)


def paged(page: int, **kw) -> AttentionSpec:
    return spec(**{"layout": "paged", "phase": "decode", "max_seqlen_q": 1, "page_size": page,
                   **kw})


def test_declarations():
    fa2 = FlashAttn2Backend().capabilities  # upstream interface when flash_attn is absent
    assert {"causal", "sliding_window", "softcap", "alibi", "document"} <= fa2.masks
    assert {"thd", "paged"} <= fa2.layouts and fa2.page_size_multiple == 256
    assert fa2.backward and fa2.deterministic_backward and fa2.min_capability == (8, 0)
    tf = TorchFlashBackend().capabilities
    assert not {"softcap", "alibi"} & tf.masks and "paged" not in tf.layouts
    dec = FlashInferDecodeBackend().capabilities
    assert dec.phases == {"decode"} and dec.layouts == {"paged"} and not dec.backward
    assert dec.head_dims == {64, 128, 256} and dec.page_size_multiple == 1
    assert FlashInferPrefillBackend().capabilities.phases == {"prefill", "decode"}


@pytest.mark.parametrize("backend,device,s,needle", [
    (FlashAttn2Backend(), "sm75", spec(), "compute capability >= 8.0"),
    (FlashAttn2Backend(), "gfx942", spec(), "runs on cuda"),
    (FlashAttn2Backend(), "sm80", spec(dtype="fp32"), "dtype fp32 not supported"),
    (FlashAttn2Backend(), "sm80", spec(head_dim=100), "head dim 100 not supported"),
    (FlashAttn2Backend(), "sm80", spec(head_dim=320), "at most 256"),
    (FlashAttn2Backend(), "sm80", spec(mask=MaskSpec(causal=True, prefix_lm=True)),
     "mask prefix_lm not supported"),
    (FlashAttn2Backend(), "sm80", paged(16), "page size 16 not supported"),
    (FlashAttn2Backend(), "sm80", paged(256, needs_grad=True), "no backward"),
    (FlashAttn2Backend(), "sm80",
     spec(layout="thd", mask=MaskSpec(causal=True, alignment="top_left", document=True)),
     "top-left alignment is converted only for bshd"),
    (TorchFlashBackend(), "sm80", spec(mask=MaskSpec(softcap=True)), "mask softcap"),
    (TorchFlashBackend(), "sm80", paged(256), "layout paged not supported"),
    (TorchFlashBackend(), "sm80", spec(deterministic=True, needs_grad=True),
     "backward is not deterministic"),
    (FlashInferDecodeBackend(), "sm80", paged(16, head_dim=96), "head dim 96"),
    (FlashInferDecodeBackend(), "sm80", spec(layout="paged", max_seqlen_q=4, page_size=16),
     "phase prefill not supported"),
    (FlashInferDecodeBackend(), "sm80", paged(16, max_seqlen_q=4), "at most 1"),
    (FlashInferDecodeBackend(), "sm80", paged(16, mask=MaskSpec(alibi=True)), "mask alibi"),
    (FlashInferPrefillBackend(), "sm80",
     spec(layout="paged", page_size=16, mask=MaskSpec(window=(8, 4))), "left only"),
    (FlashInferPrefillBackend(), "sm80",
     spec(layout="paged", page_size=16, mask=MaskSpec(causal=True, alignment="top_left")),
     "top-left causal alignment not supported"),
])
def test_check_reasons(backend, device, s, needle):
    reasons = backend.check(s, attnhub.simulate(device))
    assert any(needle in r for r in reasons), reasons


@pytest.mark.parametrize("backend,s", [
    (FlashAttn2Backend(), spec(mask=MaskSpec(causal=True, window=(128, 0), softcap=True))),
    (FlashAttn2Backend(), paged(512)),
    (FlashAttn2Backend(), spec(phase="train", needs_grad=True, deterministic=True)),
    (TorchFlashBackend(), spec(layout="thd", mask=MaskSpec(causal=True, document=True))),
    (FlashInferDecodeBackend(), paged(16, mask=MaskSpec(causal=True, window=(64, 0)))),
    (FlashInferPrefillBackend(), spec(layout="paged", page_size=1,
                                      mask=MaskSpec(causal=True, softcap=True))),
])
def test_check_accepts(backend, s):
    assert backend.check(s, SM80) == []


def test_torch_flash_declares_windows_from_the_op_schema():
    assert "sliding_window" not in torch_flash_capabilities(frozenset({"query"})).masks
    assert "sliding_window" in torch_flash_capabilities(
        frozenset({"query", "window_size_left", "window_size_right"})).masks
