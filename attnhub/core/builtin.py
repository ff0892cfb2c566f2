"""The core's own backends, registered through the same hook as any third-party plugin."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from ..hookspecs import hookimpl
from .backend import AttentionOutput, Backend
from .capabilities import ALL_MASKS, Capabilities
from .device import DeviceInfo
from .flash_conventions import natural_lse, varlen_max_q
from .kvquant import refuse_stray_descales
from .masking import (alibi_bias, allowed_mask, attends_nothing, doc_ranges, no_keys_lse,
                      window_within)
from .paged import paged_to_varlen
from .reference import _doc_params, reference_attention
from .spec import AttentionSpec, AttnParams

_ANY_LAYOUT = frozenset({"bshd", "thd", "paged"})


def _serve_layouts(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, params: AttnParams,
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttnParams, str], AttentionOutput],
) -> AttentionOutput:
    """Turn a paged call into varlen, then hand bshd or thd to ``run``."""
    if spec.layout == "paged":
        b, sq = q.shape[:2]
        if b == 0:  # no sequences (thd has no form for an empty batch)
            lse = q.new_empty(0, q.shape[2], sq, dtype=torch.float32) if params.return_lse \
                else None
            return AttentionOutput(attends_nothing(q, k, v), lse)
        qv, kv, vv, cu_q, cu_k = paged_to_varlen(q, k, v, params.block_table, params.seqlens_k)
        p = replace(params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, block_table=None)
        out, lse = run(qv, kv, vv, p, "thd")
        lse_b = lse.view(lse.shape[0], b, sq).transpose(0, 1) if lse is not None else None
        return AttentionOutput(out.view(b, sq, *out.shape[1:]), lse_b)
    return run(q, k, v, params, spec.layout)


class ReferenceBackend(Backend):
    """Math attention in fp64 (CPU) or fp32 (GPU): slow, exact, every mask kind."""

    name = "reference"
    tier = "reference"
    description = "math attention in fp64/fp32 materialising scores; the tests' oracle"
    capabilities = Capabilities(
        dtypes=frozenset({"fp32", "fp16", "bf16"}), max_head_dim=1024, different_v_dim=True,
        masks=ALL_MASKS, layouts=_ANY_LAYOUT, backward=True, deterministic_backward=True,
        deterministic_forward=True, gqa=True, returns_lse=True, top_left_causal=True,
        lse_second_pass=True, dropout=True,
    )

    def forward(self, q, k, v, spec, params):  # type: ignore[override]
        if params.extra:
            refuse_stray_descales(self.name, k.dtype, params.extra)
        compute = torch.float64 if q.device.type == "cpu" else torch.float32

        def run(q, k, v, p, layout):
            out, lse = reference_attention(q, k, v, p, layout=layout, compute_dtype=compute)
            return AttentionOutput(out.to(q.dtype), lse if p.return_lse else None)

        return _serve_layouts(q, k, v, spec, params, run)


class TorchSDPABackend(Backend):
    """torch's scaled_dot_product_attention. Causal masks without a materialised tensor where
    SDPA has a native form (no mask for one bottom-right query, ``is_causal``,
    ``causal_lower_right``); explicit masks/biases for the other kinds it can express.
    Packed documents (thd) and paged caches run without host syncs or loops over sequences
    on accelerators (``_sdpa_thd``, ``_sdpa_paged``)."""

    name = "torch_sdpa"
    tier = "portable"
    description = "torch.nn.functional.scaled_dot_product_attention (any device)"
    capabilities = Capabilities(
        dtypes=frozenset({"fp32", "fp16", "bf16"}), max_head_dim=1024, different_v_dim=True,
        masks=ALL_MASKS - {"softcap", "score_mod"}, layouts=_ANY_LAYOUT, backward=True,
        deterministic_backward=True, deterministic_forward=True, gqa=True, returns_lse=True,
        top_left_causal=True, lse_second_pass=True, dropout=True,
    )

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        r = []
        if spec.deterministic and spec.needs_grad and device.vendor != "cpu":
            r.append("SDPA's fused GPU backward kernels are not deterministic")
        if spec.dropout and spec.layout != "bshd":
            r.append(f"attention dropout only for dense bshd/bhsd tensors here (one SDPA call "
                     f"draws it), not {spec.layout}")
        return r

    def forward(self, q, k, v, spec, params):  # type: ignore[override]
        if params.extra:
            refuse_stray_descales(self.name, k.dtype, params.extra)
        if spec.layout == "bshd":  # the common case, without the layout plumbing
            return _sdpa_bshd(q, k, v, params)
        if spec.layout == "paged" and _paged_gather_serves(q, params):
            return _sdpa_paged(q, k, v, params)
        return _serve_layouts(q, k, v, spec, params, self._run)

    @staticmethod
    def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams,
             layout: str) -> AttentionOutput:
        if layout == "bshd":
            return _sdpa_bshd(q, k, v, p)
        return _sdpa_thd(q, k, v, p)


#: Most (documents x longest query run x longest key run) elements the padded thd path
#: materialises as a boolean mask (64 MiB); above it one SDPA call per document costs less
#: memory and arithmetic (the padded call computes every padded score).
PADDED_MASK_BUDGET = 1 << 26


def _sdpa_thd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              p: AttnParams) -> AttentionOutput:
    """Packed documents (thd), with no host sync and no Python loop over documents where a
    loop-free form is exact:

    0. Every document max_seqlen_q x max_seqlen_k (the packed lengths say so, on the host:
       B x max_seqlen tokens, each at most max_seqlen): a (B, S, H, D) view, served as
       bshd (SDPA's fastest kernels, masks native), any device.
    1. CUDA, fp16/bf16, no mask or a bottom-right causal/window mask: torch's varlen
       FlashAttention kernel (what ``torch.nn.attention.varlen`` calls; one launch, GQA
       native, per-document Sq != Sk and empty documents handled by the kernel).
    2. Otherwise, on an accelerator, when documents x max_seqlen_q x max_seqlen_k fits
       ``PADDED_MASK_BUDGET``: one SDPA call over a padded batch built by index ops from
       ``cu_seqlens`` and the host-side max lengths the hub passes (``_sdpa_thd_padded``).
    3. Otherwise one call per document (``_sdpa_thd_loop``, which reads ``cu_seqlens`` on
       the host): on the CPU, where it is cheaper (no host sync to save, and each document's
       causal mask runs natively instead of as a padded mask: 2-6x faster on causal
       documents in ``benchmarks/sdpa_thd.py --cpu``, within ~25% either way on windows);
       for ``mask_mod`` callables and column-sparse ranges, whose indices are per document;
       above the budget, where a padded mask costs more memory and arithmetic than the loop.
    """
    b = p.cu_seqlens_q.numel() - 1
    tq, tk = q.shape[0], k.shape[0]
    if tq == 0 or tk == 0 or b == 0:  # nothing to attend to: 0 out, -inf LSE
        lse = no_keys_lse((q.shape[1], tq), q.device) if p.return_lse else None
        return AttentionOutput(attends_nothing(q, k, v), lse)
    max_q, max_k = p.max_seqlen_q, p.max_seqlen_k
    if max_q is None or max_k is None:  # a direct backend call: the hub always passes both
        max_q = int(p.cu_seqlens_q.diff().max()) if max_q is None else max_q
        max_k = int(p.cu_seqlens_k.diff().max()) if max_k is None else max_k
    # a caller's max_seqlen may be a loose upper bound: no document is longer than the total
    # (the padded route sizes its batch by these)
    max_q, max_k = min(max_q, tq), min(max_k, tk)
    if _uniform_docs(p, b, tq, tk, max_q, max_k):
        return _sdpa_thd_uniform(q, k, v, p, b)
    window = flash_varlen_window(p, q.device, q.dtype, q.shape[-1], v.shape[-1], max_q, max_k)
    if window is not None:
        return _flash_varlen(q, k, v, p, b, max_q, max_k, window)
    fits = _padded_fits(q.device, b * max_q * max_k)
    if fits and p.mask_mod is None and p.colmask_start is None:
        return _sdpa_thd_padded(q, k, v, p, b, max_q, max_k)
    return _sdpa_thd_loop(q, k, v, p)


def _padded_fits(device: torch.device, elements: int) -> bool:
    """Whether the padded path serves a thd call of ``elements`` padded scores per head:
    on accelerators within ``PADDED_MASK_BUDGET``; never on the CPU (see ``_sdpa_thd``)."""
    return device.type != "cpu" and elements <= PADDED_MASK_BUDGET


def _uniform_docs(p: AttnParams, b: int, tq: int, tk: int, max_q: int, max_k: int) -> bool:
    """Every document holds max_q queries and max_k keys (B x max tokens, none longer), and
    no mask reads per-document indices (``mask_mod``, column-sparse)."""
    return (tq == b * max_q and tk == b * max_k and p.mask_mod is None
            and p.colmask_start is None)


def _sdpa_thd_uniform(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams,
                      b: int) -> AttentionOutput:
    """Documents of equal lengths as a (B, S, H, D) batch: a view (a copy only for strided
    packed tensors), LSE back to (H, T)."""
    res = _sdpa_bshd(q.reshape(b, -1, *q.shape[1:]), k.reshape(b, -1, *k.shape[1:]),
                     v.reshape(b, -1, *v.shape[1:]),
                     replace(p, cu_seqlens_q=None, cu_seqlens_k=None))
    lse = res.lse.transpose(0, 1).reshape(q.shape[1], -1) if res.lse is not None else None
    return AttentionOutput(res.out.reshape(q.shape[0], q.shape[1], -1), lse)


def flash_varlen_window(p: AttnParams, device: torch.device, dtype: torch.dtype, d: int,
                        dv: int, max_q: int, max_k: int) -> tuple[int, int] | None:
    """FlashAttention's ``(window_left, window_right)`` (-1 unbounded; causal is right = 0)
    when torch's varlen flash kernel computes this call exactly, else None. Exact: no
    mask, or causal/window under bottom-right alignment (FlashAttention's own, applied per
    document). Declined: other devices and dtypes, head dims it lacks, ALiBi, prefix-LM,
    column-sparse, mask_mod, top-left masks (their shift differs per document), and a
    right window edge in [max_seqlen_k, max_seqlen_q - 1) (the kernel clamps an edge
    >= max_seqlen_k to unbounded, which is exact only once it also covers every query)."""
    if (device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16)
            or d != dv or d % 8 or d > 256 or p.alibi_slopes is not None
            or p.prefix_lens is not None or p.softcap or p.colmask_start is not None
            or p.mask_mod is not None or p.score_mod is not None
            or not _torch_flash_varlen(device.index)):
        return None
    left, right = window_within(p.window, max(max_q, max_k)) or (-1, -1)
    if p.alignment == "top_left" and (p.causal or p.window is not None):
        return None
    if p.causal:
        right = 0 if right < 0 else min(right, 0)
    if max_k <= right < max_q - 1:
        return None
    return left, right


@functools.cache
def _torch_flash_varlen(index: int | None) -> bool:
    """torch's FlashAttention op takes packed sequences and windows here (a CUDA build of
    torch, sm80+, not ROCm) and returns the LSE as (heads, tokens), checked once on meta
    tensors (the op's schema and LSE layout changed across torch releases)."""
    try:
        if torch.version.hip or not torch.backends.cuda.is_flash_attention_available():
            return False
        if torch.cuda.get_device_capability(index)[0] < 8:
            return False
        q = torch.empty(3, 4, 64, device="meta", dtype=torch.bfloat16)
        k = torch.empty(5, 2, 64, device="meta", dtype=torch.bfloat16)
        cu = torch.tensor([0, 1, 3], dtype=torch.int32, device="meta")
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, k, cu, cu, 2, 3, 0.0, True, False, scale=0.125, window_size_left=-1,
            window_size_right=0)
        return tuple(out.shape) == (3, 4, 64) and tuple(lse.shape) == (4, 3)
    except (RuntimeError, TypeError, AttributeError, AssertionError):
        return False


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams, b: int,
                  max_q: int, max_k: int, window: tuple[int, int]) -> AttentionOutput:
    """One launch of torch's varlen FlashAttention (forward and, through autograd, its
    backward). Fully masked rows come back 0 with LSE +inf, turned into -inf."""
    max_q = varlen_max_q(max_q, q.shape[0], b)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    left, right = window
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, max_q, max_k, 0.0,
        p.causal and right == 0 and left < 0, False, scale=p.scale,
        window_size_left=left, window_size_right=right)
    return AttentionOutput(out, natural_lse(lse) if p.return_lse else None)


