"""The public plugin API: everything a backend plugin may import from attnhub.

In-repo plugins use only this module (and ``attnhub.testing`` in their tests), exactly as a
third-party distribution would.
"""

from __future__ import annotations

from .core.backend import TIERS, AttentionOutput, Backend, module_available, unit_head_stride
from .core.capabilities import ALL_MASKS, FLOAT_DTYPES, HALF_DTYPES, Capabilities
from .core.device import DeviceInfo
from .core.contract import check_call
from .core.env import env_flag
from .core.flash_conventions import (
    causal_alibi_lse,
    flash_causal,
    flash_dense_form,
    flash_form,
    flash_kwargs,
    flash_output_kwargs,
    flash_paged_form,
    flash_varlen,
    flash_varlen_form,
    moved_alibi,
    natural_lse,
    top_left_alibi_reason,
    top_left_reason,
    varlen_max_q,
)
from .core.masking import (
    BottomRightForm,
    alibi_bias,
    allowed_mask,
    attends_nothing,
    bottom_right_form,
    doc_ranges,
    learned_slopes,
    no_keys_lse,
    query_offset,
    window_within,
)
from .core.first_order import first_order_only
from .core.process_state import flipping_sdpa_switches
from .core.kvquant import refuse_stray_descales
from .core.paged import paged_to_varlen
from .core.reference import reference_attention
from .core.seqstate import LAYER_KEY, SEQ_IDS_KEY, STATE_KEY, SequenceStore, StateGeometry
from .core.spec import AttentionSpec, AttnParams, MaskSpec, dtype_name, torch_dtype
from .errors import AttnhubError, BackendUnavailableError, CacheFullError, InputError
from .hookspecs import hookimpl

__all__ = [
    "env_flag",
    "ALL_MASKS",
    "FLOAT_DTYPES",
    "HALF_DTYPES",
    "TIERS",
    "AttentionOutput",
    "AttentionSpec",
    "AttnParams",
    "AttnhubError",
    "Backend",
    "BottomRightForm",
    "BackendUnavailableError",
    "CacheFullError",
    "Capabilities",
    "DeviceInfo",
    "InputError",
    "LAYER_KEY",
    "MaskSpec",
    "SEQ_IDS_KEY",
    "STATE_KEY",
    "SequenceStore",
    "StateGeometry",
    "alibi_bias",
    "allowed_mask",
    "attends_nothing",
    "bottom_right_form",
    "doc_ranges",
    "first_order_only",
    "flipping_sdpa_switches",
    "flash_dense_form",
    "causal_alibi_lse",
    "check_call",
    "flash_causal",
    "flash_form",
    "flash_kwargs",
    "flash_output_kwargs",
    "flash_paged_form",
    "flash_varlen",
    "varlen_max_q",
    "flash_varlen_form",
    "learned_slopes",
    "dtype_name",
    "hookimpl",
    "module_available",
    "moved_alibi",
    "natural_lse",
    "no_keys_lse",
    "paged_to_varlen",
    "query_offset",
    "window_within",
    "reference_attention",
    "refuse_stray_descales",
    "top_left_alibi_reason",
    "top_left_reason",
    "torch_dtype",
    "unit_head_stride",
]
