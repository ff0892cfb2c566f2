"""Regret of the policy, cell by cell: is the backend it binds the fastest correct one?

For each cell of a grid (a shape, mask and phase real clients run), the call is timed through
the public API twice over: as the policy binds it, and forced onto every exact backend that
accepts the cell, each checked against the fp64 reference first (a fast wrong kernel has no
speed). Regret = policy time / best forced time; 1.00 means the policy picked the best.
Timing (``attnhub.timing.interleaved_ms``): within every repeat the policy's call, each
forced backend and each raw library take one sample in turn (in a balanced order: each follows every other equally often), so the
policy and its own backend forced are timed under the same conditions; a sample is a batch of
back-to-back calls between CUDA events lasting about ``BATCH_MS`` when a call is under
``BATCH_BELOW_MS`` (the same batch for every callable of the cell), otherwise one call from
an idle GPU; no cache flush for any; median of
the repeats, read against each repeat's reference (``paired``: the lengths of a walking cell
grow call by call, and the ratio to the callables timed beside it cancels that), minimum
over rounds; a callable over ``DROP_ABOVE`` times the fastest after a round keeps that
round's figure and sits out the next, one over ``SKIP_ABOVE`` times in the calibration
calls sits out every round. Training cells time forward + backward.

Raw libraries called directly on the same inputs, checked like the backends and timed in the
same rounds, for information: torch SDPA (bshd; paged cells on the contiguous copy of their
cache), torch's varlen FlashAttention op (thd), and FA3 as the fa3 backend imports it (where
the fa3 backend passed the cell). Absent where the library is not installed.

``attnhub bench --regret`` runs it; the forced timings are what a shipped profile pack holds
(``--pack``), and what ``fastest`` rules then rank by.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .benchmark import Inputs, make_inputs, reference_rows
from .core.flash_conventions import flash_dense_form, flash_kwargs, flash_varlen
from .core.spec import AttentionSpec, MaskSpec, bucket
from .errors import AttnhubError
from .testing import fa_rule_error
from .timing import interleaved_ms

#: After a round, callables slower than this many times the cell's fastest are not timed
#: again (on the H200 window cell a 125 ms and an 18 ms backend shared every repeat with the
#: 2.5 ms calls being compared; the policy's call and its backend forced timed 0.99 and
#: 1.05 apart in two runs of one session).
DROP_ABOVE = 3.0
#: Callables slower than this many times the fastest in the calibration calls keep that
#: figure and are never interleaved: raw SDPA's cuDNN kernel builds a graph per new shape
#: (50-70 ms a call on the walking cells of the H200 grid), and the GPU idled meanwhile
#: for whatever was timed after it.
SKIP_ABOVE = 20.0
#: Calls under this many ms are timed in back-to-back batches of about ``BATCH_MS``. At
#: 0.1 ms the H200 grid's d64 prefill cell (a best call of 0.10-0.12 ms) was batched in one
#: step of a run and timed one call from an idle GPU in the next: 0.115 vs 0.233 ms for the
#: same kernel, which decides rankings. 1 ms keeps that cliff where the launch gap is a few
#: percent of a call, and batches the sub-millisecond cells as a model runs them.
BATCH_BELOW_MS, BATCH_MS = 1.0, 2.0

#: The regret a cell may show and still count as "the policy picked the best".
BOUND = 1.05


@dataclass(frozen=True)
class Cell:
    """One grid cell: exact sizes and mask, and the softcap value when the mask has one."""

    name: str
    spec: AttentionSpec
    softcap: float | None = None
    #: lengths that change every call, each timed callable walking its own (``_Walk``):
    #: decode on a contiguous cache one key longer per call (transformers' DynamicCache), or
    #: prefill / training on a prompt of a new length per call (a per-shape build shows)
    grow: bool = False


def standard_grid(dtype: str = "bf16", scale: int = 1) -> list[Cell]:
    """The cells of issue 15's H200 table plus a few common ones (bf16, 32/8 heads, d128
    unless the name says). ``scale`` divides every length (CPU dry runs)."""

    def n(x: int) -> int:
        return max(16, x // scale)

    def cell(name: str, phase: str = "prefill", b: int = 1, sq: int = 1, sk: int = 1,
             heads: tuple[int, int] = (32, 8), d: int = 128, layout: str = "bshd",
             causal: bool = True, window: tuple[int, int] | None = None,
             softcap: float | None = None, page: int = 0, grow: bool = False) -> Cell:
        mask = MaskSpec(causal=causal, window=window, softcap=softcap is not None,
                        document=layout == "thd")
        spec = AttentionSpec(phase=phase, dtype=dtype, kv_dtype=dtype, head_dim=d,
                             head_dim_v=d, num_q_heads=heads[0], num_kv_heads=heads[1],
                             layout=layout, mask=mask, max_seqlen_q=sq, max_seqlen_k=sk,
                             batch=b, needs_grad=phase == "train", page_size=page)
        return Cell(name, spec, softcap, grow)

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
        # what generate() with a DynamicCache runs: lengths from 2k + 1 up, one more per call
        cell("decode growing cache 1 x 2k+ (DynamicCache)", phase="decode", sk=n(2048) + 1,
             grow=True),
        cell("decode growing cache 8 x 2k+, d64 (DynamicCache)", phase="decode", b=8,
             sk=n(2048) + 1, d=64, grow=True),
        # prompts of a new length every call (serving, generate() on new prompts, training
        # with per-batch padding): what a backend that builds per exact shape pays
        cell("prefill causal, a new prompt length per call, 1 x 2k+", sq=n(2048) + 1,
             sk=n(2048) + 1, grow=True),
        cell("prefill causal, a new length per call, 8/2 heads, d64, 1 x 4k+", sq=k4 + 1,
             sk=k4 + 1, heads=(8, 2), d=64, grow=True),
        cell("train causal, a new length per step, b2 x 4k+ fwd+bwd", phase="train", b=2,
             sq=k4 + 1, sk=k4 + 1, grow=True),
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
    #: raw libraries called directly (``SDPA``, ``torch varlen``, ``fa3``): ms, or why not
    raw: dict[str, float] = field(default_factory=dict)
    raw_failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    #: calls per timed sample (a batch of back-to-back calls for short ones)
    batch: int = 1
    #: what the policy's hub ran while timed: every backend it bound (a walk past the first
    #: call's length bucket binds again) and its run-time fallbacks ("a->b": count)
    policy_bound: list[str] = field(default_factory=list)
    policy_fallbacks: dict[str, int] = field(default_factory=dict)

    @property
    def raw_sdpa_ms(self) -> float | None:
        return self.raw.get("SDPA")

    @property
    def policy_forced_ms(self) -> float | None:
        """The bound backend's own time, forced, in the same rounds as the policy's call."""
        return self.times.get(self.policy_backend) if self.policy_backend else None

    @property
    def path_ratio(self) -> float | None:
        """Policy call over the same backend forced: the cost of the policy's call path plus
        the timing noise between two figures of one kernel (1.00 when neither)."""
        forced = self.policy_forced_ms
        return self.policy_ms / forced if self.policy_ms is not None and forced else None

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
                           "forced_ms": self.policy_forced_ms, "path_ratio": self.path_ratio,
                           "error": self.policy_error, "bound_while_timed": self.policy_bound,
                           "fallbacks_while_timed": self.policy_fallbacks},
                "best": {"backend": best[0], "ms": best[1]} if best else None,
                "regret": self.regret, "choice_regret": self.choice_regret,
                "times_ms": self.times, "skipped": self.skipped, "failed": self.failed,
                "raw_ms": self.raw, "raw_failed": self.raw_failed,
                "raw_sdpa_ms": self.raw_sdpa_ms, "batch": self.batch,
                "seconds": round(self.seconds, 1)}


def from_json(d: dict[str, Any]) -> CellResult:
    """A cell back from ``CellResult.to_json`` (to re-render or combine saved reports)."""
    pol = d.get("policy", {})
    raw = dict(d.get("raw_ms") or {})
    if not raw and d.get("raw_sdpa_ms") is not None:  # reports from before raw_ms
        raw["SDPA"] = d["raw_sdpa_ms"]
    return CellResult(d["cell"], None, pol.get("backend"), pol.get("rule"),
                      pol.get("source") or "", pol.get("ms"), pol.get("error"),
                      dict(d.get("times_ms", {})), dict(d.get("skipped", {})),
                      dict(d.get("failed", {})), raw, dict(d.get("raw_failed") or {}),
                      d.get("seconds", 0.0), d.get("batch", 1),
                      list(pol.get("bound_while_timed") or []),
                      dict(pol.get("fallbacks_while_timed") or {}))


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
            others = [b for b in r.policy_bound if b != r.policy_backend]
            if others:
                why += f"; while timed the policy also bound {', '.join(others)}"
            if r.policy_fallbacks:
                why += f"; it fell back at run time: {r.policy_fallbacks}"
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
    spec0 = cell.spec.bucketed()
    serving = [b for b in backends if not registry.get(b).check(spec0, policy_hub.device)]
    # policy, the backends and raw SDPA each walk their own lengths
    walks = _Walks(inp, len(serving) + 3, walk_calls(warmup, repeats, rounds)) \
        if cell.grow else None
    try:
        fn = _caller(policy_hub, walks.next() if walks else inp, None, train)
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
    timed: dict[Any, Callable[[], torch.Tensor]] = dict(fns)

    def admit(key: Any, make: Callable[[], Callable[[], torch.Tensor]],
              failed: dict[str, str], label: str, inp: Inputs = inp) -> None:
        """Time ``make()``'s callable under ``key`` if it passes the check, else record why."""
        fn, err = _checked(make, inp, ref64, same, rows, device)
        if fn is None:
            failed[label] = err
        else:
            timed[key] = fn
        if log:
            log(f"  {'raw ' if isinstance(key, tuple) else ''}{label}: "
                f"{err[:120] if err else 'ok'}")

    for name in backends:
        reasons = registry.get(name).check(spec, policy_hub.device)
        if not reasons and walks and name not in serving:  # no walk was set aside for it
            reasons = [f"refused the cell's spec {spec0.describe()} when the walks were made"]
        if reasons:
            res.skipped[name] = "; ".join(reasons)
            continue
        # each forced backend in a hub of its own, as a caller who forces one backend has
        # it: in one hub shared by all, each call follows another backend's, so the hot
        # path's memo of the last call (and of a growing cache's last length bucket) never
        # holds. With a shared hub the policy's call timed 6-7% faster than its backend
        # forced on the H200's growing-cache cells (2026-12-02, 8b0b0e2), the hub being the
        # one difference between the two paths.
        admit(name, functools.partial(_caller, Hub(policy, registry=registry),
                                      walks.next() if walks else inp,
                                      name, train), res.failed, name)
    if walks and not train:  # SDPA as torch picks, and with its cuDNN kernel off
        for lib, cudnn in (("SDPA", True), ("SDPA cuDNN off", False)):
            admit(("raw", lib), functools.partial(_raw_sdpa_walk, walks.next(), cudnn),
                  res.raw_failed, lib)
    elif not train:
        for lib, peer in _raw_peers(inp, cell.spec, "fa3" in timed).items():
            admit(("raw", lib), lambda peer=peer: peer, res.raw_failed, lib)
    # a growing cell's callables take a new length per call: fewer calls per sample
    t = _timed_until_none_fails(timed, res, device, walks.rewind if walks else None,
                                warmup=warmup, repeats=repeats,
                                rounds=rounds, drop_above=DROP_ABOVE,
                                skip_above=SKIP_ABOVE, paired=True,
                                max_batch=4 if walks else 64, batch_below_ms=BATCH_BELOW_MS,
                                batch_ms=BATCH_MS)
    res.batch = t.batch
    res.policy_ms = t.ms.get(None)
    res.policy_bound = sorted({r.decision.backend for r in policy_hub.bound()})
    res.policy_fallbacks = {f"{a}->{b}": n for (a, b), n in policy_hub.fallback_counts.items()}
    res.times = {k: v for k, v in t.ms.items() if isinstance(k, str)}
    res.raw = {k[1]: v for k, v in t.ms.items() if isinstance(k, tuple)}
    res.seconds = time.perf_counter() - t0
    timed.clear()  # the inputs and callables go before the next cell's
    del inp, fns, admit
    _free(device)
    return res


