"""The two libraries that expose AMD's Composable Kernel flash attention to Python.

* ``flash_attn`` built on a ROCm torch: its ``flash_attn_2_cuda`` extension is compiled from
  ``csrc/flash_attn_ck`` (the default ROCm backend; ``FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE``
  swaps in a Triton backend instead). Same Python API as the CUDA build:
  ``flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
  alibi_slopes, deterministic, return_attn_probs)`` and ``flash_attn_varlen_func`` with
  ``cu_seqlens_q/k`` and ``max_seqlen_q/k``. The CK sources declare ``const float /*softcap*/``:
  the argument is accepted and ignored. Upstream README: MI200x/MI250x/MI300x/MI355x, fp16 and
  bf16, forward and backward head dims up to 256 (the Python wrapper pads to a multiple of 8).
* ``aiter`` (AMD's AI Tensor Engine; PyPI distribution ``amd-aiter``, import name ``aiter``; the
  PyPI package named ``aiter`` is an unrelated async-iterator library):
  ``aiter.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, bias,
  alibi_slopes, deterministic, return_lse, return_attn_probs)`` and
  ``aiter.flash_attn_varlen_func``; no softcap argument at all; CK/ASM kernels for gfx942 and
  gfx950 only (its README: most CK and ASM kernels are CDNA-only).

Both align causal masks and windows bottom-right (query i sits at key i + Sk - Sq), return the
LSE as (B, H, Sq) for dense and (H, total_q) for varlen, and fill the LSE of an empty key
sequence with +inf, which attnhub turns into its -inf convention.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from attnhub.plugin import Capabilities

CK_ARCHS = frozenset({"gfx90a", "gfx942", "gfx950"})
AITER_ARCHS = frozenset({"gfx942", "gfx950"})
#: The masks both libraries express natively (document = varlen cu_seqlens).
CK_MASKS = frozenset({"none", "causal", "sliding_window", "alibi", "document"})
#: (head_dim, head_dim_v) pairs with different V width that aiter's CK fwd/bwd tiles cover
#: (the DeepSeek MLA prefill shape); others are padded or not generated.
AITER_QK_V_PAIRS = frozenset({(192, 128)})

TRITON_AMD_ENV = "FLASH_ATTENTION_TRITON_AMD_ENABLE"
LIBRARY_ENV = "ATTNHUB_CK_FA_LIBRARY"


def _capabilities(archs: frozenset[str], different_v: bool) -> Capabilities:
    return Capabilities(
        vendors=frozenset({"rocm"}), archs=archs, dtypes=frozenset({"fp16", "bf16"}),
        max_head_dim=256, different_v_dim=different_v, masks=CK_MASKS,
        layouts=frozenset({"bshd", "bhsd", "thd"}), backward=True, deterministic_backward=True,
        deterministic_forward=True, gqa=True, returns_lse=True, top_left_causal=False,
    )


def _module_present(name: str) -> bool:
    """Whether ``name`` is importable, without importing it (a faked module in
    ``sys.modules`` counts, as it does for ``import``)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _aiter_is_amds() -> bool:
    """AMD's aiter has ``aiter/ops/mha.py``; PyPI's unrelated ``aiter`` does not."""
    mod = sys.modules.get("aiter")
    if mod is not None:
        return hasattr(mod, "flash_attn_varlen_func")
    try:
        spec = importlib.util.find_spec("aiter")
    except (ImportError, ValueError):
        return False
    locations = (spec.submodule_search_locations or []) if spec else []
    return any((Path(loc) / "ops" / "mha.py").is_file() for loc in locations)


@dataclass(frozen=True)
class CKCall:
    """The library-neutral arguments of one call (attnhub semantics already translated)."""

    softmax_scale: float
    causal: bool
    window_size: tuple[int, int]
    alibi_slopes: torch.Tensor | None
    deterministic: bool
    return_lse: bool


