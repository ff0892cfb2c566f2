"""``fa3``: FlashAttention-3 (Hopper) over ``flash_attn_interface`` or ``fa3_fwd_interface``.

Declared from the installed build's flags (``build.fa3_build``): backward, paged KV, sliding
window, softcap, fp16, varlen and the head-dim buckets each appear only when compiled in.
FA3 has no ALiBi. Decode (one short query against a long cache) goes through
``flash_attn_with_kvcache`` with the split-KV heuristic (``num_splits=0``) when the build has
split-KV; everything else through ``flash_attn_func`` / ``flash_attn_varlen_func``.

A call without autograd goes to FA3's registered forward op itself (``Fa3Op``) when its
schema takes every argument attnhub passes: the interface's Python layers (an autograd
Function, a ``torch.library`` custom op, two empty device tensors per call) are host time on
every call, and on small cells the host is what the GPU waits for.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

import torch

from attnhub.plugin import (
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    Capabilities,
    DeviceInfo,
    flash_dense_form,
    flash_form,
    flash_kwargs,
    flash_output_kwargs,
    flash_paged_form,
    flash_varlen,
    flash_varlen_form,
    natural_lse,
    top_left_reason,
)

from .build import INSTALL_FA3, Fa3Build, fa3_build, import_interface

log = logging.getLogger("attnhub.sm90_fa3")


def fa3_masks(build: Fa3Build) -> frozenset[str]:
    masks = {"causal"}
    if build.has("LOCAL"):
        masks.add("sliding_window")
    if build.has("SOFTCAP"):
        masks.add("softcap")
    if build.has("VARLEN"):
        masks.add("document")
    return frozenset(masks)


def fa3_capabilities(build: Fa3Build) -> Capabilities:
    """What this FA3 build serves in bf16/fp16."""
    layouts = {"bshd", "bhsd"}
    if build.has("VARLEN"):
        layouts.add("thd")
    if build.has("PAGEDKV"):
        layouts.add("paged")
    dtypes = {"bf16"} | ({"fp16"} if build.has("FP16") else set())
    backward = build.has("BACKWARD")
    return Capabilities(
        vendors=frozenset({"cuda"}), archs=frozenset({"sm90"}), dtypes=frozenset(dtypes),
        max_head_dim=build.max_head_dim, head_dim_multiple=8, masks=fa3_masks(build),
        layouts=frozenset(layouts), backward=backward, deterministic_backward=backward,
        phases=frozenset({"train", "prefill", "decode"} if backward else {"prefill", "decode"}),
        deterministic_forward=True, gqa=True, returns_lse=True, top_left_causal=True,
    )


#: The arguments of FA3's forward op that attnhub passes by name (the op is used only when
#: its schema has every one; else the interface functions are called).
OP_ARGS: frozenset[str] = frozenset({
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q",
    "max_seqlen_k", "page_table", "q_descale", "k_descale", "v_descale", "softmax_scale",
    "is_causal", "window_size_left", "window_size_right", "softcap", "num_splits"})
#: Entries of a runner's memo of bshd op arguments, the oldest dropped first: a new length
#: adds one (a prompt of a new length, a growing cache), and a fixed shape's layers hit it;
#: kept small so that a walk's entries die young (thousands of long-lived dicts cost the
#: garbage collector's full passes, as triton_decode's shape cache did)
DENSE_MEMO = 64
#: Where the interface modules keep their op namespace (fa3-fwd wheel; upstream hopper/).
OP_NAMESPACES: tuple[str, ...] = ("fa3_fwd_cuda", "flash_attn_3_cuda")


def forward_op(fa: ModuleType) -> tuple[Any | None, str]:
    """FA3's registered forward op (``<namespace>.fwd.default``) behind the interface ``fa``,
    or None and why the interface functions are called instead."""
    for attr in OP_NAMESPACES:
        ns = getattr(fa, attr, None)
        if ns is None:
            continue
        schema = getattr(getattr(getattr(ns, "fwd", None), "default", None), "_schema", None)
        if schema is None:  # an older pybind module: positional arguments only
            return None, f"{fa.__name__}.{attr}.fwd has no operator schema"
        missing = OP_ARGS - {a.name for a in schema.arguments}
        if missing:
            return None, (f"{fa.__name__}.{attr}.fwd lacks argument(s) "
                          f"{', '.join(sorted(missing))}")
        return ns.fwd.default, f"{fa.__name__}.{attr}.fwd"
    return None, f"{fa.__name__} exposes no forward op ({' or '.join(OP_NAMESPACES)})"


def op_kwargs(params: AttnParams, form: Any) -> dict[str, Any]:
    """``flash_kwargs`` under the op's argument names (FA3 has no ALiBi: never declared),
    so that both paths pass the same values."""
    kw = flash_kwargs(params, form)
    kw["is_causal"] = kw.pop("causal")
    window = kw.pop("window_size", None)
    if window is not None:
        kw["window_size_left"], kw["window_size_right"] = window
    return kw


def _last_dim_unit(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def split_outputs(res: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FA3 interfaces return ``out`` or ``(out, lse, ...)`` depending on flags and version."""
    if isinstance(res, (tuple, list)):
        return res[0], res[1]
    return res, None