class _FailedWhileTimed(Exception):
    def __init__(self, key: Any, exc: BaseException):
        super().__init__(key, exc)
        self.key, self.exc = key, exc


def _timed_until_none_fails(timed: dict[Any, Callable[[], torch.Tensor]], res: CellResult,
                            device: torch.device, rewind: Callable[[], None] | None,
                            **kw: Any) -> Any:
    """``interleaved_ms`` over ``timed``; a callable that raises while timed (a backend that
    refuses a new shape past its build budget, say) is recorded as failed with its reason
    and the timing starts again without it, so one failure never loses the cell. A walking
    cell's walks are rewound first (``rewind``): every callable then times the same lengths
    again. (Left where the failure found them, the callables timed before it in that
    repeat had walked further, to longer and slower lengths. This happens in the new-length
    prefill cells, where cudnn's build budget runs out while timed.)"""
    def guarded(key: Any, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - recorded below, with its reason
                raise _FailedWhileTimed(key, exc) from exc
        return call

    while True:
        try:
            return interleaved_ms({k: guarded(k, f) for k, f in timed.items()}, device, **kw)
        except _FailedWhileTimed as failure:
            why = f"raised while timed: {_short(failure.exc)}"
            if failure.key is None:
                res.policy_error = why
            elif isinstance(failure.key, tuple):
                res.raw_failed[failure.key[1]] = why
            else:
                res.failed[failure.key] = why
            del timed[failure.key]
            if rewind is not None:
                rewind()


def _caller(hub: Any, inp: Inputs, backend: str | None,
            train: bool) -> Callable[[], torch.Tensor]:
    kw = inp.api_kwargs()
    if backend is not None:
        kw["backend"] = backend
    if not train:
        return lambda: hub.attention(inp.q, inp.k, inp.v, **kw)
    grad: list[torch.Tensor] = []  # one random buffer; each call's gradient a view of it

    def step() -> torch.Tensor:  # leaves made per call: a walk's lengths change each call
        q, k, v = (t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v))
        out = hub.attention(q, k, v, **kw)
        if not grad or grad[0].numel() < out.numel():
            grad[:] = [torch.randn(out.numel() * 2, device=out.device, dtype=out.dtype)]
        torch.autograd.grad(out, (q, k, v), grad[0][:out.numel()].view(out.shape))
        return out.detach()

    return step


