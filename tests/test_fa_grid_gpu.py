"""FlashAttention's own test grid on the GPU, through the public API: the policy's choice and
every exact backend forced, each by the FlashAttention rule against the fp64 reference.

Why: the plugins' GPU tests use head dims 64 and 128 and a few shapes; FlashAttention's grid
(tests/test_flash_attn.py) goes through head dims 32-256 with odd ones (59, 111), odd
lengths on both sides (113 x 203, 1023 x 1024), MHA/GQA/MQA, causal, local windows, softcap
and ALiBi, and its kvcache test through paged caches of page 256 with scattered pages. A
backend that takes a case must answer it right (forward, LSE, gradients where it declares a
backward); one that declines says why and is not counted. Each test reports every failure of
its case at once, so one GPU run shows all of them.

The grid is sampled (seeded): ``ATTNHUB_FA_GRID_CASES`` dense cases (default 72: every head
dim under every mask) and ``ATTNHUB_FA_GRID_PAGED`` paged ones (default 24).
"""

from __future__ import annotations

import math
import os
import random
from typing import Any

import pytest
import torch

import attnhub
from attnhub.core.spec import AttnParams
from attnhub.errors import BackendUnavailableError, NoBackendError
from attnhub.testing import fa_references, fa_rule_error, gpu_marks

pytestmark = gpu_marks()

HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
SEQLENS = ((113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
           (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048), (1, 239), (3, 799))
MASKS = ("none", "causal", "causal_tl", "local", "softcap", "alibi")
HEADS = ((6, 6), (6, 2), (6, 1))
DTYPES = (torch.float16, torch.bfloat16)
N_DENSE = int(os.environ.get("ATTNHUB_FA_GRID_CASES", "72"))
N_PAGED = int(os.environ.get("ATTNHUB_FA_GRID_PAGED", "24"))
DEV = "cuda"


def _dense_cases(n: int) -> list[tuple[Any, ...]]:
    """(d, (sq, sk), mask, heads, dtype, grads, seed): head dim and mask cycle so that the first
    72 cover every pair; the rest of each case is drawn."""
    rng = random.Random(2016)
    out = []
    for i in range(n):
        d = HEAD_DIMS[i % len(HEAD_DIMS)]
        mask = MASKS[(i // len(HEAD_DIMS) + i) % len(MASKS)]
        out.append((d, rng.choice(SEQLENS), mask, rng.choice(HEADS), rng.choice(DTYPES),
                    rng.random() < 0.5, rng.randrange(1 << 30)))
    return out


def _case_id(c: tuple[Any, ...]) -> str:
    d, (sq, sk), mask, (hq, hkv), dtype, grads, _ = c
    return f"d{d}-{sq}x{sk}-{mask}-{hq}:{hkv}-{str(dtype)[6:]}{'-grad' if grads else ''}"


def _mask_kwargs(mask: str, b: int, hq: int, sk: int, g: torch.Generator,
                 dev: str) -> dict[str, Any]:
    if mask == "causal":
        return {"causal": True}
    if mask == "causal_tl":
        return {"causal": True, "causal_alignment": "top_left"}
    if mask == "local":  # FA: window_size = torch.randint(0, seqlen_k, (2,))
        left, right = torch.randint(0, sk, (2,), generator=g).tolist()
        return {"window": (left, right)}
    if mask == "softcap":
        return {"causal": True, "softcap": 50.0}
    if mask == "alibi":  # FA: torch.rand(batch, nheads) * 0.3
        return {"causal": True, "alibi_slopes": (torch.rand(b, hq, generator=g) * 0.3).to(dev)}
    return {}


def _params(kw: dict[str, Any], d: int) -> AttnParams:
    p = dict(kw)
    if "causal_alignment" in p:
        p["alignment"] = p.pop("causal_alignment")
    return AttnParams(scale=d ** -0.5, **p)


def _exact_backends(hub: attnhub.Hub) -> list[str]:
    """Every exact backend but ``ring`` (it needs a process group and a local backend from
    a policy rule; plugins/ring's tests run it)."""
    return sorted(n for n in hub.registry.names()
                  if hub.registry.get(n).capabilities.exact and n != "ring")


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub()


class _Failures(list):
    """What went wrong in one case, every backend's, reported together."""

    def check(self, who: str, what: str, got: torch.Tensor, ref64: torch.Tensor,
              same: torch.Tensor, mult: float) -> None:
        if got.shape != ref64.shape:
            self.append(f"{who}: {what} shape {tuple(got.shape)}, want {tuple(ref64.shape)}")
        elif bool(torch.isnan(got).any()):
            self.append(f"{who}: {what} has NaN")
        else:
            err, allowed = fa_rule_error(got, ref64, same, mult)
            if err > allowed:
                self.append(f"{who}: {what} error {err:.3e} > allowed {allowed:.3e}")

    def check_lse(self, who: str, lse: torch.Tensor, ref_lse: torch.Tensor) -> None:
        lse, ref_lse = lse.detach(), ref_lse.detach()
        inf = torch.isinf(ref_lse)
        if lse.shape != ref_lse.shape:
            self.append(f"{who}: lse shape {tuple(lse.shape)}, want {tuple(ref_lse.shape)}")
        elif not torch.equal(torch.isinf(lse), inf):
            self.append(f"{who}: lse -inf pattern differs")
        else:
            diff = (lse.float() - ref_lse.float())[~inf].abs()
            if diff.numel() and float(diff.max()) > 2e-2:
                self.append(f"{who}: lse error {float(diff.max()):.3e}")


def _call(fail: _Failures, hub: attnhub.Hub, who: str, q, k, v, **kw: Any) -> Any:
    """The hub's answer, or None when the backend declines (or, for the policy, nothing
    serves); any other exception is a failure."""
    try:
        return hub.attention(q, k, v, **kw)
    except (BackendUnavailableError, NoBackendError):
        return None
    except Exception as exc:  # noqa: BLE001 - every failure of the case, reported together
        fail.append(f"{who}: {type(exc).__name__}: {str(exc)[:300]}")
        return None


@pytest.mark.parametrize("case", _dense_cases(N_DENSE), ids=_case_id)
def test_dense_case(hub, case):
    d, (sq, sk), mask, (hq, hkv), dtype, grads, seed = case
    b = 2
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(DEV, dtype).requires_grad_(grads)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    kw = _mask_kwargs(mask, b, hq, sk, g, DEV)
    ref64, ref_lse, same = fa_references(q, k, v, _params({**kw, "return_lse": True}, d))
    dout = torch.randn(ref64.shape, generator=g).to(DEV, dtype)
    refs = {}
    if grads:
        refs = {"64": torch.autograd.grad(ref64, (q, k, v), dout.double(), retain_graph=True),
                "same": torch.autograd.grad(same, (q, k, v), dout, retain_graph=True)}
    fail, served = _Failures(), []
    for name in (None, *_exact_backends(hub)):
        who = name or "policy"
        out = _call(fail, hub, who, q, k, v, backend=name, **kw)
        if out is None:
            continue
        served.append(who)
        fail.check(who, "output", out.detach(), ref64, same, 2.0)
        if grads and out.requires_grad:
            got = torch.autograd.grad(out, (q, k, v), dout)
            for x, gx, r64, rs in zip("qkv", got, refs["64"], refs["same"]):
                fail.check(who, f"d{x}", gx, r64, rs, 3.0)
        if name is not None and hub.registry.get(name).capabilities.returns_lse:
            res = _call(fail, hub, who, q.detach(), k.detach(), v.detach(), backend=name,
                        return_lse=True, **kw)
            if res is not None:
                fail.check(who, "output (with lse)", res[0], ref64, same, 2.0)
                fail.check_lse(who, res[1], ref_lse)
    assert "policy" in served or fail, "the policy served nothing and said nothing"
    assert not fail, f"served by {served}:\n" + "\n".join(fail)


def _paged_cases(n: int) -> list[tuple[Any, ...]]:
    """(d, page, sq, heads, dtype, causal, seed): FlashAttention's kvcache grid (page 256,
    queries 1..128 on a longer cache) and FlashInfer's decode pages (1, 16)."""
    rng = random.Random(256)
    return [(rng.choice((64, 128, 256, 80)), rng.choice((1, 16, 256)),
             rng.choice((1, 1, 3, 128)), rng.choice(HEADS), rng.choice(DTYPES),
             rng.random() < 0.5, rng.randrange(1 << 30)) for _ in range(n)]


def _paged_id(c: tuple[Any, ...]) -> str:
    d, page, sq, (hq, hkv), dtype, causal, _ = c
    return f"d{d}-page{page}-q{sq}-{hq}:{hkv}-{str(dtype)[6:]}{'-causal' if causal else ''}"


@pytest.mark.parametrize("case", _paged_cases(N_PAGED), ids=_paged_id)
def test_paged_case(hub, case):
    """Scattered pages, garbage past each length, lengths 0..2048 (one empty sequence): per
    sequence against the reference over its gathered KV, FA's 3x for kvcache."""
    d, page, sq, (hq, hkv), dtype, causal, seed = case
    g = torch.Generator().manual_seed(seed)
    b = 4
    lens = [0] + [int(x) for x in torch.randint(sq, 2049, (b - 1,), generator=g)]
    used = [-(-n // page) for n in lens]
    npages, width = sum(used) + 3, max(used) + 2
    kc, vc = (torch.randn(npages, page, hkv, d, generator=g).to(DEV, dtype) for _ in "kv")
    perm = torch.randperm(npages, generator=g).tolist()
    table = torch.full((b, width), 10**6, dtype=torch.int32)  # garbage past each length
    for i, n in enumerate(used):
        table[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(b, sq, hq, d, generator=g).to(DEV, dtype)
    table, seqlens = table.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)
    fail, served = _Failures(), []
    for name in (None, *_exact_backends(hub)):
        who = name or "policy"
        res = _call(fail, hub, who, q, kc, vc, backend=name, layout="paged",
                    block_table=table, seqlens_k=seqlens, causal=causal, return_lse=True)
        if res is None:
            continue
        served.append(who)
        out, lse = res
        for i, n in enumerate(lens):
            ids = table[i, : used[i]].long()
            k, v = (c[ids].flatten(0, 1)[None, :n] for c in (kc, vc))
            p = AttnParams(scale=1 / math.sqrt(d), causal=causal, return_lse=True)
            ref64, ref_lse, same = fa_references(q[i:i + 1], k, v, p)
            fail.check(f"{who} seq {i} (len {n})", "output", out[i:i + 1], ref64, same, 3.0)
            fail.check_lse(f"{who} seq {i}", lse[i:i + 1], ref_lse)
    assert "policy" in served or fail, "the policy served nothing and said nothing"
    assert not fail, f"served by {served}:\n" + "\n".join(fail)