@dataclass(frozen=True)
class CKLibrary:
    """One Python front-end to CK flash attention: what it can do and how to call it."""

    name: str
    install: str
    capabilities: Capabilities
    softcap_reason: str
    #: Which keyword asks the library for the LSE, and what else each call must pass.
    lse_keyword: str
    fixed_kwargs: tuple[tuple[str, Any], ...]
    present: Callable[[], bool]
    module_name: str

    def missing(self) -> list[str]:
        """Reasons the library cannot be used here (not installed, or the wrong backend)."""
        if not self.present():
            return [f"{self.name} is not installed ({self.install})"]
        if self.name == "flash_attn" and os.environ.get(TRITON_AMD_ENV, "").upper() == "TRUE":
            return [f"{TRITON_AMD_ENV}=TRUE makes flash_attn run its Triton backend, not CK; "
                    "unset it for ck_fa (triton_rocm is attnhub's own Triton path)"]
        return []

    def module(self) -> ModuleType:
        return importlib.import_module(self.module_name)

    def kwargs(self, call: CKCall) -> dict[str, Any]:
        """Keyword arguments for ``flash_attn_func``/``flash_attn_varlen_func``."""
        kw: dict[str, Any] = dict(self.fixed_kwargs)
        kw.update(softmax_scale=call.softmax_scale, causal=call.causal,
                  window_size=call.window_size, alibi_slopes=call.alibi_slopes,
                  deterministic=call.deterministic)
        kw[self.lse_keyword] = call.return_lse
        return kw

    def run_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  call: CKCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        res = self.module().flash_attn_func(q, k, v, **self.kwargs(call))
        return _split(res, call.return_lse, self.name)

    def run_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                   call: CKCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        res = self.module().flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                   **self.kwargs(call))
        return _split(res, call.return_lse, self.name)


def _split(res: Any, want_lse: bool, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) from either library's return: a tensor, or a tuple starting (out, lse)."""
    if isinstance(res, torch.Tensor):
        if want_lse:
            raise RuntimeError(f"ck_fa: {name} returned no LSE although it was asked for one; "
                               "this library version is not supported (see plugins/rocm/README)")
        return res, None
    out, lse = res[0], (res[1] if want_lse else None)
    return out, lse


FLASH_ATTN_CK = CKLibrary(
    name="flash_attn",
    install="on a ROCm torch, `pip install flash-attn --no-build-isolation` builds the CK "
            "backend (extra `attnhub-rocm[ck]`); GPU_ARCHS=gfx942 limits the build",
    capabilities=_capabilities(CK_ARCHS, different_v=False),
    softcap_reason="softcap: flash_attn's CK build accepts softcap= and silently ignores it "
                   "(`const float /*softcap*/` in csrc/flash_attn_ck/mha_*.cpp), so results "
                   "would be wrong; route softcap to triton_rocm",
    lse_keyword="return_attn_probs",
    fixed_kwargs=(("dropout_p", 0.0), ("softcap", 0.0)),
    present=lambda: _module_present("flash_attn") and _module_present("flash_attn_2_cuda"),
    module_name="flash_attn",
)

AITER = CKLibrary(
    name="aiter",
    install="`pip install amd-aiter` or build ROCm/aiter from source (extra `attnhub-rocm[aiter]`"
            "); PyPI's `aiter` is an unrelated package",
    capabilities=_capabilities(AITER_ARCHS, different_v=True),
    softcap_reason="softcap: aiter's flash_attn_func has no softcap argument; route softcap to "
                   "triton_rocm",
    lse_keyword="return_lse",
    fixed_kwargs=(("dropout_p", 0.0),),
    present=_aiter_is_amds,
    module_name="aiter",
)

LIBRARIES: dict[str, CKLibrary] = {"aiter": AITER, "flash_attn": FLASH_ATTN_CK}


def select_library(environ: dict[str, str] | None = None) -> CKLibrary:
    """The library ``ck_fa`` wraps: ``ATTNHUB_CK_FA_LIBRARY`` when set, else aiter when AMD's
    aiter is installed (its ASM kernels are the faster ones on gfx942/gfx950), else flash_attn
    (whose declaration is also the one used for planning when neither is installed)."""
    env = os.environ if environ is None else environ
    choice = env.get(LIBRARY_ENV, "").strip().lower()
    if choice:
        if choice not in LIBRARIES:
            raise ValueError(f"{LIBRARY_ENV}={choice!r}: use one of {', '.join(LIBRARIES)}")
        return LIBRARIES[choice]
    return AITER if AITER.present() else FLASH_ATTN_CK