class _Walk:
    """One timed callable's walk over lengths: the first call gets the cell's own inputs (the
    checked call), each later call the next of ``lengths``, which no other callable of the
    cell meets, so none reuses another's per-shape state. Decode: a contiguous (B, Hkv, s, D)
    cache seen as bshd (what transformers hands over) behind the cell's query; prefill /
    training (Sq == Sk): contiguous bshd q, k, v of s tokens each. The lengths stay in the
    cell's length bucket (past it the hub binds anew, perhaps another backend than the one
    the cell reports); a walk that has taken all its lengths starts over from its first
    fresh one (never from the cell's own inputs, which every callable's check has run)."""

    def __init__(self, inp: Inputs, bufs: tuple[torch.Tensor, ...], lengths: range):
        self.inp, self.params, self.layout = inp, inp.params, inp.layout
        b, sk, hkv, d = inp.k.shape
        hq = inp.q.shape[2]
        if inp.q.shape[1] == sk and sk > 1:  # prefill / training: q walks with the keys
            self._views = [(inp.q, inp.k, inp.v)] + [
                tuple(buf.as_strided((b, s, h, d), (s * h * d, h * d, d, 1))
                      for buf, h in zip(bufs, (hq, hkv, hkv))) for s in lengths]
        else:
            self._views = [(inp.q, inp.k, inp.v)] + [
                (inp.q, *(buf.as_strided((b, hkv, s, d), (hkv * s * d, s * d, d, 1))
                          .transpose(1, 2) for buf in bufs[1:])) for s in lengths]
        self._i = -1

    @property
    def q(self) -> torch.Tensor:  # read first in every call: it takes the next length
        i = self._i + 1
        self._i = i if i < len(self._views) else min(1, len(self._views) - 1)
        return self._views[self._i][0]

    @property
    def k(self) -> torch.Tensor:
        return self._views[self._i][1]

    @property
    def v(self) -> torch.Tensor:
        return self._views[self._i][2]

    def api_kwargs(self) -> dict[str, Any]:
        return self.inp.api_kwargs()

    def rewind(self) -> None:
        """The next call takes the first fresh length again."""
        self._i = 0


