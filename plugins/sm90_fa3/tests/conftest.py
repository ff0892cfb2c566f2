"""A recording fake of FlashAttention-3 (``fa3_fwd_interface`` + its build config), injected
into sys.modules. It computes what FA3 returns (bottom-right masks, +inf LSE on empty rows,
FP8 inputs dequantized with per-(batch, KV head) descales, bf16 output), independently of
the plugin's translation."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import pytest
import torch

from attnhub.plugin import AttentionSpec, MaskSpec
from attnhub.testing import flash_reference

FA3_FWD_FLAGS = {  # the fa3-fwd 0.0.3 wheel's CONFIG['build_flags']
    "FLASHATTENTION_DISABLE_BACKWARD": True, "FLASHATTENTION_DISABLE_SPLIT": False,
    "FLASHATTENTION_DISABLE_PAGEDKV": True, "FLASHATTENTION_DISABLE_LOCAL": True,
    "FLASHATTENTION_DISABLE_SOFTCAP": False, "FLASHATTENTION_DISABLE_FP16": True,
    "FLASHATTENTION_DISABLE_FP8": False, "FLASHATTENTION_DISABLE_VARLEN": False,
    "FLASHATTENTION_DISABLE_HDIM256": False,
}


def module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


class Fa3Fake:
    """Records calls as (name, kwargs) and computes FA3's results."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def last(self, name: str) -> dict[str, Any]:
        return [kw for n, kw in self.calls if n == name][-1]

    @staticmethod
    def _dequant(x: torch.Tensor, descale: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.float8_e4m3fn:
            return x
        b, _, h, _ = x.shape
        d = descale.repeat_interleave(h // descale.shape[1], dim=1)
        return x.float() * d.view(b, 1, h, 1)

    def _attend(self, q, k, v, q_descale=None, k_descale=None, v_descale=None, **kw):
        fp8 = q.dtype == torch.float8_e4m3fn
        q, k, v = (self._dequant(x, d) for x, d in ((q, q_descale), (k, k_descale),
                                                      (v, v_descale)))
        out, lse = flash_reference(q, k, v, **kw)
        return (out.to(torch.bfloat16) if fp8 else out), lse

    # -- what FA3 computes, per entry point (shared by the interface fakes and the op) ---
    def _varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outs, lses = [], []
        for i in range(len(cq) - 1):
            o, lse = self._attend(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]],
                                  v[None, ck[i]:ck[i + 1]], **kw)
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, -1)

    def _paged(self, q, k_cache, v_cache, cache_seqlens, page_table, **kw):
        page, outs, lses = k_cache.shape[1], [], []
        for i, n in enumerate(cache_seqlens.tolist()):
            pages = page_table[i, : (n + page - 1) // page].long()
            kk = k_cache[pages].flatten(0, 1)[:n][None]
            vv = v_cache[pages].flatten(0, 1)[:n][None]
            o, lse = self._attend(q[i:i + 1], kk, vv, **kw)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)

    def module(self, op_arguments: frozenset[str] | None = None) -> types.ModuleType:
        """The interface module; with ``op_arguments``, also the registered forward op
        (``fa3_fwd_cuda.fwd.default``) whose schema has those argument names."""
        fake = self

        def flash_attn_func(q, k, v, return_attn_probs=False, **kw):
            fake.calls.append(("flash_attn_func", dict(kw, q=q, k=k, v=v)))
            out, lse = fake._attend(q, k, v, **kw)
            return (out, lse) if return_attn_probs else out

        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, return_attn_probs=False, **kw):
            fake.calls.append(("flash_attn_varlen_func", dict(kw, max_seqlen_k=max_seqlen_k)))
            out, lse = fake._varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)
            return (out, lse) if return_attn_probs else out

        def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, page_table=None,
                                    return_softmax_lse=False, **kw):
            fake.calls.append(("flash_attn_with_kvcache", dict(
                kw, page_table=page_table, cache_seqlens=cache_seqlens, q=q)))
            if page_table is None:
                out, lse = fake._attend(q, k_cache, v_cache, **kw)
            else:
                out, lse = fake._paged(q, k_cache, v_cache, cache_seqlens, page_table, **kw)
            return (out, lse, None, None) if return_softmax_lse else out

        attrs: dict[str, Any] = {}
        if op_arguments is not None:
            def fwd(q, k, v, *, softmax_scale=None, is_causal=False, window_size_left=-1,
                    window_size_right=-1, softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, seqused_k=None, page_table=None,
                    **kw):
                """FA3's ``fwd`` op: what the interface functions call, by the names of
                ``csrc/flash_api.cpp``'s schema (hopper/flash_attn_interface.py maps them)."""
                fake.calls.append(("op", dict(
                    kw, q=q, k=k, v=v, softmax_scale=softmax_scale, is_causal=is_causal,
                    window=(window_size_left, window_size_right), softcap=softcap,
                    cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, page_table=page_table)))
                same = dict(softmax_scale=softmax_scale, causal=is_causal, softcap=softcap,
                            window_size=(window_size_left, window_size_right),
                            **{n: kw[n] for n in ("q_descale", "k_descale", "v_descale")
                               if n in kw})
                if page_table is not None:
                    out, lse = fake._paged(q, k, v, seqused_k, page_table, **same)
                elif cu_seqlens_q is not None:
                    out, lse = fake._varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **same)
                else:
                    out, lse = fake._attend(q, k, v, **same)
                return out, lse, None, None

            schema = types.SimpleNamespace(arguments=[types.SimpleNamespace(name=n)
                                                      for n in sorted(op_arguments)])
            fwd._schema = schema  # type: ignore[attr-defined]
            attrs["fa3_fwd_cuda"] = types.SimpleNamespace(
                fwd=types.SimpleNamespace(default=fwd))
        return module("fa3_fwd_interface", flash_attn_func=flash_attn_func,
                      flash_attn_varlen_func=flash_attn_varlen_func,
                      flash_attn_with_kvcache=flash_attn_with_kvcache, **attrs)


