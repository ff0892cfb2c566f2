"""Side-by-side backend timing with a correctness gate (what ``attnhub bench`` runs).

For one spec, random inputs are built once; every backend that can serve the spec is first
checked on those inputs against the fp64 reference with the FlashAttention rule (error at
most twice the same-precision reference's, plus a rounding floor) and only then timed (median
of repeats after warm-up, CUDA events on a GPU). A backend that fails the check is reported
and not timed: a fast wrong kernel has no speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from .core.kvcache import PagedKVCache
from .core.reference import reference_attention
from .core.spec import AttentionSpec, AttnParams, torch_dtype
from .errors import AttnhubError
from .hub import Hub
from .testing import fa_rule_error
from .timing import median_ms

#: Above this many score elements, the reference checks a trailing slice of the queries
#: (under bottom-right alignment those rows are the same problem with fewer queries).
REFERENCE_BUDGET = 1 << 26


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    params: AttnParams
    #: Contiguous (B, Sk, Hkv, D) keys/values for the reference (the paged cache gathered).
    k_dense: torch.Tensor
    v_dense: torch.Tensor


def make_inputs(spec: AttentionSpec, device: torch.device, *, seed: int = 0) -> Inputs:
    """Random inputs of the spec's exact sizes (bucket values): bshd, or a filled paged cache."""
    gen = torch.Generator(device).manual_seed(seed)
    dt = torch_dtype(spec.dtype)
    b, sq, sk = spec.batch, spec.max_seqlen_q, spec.max_seqlen_k

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    q = rnd(b, sq, spec.num_q_heads, spec.head_dim)
    k = rnd(b, sk, spec.num_kv_heads, spec.head_dim)
    v = rnd(b, sk, spec.num_kv_heads, spec.head_dim_v)
    params = AttnParams(scale=1 / math.sqrt(spec.head_dim), causal=spec.mask.causal,
                        alignment=spec.mask.alignment, window=spec.mask.window,
                        max_seqlen_q=sq, max_seqlen_k=sk)
    if spec.layout != "paged":
        return Inputs(q, k, v, params, k, v)
    cache = PagedKVCache(num_layers=1, num_pages=b * -(-sk // spec.page_size),
                         page_size=spec.page_size, num_kv_heads=spec.num_kv_heads,
                         head_dim=spec.head_dim, head_dim_v=spec.head_dim_v, dtype=dt,
                         device=device)
    seqs = [cache.allocate() for _ in range(b)]
    cache.write(0, cache.reserve(seqs, sk), k.flatten(0, 1), v.flatten(0, 1))
    params = replace(params, block_table=cache.block_table(seqs), seqlens_k=cache.seqlens(seqs))
    return Inputs(q, cache.k_cache(0), cache.v_cache(0), params, k, v)


@dataclass
class Measurement:
    """One backend on one spec: checked (error vs allowed), then timed, or why not."""

    backend: str
    spec: AttentionSpec
    ms: float | None = None
    error: float | None = None
    allowed: float | None = None
    skipped: str | None = None
    failed: str | None = None

    @property
    def ok(self) -> bool:
        return self.ms is not None

    def throughput(self) -> tuple[float, str] | None:
        """TFLOP/s for prefill/train, KV TB/s for decode."""
        if self.ms is None:
            return None
        s = self.spec
        if s.phase == "decode":
            elem = torch.finfo(torch_dtype(s.kv_dtype)).bits / 8
            byts = s.batch * s.max_seqlen_k * s.num_kv_heads * (s.head_dim + s.head_dim_v) * elem
            return byts / (self.ms * 1e-3) / 1e12, "TB/s"
        frac = 0.5 if s.mask.causal and s.max_seqlen_q == s.max_seqlen_k else 1.0
        flops = 2 * s.batch * s.num_q_heads * s.max_seqlen_q * s.max_seqlen_k * (
            s.head_dim + s.head_dim_v) * frac
        return flops / (self.ms * 1e-3) / 1e12, "TFLOP/s"

    def to_json(self) -> dict[str, Any]:
        t = self.throughput()
        return {"backend": self.backend, "spec": self.spec.describe(), "ms": self.ms,
                "throughput": t[0] if t else None, "unit": t[1] if t else None,
                "error": self.error, "allowed": self.allowed, "skipped": self.skipped,
                "failed": self.failed}


def reference_rows(inp: Inputs, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor, int]:
    """fp64 and same-precision reference outputs for the last ``m`` queries of each row."""
    b, sq, sk = spec.batch, spec.max_seqlen_q, spec.max_seqlen_k
    m = max(1, min(sq, REFERENCE_BUDGET // max(1, b * spec.num_q_heads * sk)))
    q = inp.q[:, sq - m:]
    params = replace(inp.params, block_table=None, seqlens_k=None, max_seqlen_q=m)
    if spec.mask.alignment == "top_left" and m < sq:
        m = sq  # top-left rows move with Sq: check them all
        q, params = inp.q, inp.params
    ref64, _ = reference_attention(q, inp.k_dense, inp.v_dense, params,
                                   compute_dtype=torch.float64)
    same, _ = reference_attention(q, inp.k_dense, inp.v_dense, params, compute_dtype=q.dtype)
    return ref64, same, m


def measure(hub: Hub, spec: AttentionSpec, backends: list[str], device: torch.device, *,
            warmup: int = 3, repeats: int = 10, seed: int = 0,
            on_step: Any = None) -> list[Measurement]:
    """Check then time each backend on one set of random inputs for ``spec``."""
    inp = make_inputs(spec, device, seed=seed)
    ref64 = same = None
    out: list[Measurement] = []
    for name in backends:
        m = Measurement(name, spec)
        out.append(m)
        reasons = hub.registry.get(name).check(spec, hub.device)
        if reasons:
            m.skipped = "; ".join(reasons)
        else:
            if ref64 is None:
                ref64, same, rows = reference_rows(inp, spec)
            _check_and_time(hub, m, inp, ref64, same, rows, device, warmup, repeats)
        if on_step is not None:
            on_step()
    return out


def _check_and_time(hub: Hub, m: Measurement, inp: Inputs, ref64: torch.Tensor,
                    same: torch.Tensor, rows: int, device: torch.device, warmup: int,
                    repeats: int) -> None:
    try:
        runner = hub.runner_for(m.spec, backend=m.backend)

        def call() -> torch.Tensor:
            return runner(inp.q, inp.k, inp.v, m.spec, inp.params).out

        got = call()[:, -rows:]
    except (AttnhubError, RuntimeError, ValueError, TypeError) as exc:
        m.failed = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return
    if torch.isnan(got).any():
        m.failed = "NaN in output"
        return
    m.error, m.allowed = fa_rule_error(got, ref64, same)
    if m.error > m.allowed:
        m.failed = (f"wrong: max error {m.error:.3g} vs fp64 > allowed {m.allowed:.3g} "
                    "(2x same-precision error + floor)")
        return
    m.ms = median_ms(call, device, warmup=warmup, repeats=repeats)
