"""What an attention call asks for, as small frozen values.

``AttentionSpec`` is the policy's view of a call: hashable and bucketed, so that resolution is
done once per bucket and the hot path is a dict lookup. ``AttnParams`` carries the per-call
data a kernel needs (scale, window sizes, slopes, cu_seqlens, block tables, callables) and is
never part of a cache key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal

import torch

Phase = Literal["train", "prefill", "decode"]
Layout = Literal["bshd", "bhsd", "thd", "paged"]
Alignment = Literal["bottom_right", "top_left"]

PHASES: tuple[str, ...] = ("train", "prefill", "decode")
LAYOUTS: tuple[str, ...] = ("bshd", "bhsd", "thd", "paged")
DTYPES: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
#: Every mask kind the vocabulary knows; ``none`` means full bidirectional attention.
MASK_KINDS: tuple[str, ...] = (
    "none",
    "causal",
    "sliding_window",
    "alibi",
    "softcap",
    "prefix_lm",
    "document",
    "column_sparse",
    "score_mod",
    "mask_mod",
)

_TORCH_TO_NAME: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
}
for _attr, _name in (("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2")):
    if hasattr(torch, _attr):
        _TORCH_TO_NAME[getattr(torch, _attr)] = _name
_NAME_TO_TORCH = {v: k for k, v in _TORCH_TO_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``; raises for dtypes attention does not take."""
    try:
        return _TORCH_TO_NAME[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} is not an attention dtype; use one of {', '.join(DTYPES)}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``."""
    try:
        return _NAME_TO_TORCH[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def bucket(n: int) -> int:
    """Round a length up to a power of two (0 stays 0) so specs make cheap cache keys."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


@dataclass(frozen=True, slots=True)
class MaskSpec:
    """The shape of the mask, without its data: what a backend must support.

    ``window`` is ``(left, right)`` in keys, -1 meaning unbounded, measured from the query's
    aligned position. ``alignment`` only matters when Sq != Sk: ``bottom_right`` (the
    FlashAttention/FlashInfer convention) lines the last query up with the last key.
    """

    causal: bool = False
    alignment: Alignment = "bottom_right"
    window: tuple[int, int] | None = None
    alibi: bool = False
    softcap: bool = False
    prefix_lm: bool = False
    document: bool = False
    column_sparse: bool = False
    score_mod: str | None = None
    mask_mod: str | None = None

    @property
    def kinds(self) -> frozenset[str]:
        """The mask kinds present, e.g. ``{"causal", "softcap"}``; ``{"none"}`` when empty."""
        k = set()
        if self.causal:
            k.add("causal")
        if self.window is not None:
            k.add("sliding_window")
        for flag in ("alibi", "softcap", "prefix_lm", "document", "column_sparse"):
            if getattr(self, flag):
                k.add(flag)
        if self.score_mod is not None:
            k.add("score_mod")
        if self.mask_mod is not None:
            k.add("mask_mod")
        return frozenset(k or {"none"})

    def describe(self) -> str:
        parts = sorted(self.kinds)
        if self.causal:
            parts[parts.index("causal")] = f"causal({self.alignment})"
        if self.window is not None:
            parts[parts.index("sliding_window")] = f"window{self.window}"
        return "+".join(parts)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """A bucketed, hashable description of an attention call: the policy's cache key."""

    phase: Phase = "prefill"
    dtype: str = "bf16"
    kv_dtype: str | None = None
    head_dim: int = 128
    head_dim_v: int | None = None
    num_q_heads: int = 32
    num_kv_heads: int = 32
    layout: Layout = "bshd"
    mask: MaskSpec = field(default_factory=MaskSpec)
    max_seqlen_q: int = 1
    max_seqlen_k: int = 1
    batch: int = 1
    needs_grad: bool = False
    deterministic: bool = False
    return_lse: bool = False
    #: Tokens per KV page for the ``paged`` layout (0 otherwise): kernels constrain it.
    page_size: int = 0
    #: Attention dropout on the probabilities (``dropout_p > 0``): only backends that
    #: declare it may serve (the probability itself is per call, in ``AttnParams``).
    dropout: bool = False

    def __post_init__(self) -> None:
        if self.kv_dtype is None:
            object.__setattr__(self, "kv_dtype", self.dtype)
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    @property
    def gqa_ratio(self) -> int:
        return self.num_q_heads // max(self.num_kv_heads, 1)

    def bucketed(self) -> "AttentionSpec":
        """The same spec with lengths and batch rounded up to powers of two."""
        return replace(
            self,
            max_seqlen_q=bucket(self.max_seqlen_q),
            max_seqlen_k=bucket(self.max_seqlen_k),
            batch=bucket(self.batch),
        )

    def with_(self, **changes: Any) -> "AttentionSpec":
        return replace(self, **changes)

    def describe(self) -> str:
        kv = f"/{self.kv_dtype}" if self.kv_dtype != self.dtype else ""
        return (
            f"{self.phase} {self.dtype}{kv} d={self.head_dim} heads={self.num_q_heads}:"
            f"{self.num_kv_heads} {self.layout} mask={self.mask.describe()} "
            f"sq<={self.max_seqlen_q} sk<={self.max_seqlen_k} b<={self.batch}"
            + (" grad" if self.needs_grad else "")
            + (" deterministic" if self.deterministic else "")
            + (" lse" if self.return_lse else "")
            + (f" page={self.page_size}" if self.page_size else "")
            + (" dropout" if self.dropout else "")
        )


ScoreMod = Callable[..., torch.Tensor]
MaskMod = Callable[..., torch.Tensor]


@dataclass(slots=True)
class AttnParams:
    """Per-call data for a kernel; never hashed, never seen by the policy.

    Shapes (B batch, Hq/Hkv heads, S lengths):
      alibi_slopes: (Hq,) or (B, Hq) fp32.
      prefix_lens: (B,) int; keys below the prefix are visible to every query (prefix-LM).
      colmask_start/colmask_end: (B, Hkv or 1, Sk) int32; rows in [start, end) are masked for
        that key column (FlashMask-style column-sparse ranges), in query positions.
      cu_seqlens_q/k: (B+1,) int32 for the ``thd`` layout (documents / varlen).
      block_table: (B, max_pages) int32 and seqlens_k: (B,) int32 for the ``paged`` layout.
      score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx, kv_idx) follow
        FlexAttention's signature and work on broadcastable index tensors.
      dropout_p: in [0, 1); each probability is zeroed with it and the others scaled by
        1 / (1 - dropout_p), drawn from torch's generator of q's device.
    """

    scale: float
    causal: bool = False
    alignment: Alignment = "bottom_right"
    window: tuple[int, int] | None = None
    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None
    colmask_start: torch.Tensor | None = None
    colmask_end: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    block_table: torch.Tensor | None = None
    seqlens_k: torch.Tensor | None = None
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    deterministic: bool = False
    return_lse: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    dropout_p: float = 0.0

    def fresh(self) -> AttnParams:
        """A copy for one backend call: what a backend changes in it (a field, an ``extra``
        entry) stays with that call and never reaches a fallback or another candidate."""
        return replace(self, extra=dict(self.extra) if self.extra else {})