def _sdpa_thd_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams,
                     b: int, max_q: int, max_k: int) -> AttentionOutput:
    """One SDPA call over the documents padded to (B, max_seqlen, H, D) by index ops (no
    host sync). Under bottom-right alignment every document is right-aligned in its row,
    under top-left left-aligned: then the padded row's own causal/window/ALiBi geometry is
    the document's, and a key-validity mask hides the padding (rows that see no key come
    back 0 with LSE -inf, as in ``_sdpa_masked``). Padded query rows are dropped."""
    right = p.alignment == "bottom_right"
    iq = _padded_index(p.cu_seqlens_q, q.shape[0], max_q, right)
    ik = _padded_index(p.cu_seqlens_k, k.shape[0], max_k, right)
    qp, kp, vp = (_pad(t, idx, b, m) for t, idx, m in ((q, iq, max_q), (k, ik, max_k),
                                                        (v, ik, max_k)))
    len_k = p.cu_seqlens_k.diff().to(torch.long)
    shift = (max_k - len_k) if right else torch.zeros_like(len_k)
    res = _sdpa_key_padded(qp, kp, vp, replace(p, cu_seqlens_q=None, cu_seqlens_k=None),
                           len_k, shift)
    hq = q.shape[1]
    out = res.out.reshape(b * max_q, hq, -1).index_select(0, iq)
    lse = res.lse.transpose(0, 1).reshape(hq, b * max_q).index_select(1, iq) \
        if res.lse is not None else None
    return AttentionOutput(out, lse)


