"""A FlashInfer wrapper holds one plan: a thread that plans another batch on the same slot
between a call's plan and run made that call read the other batch's pages (review round 7;
FlashInfer here is the recording fake of conftest.py, whose wrappers keep their plan as the
real ones do)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from attnhub.plugin import AttentionSpec, AttnParams, MaskSpec


def test_a_call_runs_the_plan_it_made_while_another_thread_plans(fake_flashinfer,
                                                                   monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    from attnhub_sm80_fa2.flashinfer_paged import FlashInferDecodeBackend

    backend = FlashInferDecodeBackend()
    backend.workspace_bytes = 64
    backend.load()
    wrapper = sys.modules["flashinfer"].BatchDecodeWithPagedKVCacheWrapper
    other_planned, run = threading.Event(), wrapper.run

    def slow_run(self, q, kv, return_lse=False):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "A":
            other_planned.wait(1.0)  # B plans meanwhile, unless the run holds the plan's lock
        return run(self, q, kv, return_lse)

    monkeypatch.setattr(wrapper, "run", slow_run)
    page, h, d = 4, 1, 16
    kc = torch.zeros(8, page, h, d, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    vc[0:2], vc[4:6] = 1.0, 7.0  # sequence A's pages hold 1, B's 7
    spec = AttentionSpec(phase="decode", dtype="fp16", num_q_heads=h, num_kv_heads=h,
                         head_dim=d, layout="paged", page_size=page, max_seqlen_q=1,
                         max_seqlen_k=8, batch=1, mask=MaskSpec())
    out: dict[str, torch.Tensor] = {}

    def call(table: list[int], n: int, key: str) -> None:
        p = AttnParams(scale=0.25, block_table=torch.tensor([table], dtype=torch.int32),
                       seqlens_k=torch.tensor([n], dtype=torch.int32), max_seqlen_k=n)
        q = torch.randn(1, 1, h, d, dtype=torch.float16)
        out[key] = backend.forward(q, kc, vc, spec, p)[0]

    a = threading.Thread(target=call, args=([0, 1], 7, "A"), name="A")
    a.start()
    time.sleep(0.2)
    call([4, 5], 6, "B")
    other_planned.set()
    a.join(10)
    assert float(out["A"].float().max()) == float(out["A"].float().min()) == 1.0
    assert float(out["B"].float().max()) == float(out["B"].float().min()) == 7.0