def walk_calls(warmup: int, repeats: int, rounds: int, max_batch: int = 4) -> int:
    """The most calls one callable of a walking cell takes: the check, the warm-up, the
    batch estimate (3 calls) and ``rounds`` x ``repeats`` samples of at most ``max_batch``
    calls (``interleaved_ms``)."""
    return 1 + warmup + 3 + rounds * max(1, repeats) * max_batch


class _Walks:
    """The walks of one cell: one buffer each for q, k and v (random data), a residue each,
    every length in ``(sk, bucket(sk)]`` and at most ``calls`` of them per walk.

    The stride is odd, so each walk meets every residue modulo any power of two equally
    often: with an even stride (8 walks, say) one walk took only lengths 2 mod 8 and
    another only 7 mod 8, and kernels whose speed depends on the length's alignment (tails
    of a tile, vector widths) then timed the *same* backend differently per walk; the
    policy's call against that backend forced showed 1.06-1.11 on the H200 (2026-12-01)."""

    def __init__(self, inp: Inputs, count: int, calls: int):
        b, sk, hkv, d = inp.k.shape
        self.inp, self.count, self.calls, self._n = inp, count, calls, 0
        self.stride = count | 1
        self.limit = bucket(sk)
        self._made: list[_Walk] = []
        top = max(self.limit, sk)
        self.bufs = tuple(torch.randn(b * h * top * d, dtype=torch.float32,
                                      device=inp.k.device).to(inp.k.dtype)
                          for h in (inp.q.shape[2], hkv, hkv))

    def next(self) -> _Walk:
        self._n += 1
        if self._n > self.count:  # another residue would meet an earlier walk's lengths
            raise RuntimeError(f"walking cell: walk {self._n} of {self.count} asked for")
        sk = self.inp.k.shape[1]
        lengths = range(sk + self._n, self.limit + 1, self.stride)[:self.calls]
        walk = _Walk(self.inp, self.bufs, lengths)
        self._made.append(walk)
        return walk

    def rewind(self) -> None:
        """Every walk back to its first fresh length (see ``_timed_until_none_fails``)."""
        for walk in self._made:
            walk.rewind()