def _paged_gather_serves(q: torch.Tensor, p: AttnParams) -> bool:
    """Whether ``_sdpa_paged`` serves this paged call: on an accelerator (on the CPU the
    varlen route is cheaper and syncs nothing anyway), with the longest length known (the
    hub always passes it), for masks given by positions alone (``mask_mod`` and column
    ranges index per sequence: they take the varlen route)."""
    return (q.device.type != "cpu" and p.max_seqlen_k is not None and p.mask_mod is None
            and p.colmask_start is None)


def _sdpa_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                p: AttnParams) -> AttentionOutput:
    """A paged cache read as one padded batch by index ops, then one SDPA call: no host
    sync (``paged_to_varlen`` reads the lengths on the host) and no loop over sequences.

    Key ``j`` of sequence ``b`` lands in padded position ``j + max_k - L_b`` under
    bottom-right alignment (position ``j`` under top-left), so the padded row's causal,
    window and ALiBi geometry is the sequence's own; a key-validity mask hides the rest.
    Masked positions read key ``clamp(j, 0, L_b - 1)``, a slot the sequence owns: never an
    unwritten tail slot or an unused table entry, whose garbage (NaN, inf in an empty-made
    cache) would reach the output through ``0 * NaN`` (an empty sequence's rows are zeroed
    whatever they read).
    """
    b = q.shape[0]
    page = k_cache.shape[1]
    if p.block_table.shape[1] == 0:  # a table without pages: every length is 0
        lse = no_keys_lse((b, q.shape[2], q.shape[1]), q.device) if p.return_lse else None
        return AttentionOutput(attends_nothing(q, k_cache, v_cache), lse)
    # max_seqlen_k may be a caller's upper bound: no length exceeds the tables' capacity
    max_k = max(min(int(p.max_seqlen_k or 0), page * p.block_table.shape[1]), 1)
    right = p.alignment == "bottom_right"
    lens = p.seqlens_k.to(torch.long).view(b, 1)
    pos = torch.arange(max_k, device=q.device).view(1, max_k)
    shift = (max_k - lens) if right else torch.zeros_like(lens)
    # the sequence's key index at each padded position (outside [0, L_b): masked, and read
    # from an owned slot)
    key = torch.minimum((pos - shift).clamp_min(0), (lens - 1).clamp_min(0))
    pages = p.block_table.to(torch.long).gather(1, key // page).clamp(0, k_cache.shape[0] - 1)
    slot = key % page
    # indexed by (page, slot), whatever the caches' strides: a flattening reshape would copy
    # a whole strided cache (K and V interleaved per page) on every call
    kp, vp = k_cache[pages, slot], v_cache[pages, slot]  # (B, max_k, Hkv, D)
    return _sdpa_key_padded(q, kp, vp, replace(p, block_table=None, seqlens_k=None),
                            lens.view(b), shift.view(b))


def _sdpa_key_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams,
                     lens: torch.Tensor, shift: torch.Tensor) -> AttentionOutput:
    """SDPA over a padded batch (B, Sq, Hq, D) x (B, max_k, Hkv, D) whose sequence ``b``
    holds ``lens[b]`` keys moved ``shift[b]`` positions right (so that its own causal,
    window and ALiBi geometry is the padded row's); the other positions are masked."""
    b, sq, hq, _ = q.shape
    max_k = k.shape[1]
    kj = torch.arange(max_k, device=q.device)
    key_ok = (kj >= shift[:, None]) & (kj < (shift + lens)[:, None])
    prefix = p.prefix_lens
    if prefix is not None:  # keys below the prefix, in padded positions
        prefix = prefix.to(q.device) + shift
    pp = replace(p, prefix_lens=prefix)
    allowed = allowed_mask(pp, b, hq, sq, max_k, q.device, kv_heads=k.shape[2])
    key_ok = key_ok.view(b, 1, 1, max_k)
    allowed = key_ok if allowed is None else allowed & key_ok
    bias = alibi_bias(p.alibi_slopes, sq, max_k, p.alignment, q.device) \
        if p.alibi_slopes is not None else None
    return _sdpa_masked(q, k, v, pp, allowed, bias)


