"""Regret of the policy, cell by cell: is the backend it binds the fastest correct one?

For each cell of a grid (a shape, mask and phase real clients run), the call is timed through
the public API twice over: as the policy binds it, and forced onto every exact backend that
accepts the cell, each checked against the fp64 reference first (a fast wrong kernel has no
speed). Regret = policy time / best forced time; 1.00 means the policy picked the best.
Timings are medians of CUDA-event-timed single calls after warm-up (host time included),
taken in interleaved rounds (the minimum median of the rounds counts), so a clock change
hits every backend alike. Training cells time forward + backward.

``attnhub bench --regret`` runs it; the forced timings are what a shipped profile pack holds
(``--pack``), and what ``fastest`` rules then rank by.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .benchmark import Inputs, make_inputs, reference_rows
from .core.spec import AttentionSpec, MaskSpec
from .errors import AttnhubError
from .testing import fa_rule_error
from .timing import median_ms

#: The regret a cell may show and still count as "the policy picked the best".
BOUND = 1.05


@dataclass(frozen=True)
class Cell:
    """One grid cell: exact sizes and mask, and the softcap value when the mask has one."""

    name: str
    spec: AttentionSpec
    softcap: float | None = None


def standard_grid(dtype: str = "bf16", scale: int = 1) -> list[Cell]:
    """The cells of issue 15's H200 table plus a few common ones (bf16, 32/8 heads, d128
    unless the name says). ``scale`` divides every length (CPU dry runs)."""

    def n(x: int) -> int:
        return max(16, x // scale)

    def cell(name: str, phase: str = "prefill", b: int = 1, sq: int = 1, sk: int = 1,
             heads: tuple[int, int] = (32, 8), d: int = 128, layout: str = "bshd",
             causal: bool = True, window: tuple[int, int] | None = None,
             softcap: float | None = None, page: int = 0) -> Cell:
        mask = MaskSpec(causal=causal, window=window, softcap=softcap is not None,
                        document=layout == "thd")
        spec = AttentionSpec(phase=phase, dtype=dtype, kv_dtype=dtype, head_dim=d,
                             head_dim_v=d, num_q_heads=heads[0], num_kv_heads=heads[1],
                             layout=layout, mask=mask, max_seqlen_q=sq, max_seqlen_k=sk,
                             batch=b, needs_grad=phase == "train", page_size=page)
        return Cell(name, spec, softcap)

    k4, k16 = n(4096), n(16384)
    return [
        cell("prefill causal b4 x 4k", b=4, sq=k4, sk=k4),
        cell("prefill full 16k", sq=k16, sk=k16, causal=False),
        cell("prefill causal window 4096, 16k", sq=k16, sk=k16, window=(n(4096), 0)),
        cell("prefill causal softcap 50, d256, 16/8 heads, 8k", sq=n(8192), sk=n(8192),
             heads=(16, 8), d=256, softcap=50.0),
        cell("chunked prefill 1k queries on 16k keys", sq=n(1024), sk=k16),
        cell("train causal b2 x 4k fwd+bwd", phase="train", b=2, sq=k4, sk=k4),
        cell("varlen causal 8 docs x 2k (thd)", b=8, sq=n(2048), sk=n(2048), layout="thd"),
        cell("decode contiguous 1 x 32k", phase="decode", sk=n(32768)),
        cell("decode contiguous 16 x 4k", phase="decode", b=16, sk=k4),
        cell("decode paged/16 1 x 32k", phase="decode", sk=n(32768), layout="paged", page=16),
        cell("decode paged/16 64 x 32k", phase="decode", b=64, sk=n(32768), layout="paged",
             page=16),
        cell("decode paged/16 1 x 128k", phase="decode", sk=n(131072), layout="paged",
             page=16),
        cell("decode paged/16 32 x 4k", phase="decode", b=32, sk=k4, layout="paged", page=16),
        cell("spec-decode 4 queries paged/16 16 x 8k", phase="decode", b=16, sq=4,
             sk=n(8192), layout="paged", page=16),
        cell("prefill causal 1 x 4k, 8/2 heads, d64", sq=k4, sk=k4, heads=(8, 2), d=64),
        cell("prefill causal b16 x 1k", b=16, sq=n(1024), sk=n(1024)),
        cell("decode tiny 1 query, 1k keys", phase="decode", sk=n(1024)),
    ]


@dataclass
class CellResult:
    """One cell: what the policy bound and its time, every backend's time or why not."""

    cell: str
    spec: AttentionSpec | None = None
    policy_backend: str | None = None
    policy_rule: str | None = None
    policy_source: str = ""
    policy_ms: float | None = None
    policy_error: str | None = None
    times: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    raw_sdpa_ms: float | None = None
    seconds: float = 0.0

    @property
    def best(self) -> tuple[str, float] | None:
        """The fastest correct backend (forced) and its time."""
        return min(self.times.items(), key=lambda t: t[1]) if self.times else None

    @property
    def regret(self) -> float | None:
        return regret(self.policy_ms, self.times)

    @property
    def choice_regret(self) -> float | None:
        """The bound backend's forced time over the best: the choice alone, without the
        noise between two timings of the same kernel."""
        if self.policy_backend not in self.times:
            return None
        return regret(self.times[self.policy_backend], self.times)

    def to_json(self) -> dict[str, Any]:
        best = self.best
        return {"cell": self.cell, "spec": self.spec.describe() if self.spec else None,
                "policy": {"backend": self.policy_backend, "rule": self.policy_rule,
                           "source": self.policy_source, "ms": self.policy_ms,
                           "error": self.policy_error},
                "best": {"backend": best[0], "ms": best[1]} if best else None,
                "regret": self.regret, "choice_regret": self.choice_regret,
                "times_ms": self.times, "skipped": self.skipped, "failed": self.failed,
                "raw_sdpa_ms": self.raw_sdpa_ms, "seconds": round(self.seconds, 1)}