def _raw_sdpa_walk(walk: _Walk, cudnn: bool = True) -> Callable[[], torch.Tensor]:
    """torch SDPA called directly on a walk's lengths: its default kernel choice, or without
    its cuDNN kernel (which builds a graph per shape); causal as the cell is (a walk's Sq is
    1 or Sk, where top-left and bottom-right agree)."""
    from .core.builtin import sdpa

    F = torch.nn.functional
    call_sdpa = F.scaled_dot_product_attention if cudnn else sdpa
    gqa = walk.inp.q.shape[2] != walk.inp.k.shape[2]
    causal = walk.params.causal and walk.inp.q.shape[1] > 1

    def call() -> torch.Tensor:
        qt = walk.q.transpose(1, 2)
        return call_sdpa(
            qt, walk.k.transpose(1, 2), walk.v.transpose(1, 2), is_causal=causal,
            scale=walk.params.scale, enable_gqa=gqa).transpose(1, 2)

    return call


def _checked(make: Callable[[], Callable[[], torch.Tensor]], inp: Inputs,
             ref64: torch.Tensor, same: torch.Tensor, rows: int,
             device: torch.device) -> tuple[Callable[[], torch.Tensor] | None, str]:
    """``make()``'s callable if it builds and passes the FlashAttention rule, else None and
    why (a raise is the callable failing, its memory freed)."""
    try:
        fn = make()
        err = _check(inp, fn, ref64, same, rows)
    except (AttnhubError, RuntimeError, ValueError, TypeError, ImportError) as exc:
        _free(device)
        return None, _short(exc)
    return (None, err) if err else (fn, "")


