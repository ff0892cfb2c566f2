"""Cases every rank runs in the distributed tests: the ring on this rank's zigzag shard
against the single-process fp64 and same-precision references, by the FlashAttention rule
(2x forward, 3x gradients), LSE included. Loaded by file path in each gloo process."""

from __future__ import annotations

import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from attnhub_ring import ZigzagLayout, ring_attention

import attnhub
from attnhub.plugin import AttnParams, reference_attention
from attnhub.testing import assert_fa_rule, assert_lse

B, HQ, HKV, D = 2, 4, 2, 16


@dataclass(frozen=True)
class Case:
    """One comparison; lengths are functions of the world size W."""

    lengths: Callable[[int], list[int]]  # bshd: [S]; thd: the documents' lengths
    causal: bool
    dtype: torch.dtype = torch.bfloat16
    thd: bool = False
    local: str = "torch_flash_cpu"
    softcap: float | None = None
    scale: float | None = None
    lse_grad: bool = False  # the loss also uses the returned LSE
    via_hub: bool = False   # through attnhub.Hub with a stand-in resolver: ring + local
    via_policy: bool = False  # through attnhub.Hub with a YAML policy and a BindContext


CASES: dict[str, Case] = {
    "causal_even": Case(lambda w: [4 * w], causal=True),
    "causal_uneven_fp32": Case(lambda w: [4 * w + 3], causal=True, dtype=torch.float32,
                               local="reference"),
    "full_uneven_lse_grad": Case(lambda w: [6 * w + 1], causal=False, lse_grad=True),
    # S = W+1: chunk 2W-1 (and more) is empty, so a rank's whole shard is masked for a block
    "causal_masked_shard": Case(lambda w: [w + 1], causal=True),
    # S = W-1: the last rank holds no token at all
    "causal_empty_shard": Case(lambda w: [w - 1], causal=True, dtype=torch.float32),
    "softcap_causal": Case(lambda w: [4 * w + 1], causal=True, dtype=torch.float32,
                           local="reference", softcap=2.0, scale=1.0),
    # documents cut across shard boundaries, some shorter than 2W (empty chunks)
    "varlen_causal": Case(lambda w: [5, 2 * w + 3, 1, 3 * w], causal=True, thd=True),
    "varlen_full_fp32": Case(lambda w: [2 * w + 1, 3, 4 * w - 1], causal=False, thd=True,
                             dtype=torch.float32, lse_grad=True),
    "hub_causal": Case(lambda w: [4 * w + 2], causal=True, via_hub=True),
    "hub_varlen": Case(lambda w: [3 * w, w + 1], causal=True, thd=True, via_hub=True),
    "policy_yaml": Case(lambda w: [5 * w + 1], causal=True, via_policy=True),
}

#: A policy as a deployment would write it: ring for a context-parallel group, the local
#: kernel from the rest of the policy (resolved at world size 1).
POLICY = """\
name: ring-test
version: 1
description: ring across the group, a kernel that returns its LSE inside
targets: [cpu]
rules:
  - name: ring-context-parallel
    when: {world_size: {ge: 2}, phase: [train, prefill]}
    use: [ring]
  - name: cpu
    when: {hardware: cpu}
    use: [torch_sdpa, torch_flash_cpu]
"""


def check_cases(rank: int, world: int, names: list[str]) -> dict[str, str | None]:
    """Per case: None when it passes on this rank, else the assertion message."""
    results: dict[str, str | None] = {}
    for name in names:
        try:
            _check(name, CASES[name], rank, world)
            results[name] = None
        except AssertionError as exc:
            results[name] = f"rank {rank}/{world}: {exc}"
    return results


def _reference(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dout: torch.Tensor, dlse: torch.Tensor, params: AttnParams,
               compute: torch.dtype) -> dict[str, torch.Tensor]:
    leaves = [x.detach().to(compute).requires_grad_() for x in (q, k, v)]
    out, lse = reference_attention(*leaves, params, layout="thd" if case.thd else "bshd",
                                   compute_dtype=compute)
    loss = (out * dout.to(out.dtype)).sum()
    if case.lse_grad:
        loss = loss + (lse * dlse).sum()
    loss.backward()
    return {"out": out.detach(), "lse": lse.detach(),
            **{n: x.grad for n, x in zip(("dq", "dk", "dv"), leaves)}}


