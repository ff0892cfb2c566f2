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

from .core.backend import safe_check
from .core.kvcache import PagedKVCache
from .core.memory import check_memory
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
    #: Contiguous (B, Sk, Hkv, D) keys/values for the reference (the paged cache gathered,
    #: the packed documents unpacked: equal-length documents, one per batch row).
    k_dense: torch.Tensor
    v_dense: torch.Tensor
    q_dense: torch.Tensor | None = None
    layout: str = "bshd"

    def api_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``attnhub.attention`` for these inputs (public API)."""
        p = self.params
        kw: dict[str, Any] = {"causal": p.causal, "causal_alignment": p.alignment,
                              "scale": p.scale, "layout": self.layout}
        if p.window is not None:
            kw["window"] = p.window
        if p.softcap:
            kw["softcap"] = p.softcap
        if self.layout == "thd":
            kw.update(cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k,
                      max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k)
        if self.layout == "paged":
            kw.update(block_table=p.block_table, seqlens_k=p.seqlens_k)
        return kw

    def dense(self, out: torch.Tensor) -> torch.Tensor:
        """An output of these inputs as (B, Sq, H, D), the reference's shape."""
        return out.view(self.k_dense.shape[0], -1, *out.shape[-2:]) \
            if self.layout == "thd" else out


def make_inputs(spec: AttentionSpec, device: torch.device, *, seed: int = 0,
                softcap: float | None = None) -> Inputs:
    """Random inputs of the spec's exact sizes (bucket values): bshd, a filled paged cache,
    or ``batch`` packed documents of ``max_seqlen_q`` tokens each (thd)."""
    gen = torch.Generator(device).manual_seed(seed)
    dt = torch_dtype(spec.dtype)
    b, sq, sk = spec.batch, spec.max_seqlen_q, spec.max_seqlen_k

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    sizes = [b * sq * spec.num_q_heads * spec.head_dim,
             b * sk * spec.num_kv_heads * spec.head_dim,
             b * sk * spec.num_kv_heads * spec.head_dim_v]  # q, k, v (twice when paged)
    paged = 2 if spec.layout == "paged" else 1
    check_memory((sizes[0] + paged * sum(sizes[1:])) * dt.itemsize + max(sizes) * 4, device,
                 f"the inputs of {spec.describe()}", "pass smaller sizes (--seqlens, "
                 "--batch, --heads, --head-dim, --prompt-len; with --regret a larger --scale)")
    q = rnd(b, sq, spec.num_q_heads, spec.head_dim)
    k = rnd(b, sk, spec.num_kv_heads, spec.head_dim)
    v = rnd(b, sk, spec.num_kv_heads, spec.head_dim_v)
    params = AttnParams(scale=1 / math.sqrt(spec.head_dim), causal=spec.mask.causal,
                        alignment=spec.mask.alignment, window=spec.mask.window,
                        softcap=softcap if spec.mask.softcap else None,
                        max_seqlen_q=sq, max_seqlen_k=sk)
    if spec.layout == "thd":
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device)
        cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=device)
        params = replace(params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        return Inputs(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), params, k, v, q, "thd")
    if spec.layout != "paged":
        return Inputs(q, k, v, params, k, v, q)
    cache = PagedKVCache(num_layers=1, num_pages=b * -(-sk // spec.page_size),
                         page_size=spec.page_size, num_kv_heads=spec.num_kv_heads,
                         head_dim=spec.head_dim, head_dim_v=spec.head_dim_v, dtype=dt,
                         device=device)
    seqs = [cache.allocate() for _ in range(b)]
    cache.write(0, cache.reserve(seqs, sk), k.flatten(0, 1), v.flatten(0, 1))
    params = replace(params, block_table=cache.block_table(seqs), seqlens_k=cache.seqlens(seqs))
    return Inputs(q, cache.k_cache(0), cache.v_cache(0), params, k, v, q, "paged")


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


#: Above this many (batch x key x head x dim) elements, the reference checks the first
#: batch rows only (the fp64 copy of a 64 x 32k cache would not fit).
REFERENCE_KV_BUDGET = 1 << 28


def reference_rows(inp: Inputs, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor, int]:
    """fp64 and same-precision reference outputs for the last ``m`` queries of the first
    ``nb`` batch rows (``ref.shape[0]``); compare ``inp.dense(out)[:nb, -m:]``."""
    b, sq, sk = spec.batch, spec.max_seqlen_q, spec.max_seqlen_k
    per_row = sk * spec.num_q_heads * max(spec.head_dim, spec.head_dim_v)
    nb = max(1, min(b, REFERENCE_KV_BUDGET // max(1, per_row)))
    m = max(1, min(sq, REFERENCE_BUDGET // max(1, nb * spec.num_q_heads * sk)))
    q_all = inp.q_dense if inp.q_dense is not None else inp.q
    q = q_all[:nb, sq - m:]
    params = replace(inp.params, block_table=None, seqlens_k=None, cu_seqlens_q=None,
                     cu_seqlens_k=None, max_seqlen_q=m)
    if spec.mask.alignment == "top_left" and m < sq:
        m = sq  # top-left rows move with Sq: check them all
        q, params = q_all[:nb], replace(params, max_seqlen_q=sq)
    kd, vd = inp.k_dense[:nb], inp.v_dense[:nb]
    ref64, _ = reference_attention(q, kd, vd, params, compute_dtype=torch.float64)
    same, _ = reference_attention(q, kd, vd, params, compute_dtype=q.dtype)
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
        reasons = safe_check(hub.registry.get(name), spec, hub.device)
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

        got = inp.dense(call())[:ref64.shape[0], -rows:]
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