def _check(inp: Inputs, fn: Callable[[], torch.Tensor], ref64: torch.Tensor,
           same: torch.Tensor, rows: int) -> str | None:
    got = inp.dense(fn())[:ref64.shape[0], -rows:]
    if torch.isnan(got).any():
        return "NaN in output"
    err, allowed = fa_rule_error(got, ref64, same)
    if err > allowed:
        return f"wrong: max error {err:.3g} vs fp64 > allowed {allowed:.3g}"
    return None


def _raw_peers(inp: Inputs, spec: AttentionSpec,
               fa3_ok: bool) -> dict[str, Callable[[], torch.Tensor]]:
    """The raw libraries that take this cell, called directly (forward only): torch SDPA,
    torch's varlen FlashAttention op, and FA3 (only where the fa3 backend passed the cell:
    a build without a feature can crash on it rather than refuse)."""
    out: dict[str, Callable[[], torch.Tensor]] = {}
    sdpa = _raw_sdpa(inp, spec)
    if sdpa is not None:
        out["SDPA"] = sdpa
    varlen = _raw_torch_varlen(inp)
    if varlen is not None:
        out["torch varlen"] = varlen
    fa = _fa3_interface() if fa3_ok else None
    if fa is not None:
        try:
            out["fa3"] = _raw_fa3(fa, inp, spec)
        except AttnhubError:  # no FlashAttention form for this mask: no raw fa3 figure
            pass
    return out


def _raw_sdpa(inp: Inputs, spec: AttentionSpec) -> Callable[[], torch.Tensor] | None:
    """torch SDPA called directly, where the cell's mask has a native SDPA form: bshd, and
    paged cells on the contiguous copy of their cache (a KV cache without pages)."""
    from torch.nn.attention.bias import causal_lower_right

    p, m = inp.params, spec.mask
    if inp.layout not in ("bshd", "paged") or m.window is not None or m.softcap:
        return None
    q, k, v = (inp.q, inp.k, inp.v) if inp.layout == "bshd" else (
        inp.q, inp.k_dense, inp.v_dense)
    sq, sk = q.shape[1], k.shape[1]
    mask, is_causal = None, False
    if p.causal and sq == sk:
        is_causal = True
    elif p.causal and 1 < sq < sk:
        mask = causal_lower_right(sq, sk)
    elif p.causal and sq > sk:
        return None
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = qt.shape[1] != kt.shape[1]
    F = torch.nn.functional
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask,
                                                  is_causal=is_causal, scale=p.scale,
                                                  enable_gqa=gqa).transpose(1, 2)


def _raw_torch_varlen(inp: Inputs) -> Callable[[], torch.Tensor] | None:
    """torch's varlen FlashAttention op (``torch.nn.attention.varlen`` calls it) on a thd
    cell, where it computes the cell exactly (``flash_varlen_window``)."""
    from .core.builtin import flash_varlen_window

    p = inp.params
    if inp.layout != "thd":
        return None
    window = flash_varlen_window(p, inp.q.device, inp.q.dtype, inp.q.shape[-1],
                                 inp.v.shape[-1], p.max_seqlen_q, p.max_seqlen_k)
    if window is None:
        return None
    causal = p.causal and window == (-1, 0)
    op = torch.ops.aten._flash_attention_forward
    return lambda: op(inp.q, inp.k, inp.v, p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q,
                      p.max_seqlen_k, 0.0, causal, False, scale=p.scale,
                      window_size_left=window[0], window_size_right=window[1])[0]


