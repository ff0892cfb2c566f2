"""The public plugin API: everything a backend plugin may import from attnhub.

In-repo plugins use only this module (and ``attnhub.testing`` in their tests), exactly as a
third-party distribution would.
"""

from __future__ import annotations

from .core.backend import TIERS, AttentionOutput, Backend
from .core.capabilities import ALL_MASKS, FLOAT_DTYPES, HALF_DTYPES, Capabilities
from .core.device import DeviceInfo
from .core.masking import alibi_bias, allowed_mask, doc_ranges, query_offset
from .core.paged import paged_to_varlen
from .core.reference import reference_attention
from .core.spec import AttentionSpec, AttnParams, MaskSpec, dtype_name, torch_dtype
from .errors import AttnhubError, BackendUnavailableError, InputError
from .hookspecs import hookimpl

__all__ = [
    "ALL_MASKS",
    "FLOAT_DTYPES",
    "HALF_DTYPES",
    "TIERS",
    "AttentionOutput",
    "AttentionSpec",
    "AttnParams",
    "AttnhubError",
    "Backend",
    "BackendUnavailableError",
    "Capabilities",
    "DeviceInfo",
    "InputError",
    "MaskSpec",
    "alibi_bias",
    "allowed_mask",
    "doc_ranges",
    "dtype_name",
    "hookimpl",
    "paged_to_varlen",
    "query_offset",
    "reference_attention",
    "torch_dtype",
]