def _padded_index(cu: torch.Tensor, total: int, m: int, right: bool) -> torch.Tensor:
    """For each packed token, its row-major index in a (B, m) padded batch: document
    ``searchsorted(cu[1:], t)``, position in it, right-aligned when ``right``."""
    cu = cu.to(torch.long)
    tok = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(cu[1:].contiguous(), tok, right=True)
    start = cu[doc]
    pos = tok - start + (m - (cu[doc + 1] - start) if right else 0)
    return doc * m + pos


def _pad(t: torch.Tensor, idx: torch.Tensor, b: int, m: int) -> torch.Tensor:
    """Packed (T, H, D) into zeros (B, m, H, D) at ``idx`` (differentiable)."""
    return t.new_zeros(b * m, *t.shape[1:]).index_copy(0, idx, t).view(b, m, *t.shape[1:])


def _sdpa_thd_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   p: AttnParams) -> AttentionOutput:
    """One SDPA call per document (reads ``cu_seqlens`` on the host: the slow path)."""
    outs, lses = [], []
    for i, ((qs, qe), (ks, ke)) in enumerate(zip(doc_ranges(p.cu_seqlens_q),
                                                   doc_ranges(p.cu_seqlens_k))):
        o, l = _sdpa_bshd(q[qs:qe][None], k[ks:ke][None], v[ks:ke][None],
                          _doc_params(p, i, p.alibi_slopes))
        outs.append(o[0])
        lses.append(l[0] if l is not None else None)
    lse = torch.cat(lses, -1) if p.return_lse else None
    return AttentionOutput(torch.cat(outs, 0), lse)