def _fa3_interface() -> Any:
    """FA3's interface module, imported as the fa3 backend imports it; None when the plugin
    or FA3 is not installed (the raw fa3 column is then absent)."""
    try:
        from attnhub_sm90_fa3.build import fa3_build, import_interface  # type: ignore

        return import_interface(fa3_build())
    except (ImportError, OSError, RuntimeError, AttributeError):
        return None


def _raw_fa3(fa: Any, inp: Inputs, spec: AttentionSpec) -> Callable[[], torch.Tensor]:
    """FA3 called directly: ``flash_attn_varlen_func`` (thd), ``flash_attn_with_kvcache``
    on the contiguous cache (decode), ``flash_attn_func`` (prefill); masks in
    FlashAttention's terms as the fa3 backend passes them."""
    p = inp.params

    def first(res: Any) -> torch.Tensor:
        return res[0] if isinstance(res, (tuple, list)) else res

    if inp.layout == "thd":
        return lambda: first(flash_varlen(fa.flash_attn_varlen_func, "fa3", inp.q, inp.k,
                                          inp.v, p))
    k, v = (inp.k, inp.v) if inp.layout == "bshd" else (inp.k_dense, inp.v_dense)
    form, k, v = flash_dense_form("fa3", p, inp.q, k, v)
    kw = flash_kwargs(p, form)
    if spec.phase == "decode":
        return lambda: first(fa.flash_attn_with_kvcache(inp.q, k, v, **kw))
    return lambda: first(fa.flash_attn_func(inp.q, k, v, **kw))


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
    lines += [("| cell | policy binds (rule, ranking) | policy ms | its backend forced ms "
               "(policy/forced) | best ms (who) | regret | choice regret | raw library ms | "
               "every correct backend, ms | calls/sample |"),
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        best = r.best
        reg = r.regret
        mark = f"**{reg:.2f}**" if reg is not None and reg > bound else (
            f"{reg:.2f}" if reg is not None else "-")
        others = ", ".join(f"{b} {ms:.4g}" for b, ms in sorted(r.times.items(),
                                                               key=lambda t: t[1]))
        bad = "; ".join(f"{b}: {w[:80]}" for b, w in r.failed.items())
        forced, path = r.policy_forced_ms, r.path_ratio
        raws = ", ".join(f"{lib} {ms:.4g}" for lib, ms in r.raw.items())
        lines.append(
            f"| {r.cell} | {r.policy_backend or '-'} ({r.policy_rule or '-'}, "
            f"{r.policy_source or '-'}) | "
            f"{f'{r.policy_ms:.4g}' if r.policy_ms is not None else 'failed'} | "
            f"{f'{forced:.4g} ({path:.2f})' if forced and path else '-'} | "
            f"{f'{best[1]:.4g} ({best[0]})' if best else '-'} | {mark} | "
            f"{f'{r.choice_regret:.2f}' if r.choice_regret is not None else '-'} | "
            f"{raws or '-'} | {others or '-'}{' FAILED: ' + bad if bad else ''} | "
            f"{r.batch} |")
    served = [r for r in results if r.times]
    worst = max((r.regret or math.inf for r in served), default=None)
    lines += ["", f"{len(served)} cells with at least one exact backend; worst regret "
              f"{worst:.2f} (bound {bound})." if worst is not None else ""]
    missed = misses(results, bound)
    if missed:
        lines += ["", f"Cells over {bound}:"]
        lines += [f"- {r.cell}: regret {r.regret or math.inf:.2f}: {why}" for r, why in missed]
    failed = [(r.cell, b, w) for r in results for b, w in r.failed.items()]
    failed += [(r.cell, f"raw {lib}", w) for r in results for lib, w in r.raw_failed.items()]
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
        for ms in r.raw.values():
            ax2.scatter(ms, y, marker="x", color="grey", s=30, zorder=3)
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
    ax2.scatter([], [], marker="x", color="grey", label="raw library (info)")
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
