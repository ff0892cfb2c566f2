"""Backends ``gla``, ``linear`` and ``retention``: one recurrence, three decays.

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t     (per query head)

* ``gla``: g data-dependent, per head and key channel (``extra["gla_gate"]`` or the default
  of :func:`default_gate`);
* ``retention``: g fixed per head, log(1 - 2^(-5-h)) (RetNet's decays, as fla's
  ``chunk_retention``);
* ``linear``: g = 0, plain (unnormalised) causal linear attention.

These are different operators from softmax attention, not approximations of it: they are
declared approximate (``exact=False``, tier ``approximate``) with an unbounded error budget
against dense attention, so a resolver never binds them to an exact request; only a policy
rule that names them for a layer does. Causal only (a recurrence), no LSE.

Phases: train/prefill run the chunked form; decode (at most ``RECURRENT_MAX`` new tokens
per sequence, no gradients) the recurrent form. See :mod:`.extra` for the recurrent-state
cache that makes decode O(1) per token, and :mod:`.linear_ops` for which kernels run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from attnhub.plugin import (
    env_flag,
    FLOAT_DTYPES,
    AttentionOutput,
    AttentionSpec,
    AttnParams,
    Backend,
    BackendUnavailableError,
    Capabilities,
    DeviceInfo,
    InputError,
    StateGeometry,
    attends_nothing,
)

from . import extra as X
from . import linear_ops
from .layouts import Doc, serve
from .state_cache import RecurrentStateCache

#: Why a training call with queries after a prefix and no state cache is declined, at call
#: time (``check`` cannot see whether ``extra`` brings the prefix's state).
_PREFIX_GRAD = ("{} does not differentiate the state of a prefix: gradients need Sq == Sk "
                "(train on whole sequences, or bind an exact backend)")

#: Decode calls with at most this many new tokens per sequence use the recurrent form.
RECURRENT_MAX = 16
#: Temperature of the default gate: per-step decay sigmoid(k)^(1/16), as GLA's gates
#: (Yang et al. 2024, "Gated Linear Attention Transformers", tau = 16).
GATE_TEMPERATURE = 16.0

LINEAR_CAPABILITIES = Capabilities(
    dtypes=FLOAT_DTYPES, max_head_dim=128, different_v_dim=True,
    masks=frozenset({"causal", "document"}), layouts=frozenset({"bshd", "thd", "paged"}),
    backward=True, deterministic_backward=True, returns_lse=False, top_left_causal=False,
    deterministic_forward=True, gqa=True, exact=False, error_budget=math.inf,
)


#: The lowest log decay a gate's token keeps (a full reset below it means the same)
GATE_FLOOR = -60.0


def default_gate(k: torch.Tensor) -> torch.Tensor:
    """The gate used when ``extra["gla_gate"]`` is absent: ``logsigmoid(k) / 16`` (fp32),
    floored at :data:`GATE_FLOOR` like a given gate.

    Deterministic and data-dependent through the keys alone (the call has no access to the
    layer input a trained gate projection would read): each channel keeps sigmoid(k)^(1/16)
    of its state per token, a half-life of about 11 tokens at k = 0. Causal-consistent: the
    gate of token t depends on k_t only, so prefill and decode derive the same gates. The
    floor (a decay of 1e-26, 0 to fp32 beside 1) keeps a key of -1e6 from turning into a log
    decay of -6e4 that absorbs the digits of its chunk's cumulative decays (prefill was up to
    87% off the recurrence, which decode follows exactly).
    """
    return (F.logsigmoid(k.float()) / GATE_TEMPERATURE).clamp_min(GATE_FLOOR)


def retention_decay(heads: int, device: torch.device) -> torch.Tensor:
    """(H,) log-decays log(1 - 2^(-5-h)): RetNet's per-head decays, as fla uses them."""
    h = torch.arange(heads, dtype=torch.float32, device=device)
    return torch.log1p(-torch.pow(2.0, -5.0 - h))


