"""``flashinfer_decode`` and ``flashinfer_prefill``: FlashInfer's batch kernels over a paged KV
cache, with ``plan()`` kept off the hot path.

A FlashInfer wrapper is planned for one batch layout (page table, lengths, heads, dtypes,
mask) and then ``run()`` any number of times; every layer of a model step shares one layout.
The wrapper's plan is cached under that layout's key (tensor identity + in-place version of
``block_table`` and ``seqlens_k``, so a step that writes new lengths replans), and
:meth:`FlashInferPagedBackend.plan` lets a serving loop plan explicitly before capturing
``run()`` in a CUDA graph. Caches are (pages, page_size, Hkv, D): NHD storage, or a transposed
view of HND storage (pages, Hkv, page_size, D), detected from strides.

FlashInfer returns base-2 LSE; it is converted to natural log here. Rows that see no key (an
empty sequence, or the first Sq - seqlens_k queries of a causal chunk longer than its cache)
are set to output 0 and LSE -inf here: FlashInfer before 0.6.18 masked with a finite sentinel
(-5e4) and returned a finite LSE for such rows (flashinfer PR 4401).

The CUDA-core decode kernel is compiled for GQA group sizes 1, 2, 3, 4 and 8 only
(``DISPATCH_GQA_GROUP_SIZE`` in ``include/flashinfer/utils.cuh``; 6 from 0.6.18): plan() raises
"Unsupported group_size" for any other ratio, so those decodes take the tensor-core kernel (the
prefill kernels, any group size).
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from attnhub.plugin import (
    HALF_DTYPES,
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    BackendUnavailableError,
    Capabilities,
    DeviceInfo,
    unit_head_stride,
)

from .decode_choice import choose_tensor_cores
from .paged_csr import PagedCSR, block_table_to_csr, kv_layout_of, tensor_key
from .probe import FlashInferBuild, flashinfer_build

INSTALL_FLASHINFER = "pip install 'attnhub-sm80-fa2[flashinfer]'"
WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace
LN2 = math.log(2.0)
#: GQA group sizes FlashInfer's CUDA-core decode kernel is compiled for (``utils.cuh``,
#: ``DISPATCH_GQA_GROUP_SIZE``: 1, 2, 3, 4, 8; 6 only from 0.6.18, left out to stay exact on
#: older releases): another ratio needs the tensor-core (prefill) kernel
CUDA_CORE_DECODE_GROUPS = frozenset({1, 2, 3, 4, 8})


def rows_without_keys(seqlens_k: torch.Tensor, sq: int, causal: bool,
                      empty_seqs: torch.Tensor | None | bool = True) -> torch.Tensor | None:
    """(B, Sq) bool of the query rows that see no key, or None when every row sees one: every
    row of an empty sequence, and under bottom-right causal the first ``Sq - seqlens_k``
    rows (query i sits at key ``i + seqlens_k - Sq``). A left window never empties a row
    that sees its own diagonal key. Computed at plan time (one host read per plan), none
    where only empty sequences have such rows (one query, or not causal) and ``empty_seqs``
    (the CSR's (B,) bool of them, or None) says which: decode plans read nothing more."""
    if empty_seqs is not True and (sq == 1 or not causal):
        return None if empty_seqs is None else empty_seqs.view(-1, 1).expand(-1, sq)
    lens = seqlens_k.to(torch.int64).view(-1, 1)
    rows = torch.arange(sq, device=lens.device).view(1, sq)
    empty = rows < sq - lens if causal else (lens == 0) & (rows >= 0)
    return empty if bool(empty.any()) else None


def flashinfer_capabilities(build: FlashInferBuild, phases: frozenset[str],
                            max_query_len_decode: int | None) -> Capabilities:
    """Declared from what the wrappers take (``FlashInferBuild``: by the installed version,
    since plan() may be ``**kwargs``): windows and softcap only where plan takes them."""
    masks = {"causal"}
    if build.window:
        masks.add("sliding_window")
    if build.softcap:
        masks.add("softcap")
    return Capabilities(
        vendors=frozenset({"cuda"}), min_capability=(8, 0), dtypes=HALF_DTYPES,
        head_dims=frozenset({64, 128, 256}), masks=frozenset(masks), phases=phases,
        layouts=frozenset({"paged"}), top_left_causal=False, returns_lse=build.lse,
        max_query_len_decode=max_query_len_decode, deterministic_forward=True, gqa=True,
    )


@dataclass
class Plan:
    """One planned wrapper and what it was planned for."""

    key: tuple[Any, ...]
    wrapper: Any
    csr: PagedCSR
    keepalive: tuple[torch.Tensor, ...]
    tensor_cores: bool = False
    reason: str = ""
    hnd: bool = False  # the cache is a (pages, page, H, D) view of HND storage
    #: (B, Sq) rows that see no key (output 0, LSE -inf), None when there is none
    empty_rows: torch.Tensor | None = None
    #: the slot whose wrapper holds this plan (its lock spans a plan's run)
    slot: Any = field(default=None, repr=False, compare=False)


@dataclass
class _Slot:
    """A wrapper per (device, kv layout, tensor cores), holding its current plan."""

    wrapper: Any
    plan: Plan | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class FlashInferPagedBackend(Backend):
    """Shared machinery: workspace, plan cache, CSR conversion, run and LSE conversion."""

    tier = "serving"
    requires = {"flashinfer": INSTALL_FLASHINFER}
    phases: ClassVar[frozenset[str]] = frozenset()
    max_query_len: ClassVar[int | None] = None
    workspace_bytes: int = WORKSPACE_BYTES

    def __init__(self) -> None:
        super().__init__()
        self._workspace: dict[torch.device, torch.Tensor] = {}
        self._slots: dict[tuple[Any, ...], _Slot] = {}
        self._slots_lock = threading.Lock()
        self._fast: dict[tuple[Any, ...], tuple[_Slot, Plan]] = {}
        #: Decode kernel choices made so far: (gqa, batch, seqlen_k) -> (tensor cores, why).
        self.choices: dict[tuple[int, int, int], tuple[bool, str]] = {}

    @functools.cached_property
    def build(self) -> FlashInferBuild:
        return flashinfer_build()

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return flashinfer_capabilities(self.build, self.phases, self.max_query_len)

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        if (old := self.build.too_old) is not None:
            return [old]
        m = spec.mask
        if m.window is not None and m.alignment == "top_left" and not m.causal:
            return ["top-left windows not supported (FlashInfer aligns bottom-right)"]
        if (m.window is not None and not m.causal and m.window[1] > 0
                and spec.phase != "decode"):
            return [f"window {m.window}: FlashInfer bounds windows on the left only "
                    "(right must be -1, or 0 with causal)"]
        return []

    def _load(self) -> None:
        import flashinfer

        self._fi = flashinfer

    # -- planning (host side, outside CUDA graphs) ------------------------------------------
    def plan(self, q: torch.Tensor, k_cache: torch.Tensor, params: AttnParams) -> Plan:
        """Plan (or reuse the plan of) this batch layout; call once per step before capture.

        The hot path is one tuple and one dict lookup: the layout's cheap key (identity and
        version of the tables, shapes, mask) maps to the slot and plan made for it, valid
        while that slot still holds that plan.
        """
        bt, sl = params.block_table, params.seqlens_k
        fast = (id(bt), bt._version, id(sl), sl._version, q.shape, k_cache.shape,
                k_cache.stride(), q.dtype, k_cache.dtype, q.device, params.causal,
                params.window, params.softcap, params.scale)
        hit = self._fast.get(fast)
        if hit is not None and hit[0].plan is hit[1]:
            return hit[1]
        self.load()
        layout = kv_layout_of(k_cache)
        causal, window_left, mask_key = self._mask(q, params)
        b, sq, hq, d = q.shape
        hkv, page = k_cache.shape[2], k_cache.shape[1]
        max_k = params.max_seqlen_k or int(params.seqlens_k.max())
        use_tc, why = self._tensor_cores(hq // hkv, b, max_k)
        key = (tensor_key(params.block_table), tensor_key(params.seqlens_k), b, sq, hq, hkv, d,
               page, q.dtype, k_cache.dtype, mask_key, params.scale, use_tc)
        slot = self._slot(q.device, layout, use_tc)
        with slot.lock:
            if slot.plan is not None and slot.plan.key == key:
                self._fast[fast] = (slot, slot.plan)
                return slot.plan
            csr = block_table_to_csr(params.block_table, params.seqlens_k, page)
            kw: dict[str, Any] = {"sm_scale": params.scale, "q_data_type": q.dtype,
                                  "kv_data_type": k_cache.dtype}
            if window_left >= 0:
                kw["window_left"] = window_left
            if params.softcap:
                kw["logits_soft_cap"] = float(params.softcap)
            self._plan_wrapper(slot.wrapper, csr, q, hkv, page, causal, kw)
            empty = rows_without_keys(params.seqlens_k, sq, causal, csr.empty)
            slot.plan = Plan(key, slot.wrapper, csr, (params.block_table, params.seqlens_k),
                             use_tc, why, layout == "HND", slot=slot, empty_rows=empty)
            if len(self._fast) > 64:
                self._fast.clear()
            self._fast[fast] = (slot, slot.plan)
            return slot.plan

    def _mask(self, q: torch.Tensor, params: AttnParams) -> tuple[bool, int, tuple[Any, ...]]:
        """(causal, window_left, key part) in FlashInfer's bottom-right terms."""
        left, right = params.window if params.window is not None else (-1, -1)
        causal = params.causal or (right == 0 and q.shape[1] > 1)
        if right > 0 and not causal and q.shape[1] > 1:
            raise BackendUnavailableError(self.name, [
                f"window {params.window}: FlashInfer bounds windows on the left only"])
        return causal, left, (causal, left, params.softcap)

    def _tensor_cores(self, gqa: int, batch: int, seqlen_k: int) -> tuple[bool, str]:
        return False, "prefill kernel (tensor cores)"

    def _slot(self, device: torch.device, layout: str, use_tc: bool) -> _Slot:
        key = (device, layout, use_tc)
        with self._slots_lock:
            slot = self._slots.get(key)
            if slot is None:
                ws = self._workspace.get(device)
                if ws is None:
                    ws = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
                    self._workspace[device] = ws
                slot = _Slot(self._new_wrapper(ws, layout, use_tc))
                self._slots[key] = slot
            return slot

    def _new_wrapper(self, workspace: torch.Tensor, layout: str, use_tc: bool) -> Any:
        raise NotImplementedError

    def _plan_wrapper(self, wrapper: Any, csr: PagedCSR, q: torch.Tensor, hkv: int,
                      page: int, causal: bool, kw: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- the hot path ------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise BackendUnavailableError(self.name, [
                f"the paged cache's head dim has stride {k.stride(-1)}/{v.stride(-1)}: "
                "FlashInfer reads it as dense; pass caches whose last dim is contiguous"])
        if k.stride() != v.stride():  # one layout (NHD/HND) is detected from k for both
            raise BackendUnavailableError(self.name, [
                f"the paged k/v caches have different strides {k.stride()}/{v.stride()}: "
                "FlashInfer reads both with one layout and one set of strides; pass k and v "
                "caches of one storage layout"])
        (q,) = unit_head_stride(q)
        b, sq, hq, d = q.shape
        while True:  # a wrapper holds one plan: another thread may plan it between our
            plan = self.plan(q, k, params)  # plan and run, so the run checks under its lock
            with plan.slot.lock:
                if plan.slot.plan is plan:
                    kv = (k.transpose(1, 2), v.transpose(1, 2)) if plan.hnd else (k, v)
                    res = plan.wrapper.run(q.reshape(b * sq, hq, d), kv,
                                           return_lse=params.return_lse)
                    break
        out, lse = res if params.return_lse else (res, None)
        out = out.view(b, sq, hq, out.shape[-1])
        if lse is not None:
            lse = lse.view(b, sq, hq).transpose(1, 2) * LN2
        if plan.empty_rows is not None:  # rows without keys: output 0, LSE -inf
            out = out.masked_fill(plan.empty_rows.view(b, sq, 1, 1), 0.0)
            if lse is not None:
                lse = lse.masked_fill(plan.empty_rows.view(b, 1, sq), float("-inf"))
        return AttentionOutput(out, lse)


class FlashInferDecodeBackend(FlashInferPagedBackend):
    """BatchDecodeWithPagedKVCacheWrapper: one query token per sequence."""

    name = "flashinfer_decode"
    description = ("FlashInfer batch decode over a paged KV cache (NHD/HND, any page size, GQA, "
                   "window, softcap); tensor-core kernel chosen from measurements")
    phases = frozenset({"decode"})
    max_query_len = 1

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        r = super().extra_checks(spec, device)
        group = spec.num_q_heads // max(spec.num_kv_heads, 1)
        if group not in CUDA_CORE_DECODE_GROUPS and not self.build.tensor_core_choice:
            r.append(f"GQA group size {group}: FlashInfer's CUDA-core decode kernel is built for "
                     f"group sizes {sorted(CUDA_CORE_DECODE_GROUPS)} only and this build has no "
                     "use_tensor_cores switch; use flashinfer_prefill or triton_decode")
        return r

    def _tensor_cores(self, gqa: int, batch: int, seqlen_k: int) -> tuple[bool, str]:
        if not self.build.tensor_core_choice:
            return False, "this FlashInfer build has no use_tensor_cores switch"
        if gqa not in CUDA_CORE_DECODE_GROUPS:  # plan() would raise "Unsupported group_size"
            use, why = True, (f"tensor cores: GQA group size {gqa} is not compiled into the "
                              f"CUDA-core decode kernel ({sorted(CUDA_CORE_DECODE_GROUPS)})")
            self.choices[(gqa, batch, seqlen_k)] = (use, why)
            return use, why
        use, why = choose_tensor_cores(gqa, batch, seqlen_k)
        self.choices[(gqa, batch, seqlen_k)] = (use, why)
        return use, why

    def _new_wrapper(self, workspace: torch.Tensor, layout: str, use_tc: bool) -> Any:
        kw = {"use_tensor_cores": True} if use_tc else {}
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(workspace, layout, **kw)

    def _plan_wrapper(self, wrapper: Any, csr: PagedCSR, q: torch.Tensor, hkv: int,
                      page: int, causal: bool, kw: dict[str, Any]) -> None:
        wrapper.plan(csr.indptr, csr.indices, csr.last_page_len, q.shape[2], hkv, q.shape[3],
                     page, **kw)


class FlashInferPrefillBackend(FlashInferPagedBackend):
    """BatchPrefillWithPagedKVCacheWrapper: several query tokens per sequence (chunked
    prefill, append, speculative decode) against the paged cache."""

    name = "flashinfer_prefill"
    description = ("FlashInfer batch prefill over a paged KV cache (NHD/HND, any page size, GQA, "
                   "causal bottom-right, window, softcap)")
    phases = frozenset({"prefill", "decode"})

    def _new_wrapper(self, workspace: torch.Tensor, layout: str, use_tc: bool) -> Any:
        return self._fi.BatchPrefillWithPagedKVCacheWrapper(workspace, layout)

    def _plan_wrapper(self, wrapper: Any, csr: PagedCSR, q: torch.Tensor, hkv: int,
                      page: int, causal: bool, kw: dict[str, Any]) -> None:
        b, sq = q.shape[:2]
        qo_indptr = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
        wrapper.plan(qo_indptr, csr.indptr, csr.indices, csr.last_page_len, q.shape[2], hkv,
                     q.shape[3], page, causal=causal, **kw)