#: What SDPA raises when no enabled kernel takes a call: the CPU build's words, and CUDA's
#: (torch 2.11 on the H200: no kernel enabled at all, or none enabled that takes the call).
_NO_SDPA_KERNEL = ("No available kernel", "No viable backend")


_HALF = (torch.float16, torch.bfloat16)


def math_sdpa(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, *,
              attn_mask: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
    """SDPA's math kernel, called as the op it is: ``sdpa_kernel(SDPBackend.MATH)`` would
    set SDPA's process-wide switches, which another thread's call then sees (and its
    settings check blames on its backend). A boolean mask becomes the additive one SDPA
    makes of it (the op itself takes additive masks); equal to SDPA under that context
    manager, dropout draws included. A ``CausalBias`` is made dense."""
    if isinstance(attn_mask, CausalBias):  # a tensor subclass SDPA alone understands
        attn_mask = attn_mask._materialize(qt.device)  # (bool, Sq x Sk)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=qt.dtype, device=qt.device
                                ).masked_fill(~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(qt, kt, vt, attn_mask, **kw)[0]


def sdpa(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, **kw: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with SDPA's cuDNN kernel left out on CUDA.

    cuDNN builds a graph for every new shape: on the H200 (torch 2.11) a decode call on a
    cache one key longer than the last took 47-68 ms, against 51 us once built
    (``benchmarks/decode_growing_gpu.py``), so a growing KV cache or a prompt of a new length
    would pay it every call. SDPA's other kernels have no per-shape build; the ``cudnn``
    backend serves cuDNN where shapes repeat. SDPA's flags are process-wide: while one call
    runs, another thread's SDPA may also skip cuDNN (a kernel choice, never a result).
    Where cuDNN is the only kernel SDPA may run for the call (the caller's
    ``sdpa_kernel([CUDNN_ATTENTION])``, or cuDNN beside a kernel that cannot take it), SDPA
    answers "No available kernel" without it: the call is then made with cuDNN on."""
    if (qt.device.type == "cpu" and torch.is_grad_enabled()
            and (qt.requires_grad or getattr(kt, "requires_grad", False)
                 or getattr(vt, "requires_grad", False))
            and not torch.compiler.is_compiling()):
        # torch's CPU flash backward broke the FlashAttention rule on peaked softmaxes: in
        # fp16/bf16 (scale 1, D=64, a few keys: dq/dk up to 9.7x the bound, 6 of 40 seeds)
        # and in fp32 with a large scale (3: every seed, up to 4.9x; 10: 9.4x); its math
        # kernel, which autograd differentiates, stays within it
        return math_sdpa(qt, kt, vt, **kw)
    if (qt.device.type != "cuda" or torch.compiler.is_compiling()
            or not torch.backends.cuda.cudnn_sdp_enabled()):
        # (under torch.compile SDPA as is: Dynamo cannot trace the flag's bool, and a
        # fullgraph=True compile would fail where plain SDPA compiles)
        return F.scaled_dot_product_attention(qt, kt, vt, **kw)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return F.scaled_dot_product_attention(qt, kt, vt, **kw)
    except RuntimeError as exc:
        if not any(m in str(exc) for m in _NO_SDPA_KERNEL):
            raise  # a failure of its own, not of the kernel choice
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    return F.scaled_dot_product_attention(qt, kt, vt, **kw)  # cuDNN was the caller's only one


def _sdpa_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               p: AttnParams) -> AttentionOutput:
    b, sq, hq, _ = q.shape
    mask_kv_heads = k.shape[2]  # column-sparse ranges are per KV head of the call
    k, v = expand_kv_for_half_grads(q, k, v)
    sk, hkv = k.shape[1], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if sq == 0 or sk == 0:
        lse = no_keys_lse((b, hq, sq), q.device) if p.return_lse else None
        return AttentionOutput(attends_nothing(q, k, v), lse)
    native = _native_causal(p, sq, sk)
    if native is not None and not _cpu_needs_explicit_mask(native, p, k):
        is_causal, bias_obj = native
        out = sdpa(qt, kt, vt, attn_mask=bias_obj, is_causal=is_causal, scale=p.scale,
                   enable_gqa=hq != hkv, dropout_p=p.dropout_p)
        lse = _lse(qt, kt, p, _causal_allowed(p, sq, sk, q.device), None, None) \
            if p.return_lse else None
        out, lse = _keep_nan(out, lse, qt, None if p.dropout_p else lambda: math_sdpa(
            qt, kt, vt, attn_mask=bias_obj, is_causal=is_causal, scale=p.scale,
            enable_gqa=hq != hkv))
        return AttentionOutput(out.transpose(1, 2), lse)
    allowed = allowed_mask(p, b, hq, sq, sk, q.device, kv_heads=mask_kv_heads)
    bias = alibi_bias(p.alibi_slopes, sq, sk, p.alignment, q.device) \
        if p.alibi_slopes is not None else None
    return _sdpa_masked(q, k, v, p, allowed, bias)


def expand_kv_for_half_grads(q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bshd k/v with their heads repeated for each query head when torch's CPU flash
    backward would otherwise sum a KV head's gradient over its query heads in fp16/bf16
    (GQA/MQA, gradients of k or v wanted): at 32:1 heads its dK/dV errors were 3-5x those
    of the same-precision maths (outside the FlashAttention rule). Repeated, autograd sums
    the group's gradients with fp32 accumulation. Other calls: k, v unchanged."""
    g = q.shape[-2] // k.shape[-2]
    if (g > 1 and q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16)
            and torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)):
        return k.repeat_interleave(g, dim=-2), v.repeat_interleave(g, dim=-2)
    return k, v