class Fa3Runner:
    """The three FA3 entry points called with attnhub's data; shared by fa3 and fa3_fp8."""

    def __init__(self, fa: ModuleType, build: Fa3Build, name: str):
        self.fa = fa
        self.build = build
        self.name = name
        self.splits = 0 if build.has("SPLIT") else 1  # 0: FA3's split-KV heuristic
        #: the op for calls without autograd, and which op it is or why there is none
        self.op, self.op_note = forward_op(fa)
        #: bshd calls: (keys the form keeps, the op's keyword arguments) per ``_op_call`` key
        self._dense: dict[tuple[Any, ...], tuple[int, dict[str, Any]]] = {}
        log.info("%s: calls without autograd go to %s", name,
                 self.op_note if self.op is not None
                 else f"the interface functions ({self.op_note})")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 spec: AttentionSpec, params: AttnParams,
                 **extra: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out, lse or None); ``extra`` carries FP8 descales."""
        if self.op is not None and not spec.needs_grad:
            return self._op_call(q, k, v, spec, params, extra)
        fa = self.fa
        splits = self.splits
        if spec.layout == "paged":
            kw = flash_kwargs(params, flash_paged_form(self.name, params, q, k))
            res = fa.flash_attn_with_kvcache(
                q, k, v, cache_seqlens=params.seqlens_k, page_table=params.block_table,
                num_splits=splits, return_softmax_lse=True, **kw, **extra)
            return split_outputs(res)
        out_kw = flash_output_kwargs(params)
        if spec.layout == "thd":
            return split_outputs(flash_varlen(fa.flash_attn_varlen_func, self.name, q, k, v,
                                              params, **out_kw, **extra))
        form, k, v = flash_dense_form(self.name, params, q, k, v)
        kw = flash_kwargs(params, form)
        if spec.phase == "decode" and not spec.needs_grad:
            res = fa.flash_attn_with_kvcache(q, k, v, num_splits=splits,
                                             return_softmax_lse=True, **kw, **extra)
            return split_outputs(res)
        return split_outputs(fa.flash_attn_func(q, k, v, **kw, **out_kw, **extra))

    def _op_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 spec: AttentionSpec, params: AttnParams,
                 extra: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The op with the arguments the interface function for this call would pass it
        (``flash_attn_with_kvcache`` / ``_varlen_func`` / ``_func``), the same kernel."""
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k.stride(-1) != 1:
            k = k.contiguous()
        if v.stride(-1) != 1 and v.stride(-3) != 1:  # the interface's rule for v
            v = v.contiguous()
        if spec.layout == "bshd":
            # the op's scalar arguments follow from these values alone: made once per key
            # (the mask's form and its checks are ~2.5 us a call; a new length makes a key)
            sq, sk = q.shape[1], k.shape[1]
            key = (sq, sk, params.causal, params.alignment, params.window, params.softcap,
                   params.scale, params.alibi_slopes is None, spec.phase)
            hit = self._dense.get(key)
            if hit is None:
                form = flash_form(self.name, params, sq, sk)  # raises where no form exists
                kw = op_kwargs(params, form)
                kw["num_splits"] = self.splits if spec.phase == "decode" else 1
                if len(self._dense) >= DENSE_MEMO:
                    del self._dense[next(iter(self._dense))]  # the oldest
                hit = self._dense[key] = (form.keys, kw)
            keys, kw = hit
            if keys < sk:  # a top-left causal mask with Sq < Sk never reaches the keys past Sq
                k, v = k[:, :keys], v[:, :keys]
        elif spec.layout == "paged":
            kw = op_kwargs(params, flash_paged_form(self.name, params, q, k))
            kw.update(seqused_k=_last_dim_unit(params.seqlens_k),
                      page_table=_last_dim_unit(params.block_table), num_splits=self.splits)
        else:  # thd
            kw = op_kwargs(params, flash_varlen_form(self.name, params))
            kw.update(cu_seqlens_q=_last_dim_unit(params.cu_seqlens_q),
                      cu_seqlens_k=_last_dim_unit(params.cu_seqlens_k),
                      max_seqlen_q=params.max_seqlen_q, max_seqlen_k=params.max_seqlen_k,
                      num_splits=1)
        res = self.op(q, k, v, **kw, **extra)
        return res[0], res[1]


class Fa3Backend(Backend):
    """FlashAttention-3 in bf16/fp16."""

    name = "fa3"
    tier = "vendor"
    description = "FlashAttention-3 (Hopper): features as compiled into the installed build"
    @functools.cached_property
    def build(self) -> Fa3Build:
        return fa3_build()

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return fa3_capabilities(self.build)

    def missing_requirements(self) -> list[str]:
        """Either interface will do (flash_attn_interface or fa3_fwd_interface)."""
        if self.build.module is None:
            return [f"FlashAttention-3 is not installed ({INSTALL_FA3})"]
        return []

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        r = top_left_reason(spec)
        if spec.layout == "paged" and spec.needs_grad:
            r.append("the paged path (flash_attn_with_kvcache) has no backward")
        return r

    def _load(self) -> None:
        self._run = Fa3Runner(import_interface(self.build), self.build, self.name)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        out, lse = self._run(q, k, v, spec, params)
        return AttentionOutput(out, natural_lse(lse) if params.return_lse and lse is not None
                               else None)