def from_json(d: dict[str, Any]) -> CellResult:
    """A cell back from ``CellResult.to_json`` (to re-render or combine saved reports)."""
    pol = d.get("policy", {})
    return CellResult(d["cell"], None, pol.get("backend"), pol.get("rule"),
                      pol.get("source") or "", pol.get("ms"), pol.get("error"),
                      dict(d.get("times_ms", {})), dict(d.get("skipped", {})),
                      dict(d.get("failed", {})), d.get("raw_sdpa_ms"), d.get("seconds", 0.0))


def regret(policy_ms: float | None, times: dict[str, float]) -> float | None:
    """Policy time over the best time (None when either is missing)."""
    if policy_ms is None or not times:
        return None
    return policy_ms / min(times.values())


def misses(results: list[CellResult], bound: float = BOUND) -> list[tuple[CellResult, str]]:
    """Cells over the bound (or whose policy call failed), each with the likely cause."""
    out = []
    for r in results:
        if not r.times:
            continue  # no exact backend serves the cell: nothing to compare
        best = r.best
        assert best is not None
        if r.policy_ms is None:
            out.append((r, f"the policy's binding failed: {r.policy_error}"))
        elif (r.regret or 0) > bound:
            if r.policy_backend != best[0] and (r.choice_regret or math.inf) > bound:
                why = (f"policy bound {r.policy_backend} ({r.policy_source or 'list order'}); "
                       f"{best[0]} was faster ({best[1]:.4g} ms)")
            else:
                why = (f"policy bound {r.policy_backend}, the best or within the bound when "
                       f"forced (choice regret {r.choice_regret or 0:.2f}); the difference is "
                       "in the policy call path or timing noise")
            out.append((r, why))
    return out


