"""Recording fakes of flash_attn and FlashInfer, injected into sys.modules.

Each fake records how it was called and computes what the real library would (bottom-right
masks, FA's +inf LSE marker, FlashInfer's base-2 LSE and CSR page tables), independently of
the plugin's own translation, so tests check both the arguments and the numbers.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch

from attnhub.plugin import AttentionSpec, AttnParams, MaskSpec, paged_to_varlen
from attnhub.plugin import reference_attention
from attnhub.testing import flash_reference


class Recorder:
    """Calls made to a fake library: (function name, keyword arguments)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    def last(self, name: str) -> dict[str, Any]:
        return [kw for n, kw in self.calls if n == name][-1]


def _docs(cu: torch.Tensor) -> list[tuple[int, int]]:
    c = cu.tolist()
    return list(zip(c[:-1], c[1:]))


def make_flash_attn(rec: Recorder) -> types.ModuleType:
    """``flash_attn.flash_attn_interface`` with the three entry points."""
    mod = types.ModuleType("flash_attn.flash_attn_interface")

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                        deterministic=False, return_attn_probs=False):
        rec.calls.append(("flash_attn_func", dict(
            sk=k.shape[1], softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
            return_attn_probs=return_attn_probs, dropout_p=dropout_p)))
        out, lse = flash_reference(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                   window_size=window_size, softcap=softcap,
                                   alibi_slopes=alibi_slopes, dropout_p=dropout_p)
        return (out, lse, None) if return_attn_probs else out

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               return_attn_probs=False, **kw):
        rec.calls.append(("flash_attn_varlen_func", dict(kw, cu_seqlens_q=cu_seqlens_q,
                                                         max_seqlen_q=max_seqlen_q)))
        outs, lses = [], []
        for (qs, qe), (ks, ke) in zip(_docs(cu_seqlens_q), _docs(cu_seqlens_k)):
            o, lse = flash_reference(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], **kw)
            outs.append(o[0])
            lses.append(lse[0])
        out, lse = torch.cat(outs), torch.cat(lses, dim=-1)
        return (out, lse, None) if return_attn_probs else out

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                                return_softmax_lse=False, **kw):
        rec.calls.append(("flash_attn_with_kvcache", dict(kw, block_table=block_table,
                                                          cache_seqlens=cache_seqlens)))
        page = k_cache.shape[1]
        outs, lses = [], []
        for i, n in enumerate(cache_seqlens.tolist()):
            pages = block_table[i, : (n + page - 1) // page].long()
            kk = k_cache[pages].flatten(0, 1)[:n][None]
            vv = v_cache[pages].flatten(0, 1)[:n][None]
            o, lse = flash_reference(q[i:i + 1], kk, vv, **kw)
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs), torch.cat(lses)
        return (out, lse) if return_softmax_lse else out

    for f in (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache):
        setattr(mod, f.__name__, f)
    return mod


def _paged_keys(cache: torch.Tensor, layout: str, pages: list[int], n: int) -> torch.Tensor:
    """(1, n, H, D) keys of one sequence from a FlashInfer cache in ``layout``."""
    c = cache[pages]
    c = c.transpose(1, 2) if layout == "HND" else c
    return c.flatten(0, 1)[:n][None]


class _FakeWrapper:
    def __init__(self, rec: Recorder, kind: str, workspace: torch.Tensor, kv_layout: str = "NHD",
                 use_tensor_cores: bool = False) -> None:
        self.rec, self.kind, self.layout = rec, kind, kv_layout
        rec.calls.append((f"{kind}.__init__", dict(kv_layout=kv_layout,
                                                   use_tensor_cores=use_tensor_cores)))

    def _plan(self, qo_indptr, indptr, indices, last_page_len, hq, hkv, d, page, causal, kw):
        self.qo = qo_indptr.tolist()
        self.indptr, self.indices = indptr.tolist(), indices.tolist()
        self.last, self.page = last_page_len.tolist(), page
        self.causal = causal
        self.kw = kw
        self.rec.calls.append((f"{self.kind}.plan", dict(
            kw, qo_indptr=qo_indptr, indptr=indptr, indices=indices,
            last_page_len=last_page_len, heads=(hq, hkv), head_dim=d, page_size=page,
            causal=causal)))

    def run(self, q, paged_kv_cache, return_lse=False):
        self.rec.calls.append((f"{self.kind}.run", dict(q_shape=tuple(q.shape),
                                                        q_head_stride=q.stride(-1))))
        kc, vc = paged_kv_cache
        outs, lses = [], []
        for b in range(len(self.last)):
            pages = self.indices[self.indptr[b]:self.indptr[b + 1]]
            n = (len(pages) - 1) * self.page + self.last[b] if pages else 0
            kk, vv = (_paged_keys(c, self.layout, pages, n) for c in (kc, vc))
            qs, qe = self.qo[b], self.qo[b + 1]
            o, lse = flash_reference(q[None, qs:qe], kk, vv, softmax_scale=self.kw["sm_scale"],
                                     causal=self.causal,
                                     window_size=(self.kw.get("window_left", -1), -1),
                                     softcap=self.kw.get("logits_soft_cap") or 0.0)
            outs.append(o[0])
            lses.append(lse[0].transpose(0, 1) / math.log(2.0))  # (Sq, H), base 2
        out, lse = torch.cat(outs), torch.cat(lses)
        return (out, lse) if return_lse else out


