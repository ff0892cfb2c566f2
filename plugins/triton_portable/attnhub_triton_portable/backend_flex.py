"""The ``flex`` backend: ``torch.compile(flex_attention)`` for every mask kind and any
score_mod/mask_mod, with BlockMasks cached per (mask, shape) and one compile per static shape
(forward and backward); past ``flex.RECOMPILE_LIMIT`` compiled variants a call raises, so the
rule's next candidate serves it loudly rather than flex running uncompiled."""

from __future__ import annotations

import importlib.util
import shutil

import torch

from attnhub.plugin import (
    ALL_MASKS,
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    Capabilities,
    DeviceInfo,
)

#: Why decode is refused, with what was measured (shared/gpu/README.md, H200, bf16, 32/8
#: heads, d=128): flex's decode path ran at 0.11-0.12 TB/s at batch 1 (SDPA 2.73-3.91) and
#: failed to compile at 64 x 32k.
DECODE_REASON = ("decode is not served: compiled flex_attention measured 10-40x slower than "
                 "SDPA for decode on the H200 (0.11 vs 2.73 TB/s at 1 x 32k) and failed to "
                 "compile at batch 64 x 32k; use triton_decode, fa3 or torch_sdpa")


#: Why flex runs eagerly on the CPU by default. Measured on the 2-core x86 CI box (AVX2),
#: torch 2.13.0+cpu, 2026-12-01: ``torch.compile(flex_attention, dynamic=False)`` against
#: SDPA, B=2, H=4, fp32, no mask and no score_mod, 3-4 random inputs per shape: with head
#: dim 8/16, every key length of 8 mod 16 (8, 24, 40, 72, 136, 264) returned wrong outputs
#: (max error 0.2-31) in at least one call, varying from call to call; eager flex was exact
#: at all of them. Eager flex materialises the scores, which the CPU's shapes afford.
CPU_EAGER_REASON = ("on the CPU flex runs eagerly: Inductor's compiled CPU flex template "
                    "(torch 2.13) returned wrong outputs at key lengths of 8 mod 16")


class FlexBackend(Backend):
    """FlexAttention through torch.compile: the variant tier for masks and score functions
    that no fused kernel has. ``compiled``: None (default) compiles on GPUs and runs eagerly
    on the CPU (``CPU_EAGER_REASON``); True compiles everywhere, False nowhere (eager flex
    materialises the whole score matrix)."""

    name = "flex"
    tier = "variant"
    description = ("torch.compile(flex_attention): every attnhub mask kind plus arbitrary "
                   "score_mod/mask_mod; BlockMask built once per (mask, shape), compiled once "
                   "per static shape on GPUs; " + CPU_EAGER_REASON)
    capabilities = Capabilities(
        vendors=frozenset({"cpu", "cuda", "rocm"}),
        dtypes=frozenset({"fp32", "fp16", "bf16"}),
        max_head_dim=256,
        masks=ALL_MASKS,
        phases=frozenset({"train", "prefill"}),
        layouts=frozenset({"bshd", "thd"}),
        backward=True,
        deterministic_backward=False,
        # not claimed: the conformance kit saw two CPU runs differ (5.96e-07)
        deterministic_forward=False,
        gqa=True,
        returns_lse=True,
        top_left_causal=True,
    )

    def __init__(self, compiled: bool | None = None) -> None:
        super().__init__()
        self.compiled = compiled

    def compiles(self, vendor: str) -> bool:
        """Whether calls on this device vendor (``cpu``, ``cuda``...) run compiled flex."""
        return self.compiled if self.compiled is not None else vendor != "cpu"

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """Decode, the CPU limits of Inductor's flex lowering, and what compile needs."""
        r: list[str] = []
        if spec.phase == "decode":
            r.append(DECODE_REASON)
        if spec.layout == "thd" and spec.mask.column_sparse:
            r.append("column-sparse ranges are per (batch, head, key) of a bshd batch; with "
                     "thd documents use layout='bshd' or the triton backend")
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            r.append(f"torch {torch.__version__} has no flex_attention (needs torch >= 2.5)")
        if device.vendor == "cpu" and spec.needs_grad:
            r.append("flex_attention on the CPU is inference-only (torch: 'FlexAttention does "
                     "not support backward on CPU'); no gradients")
        if device.vendor == "cpu" and self.compiles("cpu"):
            if spec.return_lse:
                r.append("torch.compile(flex_attention) on the CPU cannot return the LSE "
                         "(Inductor: 'return_lse is not supported yet')")
            if not device.simulated and not any(shutil.which(c) for c in ("c++", "g++",
                                                                           "clang++")):
                r.append("torch.compile on the CPU needs a C++ compiler (c++/g++/clang++) on "
                         "PATH; none found")
        if device.vendor != "cpu" and not device.simulated and self.compiles(device.vendor) and \
                importlib.util.find_spec("triton") is None:
            r.append("torch.compile(flex_attention) on GPUs generates Triton kernels: "
                     "triton is not installed (pip install triton)")
        return r

    def _load(self) -> None:
        from . import flex

        self._flex = flex
        self._mods = flex.ModCache()

    @property
    def mask_builds(self) -> int:
        """BlockMask/score-function builds so far (a cache hit builds nothing)."""
        return self._mods.builds if self._loaded else 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        out, lse = self._flex.flex_attention(
            q, k, v, params, spec.layout, self._mods,
            compiled=self.compiles("cpu" if q.device.type == "cpu" else "cuda"),
            want_lse=params.return_lse)
        return AttentionOutput(out, lse)