# -- measuring --------------------------------------------------------------------------------
def measure_cell(cell: Cell, backends: list[str], registry: Any, device: torch.device, *,
                 policy: Any = None, warmup: int = 3, repeats: int = 20, rounds: int = 2,
                 seed: int = 0, log: Callable[[str], None] | None = None) -> CellResult:
    """Check then time the policy's binding and every backend that accepts ``cell``."""
    from .hub import Hub

    t0 = time.perf_counter()
    res = CellResult(cell.name)
    inp = make_inputs(cell.spec, device, seed=seed, softcap=cell.softcap)
    ref64, same, rows = reference_rows(inp, cell.spec)
    train = cell.spec.phase == "train"
    policy_hub = Hub(policy, registry=registry)
    fns: dict[str | None, Callable[[], torch.Tensor]] = {}
    try:
        fn = _caller(policy_hub, inp, None, train)
        err = _check(inp, fn, ref64, same, rows)
        d = policy_hub.bound()[-1].decision
        res.spec, res.policy_backend, res.policy_rule = d.spec, d.backend, d.rule
        res.policy_source = next((n.split(")")[0].split("(")[1] for n in d.notes
                                  if n.startswith("fastest (")), "order")
        if sum(policy_hub.fallback_counts.values()):
            err = err or f"fell back at run time: {dict(policy_hub.fallback_counts)}"
        if err:
            res.policy_error = err
        else:
            fns[None] = fn
    except (AttnhubError, RuntimeError, ValueError, TypeError) as exc:
        res.policy_error = _short(exc)
    spec = res.spec or cell.spec.bucketed()
    forced_hub = Hub(policy, registry=registry)
    for name in backends:
        reasons = registry.get(name).check(spec, forced_hub.device)
        if reasons:
            res.skipped[name] = "; ".join(reasons)
            continue
        try:
            fn = _caller(forced_hub, inp, name, train)
            err = _check(inp, fn, ref64, same, rows)
        except (AttnhubError, RuntimeError, ValueError, TypeError) as exc:
            err = _short(exc)
            _free(device)
        if err:
            res.failed[name] = err
        else:
            fns[name] = fn
        if log:
            log(f"  {name}: {'ok' if not err else err[:120]}")
    raw = None if train else _raw_sdpa(inp, cell.spec)
    if raw is not None:
        fns["raw SDPA"] = raw  # type: ignore[index]
    best: dict[str | None, float] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            ms = median_ms(fn, device, warmup=warmup, repeats=repeats)
            best[name] = min(ms, best.get(name, math.inf))
    res.policy_ms = best.pop(None, None)
    res.raw_sdpa_ms = best.pop("raw SDPA", None)  # type: ignore[call-overload]
    res.times = {k: v for k, v in best.items() if k is not None}
    res.seconds = time.perf_counter() - t0
    del inp, fns
    _free(device)
    return res


def _caller(hub: Any, inp: Inputs, backend: str | None,
            train: bool) -> Callable[[], torch.Tensor]:
    kw = inp.api_kwargs()
    if backend is not None:
        kw["backend"] = backend
    if not train:
        return lambda: hub.attention(inp.q, inp.k, inp.v, **kw)
    q, k, v = (t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v))
    grad: list[torch.Tensor] = []

    def step() -> torch.Tensor:
        out = hub.attention(q, k, v, **kw)
        if not grad:
            grad.append(torch.randn_like(out))
        torch.autograd.grad(out, (q, k, v), grad[0])
        return out.detach()

    return step


def _check(inp: Inputs, fn: Callable[[], torch.Tensor], ref64: torch.Tensor,
           same: torch.Tensor, rows: int) -> str | None:
    got = inp.dense(fn())[:ref64.shape[0], -rows:]
    if torch.isnan(got).any():
        return "NaN in output"
    err, allowed = fa_rule_error(got, ref64, same)
    if err > allowed:
        return f"wrong: max error {err:.3g} vs fp64 > allowed {allowed:.3g}"
    return None


def _raw_sdpa(inp: Inputs, spec: AttentionSpec) -> Callable[[], torch.Tensor] | None:
    """torch SDPA called directly, where the cell's mask has a native SDPA form (bshd)."""
    from torch.nn.attention.bias import causal_lower_right

    p, m = inp.params, spec.mask
    if inp.layout != "bshd" or m.window is not None or m.softcap:
        return None
    sq, sk = inp.q.shape[1], inp.k.shape[1]
    mask, is_causal = None, False
    if p.causal and sq == sk:
        is_causal = True
    elif p.causal and 1 < sq < sk:
        mask = causal_lower_right(sq, sk)
    elif p.causal and sq > sk:
        return None
    qt, kt, vt = inp.q.transpose(1, 2), inp.k.transpose(1, 2), inp.v.transpose(1, 2)
    gqa = qt.shape[1] != kt.shape[1]
    F = torch.nn.functional
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask,
                                                  is_causal=is_causal, scale=p.scale,
                                                  enable_gqa=gqa)