def _sdpa_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams,
                 allowed: torch.Tensor | None, bias: torch.Tensor | None) -> AttentionOutput:
    """SDPA on (B, S, H, D) with an explicit boolean mask of visible pairs and/or an additive
    bias; rows that see no key come back 0 with LSE -inf."""
    hq, hkv = q.shape[2], k.shape[2]
    k, allowed, nan_seen = _hide_masked_nan_keys(q, k, allowed, p.scale)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    row_ok = None
    mask = bias
    if allowed is not None:
        row_ok = allowed.any(dim=-1, keepdim=True)
        allowed = allowed | ~row_ok  # fully masked rows attend everywhere, then are zeroed
        mask = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))
    # the fused op's LSE carries no gradient: a call whose LSE may be differentiated (q or
    # k in the autograd graph) takes SDPA and the LSE pass, which autograd differentiates
    lse_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if (p.return_lse and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]
            and (bias is None or q.dtype == torch.float32) and not lse_grad
            and not p.dropout_p):
        out, lse = _cpu_flash_with_lse(qt, kt, vt, mask, p.scale)
        if row_ok is not None:
            lse = lse.masked_fill(~row_ok.squeeze(-1), float("-inf"))
    else:
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        out = sdpa(qt, kt, vt, attn_mask=mask, scale=p.scale, enable_gqa=hq != hkv,
                   dropout_p=p.dropout_p)
        lse = _lse(qt, kt, p, allowed, row_ok, bias) if p.return_lse else None
    out, lse = _keep_nan(out, lse, qt, None if p.dropout_p else lambda: math_sdpa(
        qt, kt, vt, attn_mask=mask if mask is None or mask.dtype == torch.bool
        else mask.to(q.dtype), scale=p.scale, enable_gqa=hq != hkv))
    if nan_seen is not None:  # rows that see a NaN key: NaN, as the maths gives
        out = out + nan_seen.to(out.dtype)
        lse = lse + nan_seen.squeeze(-1) if lse is not None else None
    if row_ok is not None:  # fully masked rows: 0 even where q held NaN
        out = out.masked_fill(~row_ok, 0.0)
    return AttentionOutput(out.transpose(1, 2), lse)


