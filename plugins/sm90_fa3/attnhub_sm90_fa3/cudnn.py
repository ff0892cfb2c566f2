"""``cudnn``: torch SDPA's cuDNN attention (``SDPBackend.CUDNN_ATTENTION``), forward and
backward.

SDPA's ``is_causal`` is top-left. A bottom-right causal mask is converted where an exact
form exists: Sq == Sk (the same mask), Sq == 1 (no mask: the one query sees every key) and
Sq > Sk (the first Sq - Sk rows see nothing and give 0 / LSE -inf; the last Sk rows are a
square top-left causal). Sq < Sk (chunked prefill) has none and is refused with a reason.
GQA goes to SDPA as ``enable_gqa`` (on the H200 with torch 2.11, SDPA's default pick ran GQA
prefill at cuDNN speed, 567 TFLOP/s at 16k, where expanding K/V heads first cost 25%); the
LSE path calls the cuDNN op itself, which takes equal head counts, so there K/V are expanded.
Decode is declined: one query token ran at 0.20 TB/s (1 x 32k, 32/8 heads) against 2.7 TB/s
for SDPA's own choice.

cuDNN builds a graph per exact shape: on the H200 (torch 2.11, cuDNN 9.19) a prefill at a new
prompt length cost 52-61 ms and a training step 138-162 ms, against 0.5 / 2.2 ms once built
(``benchmarks/decode_growing_gpu.py``). So the backend builds at most ``SHAPE_BUDGET`` exact
shapes per spec bucket (the lengths a bound call meets as prompts or padded batches vary)
and refuses a further new one there with that reason (the rule's ``on_failure`` then
decides: the next candidate, counted and logged, or an error), instead of paying a build
per new length in serving or in training with per-batch padding; calls of other buckets
(a test grid, a model's few fixed shapes) each have their own budget. torch's ragged cuDNN path
(``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``, set by the user before the first cuDNN attention
call: torch reads it once per process) builds per power-of-two length instead (0.6-0.96 /
2.1-2.9 ms at new lengths in the same H200 run): with it set, the budget does not apply and
the backend hands cuDNN the dense BSHD tensors that path takes. The backend does not set the
variable itself: it changes every cuDNN attention call of the process (the user's own SDPA
calls too), and in the one H200 run where this backend had set it, the regret grid's raw
SDPA call at decode 16 x 4k (cuDNN, one query) did not return for over 100 s, where that
cell took 2.5 s in the run before (the likely cause; not isolated, no device time was left).
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

from attnhub.plugin import (
    HALF_DTYPES,
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    BackendUnavailableError,
    Capabilities,
    DeviceInfo,
    flipping_sdpa_switches,
    unit_head_stride,
)

CUDNN_CAPABILITIES = Capabilities(
    vendors=frozenset({"cuda"}), min_capability=(8, 0), dtypes=HALF_DTYPES, max_head_dim=128,
    head_dim_multiple=8, masks=frozenset({"causal"}), layouts=frozenset({"bshd", "bhsd"}),
    phases=frozenset({"train", "prefill"}), backward=True, deterministic_forward=True,
    gqa=True, returns_lse=True, top_left_causal=True,
)


def bottom_right_refusal(causal: bool, alignment: str, sq: int, sk: int) -> str | None:
    """Why a causal mask cannot be expressed with SDPA's top-left ``is_causal``, or None."""
    if causal and alignment == "bottom_right" and 1 < sq < sk:
        return (f"bottom-right causal with Sq={sq} < Sk={sk} has no top-left form for cuDNN's "
                "is_causal; use fa3 or fa2_torch")
    return None


#: torch's switch for cuDNN attention's ragged path (a graph per power-of-two length)
RAGGED_ENV = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
#: Exact shapes the backend builds graphs for per spec bucket without the ragged path; a new
#: one past this is refused (each build cost 52-162 ms on the H200)
SHAPE_BUDGET = 4


def ragged_path_on() -> bool:
    """Whether the variable asks torch for the ragged path (as torch's ``check_env`` reads
    it); a variable that is unset counts as off."""
    return os.environ.get(RAGGED_ENV, "").strip().upper() in ("1", "ON", "TRUE", "YES", "Y")