def _short(exc: BaseException) -> str:
    return f"raised {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}" \
        if str(exc).strip() else f"raised {type(exc).__name__}"


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- reporting --------------------------------------------------------------------------------
def markdown(results: list[CellResult], header: str = "", bound: float = BOUND) -> str:
    """The report: one row per cell, then the misses with their causes."""
    lines = [header] if header else []
    lines += ["| cell | policy binds (rule, ranking) | policy ms | best ms (who) | regret | "
              "choice regret | raw SDPA ms | every correct backend, ms |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        best = r.best
        reg = r.regret
        mark = f"**{reg:.2f}**" if reg is not None and reg > bound else (
            f"{reg:.2f}" if reg is not None else "-")
        others = ", ".join(f"{b} {ms:.4g}" for b, ms in sorted(r.times.items(),
                                                               key=lambda t: t[1]))
        bad = "; ".join(f"{b}: {w[:80]}" for b, w in r.failed.items())
        lines.append(
            f"| {r.cell} | {r.policy_backend or '-'} ({r.policy_rule or '-'}, "
            f"{r.policy_source or '-'}) | "
            f"{f'{r.policy_ms:.4g}' if r.policy_ms is not None else 'failed'} | "
            f"{f'{best[1]:.4g} ({best[0]})' if best else '-'} | {mark} | "
            f"{f'{r.choice_regret:.2f}' if r.choice_regret is not None else '-'} | "
            f"{f'{r.raw_sdpa_ms:.4g}' if r.raw_sdpa_ms is not None else '-'} | "
            f"{others or '-'}{' | FAILED ' + bad if bad else ''} |")
    served = [r for r in results if r.times]
    worst = max((r.regret or math.inf for r in served), default=None)
    lines += ["", f"{len(served)} cells with at least one exact backend; worst regret "
              f"{worst:.2f} (bound {bound})." if worst is not None else ""]
    missed = misses(results, bound)
    if missed:
        lines += ["", f"Cells over {bound}:"]
        lines += [f"- {r.cell}: regret {r.regret or math.inf:.2f}: {why}" for r, why in missed]
    failed = [(r.cell, b, w) for r in results for b, w in r.failed.items()]
    if failed:
        lines += ["", "Backends that accepted a cell and then failed its check or raised:"]
        lines += [f"- {c}: {b}: {w}" for c, b, w in failed]
    return "\n".join(lines)


def plot(results: list[CellResult], path: str, title: str = "", bound: float = BOUND) -> None:
    """Per cell, one row: regret (left panel, bound marked) and every backend's time on a
    log axis (right panel, the policy's binding ringed), so a person reads it at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.times or r.policy_ms is not None]
    names = sorted({b for r in rows for b in r.times})
    colors = {b: plt.get_cmap("tab10")(i % 10) for i, b in enumerate(names)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.42 * len(rows) + 1.6), sharey=True,
                                   gridspec_kw={"width_ratios": [1, 2.2]})
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows):
        reg = r.regret
        ax1.barh(y, reg or 0, color="tab:red" if (reg or math.inf) > bound else "tab:green")
        ax1.text((reg or 0) + 0.02, y, f"{reg:.2f}" if reg else "n/a", va="center",
                 fontsize=8)
        for b, ms in r.times.items():
            ax2.scatter(ms, y, color=colors[b], s=28, zorder=3)
        if r.raw_sdpa_ms is not None:
            ax2.scatter(r.raw_sdpa_ms, y, marker="x", color="grey", s=30, zorder=3)
        if r.policy_ms is not None:
            ax2.scatter(r.policy_ms, y, facecolors="none", edgecolors="black", s=110,
                        linewidths=1.4, zorder=4)
    ax1.axvline(1.0, color="grey", lw=0.8)
    ax1.axvline(bound, color="tab:red", lw=0.8, ls="--")
    regs = [r.regret for r in rows if r.regret is not None] or [1.0]
    ax1.set_xlim(min(0.9, min(regs) - 0.05) if max(regs) < 1.5 else 0,
                 max(1.2, max(regs) + 0.15))
    ax1.set_xlabel(f"regret = policy / best (bound {bound})")
    ax1.set_yticks(ys, [r.cell for r in rows], fontsize=8)
    ax2.set_xscale("log")
    ax2.set_xlabel("ms per call (log; ring = the policy's call)")
    ax2.grid(axis="x", which="both", alpha=0.3)
    for b in names:
        ax2.scatter([], [], color=colors[b], label=b)
    ax2.scatter([], [], facecolors="none", edgecolors="black", label="policy")
    ax2.scatter([], [], marker="x", color="grey", label="raw SDPA (info)")
    ax2.legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pack_data(results: list[CellResult], device: Any, header: dict[str, Any],
              samples: int) -> dict[str, Any]:
    """A profile pack (store schema + ``pack`` header) of the forced timings."""
    import tempfile
    from pathlib import Path

    from .policy.profile import ProfileStore

    with tempfile.TemporaryDirectory() as tmp:
        store = ProfileStore(Path(tmp) / "pack.json", packs="off")
        for r in results:
            for b, ms in r.times.items():
                if r.spec is not None:
                    store.record_speed(device, r.spec, b, ms / 1e3, samples=samples)
        data = store.data()
    data["pack"] = dict(header)
    return data


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


__all__ = ["BOUND", "Cell", "CellResult", "from_json", "markdown", "measure_cell", "misses",
           "pack_data",
           "plot", "regret", "standard_grid"]