def _hide_masked_nan_keys(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor | None,
                                                 torch.Tensor | None]:
    """NaN in means NaN out, and only there (docs/contract.md). SDPA applies a boolean mask
    as an additive -inf, and NaN + -inf is NaN: a key holding NaN or inf (an fp16 cache
    entry that overflowed) would reach every row of its head, those that cannot see it too.
    On the CPU (a host check costs nothing there) such keys are zeroed and their scores
    taken as the maths takes them: a visible score of NaN or +inf makes its row NaN, one of
    -inf gives the key no weight (it leaves ``allowed``). Returns ``(k, allowed, poison)``,
    poison (B, Hq, Sq, 1) fp32 NaN on the rows made NaN, else 0; or ``(k, allowed, None)``."""
    if allowed is None or q.device.type != "cpu":
        return k, allowed, None
    bad = ~torch.isfinite(k).all(-1)  # (B, Sk, Hkv)
    if not bool(bad.any()):
        return k, allowed, None
    g = q.shape[2] // k.shape[2]
    cols = bad.any(0).any(-1).nonzero().squeeze(-1)  # the key positions holding one
    kb = k[:, cols].masked_fill(~bad[:, cols].unsqueeze(-1), 0.0).repeat_interleave(g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kb.double()) * scale  # those only
    bad_h = bad[:, cols].transpose(1, 2).repeat_interleave(g, dim=1).unsqueeze(2)
    at_bad = allowed[..., cols] & bad_h
    seen = (at_bad & (torch.isnan(scores) | (scores == float("inf")))).any(-1, keepdim=True)
    drop = at_bad & (scores == float("-inf"))  # (B, Hq, Sq, bad columns)
    if bool(drop.any()):
        weightless = torch.zeros((*drop.shape[:3], k.shape[1]), dtype=torch.bool,
                                 device=q.device)
        weightless[..., cols] = drop
        allowed = allowed & ~weightless
    k = k.masked_fill(bad.unsqueeze(-1), 0.0)
    poison = _nan_where(seen)
    return k, allowed, poison