class CudnnBackend(Backend):
    """cuDNN fused attention through torch SDPA."""

    name = "cudnn"
    tier = "vendor"
    description = ("cuDNN attention via torch SDPA (CUDNN_ATTENTION): fwd+bwd, causal "
                   "(bottom-right converted where exact), head dim <= 128; builds a graph "
                   f"per exact shape (52-162 ms on the H200): at most {SHAPE_BUDGET} per "
                   f"spec bucket unless {RAGGED_ENV}=1 (torch's ragged path)")
    capabilities = CUDNN_CAPABILITIES

    def __init__(self) -> None:
        super().__init__()
        self.ragged = False
        self._built: dict[AttentionSpec, set[tuple]] = {}
        self._built_lock = threading.Lock()

    def _load(self) -> None:
        self.ragged = ragged_path_on()

    def _admit(self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               causal: bool, lse: bool) -> None:
        """Count the exact shape this call makes cuDNN build (its graph cache's key: sizes,
        strides, causal, LSE) in ``spec``'s bucket; refuse a new one past ``SHAPE_BUDGET``."""
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
               q.device, causal, lse, q.requires_grad or k.requires_grad or v.requires_grad)
        built = self._built.get(spec)
        if built is not None and key in built:
            return
        with self._built_lock:
            built = self._built.setdefault(spec, set())
            if len(built) >= SHAPE_BUDGET:
                raise BackendUnavailableError(self.name, [  # one text: one log line, not one a shape
                    f"cuDNN builds a graph per exact shape (52-162 ms each on the H200) and "
                    f"this process has built {SHAPE_BUDGET} for this spec bucket, the "
                    f"backend's budget, so a new one is refused: set {RAGGED_ENV}=1 before "
                    "the first cuDNN attention "
                    "call (torch's ragged path, a graph per power-of-two length) or pad to "
                    "fixed lengths"], lasting=True)  # the hub moves cudnn behind the next
            built.add(key)

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        r = []
        # Buckets are powers of two: a smaller q bucket means Sq < Sk for every call in it.
        refusal = bottom_right_refusal(spec.mask.causal, spec.mask.alignment,
                                       spec.max_seqlen_q, spec.max_seqlen_k)
        if refusal and spec.max_seqlen_q < spec.max_seqlen_k:
            r.append(refusal)
        if not device.simulated and device.vendor == "cuda" \
                and not torch.backends.cudnn.is_available():
            r.append("cuDNN is not available in this torch build")
        return r

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        b, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        q, k, v = unit_head_stride(q, k, v)  # cuDNN refuses another head-dim stride
        refusal = bottom_right_refusal(params.causal, params.alignment, sq, sk)
        if refusal:
            raise BackendUnavailableError(self.name, [refusal])
        # one bottom-right query sees every key; a top-left one still sees key 0 only
        causal = params.causal and (sq > 1 or params.alignment == "top_left")
        skip = sq - sk if causal and params.alignment == "bottom_right" and sq > sk else 0
        q = q[:, skip:]
        if params.return_lse and hq != hkv:  # the LSE op takes equal head counts
            k, v = k.repeat_interleave(hq // hkv, 2), v.repeat_interleave(hq // hkv, 2)
        if self.ragged:  # the ragged path takes dense BSHD only (a bhsd cache is copied)
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if not self.ragged:
            self._admit(spec, qt, kt, vt, causal, params.return_lse)
        if params.return_lse:
            out, lse = cudnn_with_lse(qt, kt, vt, causal, params.scale)
            lse = lse.reshape(b, hq, sq - skip)
        else:
            out, lse = sdpa_cudnn(qt, kt, vt, causal, params.scale), None
        out = out.transpose(1, 2)
        if skip:  # rows that see no key under bottom-right alignment
            out = torch.cat([out.new_zeros(b, skip, hq, out.shape[-1]), out], dim=1)
            if lse is not None:
                lse = torch.cat([lse.new_full((b, hq, skip), float("-inf")), lse], dim=2)
        return AttentionOutput(out, lse)


#: (set, read) of SDPA's kernel switches and whether a cuDNN-only call wants each on: what
#: ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`` sets, without its context manager
#: (None on a torch without one of these switches: the context manager is used)
_CUDNN_ONLY = tuple((getattr(torch.backends.cuda, f"enable_{name}_sdp", None),
                     getattr(torch.backends.cuda, f"{name}_sdp_enabled", None), name == "cudnn")
                    for name in ("cudnn", "flash", "mem_efficient", "math"))
if not all(enable and enabled for enable, enabled, _ in _CUDNN_ONLY):
    _CUDNN_ONLY = None  # type: ignore[assignment]


def sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> torch.Tensor:
    """SDPA restricted to cuDNN (B, H, S, D): raises rather than run another kernel. The
    switches are set and restored here: ``sdpa_kernel``'s context manager costs ~11 us a
    call on the CPU box (under torch.compile it is used, as Dynamo traces it). Like it,
    this sets process-wide flags: another thread's SDPA during the call sees cuDNN only."""
    gqa = q.shape[1] != k.shape[1]
    if _CUDNN_ONLY is None or torch.compiler.is_compiling():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                  enable_gqa=gqa)
    with flipping_sdpa_switches():  # other threads' settings checks are told
        saved = [enabled() for _, enabled, _ in _CUDNN_ONLY]
        try:
            for enable, _, on in _CUDNN_ONLY:
                enable(on)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                  enable_gqa=gqa)
        finally:
            for (enable, _, _), was in zip(_CUDNN_ONLY, saved):
                enable(was)


def cudnn_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) from the op SDPA's cuDNN backend runs, asking it for the LSE."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return res[0], res[1]
