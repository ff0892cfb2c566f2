"""FP8 (e4m3) storage for the paged KV cache: one descale per (layer, page, KV head).

Decode reads the whole KV cache on every step, so an e4m3 cache halves the bytes a decode
kernel moves. Each page keeps its own descale per KV head (a key is ``stored * descale``),
which the paged kernels read beside the page id (``triton_decode_fp8``:
``k_descale``/``v_descale`` of shape (num_pages, Hkv)). A page is filled over several
writes (prefill, then one token per decode step), so its descale can only grow: when new
tokens exceed what the page's descale can represent, the tokens already in the page are
requantized to the larger descale first. The descale grows to a power of two, so that
requantizing multiplies the codes by a power of two, which e4m3 holds exactly (a token
loses bits only where it falls below e4m3's normal range): growing by just what a new
token needed (a ratio near 1) rounded most codes back to themselves while the descale
grew, and a page grown ~3% a step read its first token back 3x too large after 40 steps.
FP8 is not exact: ``attnhub fp8-check --kv`` measures the
error of this cache end to end, and the default policy reads an FP8 cache only behind a
passing record.
"""

from __future__ import annotations

import torch

from ..errors import InputError

#: e4m3 storage dtypes and the largest finite value of each.
FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0}
#: Smallest descale kept, so that an all-zero page never divides by zero.
_TINY = 2.0 ** -60


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` stores FP8 values with descales."""
    return dtype in FP8_MAX


class PageScales:
    """The k and v descales of an FP8 paged cache: (num_layers, num_pages, Hkv) fp32 each.

    A page's descales start at a tiny value when it is (re)allocated, so its first write
    sets them from that write's own range (stale values of a reused page only shrink).
    """

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if not is_fp8(dtype):
            raise InputError(f"PageScales: {dtype} is not an FP8 cache dtype; use one of "
                             f"{', '.join(map(str, FP8_MAX))}")
        self.dtype = dtype
        self.max = FP8_MAX[dtype]
        self.k = torch.full((num_layers, num_pages, num_kv_heads), _TINY,
                            dtype=torch.float32, device=device)
        self.v = self.k.clone()

    def descales(self, layer: int) -> dict[str, torch.Tensor]:
        """``extra`` entries of an attention call over layer ``layer``'s pages:
        ``{"k_descale": (num_pages, Hkv), "v_descale": (num_pages, Hkv)}``."""
        return {"k_descale": self.k[layer], "v_descale": self.v[layer]}

    def dequantize(self, layer: int, idx: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 values of pages ``idx`` of ``layer`` (k/v: those pages, e4m3)."""
        return (dequantize_pages(k, self.k[layer, idx]),
                dequantize_pages(v, self.v[layer, idx]))

    def reset_page(self, page: int) -> None:
        """A page handed to a sequence afresh: forget the descales of its previous owner."""
        self.k[:, page] = _TINY
        self.v[:, page] = _TINY

    def copy_page(self, src: int, dst: int) -> None:
        """Copy-on-write of a page: its descales go with its values (every layer)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def write(self, k_pages: torch.Tensor, v_pages: torch.Tensor, layer: int,
              slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize k/v (N, Hkv, D) into ``slots`` (N,) of one layer's pages
        (num_pages, page_size, Hkv, D), growing page descales as needed."""
        for name, x in (("k", k), ("v", v)):
            if not x.is_floating_point() or is_fp8(x.dtype):
                raise InputError(f"FP8 KV cache write: {name} is {x.dtype}; pass the "
                                 "fp16/bf16/fp32 values, the cache quantizes them")
        # checked before anything is written, so a rejected write leaves the cache as it was
        if not bool(torch.isfinite(k).all() & torch.isfinite(v).all()):
            raise InputError("FP8 KV cache write: k/v hold NaN or inf, which e4m3 cannot "
                             "store with a finite page descale")
        for pages, scales, x in ((k_pages, self.k[layer], k), (v_pages, self.v[layer], v)):
            _write(pages, scales, slots, x, self.max)


def _write(pages: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
           fmax: float) -> None:
    page_size = pages.shape[1]
    touched, inv = torch.unique(slots // page_size, return_inverse=True)
    amax = x.abs().amax(-1).float()  # (N, Hkv)
    need = amax.new_zeros(touched.numel(), amax.shape[1])  # fp32 as amax, whatever the default
    need.scatter_reduce_(0, inv[:, None].expand_as(amax), amax, "amax")
    old = scales[touched]
    # a descale grows to a power of two: the codes already in the page are then rescaled by
    # a power of two, exact in e4m3, where growing to just what the new token needs (a
    # ratio near 1) rounded most codes back to themselves, and a page grown by ~3% a step
    # drifted its first token by 3x in 40 steps
    want = torch.exp2(torch.ceil(torch.log2((need / fmax).clamp_min(_TINY))))
    new = torch.where(want > old, want, old)
    grown = (new > old).any(1)
    if bool(grown.any()):  # requantize the tokens already in pages whose descale grew
        idx = touched[grown]
        ratio = (old[grown] / new[grown])[:, None, :, None]
        # one statement, no call between the two stores: a Ctrl-C never leaves the codes
        # requantized under the old descale (the write, run again to finish, would scale
        # them twice)
        pages[idx], scales[idx] = _cast(pages[idx].float() * ratio, fmax, pages.dtype), new[grown]
    flat = pages.view(-1, *pages.shape[2:])
    flat[slots] = _cast(x.float() / new[inv][:, :, None], fmax, pages.dtype)


def _cast(x: torch.Tensor, fmax: float, dtype: torch.dtype) -> torch.Tensor:
    """Round to e4m3; values a rounding past the largest finite one are clamped to it
    (torch's cast would make them NaN)."""
    return x.clamp(-fmax, fmax).to(dtype)


def refuse_stray_descales(backend: str, kv_dtype: torch.dtype, extra: dict[str, object]) -> None:
    """``k_descale``/``v_descale`` in ``extra`` with a 16/32-bit cache: an error, never
    ignored (the caller's values would silently be read unscaled). Call only when ``extra``
    is not empty (the hot path pays one truth test)."""
    if (extra.get("k_descale") is not None or extra.get("v_descale") is not None) and not (
            is_fp8(kv_dtype)):
        raise InputError(f"{backend}: extra k_descale/v_descale given for a {kv_dtype} KV "
                         "cache, which this backend reads as is (descales belong to an FP8 "
                         "e4m3 cache); drop them, or pass the e4m3 cache they scale")


def dequantize_pages(pages: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """fp32 values of (num_pages, page_size, Hkv, D) e4m3 pages with (num_pages, Hkv)
    descales (tests and the accuracy check)."""
    return pages.float() * descale[:, None, :, None]
