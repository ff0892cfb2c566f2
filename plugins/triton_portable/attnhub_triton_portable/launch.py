"""Host side of the dense kernels: turn (q, k, v, AttnParams, layout) into kernel arguments.

Everything the forward and backward launches share lives here, checked once: strides per
layout (bshd has a batch stride, thd has cu_seqlens instead), mask scalars and side tensors
in the dtypes the kernels read, the column-sparse per-tile bounds used to skip tiles, and
whether the TMA path may be used (alignment rules of the tensor-memory engine).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from attnhub.plugin import AttnParams, InputError, window_within

from .configs import block_d, split_config

_INT32_MAX = 2**31 - 1


@functools.cache
def device_arch(device: torch.device) -> str:
    """``cpu`` (interpreter), ``sm90``, ``gfx942``...: the key of the tile tables."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        return str(getattr(props, "gcnArchName", "gfx")).split(":")[0]
    return f"sm{props.major}{props.minor}"


@functools.cache
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index``: the size of a wave of programs."""
    return torch.cuda.get_device_properties(index).multi_processor_count


#: CUDA's limit on a grid's second and third axes (the first takes 2**31 - 1).
MAX_GRID_Y = 65535


def flat_grid(n: int, block: int, rows: int) -> tuple[int]:
    """The 1-D grid of ``tiles.flat_program``: ``cdiv(n, block)`` tiles for each of ``rows``
    (B x heads). CUDA caps a grid's second axis at 65535, which a (tiles, B x H) grid
    passed with 65536 (sequence, head) pairs (a thd batch of 2048 documents x 32 heads):
    "invalid argument" at launch; the first axis takes 2**31 - 1, which a thd batch of many
    documents beside one very long one passes (every document gets the longest's tiles):
    refused here, by name, rather than by the driver (and the kernels' int32 program id)."""
    programs = -(-n // block) * rows
    if programs > _INT32_MAX:
        raise InputError(f"triton: {-(-n // block)} tiles of the longest sequence ({n} rows) "
                         f"x {rows} (sequence, head) pairs = {programs} programs, past a "
                         f"grid's {_INT32_MAX}; split the batch (or pass a tighter "
                         "max_seqlen)")
    return (programs,)


def launch_options(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a config into kernel constants and launch options, checking the block sizes."""
    consts, options = split_config(config)
    for key in ("BLOCK_M", "BLOCK_N"):
        n = consts.get(key)
        if not isinstance(n, int) or n < 16 or n & (n - 1):
            raise InputError(f"tile config {key}={n!r}: use a power of two >= 16 "
                             f"(config {config})")
    return consts, options


def _torch_scratch(size: int, alignment: int, stream: Any) -> torch.Tensor:
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_tma_allocator() -> None:
    """Device-side TMA descriptors need Triton's scratch allocator. Triton keeps it in a
    ContextVar, i.e. per thread, and autograd runs the backward on a thread of its own: so
    check on every launch and set a torch-backed one where none is set (never replacing a
    caller's)."""
    import triton
    from triton.runtime import _allocation

    holder = getattr(_allocation, "_allocator", None)
    current = holder.get() if hasattr(holder, "get") else None
    if current is None or type(current).__name__ == "NullAllocator":
        triton.set_allocator(_torch_scratch)


@dataclass
class DenseArgs:
    """Validated kernel arguments of one dense attention call (see ``from_params``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    varlen: bool
    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seqlen_q: int
    seqlen_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    cu_q: torch.Tensor | None
    cu_k: torch.Tensor | None
    scale: float
    softcap: float
    left: int
    right: int
    causal: bool
    bottom_right: bool
    slopes: torch.Tensor | None
    slope_stride_b: int
    prefix: torch.Tensor | None
    colmask_start: torch.Tensor | None
    colmask_end: torch.Tensor | None
    cm_div: int
    _tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def block_d(self) -> int:
        return block_d(self.head_dim)

    @property
    def colmask(self) -> bool:
        return self.colmask_start is not None

    @property
    def dot_precision(self) -> str | None:
        """fp32 inputs must not silently run their dots in TF32."""
        return "ieee" if self.q.dtype == torch.float32 or _interpreting() else None

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_params(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    params: AttnParams, layout: str) -> DenseArgs:
        """Check the call against what the kernels implement and pack its arguments."""
        if layout not in ("bshd", "thd"):
            raise InputError(f"triton dense kernels take layout bshd or thd, not {layout!r}")
        if v.shape[-1] != q.shape[-1]:
            raise InputError(f"triton: value head dim {v.shape[-1]} != {q.shape[-1]}; "
                             "pad v to the query head dim or use another backend")
        if q.shape[-1] > 256:
            raise InputError(f"triton: head dim {q.shape[-1]} > 256; use another backend")
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        hq, hkv = q.shape[-2], k.shape[-2]
        if params.score_mod is not None or params.mask_mod is not None:
            raise InputError("triton dense kernels take no score_mod/mask_mod; use the flex "
                             "backend for those")
        if layout == "thd":
            if params.cu_seqlens_q is None or params.cu_seqlens_k is None:
                raise InputError("layout thd needs cu_seqlens_q and cu_seqlens_k (int32, B+1)")
            cu_q = params.cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
            cu_k = params.cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
            batch = cu_q.numel() - 1
            max_q = params.max_seqlen_q or int((cu_q[1:] - cu_q[:-1]).max()) if batch else 0
            max_k = params.max_seqlen_k or int((cu_k[1:] - cu_k[:-1]).max()) if batch else 0
            seqlen_q = seqlen_k = 0
        else:
            cu_q = cu_k = None
            batch = q.shape[0]
            seqlen_q = max_q = q.shape[1]
            seqlen_k = max_k = k.shape[1]
        if not params.scale > 0:
            raise InputError(f"triton: softmax scale {params.scale} must be > 0 (the kernels "
                             "take row maxima on unscaled scores)")
        # an edge past every key is -1: the kernels add edges to positions in int32
        left, right = window_within(params.window, max(max_q, max_k)) or (-1, -1)
        if params.prefix_lens is not None and not params.causal:
            raise InputError("prefix_lens needs causal=True: prefix-LM is causal after the "
                             "prefix")
        slopes, slope_stride = _slopes(params.alibi_slopes, batch, hq, q.device)
        prefix = (_per_batch(params.prefix_lens, batch, q.device, "prefix_lens")
                  if params.prefix_lens is not None else None)
        cm_start, cm_end, cm_div = _colmask(params, layout, batch, hq, hkv, max_q, max_k,
                                            q.device)
        return cls(q=q, k=k, v=v, varlen=layout == "thd", batch=batch, num_heads=hq,
                   num_kv_heads=hkv, head_dim=q.shape[-1], seqlen_q=seqlen_q,
                   seqlen_k=seqlen_k, max_seqlen_q=max_q, max_seqlen_k=max_k, cu_q=cu_q,
                   cu_k=cu_k, scale=float(params.scale), softcap=float(params.softcap or 0.0),
                   left=int(left), right=int(right), causal=bool(params.causal),
                   bottom_right=params.alignment == "bottom_right", slopes=slopes,
                   slope_stride_b=slope_stride, prefix=prefix, colmask_start=cm_start,
                   colmask_end=cm_end, cm_div=cm_div)

    # -- what the launches need --------------------------------------------------------------
    def mask_constants(self) -> dict[str, Any]:
        """The kernels' compile-time switches: each mask feature costs nothing when off."""
        return {"CAUSAL": self.causal, "BOTTOM_RIGHT": self.bottom_right,
                "WIN_LEFT": self.left >= 0, "WIN_RIGHT": self.right >= 0,
                "SOFTCAP": self.softcap > 0, "ALIBI": self.slopes is not None,
                "PREFIX_LM": self.prefix is not None, "COLMASK": self.colmask,
                "VARLEN": self.varlen, "DOT_PREC": self.dot_precision,
                "DOT_UPCAST": self.q.dtype == torch.bfloat16 and _interpreting()}

    def mask_scalars(self) -> tuple[Any, ...]:
        """(scale, softcap, left, right, slopes, slopes batch stride, prefix lengths)."""
        return (self.scale, self.softcap, self.left, self.right, self.slopes,
                self.slope_stride_b, self.prefix)

    def bsh_strides(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, sequence, head) strides in elements; thd has no batch stride."""
        if self.varlen:
            return 0, t.stride(0), t.stride(1)
        return t.stride(0), t.stride(1), t.stride(2)

    def new_lse(self) -> torch.Tensor:
        """LSE (B, Hq, Sq) for bshd or (Hq, Tq) for thd, -inf where no program writes."""
        if self.varlen:
            return torch.full((self.num_heads, self.q.shape[0]), float("-inf"),
                              device=self.q.device, dtype=torch.float32)
        return torch.empty((self.batch, self.num_heads, self.seqlen_q), device=self.q.device,
                           dtype=torch.float32)

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int]:
        """(batch, head) strides of an LSE-shaped tensor; the row stride is 1."""
        if self.varlen:
            return 0, lse.stride(0)
        return lse.stride(0), lse.stride(1)

    def colmask_tiles(self, block_n: int) -> tuple[Any, ...]:
        """Column-sparse kernel arguments for key tiles of ``block_n`` columns.

        Returns (start, end, batch stride, head stride, head divisor, tile max start, tile min
        end, tile batch stride, tile head stride); a tile whose max start <= a block's first
        row and min end >= its last row masks the whole block and is skipped.
        """
        if not self.colmask:
            return (None, None, 0, 0, 1, None, None, 0, 0)
        s, e = self.colmask_start, self.colmask_end
        if block_n not in self._tiles:
            sk = s.shape[-1]
            nt = max(1, math.ceil(sk / block_n))
            pad = nt * block_n - sk
            tmax = F.pad(s, (0, pad), value=0).reshape(*s.shape[:2], nt, block_n).amax(-1)
            tmin = F.pad(e, (0, pad), value=_INT32_MAX).reshape(*e.shape[:2], nt, block_n)
            self._tiles[block_n] = (tmax.contiguous(), tmin.amin(-1).contiguous())
        tmax, tmin = self._tiles[block_n]
        return (s, e, s.stride(0), s.stride(1), self.cm_div, tmax, tmin, tmax.stride(0),
                tmax.stride(1))

    def tma_ok(self, consts: dict[str, Any], *extra: torch.Tensor) -> bool:
        """Whether the TMA path may run: asked for (or sm90+ by default) and every base
        address and row stride 16-byte aligned, as the tensor-memory engine requires."""
        want = consts.get("USE_TMA")
        if want is False or self.q.device.type != "cuda" or self.max_seqlen_k == 0:
            return False
        if want is None and (getattr(torch.version, "hip", None)
                             or torch.cuda.get_device_capability(self.q.device)[0] < 9):
            return False
        ok = all(_tma_aligned(t) for t in (self.q, self.k, self.v, *extra))
        if want and not ok:
            raise InputError("tile config asks USE_TMA=True but q/k/v are not 16-byte aligned "
                             "(head dim x element size and strides must be multiples of 16)")
        if ok:
            _ensure_tma_allocator()
        return ok


def _interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels index the head dim with unit stride; copy only when it is not. A lazily
    negated view (``z.conj().imag``) is materialised: a kernel reads its memory un-negated."""
    if t.is_neg():
        t = t.resolve_neg()
    return t if t.stride(-1) == 1 else t.contiguous()


def _tma_aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in t.stride()[:-1])
            and (t.shape[-1] * size) % 16 == 0)


def _slopes(slopes: torch.Tensor | None, batch: int, hq: int,
            device: torch.device) -> tuple[torch.Tensor | None, int]:
    if slopes is None:
        return None, 0
    s = slopes.to(device=device, dtype=torch.float32).contiguous()
    if s.shape == (hq,):
        return s, 0
    if s.shape == (batch, hq):
        return s, hq
    raise InputError(f"alibi_slopes has shape {tuple(slopes.shape)}; use ({hq},) or "
                     f"({batch}, {hq}) (fp32, one slope per query head)")


def _per_batch(t: torch.Tensor, batch: int, device: torch.device, name: str) -> torch.Tensor:
    if t.dim() != 1 or t.shape[0] != batch:
        raise InputError(f"{name} has shape {tuple(t.shape)}; use ({batch},), one per sequence")
    return t.to(device=device, dtype=torch.int32).contiguous()


def _colmask(params: AttnParams, layout: str, batch: int, hq: int, hkv: int, sq: int, sk: int,
             device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(start, end, query heads per mask head) as int32 (B, Hm, Sk), end defaulting to Sq."""
    if params.colmask_start is None:
        if params.colmask_end is not None:
            raise InputError("colmask_end given without colmask_start; give both (or start "
                             "alone, which masks rows start..Sq)")
        return None, None, 1
    if layout == "thd":
        raise InputError("column-sparse masks (colmask_start/end) are per batch row: use the "
                         "bshd layout, not thd")
    start = params.colmask_start
    if start.dim() != 3 or start.shape[-1] != sk or start.shape[0] not in (1, batch):
        raise InputError(f"colmask_start has shape {tuple(start.shape)}; use (B={batch}, "
                         f"Hkv={hkv} or 1, Sk={sk})")
    hm = start.shape[1]
    if hm not in (1, hkv, hq):
        raise InputError(f"colmask_start has {hm} heads; use 1, Hkv={hkv} or Hq={hq}")
    end = params.colmask_end
    if end is None:
        end = torch.full_like(start, sq)
    elif end.shape != start.shape:
        raise InputError(f"colmask_end shape {tuple(end.shape)} != colmask_start shape "
                         f"{tuple(start.shape)}")
    start, end = (t.to(device=device, dtype=torch.int32).expand(batch, hm, sk).contiguous()
                  for t in (start, end))
    return start, end, hq // hm