def _to_heads(x: torch.Tensor, hq: int, what: str) -> torch.Tensor:
    """(B, S, H, ...) with H dividing Hq -> (B, S, Hq, ...), grouped as GQA groups heads."""
    h = x.shape[2]
    if h == hq:
        return x
    if hq % h:
        raise InputError(f"{what} has {h} heads; it needs the query heads ({hq}) or a divisor "
                         "of them (the KV heads)")
    return x.repeat_interleave(hq // h, dim=2)


def _check_gate(g: Any, k: torch.Tensor, layout: str) -> None:
    """A given gate is a floating log-decay (every value <= 0; thd: one row per packed key).
    Checked once per call, before any state is read or written: a positive or NaN decay
    overflows the recurrence and would store inf/NaN in a sequence's state. The values are
    read on the CPU, or with ``ATTNHUB_DEBUG=1``: on an accelerator that read is a host sync
    per layer and step, which decode cannot afford (the hub's NaN checks follow that rule)."""
    where = f"gla: extra[{X.GATE!r}]"
    if not isinstance(g, torch.Tensor):
        raise InputError(f"{where} must be a tensor, got {type(g).__name__}")
    if not g.is_floating_point():
        raise InputError(f"{where} has dtype {g.dtype}; pass float log-decays (<= 0), e.g. "
                         "F.logsigmoid(x) / 16")
    if layout == "thd" and g.shape[:1] != k.shape[:1]:
        raise InputError(f"{where} has {g.shape[0] if g.dim() else 0} rows but k packs "
                         f"{k.shape[0]} tokens; a thd gate is packed like k (total_k, H, K|-)")
    if not g.is_cpu and not env_flag("ATTNHUB_DEBUG", False):
        return
    with torch.no_grad():
        bad = int((~(g <= 0)).sum())  # NaN included
    if bad:
        raise InputError(f"{where} has {bad} values that are > 0 or NaN; the gate is a log-"
                         "decay (<= 0): pass e.g. F.logsigmoid(x) / 16, or clamp(max=0)")


def _check_paged_gate(g: torch.Tensor, seqlens_k: torch.Tensor, sq: int, stateful: bool) -> None:
    """A paged call's gate: packed like the context's keys, (sum(seqlens_k), H, K|-), as thd
    packs it; with a state cache also (B, Sq, H, K), the new tokens' rows only."""
    where = f"gla: extra[{X.GATE!r}]"
    total = int(seqlens_k.sum())
    if g.dim() == 4 and stateful:
        return  # (B, Sq, H, K): checked against the new tokens by ``gate``
    if g.dim() in (2, 3) and g.shape[0] == total:
        return
    also = f" or (B={seqlens_k.numel()}, Sq={sq}, H, K) for the new tokens" if stateful else ""
    raise InputError(f"{where} has shape {tuple(g.shape)}; a paged call takes it packed like "
                     f"its context's keys, (sum(seqlens_k)={total}, H, K) or ({total}, H), "
                     f"sequence after sequence{also}")


def _several_queries(q: torch.Tensor, spec: AttentionSpec, params: AttnParams) -> bool:
    """Does some sequence bring more than one query? (With one, causal changes nothing.)"""
    if spec.layout == "thd":
        cu = params.cu_seqlens_q
        return bool(((cu[1:] - cu[:-1]) > 1).any())
    return q.shape[1] > 1


class _LinearFamily(Backend):
    """Shared machinery: layouts, state cache, prefix state, chunked vs recurrent."""

    tier = "approximate"
    capabilities: ClassVar[Capabilities] = LINEAR_CAPABILITIES
    keeps_sequence_state = True

    def new_sequence_store(self, geometry: StateGeometry) -> RecurrentStateCache:
        """One fp32 (Hq, K, V) state per sequence and layer: a model bound to this backend
        keeps it beside its KV cache and passes it in ``extra``, so decode reads only the
        new tokens."""
        g = geometry
        return RecurrentStateCache(layers=g.layers, num_heads=g.num_q_heads, key_dim=g.head_dim,
                                   value_dim=g.head_dim_v, max_seqs=g.max_seqs, device=g.device)

    def gate(self, q: torch.Tensor, k: torch.Tensor, extra: dict[str, Any], doc: Doc | None,
             context: int) -> torch.Tensor:
        """Log-decay (B, S, Hq, K) fp32 for keys k (B, S, Hkv, K), the last S of a context of
        ``context`` tokens (a given gate may cover the context or just these S)."""
        raise NotImplementedError

    def extra_checks(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        if not spec.mask.causal and spec.max_seqlen_q > 1:
            return [f"{self.name} is a causal recurrence: it serves causal masks only "
                    "(pass causal=True; one query at the end of its context may omit it)"]
        if spec.max_seqlen_q > spec.max_seqlen_k:  # buckets: Sq > Sk for sure
            return [f"{self.name} reads the queries as the last Sq tokens of the context, so "
                    "it needs Sq <= Sk; bind an exact backend for Sq > Sk"]
        return []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                spec: AttentionSpec, params: AttnParams) -> AttentionOutput:
        if not params.causal and _several_queries(q, spec, params):
            raise InputError(f"{self.name}: causal=False with several queries; a linear layer "
                             "is a causal recurrence, call it with causal=True")
        if X.GATE in params.extra and self.name != "gla":
            raise InputError(f"{self.name}: extra[{X.GATE!r}] given, but {self.name} has no "
                             "data-dependent gate; bind this layer to gla to use it")
        if X.GATE in params.extra:
            _check_gate(params.extra[X.GATE], k, spec.layout)
        batch = (params.cu_seqlens_q.numel() - 1 if spec.layout == "thd" else q.shape[0])
        ref = X.state_ref(params.extra, batch, self.name,
                          (q.shape[-2], q.shape[-1], v.shape[-1]))
        if spec.layout == "paged" and X.GATE in params.extra:
            _check_paged_gate(params.extra[X.GATE], params.seqlens_k, q.shape[1],
                              ref is not None)
        if spec.layout == "paged" and ref is not None:
            return AttentionOutput(self._paged_step(q, k, v, params, ref, spec), None)

        def run(q1: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor, p: AttnParams,
                doc: Doc | None) -> tuple[torch.Tensor, None]:
            r = ref.subset(doc.index) if ref is not None and doc is not None else ref
            return self._bshd(q1, k1, v1, p, doc, r, spec), None

        return serve(q, k, v, spec, params, run)

    # -- the engine -------------------------------------------------------------------------
    def _bshd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams,
              doc: Doc | None, ref: X.StateRef | None, spec: AttentionSpec) -> torch.Tensor:
        b, sq, hq, _ = q.shape
        sk = k.shape[1]
        pre = sk - sq
        if pre < 0:
            raise InputError(f"{self.name}: {sq} queries but {sk} keys; the queries are the "
                             "last Sq tokens of the context, so Sq <= Sk")
        if ref is not None:  # the state holds the prefix: only the new tokens are read
            g = self.gate(q, k[:, pre:], p.extra, doc, sk)

            def context(i: int) -> tuple[torch.Tensor, ...] | None:
                gc = self._context_gate(q, k, p.extra, doc, sk)
                if gc is None:
                    return None
                return (_to_heads(k[i:i + 1, :pre], hq, "k"),
                        _to_heads(v[i:i + 1, :pre], hq, "v"), gc[i:i + 1, :pre])

            return self._continue(q, _to_heads(k[:, pre:], hq, "k"),
                                  _to_heads(v[:, pre:], hq, "v"), g, p, ref, [pre] * b, spec,
                                  context)
        g = self.gate(q, k, p.extra, doc, sk)
        if sq == 0:  # a document without queries: no output, so no prefix state to build
            return attends_nothing(q, k, v) + g[..., :0].sum()  # (in the gate's graph too)
        k, v = _to_heads(k, hq, "k"), _to_heads(v, hq, "v")
        h0 = None
        if pre > 0:
            if self._needs_grad(q, k, v):  # (with a state cache the prefix is its state)
                raise BackendUnavailableError(self.name, [
                    f"{_PREFIX_GRAD.format(self.name)} (here Sq {sq} < Sk {sk})"])
            h0 = linear_ops.state_after(k[:, :pre], v[:, :pre], g[:, :pre])
        return self._run(q, k[:, pre:], v[:, pre:], g[:, pre:], p, h0, spec)[0]

    def _context_gate(self, q: torch.Tensor, k: torch.Tensor, extra: dict[str, Any],
                      doc: Doc | None, context: int) -> torch.Tensor | None:
        """The gate of every key of the context (B, Sk, Hq, K), or None when the call's gate
        covers only the new tokens (the prefix's decay is then unknown here)."""
        given = extra.get(X.GATE)  # thd: packed like k, so it covers the document's keys
        if given is not None and doc is None and given.shape[1] != context:
            return None
        return self.gate(q, k, extra, doc, context)

    def _continue(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  p: AttnParams, ref: X.StateRef, expected: list[int], spec: AttentionSpec,
                  context: Callable[[int], tuple[torch.Tensor, ...] | None]) -> torch.Tensor:
        """New tokens only (k/v/g of length Sq): read the states, run, store the new ones.
        A state that does not sit where the context ends (a step aborted after this layer
        wrote it, CacheStep.abort; a skipped step) is rebuilt from the context's keys, which
        the KV cache holds (``context(i)``: sequence i's prefix k, v, gate, heads expanded)."""
        h0, pos = ref.cache.read(ref.seq_ids, ref.layer)
        for i, (s, have, want) in enumerate(zip(ref.seq_ids, pos, expected)):
            if have == want:
                continue
            prefix = context(i)
            if prefix is None:
                raise InputError(
                    f"{self.name}: the recurrent state of sequence {s} in layer {ref.layer} "
                    f"has consumed {have} tokens but this call's context puts its new tokens "
                    f"after {want}, and extra[{X.GATE!r}] covers only the new tokens, so the "
                    "state cannot be rebuilt from the context: pass the gate of every key "
                    "(B, Sk, H, K|-; thd and paged: packed like k), or keep every step of a "
                    "sequence, in order, on this cache")
            h0[i] = linear_ops.state_after(*prefix)[0].to(h0.dtype)
            ref.cache.restore(s, ref.layer, h0[i], want)
        o, h1 = self._run(q, k, v, g, p, h0.to(q.device), spec)
        ref.cache.write(ref.seq_ids, ref.layer, h1.to(ref.cache.device), q.shape[1])
        return o

    def _paged_step(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    p: AttnParams, ref: X.StateRef, spec: AttentionSpec) -> torch.Tensor:
        """Paged call with states: read only the new tokens' k/v from the pages."""
        sq, hq = q.shape[1], q.shape[2]
        page = k_cache.shape[1]
        lens = p.seqlens_k.to(torch.long).view(-1, 1)
        pos = lens - sq + torch.arange(sq, device=lens.device).view(1, -1)
        if bool((pos < 0).any()):
            raise InputError(f"{self.name}: seqlens_k {p.seqlens_k.tolist()} shorter than the "
                             f"{sq} new tokens; the cache must already hold the new tokens")
        pages = p.block_table.to(torch.long).gather(1, pos // page)
        k_new = k_cache[pages, pos % page]
        given = p.extra.get(X.GATE)
        packed = given is not None and given.dim() in (2, 3)  # every key's, as thd packs it
        starts = (torch.cumsum(lens.view(-1), 0) - lens.view(-1)).tolist() if packed else []
        if packed:
            rows = (torch.tensor(starts, device=lens.device).view(-1, 1) + pos).to(given.device)
            g = self.gate(q, k_new, {**p.extra, X.GATE: given[rows]}, None, sq)
        else:
            g = self.gate(q, k_new, p.extra, None, sq)
        k = _to_heads(k_new, hq, "k")
        v = _to_heads(v_cache[pages, pos % page], hq, "v")
        expected = (lens.view(-1) - sq).tolist()

        def context(i: int) -> tuple[torch.Tensor, ...] | None:
            if given is not None and not packed:  # (B, Sq, H, K): the new tokens only
                return None
            at = torch.arange(expected[i], device=lens.device)
            pg = p.block_table[i].to(torch.long)[at // page]
            kc = k_cache[pg, at % page].unsqueeze(0)
            extra = p.extra if not packed else {
                **p.extra, X.GATE: given[starts[i]:starts[i] + expected[i]].unsqueeze(0)}
            return (_to_heads(kc, hq, "k"),
                    _to_heads(v_cache[pg, at % page].unsqueeze(0), hq, "v"),
                    self.gate(q[i:i + 1], kc, extra, None, expected[i]))

        return self._continue(q, k, v, g, p, ref, expected, spec, context)

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             p: AttnParams, h0: torch.Tensor | None,
             spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
        det = spec.deterministic or p.deterministic
        if q.shape[1] <= RECURRENT_MAX and not self._needs_grad(q, k, v, g):
            return linear_ops.recurrent(q, k, v, g, p.scale, h0, det)
        return linear_ops.chunked(q, k, v, g, p.scale, h0, det)

    @staticmethod
    def _needs_grad(*xs: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


class GLABackend(_LinearFamily):
    """Gated linear attention: per-head, per-channel, data-dependent decay."""

    name = "gla"
    description = ("gated linear attention (data-dependent decay; chunked Triton kernels for "
                   "train/prefill, recurrent step for decode; fla when faster)")

    def gate(self, q: torch.Tensor, k: torch.Tensor, extra: dict[str, Any], doc: Doc | None,
             context: int) -> torch.Tensor:
        hq = q.shape[2]
        g = extra.get(X.GATE)
        if g is None:
            return _to_heads(default_gate(k), hq, "the default gate")
        if not isinstance(g, torch.Tensor):
            raise InputError(f"gla: extra[{X.GATE!r}] must be a tensor, got {type(g).__name__}")
        if doc is not None:
            g = g[doc.k_start:doc.k_end].unsqueeze(0)
        s = k.shape[1]
        if g.dim() not in (3, 4) or g.shape[0] != k.shape[0] or g.shape[1] not in (
                s, context) or (g.dim() == 4 and g.shape[3] != k.shape[3]):
            raise InputError(
                f"gla: extra[{X.GATE!r}] has shape {tuple(g.shape)}; expected (B={k.shape[0]}, "
                f"S={context} (every key) or {s} (the new tokens), H, K={k.shape[3]}) or "
                "(B, S, H) log-decays (<= 0); thd/paged take it packed like k (total_k, H, K|-)")
        # a hard reset (-inf, -1e30) is a decay of 0: kept at GATE_FLOOR, whose exp (1e-26)
        # is 0 to fp32 beside 1, so the forms' sums and differences of log decays stay
        # finite and exact (-inf - -inf was NaN, -1e30 - -1e30 lost every digit)
        g = g[:, g.shape[1] - s:].float().clamp_min(GATE_FLOOR)
        if g.dim() == 3:
            g = g.unsqueeze(-1).expand(*g.shape, k.shape[3])
        return _to_heads(g, hq, f"extra[{X.GATE!r}]")


class LinearBackend(_LinearFamily):
    """Plain causal linear attention (no decay, no normaliser)."""

    name = "linear"
    description = "causal linear attention without decay, on the gla kernels"

    def gate(self, q: torch.Tensor, k: torch.Tensor, extra: dict[str, Any], doc: Doc | None,
             context: int) -> torch.Tensor:
        # fp32 as every gate (default_gate, a given one): not torch.get_default_dtype()
        return torch.zeros(*k.shape[:2], q.shape[2], k.shape[3], dtype=torch.float32,
                           device=k.device)


class RetentionBackend(_LinearFamily):
    """Retention: a fixed decay per head (RetNet), no data dependence."""

    name = "retention"
    description = "retention (fixed per-head decay 1 - 2^(-5-h)), on the gla kernels"

    def gate(self, q: torch.Tensor, k: torch.Tensor, extra: dict[str, Any], doc: Doc | None,
             context: int) -> torch.Tensor:
        hq = q.shape[2]
        decay = retention_decay(hq, k.device).view(1, 1, hq, 1)
        return decay.expand(*k.shape[:2], hq, k.shape[3])