def _keep_nan(out: torch.Tensor, lse: torch.Tensor | None, qt: torch.Tensor,
              math_sdpa: Callable[[], torch.Tensor] | None,
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """NaN in means NaN out (docs/contract.md). SDPA's CPU flash kernel returns a row of
    zeros where every score of a row is NaN (a NaN query, or only NaN keys visible): on the
    CPU, NaN of q is added back (one reduction over q) and, when some output row is exactly
    zero, the call is redone by SDPA's math kernel, which keeps NaN (rare: a zero row).
    ``math_sdpa`` None (dropout): no redo, which would draw again, conditioned on no zero
    row (a bias); SDPA runs its math kernel for dropout on the CPU anyway.
    The poison tests finiteness, not a sum: an fp16 row of large finite values sums to inf,
    and inf * 0 would turn an exact answer into NaN."""
    if qt.device.type != "cpu":
        return out, lse
    poison = _nan_rows(qt)
    out = out + poison.to(out.dtype)
    if math_sdpa is not None and bool((out == 0).all(-1).any()):
        out = math_sdpa() + poison.to(out.dtype)
    if lse is not None:  # a fully masked row keeps its -inf
        lse = torch.where(torch.isneginf(lse), lse, lse + poison.squeeze(-1))
    return out, lse


def _nan_rows(qt: torch.Tensor) -> torch.Tensor:
    """(..., S, 1) fp32: 0 on rows of finite values, NaN on rows holding NaN or inf."""
    finite = torch.isfinite(qt).all(-1, keepdim=True)
    return _nan_where(~finite)


def _nan_where(rows: torch.Tensor) -> torch.Tensor:
    """fp32 NaN where ``rows`` is set, else 0: an explicit dtype, since a poison added to an
    fp32 LSE must not promote it to ``torch.get_default_dtype()`` (float64 for some users)."""
    return torch.zeros(rows.shape, dtype=torch.float32, device=rows.device).masked_fill(
        rows, float("nan"))


def _native_causal(p: AttnParams, sq: int, sk: int) -> tuple[bool, object] | None:
    """``(is_causal, attn_mask)`` for SDPA when the mask needs no materialised tensor, else
    None. No mask at all: not causal, or one bottom-right query (it sees every key, the decode
    step of every KV-cache generate loop). SDPA's own ``is_causal`` (top-left): Sq == Sk or a
    top-left mask. ``causal_lower_right``: bottom-right with 1 < Sq < Sk (chunked prefill,
    speculative decode), which SDPA runs with flash/mem-efficient kernels on a GPU. Sq > Sk
    bottom-right has rows that see no key (0 out, -inf LSE) and keeps the explicit mask."""
    if (p.window is not None or p.prefix_lens is not None or p.colmask_start is not None
            or p.mask_mod is not None or p.alibi_slopes is not None):
        return None
    if not p.causal or (sq == 1 and p.alignment == "bottom_right"):
        return False, None
    if sq == sk or (p.alignment == "top_left" and sq <= sk):
        return True, None
    if sq < sk:
        return False, causal_lower_right(sq, sk)
    return None


def _cpu_needs_explicit_mask(native: tuple[bool, object], p: AttnParams,
                             k: torch.Tensor) -> bool:
    """On the CPU, the calls whose native causal form takes the explicit-mask path: those
    that want the LSE (the one-pass LSE kernel takes a materialised mask), and a causal call
    whose k holds NaN or inf (``is_causal`` or ``causal_lower_right``): wherever SDPA's
    math kernel serves it, it adds the causal mask as -inf, and NaN + -inf = NaN would reach
    rows that cannot see the key (``_hide_masked_nan_keys``). The math kernel serves more
    than gradients and dropout (Dv != D, a strided last dim, the flash switch off), so every
    causal call's k is scanned rather than guessing SDPA's choice."""
    if k.device.type != "cpu":
        return False
    return p.return_lse or ((native[0] or native[1] is not None)
                            and not bool(torch.isfinite(k).all()))


def _causal_allowed(p: AttnParams, sq: int, sk: int,
                    device: torch.device) -> torch.Tensor | None:
    """The (1, 1, Sq, Sk) causal mask for the LSE pass, None when every key is visible."""
    if not p.causal or (sq == 1 and p.alignment == "bottom_right"):
        return None
    return allowed_mask(p, 1, 1, sq, sk, device)


def _cpu_flash_with_lse(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor,
                        mask: torch.Tensor | None,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and natural-log LSE in one pass: the CPU flash kernel SDPA runs returns both
    (GQA native); it takes an additive mask of the query's dtype, not a boolean one, so a
    float bias (ALiBi) takes this path only in fp32, where the cast loses nothing, and one
    head dim for q, k and v (Dv != D takes SDPA and the LSE pass). Unlike SDPA, the raw op
    reads a last dimension of stride != 1 as if it were dense (garbage): such a tensor is
    copied first."""
    qt, kt, vt = (t if t.stride(-1) == 1 else t.contiguous() for t in (qt, kt, vt))
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=qt.dtype, device=qt.device).masked_fill(
            ~mask, float("-inf"))
    elif mask is not None:
        mask = mask.to(qt.dtype)
    if mask is not None:
        mask = mask.expand(qt.shape[0], qt.shape[1], qt.shape[2], kt.shape[2])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qt, kt, vt, 0.0, False, attn_mask=mask, scale=scale)
    return out, lse


def _lse(qt: torch.Tensor, kt: torch.Tensor, p: AttnParams, allowed: torch.Tensor | None,
         row_ok: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """LSE by a second pass over the scores, in query chunks: on a GPU SDPA's fused kernels
    do not return it (on the CPU ``_cpu_flash_with_lse`` gets it in the same pass)."""
    sq = qt.shape[2]
    kt = kt.float().repeat_interleave(qt.shape[1] // kt.shape[1], dim=1)
    chunks = []
    for s0 in range(0, sq, 1024):
        s = torch.matmul(qt[:, :, s0:s0 + 1024].float(), kt.transpose(-1, -2)) * p.scale
        if bias is not None:
            s = s + bias[..., s0:s0 + 1024, :]
        if allowed is not None:
            s = s.masked_fill(~allowed[..., s0:s0 + 1024, :], float("-inf"))
        chunks.append(torch.logsumexp(s, dim=-1))
    lse = torch.cat(chunks, dim=-1)
    if row_ok is not None:
        lse = lse.masked_fill(~row_ok.squeeze(-1), float("-inf"))
    return lse


@hookimpl
def attnhub_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(ReferenceBackend())
    register(TorchSDPABackend())