def _check(name: str, case: Case, rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    lens = case.lengths(world)
    total = sum(lens)
    shape = (lambda h, d: (total, h, d)) if case.thd else (lambda h, d: (B, total, h, d))

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen).to(case.dtype)

    q, k, v, dout = rand(*shape(HQ, D)), rand(*shape(HKV, D)), rand(*shape(HKV, D)), \
        rand(*shape(HQ, D))
    dlse = torch.randn(*((HQ, total) if case.thd else (B, HQ, total)), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = case.scale if case.scale is not None else D ** -0.5
    params = AttnParams(scale=scale, causal=case.causal, softcap=case.softcap,
                        cu_seqlens_q=cu if case.thd else None,
                        cu_seqlens_k=cu if case.thd else None)
    ref64 = _reference(case, q, k, v, dout, dlse, params, torch.float64)
    ref_same = _reference(case, q, k, v, dout, dlse, params, case.dtype)

    layout = ZigzagLayout(world, tuple(lens))
    idx = layout.global_indices(rank)
    seq = 0 if case.thd else 1

    def shard(x: torch.Tensor, dim: int = seq) -> torch.Tensor:
        return x.index_select(dim, idx)

    lse_dim = 1 if case.thd else 2
    ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
    cu_local = torch.tensor([0, *torch.tensor(layout.local_lens(rank)).cumsum(0).tolist()],
                            dtype=torch.int32)
    if case.via_hub or case.via_policy:
        out, lse = _via_hub(case, ql, kl, vl, cu_local, scale, world)
    else:
        out, lse = ring_attention(ql, kl, vl, local_backend=case.local, causal=case.causal,
                                  scale=scale, softcap=case.softcap,
                                  cu_seqlens=cu_local if case.thd else None, return_lse=True)
    loss = (out * shard(dout)).sum()
    if case.lse_grad:
        loss = loss + (lse * shard(dlse, lse_dim)).sum()
    loss.backward()

    where = f"{name} rank {rank}/{world}"
    assert_fa_rule(out, shard(ref64["out"]), shard(ref_same["out"]), mult=2,
                   what=f"{where} out")
    assert_lse(lse, shard(ref64["lse"], lse_dim))
    for grad, n in ((ql.grad, "dq"), (kl.grad, "dk"), (vl.grad, "dv")):
        assert grad is not None and not torch.isnan(grad).any(), f"{where} {n}: NaN or None"
        assert_fa_rule(grad, shard(ref64[n]), shard(ref_same[n]), mult=3, what=f"{where} {n}")


class _BindRingResolver:
    """A policy stand-in: binds ``ring`` with ``local`` inside, after checking that ring's
    capability check passes in this (real, >= 2 rank) process group."""

    name = "test-ring"

    def __init__(self, local: str):
        self.local = local

    def resolve(self, spec, device, registry, ctx):  # type: ignore[no-untyped-def]
        reasons = registry.get("ring").check(spec, device)
        assert not reasons, f"ring rejected a valid spec: {reasons}"
        inner = attnhub.Decision(spec=spec, device=device.describe(), backend=self.local,
                                 rule="local")
        return attnhub.Decision(spec=spec, device=device.describe(), backend="ring",
                                rule="ring", on_failure="error", inner=inner)


def _via_hub(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             cu_local: torch.Tensor, scale: float,
             world: int) -> tuple[torch.Tensor, torch.Tensor]:
    kw: dict = ({"layout": "thd", "cu_seqlens_q": cu_local, "cu_seqlens_k": cu_local}
                if case.thd else {})
    if case.via_policy:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "ring.yaml"
            path.write_text(POLICY)
            hub = attnhub.Hub(path)
            kw["context"] = attnhub.BindContext(world_size=world)
            out, lse = hub.attention(q, k, v, causal=case.causal, scale=scale,
                                     return_lse=True, **kw)
    else:
        hub = attnhub.Hub(_BindRingResolver(case.local))
        out, lse = hub.attention(q, k, v, causal=case.causal, scale=scale, return_lse=True,
                                 **kw)
    (runner,) = hub.bound()
    text = runner.decision.explain()
    assert "local kernel inside ring" in text and case.local in text, text
    if case.via_policy:  # SDPA's LSE is a second pass: refused inside ring, with the reason
        assert runner.decision.inner is not None and runner.decision.inner.backend == case.local
        assert "second pass" in text, text
    return out, lse