def install_fa3(monkeypatch: pytest.MonkeyPatch, flags: dict[str, bool] | None,
                interface: str = "fa3_fwd_interface",
                op_arguments: frozenset[str] | None = None) -> Fa3Fake:
    """Put a fake FA3 (and, unless ``flags`` is None, its config module) in sys.modules;
    with ``op_arguments``, its interface exposes the forward op with that schema."""
    fake = Fa3Fake()
    mod = fake.module(op_arguments)
    mod.__name__ = interface
    for name in ("flash_attn_interface", "fa3_fwd_interface", "flash_attn_config",
                 "fa3_fwd_config"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, interface, mod)
    if flags is not None:
        config = "fa3_fwd_config" if interface == "fa3_fwd_interface" else "flash_attn_config"
        monkeypatch.setitem(sys.modules, config,
                            module(config, CONFIG={"build_flags": dict(flags)}))
    return fake


@pytest.fixture
def fa3_fwd(monkeypatch: pytest.MonkeyPatch) -> Fa3Fake:
    """The fa3-fwd wheel as shipped: forward only, no paged KV, no window, no fp16."""
    return install_fa3(monkeypatch, FA3_FWD_FLAGS)


@pytest.fixture
def fa3_full(monkeypatch: pytest.MonkeyPatch) -> Fa3Fake:
    """An upstream build with every feature compiled in."""
    return install_fa3(monkeypatch, {}, interface="flash_attn_interface")


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch):
    """``install(flags, interface=..., op_arguments=...)`` for tests that switch features
    off or give the interface its forward op."""
    return lambda flags, interface="fa3_fwd_interface", op_arguments=None: install_fa3(
        monkeypatch, flags, interface, op_arguments)


def make_spec(q: torch.Tensor, k: torch.Tensor, layout: str = "bshd", *, phase: str = "prefill",
              causal: bool = False, alignment: str = "bottom_right",
              window: tuple[int, int] | None = None, softcap: bool = False,
              return_lse: bool = False, needs_grad: bool = False) -> AttentionSpec:
    kv = {torch.float8_e4m3fn: "fp8_e4m3"}.get(k.dtype, "bf16")
    return AttentionSpec(
        phase=phase, dtype="bf16", kv_dtype=kv, head_dim=q.shape[-1],  # type: ignore[arg-type]
        num_q_heads=q.shape[-2], num_kv_heads=k.shape[-2], layout=layout,  # type: ignore
        mask=MaskSpec(causal=causal, alignment=alignment, window=window,  # type: ignore
                      softcap=softcap, document=layout == "thd"),
        max_seqlen_q=q.shape[1] if q.dim() == 4 else 1,
        max_seqlen_k=k.shape[1] if k.dim() == 4 else 1, return_lse=return_lse,
        needs_grad=needs_grad, page_size=k.shape[1] if layout == "paged" else 0)


@pytest.fixture
def spec_of():
    return make_spec