def make_flashinfer(rec: Recorder) -> types.ModuleType:
    mod = types.ModuleType("flashinfer")

    class BatchDecodeWithPagedKVCacheWrapper(_FakeWrapper):
        def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False):
            super().__init__(rec, "decode", workspace, kv_layout, use_tensor_cores)

        def plan(self, indptr, indices, last_page_len, hq, hkv, d, page, **kw):
            qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
            self._plan(qo, indptr, indices, last_page_len, hq, hkv, d, page, False, kw)

    class BatchPrefillWithPagedKVCacheWrapper(_FakeWrapper):
        def __init__(self, workspace, kv_layout="NHD"):
            super().__init__(rec, "prefill", workspace, kv_layout)

        def plan(self, qo_indptr, indptr, indices, last_page_len, hq, hkv, d, page,
                 causal=False, **kw):
            self._plan(qo_indptr, indptr, indices, last_page_len, hq, hkv, d, page, causal, kw)

    mod.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    mod.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    return mod


@pytest.fixture
def fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    iface = make_flash_attn(rec)
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []  # type: ignore[attr-defined]
    pkg.flash_attn_interface = iface  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    return rec


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setitem(sys.modules, "flashinfer", make_flashinfer(rec))
    return rec


def make_spec(q: torch.Tensor, k: torch.Tensor, layout: str = "bshd", *, phase: str = "prefill",
              causal: bool = False, alignment: str = "bottom_right",
              window: tuple[int, int] | None = None, softcap: bool = False,
              alibi: bool = False, return_lse: bool = False) -> AttentionSpec:
    """The spec the hub would build for these tensors (unbucketed is fine for forward)."""
    return AttentionSpec(
        phase=phase, dtype="bf16" if q.dtype == torch.bfloat16 else "fp16",  # type: ignore
        head_dim=q.shape[-1], num_q_heads=q.shape[-2], num_kv_heads=k.shape[-2],
        layout=layout,  # type: ignore[arg-type]
        mask=MaskSpec(causal=causal, alignment=alignment, window=window,  # type: ignore
                      softcap=softcap, alibi=alibi, document=layout == "thd"),
        return_lse=return_lse, page_size=k.shape[1] if layout == "paged" else 0)


def random_paged(b: int, lens: list[int], page: int, hkv: int, d: int, extra_pages: int = 3,
                 dtype: torch.dtype = torch.float32, seed: int = 0):
    """A paged cache with pages scattered at random, its block table and lengths."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + page - 1) // page for n in lens]
    total = sum(need) + extra_pages
    kc = torch.randn(total, page, hkv, d, generator=g).to(dtype)
    vc = torch.randn(total, page, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(total, generator=g)
    width = max(need + [1])
    table = torch.zeros(b, width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at:at + n].to(torch.int32)
        at += n
    return kc, vc, table, torch.tensor(lens, dtype=torch.int32)


def small_backend(backend_cls: Any) -> Any:
    """A FlashInfer backend loaded with a tiny workspace (the fakes allocate nothing)."""
    b = backend_cls()
    b.workspace_bytes = 64
    b.load()
    return b


def paged_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor,
                    lens: torch.Tensor, params: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference output and LSE (B, Hq, Sq) of a paged call, through the thd layout."""
    qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, kc, vc, table, lens)
    p = AttnParams(scale=params.scale, causal=params.causal, window=params.window,
                   softcap=params.softcap, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = reference_attention(qv, kv, vv, p, layout="thd", compute_dtype=torch.float32)
    b, sq, hq, _ = q.shape
    return out.view(b, sq, hq, -1), lse.view(hq, b, sq).transpose(0, 1)


@pytest.fixture
def helpers() -> types.SimpleNamespace:
    """``helpers.spec(q, k, ...)``, ``helpers.paged(b, lens, page, hkv, d)``,
    ``helpers.small(backend_cls)`` and ``helpers.paged_reference(q, kc, vc, table, lens, p)``."""
    return types.SimpleNamespace(spec=make_spec, paged=random_paged, small=small_backend,
                                 paged_reference=paged_reference)
