"""The ``triton`` backend: this plugin's dense forward/backward kernels behind the Backend API.

It serves training and prefill (and decode on contiguous KV, where ``triton_decode`` is the
better choice) for bshd and varlen thd, with every mask kind except score_mod/mask_mod
(those go to ``flex``). On the CPU the kernels only run in Triton's interpreter, which must
be switched on before the kernels are imported.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from attnhub.plugin import (
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    BackendUnavailableError,
    Capabilities,
    DeviceInfo,
    InputError,
    learned_slopes,
)

from .interpreted import serialized

_MASKS = frozenset({"none", "causal", "sliding_window", "alibi", "softcap", "prefix_lm",
                    "document", "column_sparse"})

CPU_REASON = ("Triton kernels need a GPU; set TRITON_INTERPRET=1 to run them (slowly) on the "
              "CPU")


def interpreter_on() -> bool:
    """Whether Triton compiles kernels for its CPU interpreter (read at kernel import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonDenseBackend(Backend):
    """FlashAttention-2-style tiled attention written in Triton: forward with LSE, backward,
    masks fused into the tile loops. Gradients are bitwise reproducible when the call asks
    (``deterministic=True``: the atomic-free kernels only); otherwise the autotuner may also
    take a dQ summed by reduce-adds (the Hopper Gluon backward on sm90)."""

    name = "triton"
    tier = "portable"
    description = ("own Triton flash attention (fwd+bwd, bshd+thd varlen): causal both "
                   "alignments, window, softcap, ALiBi, prefix-LM, documents, column-sparse; "
                   "GQA in place; TMA tiles and a Gluon forward and backward on sm90")
    capabilities = Capabilities(
        vendors=frozenset({"cpu", "cuda", "rocm"}),
        min_capability=(8, 0),
        dtypes=frozenset({"fp32", "fp16", "bf16"}),
        max_head_dim=256,
        masks=_MASKS,
        layouts=frozenset({"bshd", "bhsd", "thd"}),
        backward=True,
        deterministic_backward=True,
        deterministic_forward=True,
        gqa=True,
        returns_lse=True,
        top_left_causal=True,
    )
    requires: ClassVar[dict[str, str]] = {"triton": "pip install triton (ships with torch on Linux x86-64)"}

    def _device_reasons(self, device: DeviceInfo) -> list[str]:
        if device.vendor == "cpu" and not device.simulated and not interpreter_on():
            return [CPU_REASON]
        return []

    def available(self, device: DeviceInfo) -> list[str]:
        return super().available(device) + self._device_reasons(device)

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """What the capability data cannot say."""
        reasons = self._device_reasons(device)
        if spec.mask.column_sparse and spec.layout == "thd":
            reasons.append("column-sparse masks are given per batch row: use the bshd layout, "
                           "not thd")
        if spec.mask.prefix_lm and not spec.mask.causal:
            reasons.append("prefix-LM needs causal=True (it is causal after the prefix)")
        return reasons

    def _load(self) -> None:
        from . import autograd

        self._attention = autograd.flash_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        if params.alibi_slopes is not None and (why := learned_slopes(params)):
            raise BackendUnavailableError(self.name, [why])  # its backward gives them none
        if q.device.type == "cpu":
            _require_interpreter()
        with serialized(q):
            out, lse = self._attention(q, k, v, params, spec.layout)
        return AttentionOutput(out, lse if params.return_lse else None)


def _require_interpreter() -> None:
    """CPU tensors need kernels built for the interpreter, i.e. imported with it switched on."""
    from triton.runtime.interpreter import InterpretedFunction

    from . import fwd

    kernel: Any = fwd._fwd_kernel
    if not isinstance(kernel, InterpretedFunction):
        raise InputError(
            "triton: CPU tensors, but the kernels were compiled for a GPU: "
            f"{CPU_REASON} before attnhub_triton_portable is first used")
