"""The Hub: registry + policy + device, and the call path of ``attnhub.attention``.

Resolution happens once per spec bucket (and bind context) and is cached as a ``Runner``; a
call builds a tuple key from shapes and flags, looks the runner up and calls it. No policy
code runs on a cache hit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import weakref
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Protocol

import torch

from .core.backend import AttentionOutput, Backend, safe_check
from .core.decision import BindContext, Decision, report_missing
from .core.device import DeviceInfo, probe
from .core.registry import Registry
from .core.masking import attends_nothing, no_keys_lse
from .core.modsig import arity_error, shape_key
from .core.lse_guard import guard_lse
from .core.spec import AttentionSpec, AttnParams, MaskSpec, bucket, dtype_name
from .core.env import env_flag
from .core.contract import (
    SCALAR_MAX,
    SCALAR_MIN,
    check_call,
    check_dropout,
    check_extra,
    check_max_seqlen,
    check_plain,
    check_qkv,
    check_scalars,
    fit_positions,
)
from .core.outputs import (
    CONTROL_FLOW,
    autocast_on,
    call_inputs,
    check_output,
    check_result,
    grad_needed,
    nan_violation,
    reused_output,
    shared_memory,
    watched_forward,
)
from .core.tables import PAGED, THD
from .errors import (
    ArgumentError,
    BackendUnavailableError,
    InputError,
    NoBackendError,
    OutputContractError,
    ShapeError,
)
from .settle import settle

log = logging.getLogger("attnhub")

#: Exact-shape bindings kept for the hot path before the table is cleared.
_EXACT_CACHE_LIMIT = 4096
#: Resolved runners kept (least recently used dropped first). Runners are keyed by bucketed
#: shapes and the *kind* (name) of score/mask callables, never by the callable object, so
#: a fresh lambda per call reuses one runner; the limit bounds even unusual workloads.
RUNNER_LIMIT = 1024
#: The default of ``Hub.attention``'s guard parameter: a fourth positional argument is not it.
_KEYWORDS = object()
_TENSOR = torch.Tensor
#: Whether torch.autocast is on for any device type: one C call, the hot path's only cost
#: when it is off (when on, the hot path runs its backend with it off, as the slow lane does).
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: autocast_on("cpu") or autocast_on("cuda"))
#: ``torch.use_deterministic_algorithms(True)`` asks every op for a deterministic kernel: a
#: call then binds as ``deterministic=True`` does (one C call, in the exact key too).
_torch_deterministic = getattr(torch._C, "_get_deterministic_algorithms", None) or (
    torch.are_deterministic_algorithms_enabled)


class Resolver(Protocol):
    """What the hub needs from a policy: a decision per spec and context."""

    name: str

    def resolve(self, spec: AttentionSpec, device: DeviceInfo, registry: Registry,
                ctx: BindContext) -> Decision: ...


class Runner:
    """A resolved binding: the chosen backend, then run-time fallbacks if the rule allows.

    Every result is checked against the output contract (shape, dtype, device: metadata
    only) before it is returned; a violation is that backend failing, like an exception.
    The hub's hot path runs ``first`` itself (one Python frame less per call) and hands
    a failure to :meth:`recover`; everything else goes through ``__call__``.
    """

    __slots__ = ("decision", "chain", "hub", "local", "first", "empty", "distrusted",
                 "summed", "previous", "generation")

    def __init__(self, decision: Decision, chain: list[Backend], hub: "Hub"):
        self.decision = decision
        self.chain = chain
        self.hub = hub
        inner = decision.inner
        self.local = hub.registry.get(inner.backend) if inner and inner.backend else None
        #: no query or no key in any call of this binding (a bucket of 0 holds only 0), and
        #: no distributed backend (its ranks must meet): the answer is known, 0 out and -inf
        #: LSE, so no backend runs (kernels mishandle empty grids: flex's LSE at batch 0)
        spec = decision.spec
        self.empty = self.local is None and 0 in (spec.batch, spec.max_seqlen_q,
                                                  spec.max_seqlen_k)
        #: the candidate the hot path may call directly (a distributed backend's runner
        #: first passes its local kernel in ``params.extra``: ``__call__`` does). None
        #: until a result of ``chain[0]`` passed the slow lane's full checks (``_fallback``
        #: sets it): a call of another thread meanwhile takes the slow lane too, never an
        #: unchecked first call
        self.first: Backend | None = None
        #: backends caught breaking what only the slow lane checks: never ``first`` again
        #: ``id()`` of each (a backend need not be hashable: a ``@dataclass`` is not)
        self.distrusted: frozenset[int] = frozenset()
        #: a result passed with the inputs' bits summed (``watched_forward(vet=True)``):
        #: later slow-lane calls (a distributed backend's, every call) skip the sums
        self.summed = False
        #: (id of the backend, weak references to its output and LSE) of the last good
        #: slow-lane call of the first candidate (``_admit``)
        self.previous: tuple[int, weakref.ref[torch.Tensor], Any] | None = None
        #: the hub's settings generation this binding was resolved under: a binding of an
        #: older one (a rebind ran while it resolved) never enters the hub's tables
        self.generation = hub._generation

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 spec: AttentionSpec, params: AttnParams,
                 want: tuple[int, ...] | None = None, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> AttentionOutput:
        """Run the chain; ``want`` is the output shape (``q.shape[:-1] + (Dv,)``),
        ``device``/``dtype`` q's, when the caller knows them already."""
        if self.local is not None:  # a distributed backend runs this local kernel per block,
            params.extra["local_backend"] = self.local  # over the ranks the call names
            if self.decision.context.world_size > 1:  # 1: the call named no world size
                params.extra["world_size"] = self.decision.context.world_size
        if self.empty:
            return _attends_nothing(q, k, v, spec.layout, params.return_lse)
        if want is None:
            want = (*q.shape[:-1], v.shape[-1])
        return self._fallback(self.chain, 0, q, k, v, spec, params, want, device or q.device,
                              dtype or q.dtype)

    def _admit(self, backend: Backend, out: torch.Tensor,
               lse: torch.Tensor | None) -> OutputContractError | None:
        """The hot path takes the first candidate after its second good slow-lane call;
        until then (and for a distrusted one, on every call) an output or LSE must not be
        the tensor the previous call returned while the caller still holds it (a static
        buffer would rewrite every result it handed out); a reuse is distrusted and
        returned."""
        if self.local is not None or self.empty:
            return None
        prev, self.previous = self.previous, (
            id(backend), weakref.ref(out), None if lse is None else weakref.ref(lse))
        held: tuple[Any, Any] = (None, None)
        if prev is not None and prev[0] == id(backend):
            held = (prev[1](), prev[2]() if prev[2] is not None else None)
        bad = reused_output(backend.name, (out, lse), held)
        if bad is not None:
            if id(backend) not in self.distrusted:
                self.hub._distrust(self, backend, _failure_reason(bad))
            return bad
        if prev is not None and prev[0] == id(backend) and id(backend) not in self.distrusted:
            self.first, self.previous = backend, None  # vetted: the hot path may call it now
        return None

    def recover(self, exc: Exception, failed: Backend, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, spec: AttentionSpec, params: AttnParams,
                want: tuple[int, ...], device: torch.device,
                dtype: torch.dtype) -> AttentionOutput:
        """The hot path's first candidate ``failed`` raised ``exc`` (not an ``InputError``:
        the call was checked before any backend ran, so that one is never retried) or broke
        the output contract: raise per the rule, or go on with the next candidate."""
        # the hot path's key holds q, k and v by shape, dtype and device only: a sparse,
        # mkldnn or nested one reaches the backend, whose failure is the input's
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):  # a tensor look-alike the key took for one
                raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            check_plain(name, t)
        chain = self.chain
        if chain[0] is not failed:  # moved back meanwhile (another thread): the chain now
            return self._fallback(chain, 0, q, k, v, spec, params, want, device, dtype)
        return self._fallback(chain, self.hub._on_failure(self, chain, 0, exc), q, k, v,
                              spec, params, want, device, dtype)

    def _fallback(self, chain: list[Backend], i: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, spec: AttentionSpec, params: AttnParams,
                  want: tuple[int, ...], device: torch.device,
                  dtype: torch.dtype) -> AttentionOutput:
        """``chain`` from candidate ``i``: load, run, check (and NaN-check in debug mode).

        This is the slow lane (a binding's first call, a fallback, debug mode), so it also
        checks what the hot path leaves out: that the backend wrote into none of its inputs
        (version counters: raised at once, never retried, since the inputs are no longer
        what the caller passed) and that its result shares no memory with them. It runs
        backends with ``torch.autocast`` off: attention computes in q's dtype (the contract),
        whatever autocast would pick for their kernels (the hot path too, so a binding's later
        calls compute as its first did)."""
        if autocast_on(device.type):
            with torch.autocast(device.type, enabled=False):
                return self._fallback(chain, i, q, k, v, spec, params, want, device, dtype)
        needs_grad = grad_needed(q, k, v)
        inputs = call_inputs(q, k, v, params)
        while True:
            backend = chain[i]
            vet = self.hub.debug or not self.summed or id(backend) in self.distrusted
            res, failure, written = watched_forward(backend, q, k, v, spec, params.fresh(),
                                                    inputs, vet)
            if written is not None:
                self.hub._distrust(self, backend, _failure_reason(written))
                raise written from failure
            if isinstance(failure, InputError):
                raise failure  # the caller's input: never retried on a fallback
            if failure is None:
                try:
                    out, lse = self._checked(backend, res, q, v, spec, params, want, device,
                                             dtype, needs_grad)
                    bad = shared_memory(backend.name, out, lse, inputs)
                    if bad is not None:
                        self.hub._distrust(self, backend, _failure_reason(bad))
                    elif self.hub.debug:
                        bad = nan_violation(backend.name, out, lse, q, k, v)
                    if bad is None and self.first is None and backend is self.chain[0]:
                        bad = self._admit(backend, out, lse)
                    if bad is None:
                        self.summed = self.summed or vet
                        return AttentionOutput(out, lse)
                    failure = bad
                except OutputContractError as exc:
                    failure = exc
            i = self.hub._on_failure(self, chain, i, failure)

    @staticmethod
    def _checked(backend: Backend, res: Any, q: torch.Tensor, v: torch.Tensor,
                 spec: AttentionSpec, params: AttnParams, want: tuple[int, ...],
                 device: torch.device, dtype: torch.dtype,
                 needs_grad: bool) -> AttentionOutput:
        """``res`` against the output contract (raises ``OutputContractError``): its type,
        then the output's metadata, with the details only when a cheap test fails."""
        if res.__class__ is AttentionOutput:
            out, lse = res
        else:
            out, lse = check_result(backend.name, res)
        if (out.__class__ is not _TENSOR or out.dtype is not dtype or out.shape != want
                or out.device != device or (needs_grad and out.grad_fn is None)
                or params.return_lse or out.layout is not torch.strided):
            check_output(backend.name, out, lse, q, v, spec.layout, params.return_lse,
                         needs_grad)
        if needs_grad and params.return_lse and lse is not None and lse.grad_fn is None:
            # an LSE outside the graph (a leaf too: ``requires_grad_()`` on a detached one
            # would take the gradient and give q and k none): it raises, never dropped
            return AttentionOutput(out, guard_lse(backend.name, out, lse))
        return res if res.__class__ is AttentionOutput else AttentionOutput(out, lse)


class Hub:
    """One deployment's view: which plugins, which policy, which device."""

    def __init__(self, policy: str | Path | Resolver | None = None, *,
                 hardware: str | None = None, registry: Registry | None = None,
                 debug: bool | None = None, settle_ties: bool | None = None):
        self._registry = registry or Registry.load()
        self._device = probe(hardware)
        self._policy_arg = policy
        self._resolver: Resolver | None = policy if _is_resolver(policy) else None
        self._runners: OrderedDict[tuple, tuple[AttentionSpec, Runner]] = OrderedDict()
        self._exact: dict[tuple, tuple] = {}
        #: ``(fast_key, entry)`` of the last exact hit or binding, read and replaced whole
        self._last_exact: tuple[tuple, tuple | None] = ((), None)
        #: the last length-bucket key that hit, and its entry: a growing cache's next step
        #: (a new length, the same buckets) compares with it instead of two hashed misses
        self._last_grow: tuple[tuple, tuple | None] = ((), None)
        #: ``(PAGED memo, exact entry)``: that memo was checked for that binding (paged)
        self._paged_last: tuple[Any, Any] = (None, None)
        self._decisions: dict[tuple[AttentionSpec, BindContext], Decision] = {}
        #: near-ties of the pack timed on a first call, per (bucket, rule, tied candidates)
        self._settled: dict[tuple, Decision] = {}
        self._lock = threading.Lock()
        #: bumped by every rebind: what a call resolved under older settings (a thread that
        #: was resolving while the settings changed) is not stored
        self._generation = 0
        #: the registry's generation the bindings were made under: a plugin added to it
        #: later (``Registry.add_plugin``) rebinds, told at once (``_registry_changed``, so
        #: the hot path reads nothing) and checked again at bind time (``_bind_current``)
        self._registry_generation = self._registry.generation
        self._registry.on_change(self._registry_changed)
        self._forced: str | None = os.environ.get("ATTNHUB_BACKEND") or None
        self.fallback_counts: Counter[tuple[str, str]] = Counter()
        self._warned: set[tuple[str, str]] = set()
        #: Debug mode (``Hub(debug=True)`` or ``ATTNHUB_DEBUG=1``; ``attnhub bench`` can set
        #: it): a backend output with NaN from inputs without NaN is that backend failing.
        #: Costs a host sync per call, so it is off on the hot path.
        self.debug = env_flag("ATTNHUB_DEBUG", False) if debug is None else debug
        #: Time a pack's near-tied candidates on the first call of a bucket and bind the
        #: fastest (``attnhub.settle``; ``ATTNHUB_SETTLE_TIES=0``: the pack's order binds).
        self.settle_ties = (env_flag("ATTNHUB_SETTLE_TIES", True) if settle_ties is None
                            else settle_ties)

    @property
    def forced_backend(self) -> str | None:
        """The backend every call is forced to (``ATTNHUB_BACKEND``), or None: the policy."""
        return self._forced

    @forced_backend.setter
    def forced_backend(self, name: str | None) -> None:
        self._rebind(_forced=name or None)

    @property
    def device(self) -> DeviceInfo:
        """The device the policy binds for (``probe(hardware)``)."""
        return self._device

    @device.setter
    def device(self, device: DeviceInfo) -> None:
        self._rebind(_device=device)

    @property
    def registry(self) -> Registry:
        """The backends and variants this hub can bind."""
        return self._registry

    @registry.setter
    def registry(self, registry: Registry) -> None:
        registry.on_change(self._registry_changed)
        self._rebind(_registry=registry)

    def _registry_changed(self, registry: Registry) -> None:
        """``registry`` changed (a plugin added): if it is this hub's, rebind (a registry
        this hub has left still calls it)."""
        if registry is self._registry:
            self._rebind()

    def _bind_current(self) -> None:
        """At bind time: the registry changed since the bindings were made (a change its
        listener call has not reached yet, another thread's): rebind first."""
        if self._registry_generation != self._registry.generation:
            self._rebind()

    def _rebind(self, **settings: Any) -> None:
        """Change what bindings depend on: the bindings and decisions made so far were made
        under the old values, so none may serve a call now."""
        with self._lock:
            for name, value in settings.items():
                setattr(self, name, value)
            self._registry_generation = self._registry.generation
            self._generation += 1
            self._runners.clear()
            self._exact.clear()
            self._last_exact = ((), None)
            self._last_grow = ((), None)
            self._paged_last = (None, None)
            self._decisions.clear()
            self._settled.clear()

    # -- policy ---------------------------------------------------------------------------
    @property
    def resolver(self) -> Resolver:
        if self._resolver is None:
            from .policy import load_policy

            # "" is the caller's (load_policy refuses it), not "no policy given"
            path = (self._policy_arg if self._policy_arg is not None
                    else os.environ.get("ATTNHUB_POLICY") or None)
            self._resolver = load_policy(path)
        return self._resolver

    def decide(self, spec: AttentionSpec, ctx: BindContext = BindContext()) -> Decision:
        """The cached decision record for a spec (bucketed) in a bind context. A ``bhsd``
        spec is the ``bshd`` call the hub makes of it (the resolver decides it so): keyed
        apart, it missed the binding that call settled (a pack's near-tie timed)."""
        self._bind_current()
        if spec.layout == "bhsd":
            spec = dataclasses.replace(spec, layout="bshd")
        key = (spec.bucketed(), ctx)
        d = self._decisions.get(key)
        if d is None:
            gen = self._generation
            d = self.resolver.resolve(key[0], self.device, self.registry, ctx)
            with self._lock:
                if self._generation == gen:
                    self._decisions[key] = d
        return d

    def runner_for(self, spec: AttentionSpec, ctx: BindContext = BindContext(),
                   backend: str | None = None) -> Runner:
        """Bind: resolve (or force) a backend for a spec and build its runner."""
        self._bind_current()
        backend = backend or self.forced_backend
        if backend is not None:
            b = self.registry.get(backend)
            reasons = safe_check(b, spec, self.device)
            if reasons:
                raise BackendUnavailableError(backend, reasons)
            d = Decision(spec=spec, device=self.device.describe(), backend=backend,
                         rule="forced", candidates=(backend,), on_failure="error", context=ctx,
                         notes=("backend forced by argument or ATTNHUB_BACKEND",))
            return Runner(d, [b], self)
        d = self.decide(spec, ctx)
        if d.missing:  # a rule names an uninstalled backend: warned once, counted
            report_missing(d, self.fallback_counts, self._warned)
        if d.backend is None:
            raise NoBackendError(
                "no backend can serve this call:\n" + d.explain(), decision=d)
        chain = [self.registry.get(n) for n in (d.backend, *d.fallbacks)]
        return Runner(d, chain, self)

    # -- run-time failure -------------------------------------------------------------------
    def _on_failure(self, runner: Runner, chain: list[Backend], i: int,
                    exc: Exception) -> int:
        """Candidate ``i`` of ``chain`` failed: raise per the rule, or count and return the
        next index. A lasting refusal also moves that candidate behind the others."""
        d = runner.decision
        name = chain[i].name
        reason = _failure_reason(exc)
        if d.rule == "forced" and isinstance(exc, BackendUnavailableError):
            raise exc  # the forced backend's own refusal, as its check gives one
        if d.on_failure == "error" or i + 1 >= len(chain):
            raise NoBackendError(
                f"backend {name!r} raised {reason}\n(rule on_failure={d.on_failure}; "
                f"no further candidate)\n{d.explain()}", decision=d) from exc
        nxt = chain[i + 1]
        self.fallback_counts[(name, nxt.name)] += 1
        if (name, reason) not in self._warned:
            self._warned.add((name, reason))
            log.warning("attnhub: backend %s failed (%s); falling back to %s as rule %s allows",
                        name, reason, nxt.name, d.rule)
        if isinstance(exc, BackendUnavailableError) and exc.lasting:
            self._move_back(runner, chain[i], "; ".join(exc.reasons) or reason)
        return i + 1

    def _move_back(self, runner: Runner, failed: Backend, why: str,
                   after: str = "a lasting refusal at run time") -> None:
        """``failed`` refuses every later call of ``runner``'s binding: put it behind the
        other candidates (the hot path then calls the next one directly, once a result of it
        passed the slow lane) and say so in the
        decision that ``decide``/``explain`` report."""
        with self._lock:
            chain = runner.chain
            if chain[0] is not failed:
                return  # another thread did it
            new = [*chain[1:], failed]
            d = runner.decision
            note = f"{failed.name} moved behind {new[0].name} after {after}: {why}"
            d = dataclasses.replace(d, backend=new[0].name,
                                    fallbacks=tuple(b.name for b in new[1:]),
                                    notes=(note, *d.notes))
            runner.decision, runner.chain = d, new
            runner.first = None  # the next candidate is vetted by its next slow-lane call
            if runner.generation == self._generation:
                self._decisions[(d.spec, d.context)] = d
        log.warning("attnhub: %s", note)

    def _distrust(self, runner: Runner, failed: Backend, why: str) -> None:
        """``failed`` broke the part of the contract that only the slow lane checks (its
        result shares memory with its inputs, or it wrote into them): the hot path, which
        checks metadata only, must not call it again for this binding. Under
        ``on_failure: next`` with another candidate it moves behind the others; else every
        later call runs it through the checked lane (and fails there, with the reason)."""
        with self._lock:
            if id(failed) in runner.distrusted:
                return  # another thread did it
            runner.distrusted |= {id(failed)}
            if runner.first is failed:
                runner.first = None
        d = runner.decision
        if d.on_failure != "error" and len(runner.chain) > 1:
            self._move_back(runner, failed, why, "breaking the output contract")
            return
        with self._lock:
            note = (f"{failed.name} runs with every result checked in full from now on, "
                    f"after breaking the output contract: {why}")
            d = dataclasses.replace(runner.decision, notes=(note, *runner.decision.notes))
            runner.decision = d
            if runner.generation == self._generation:
                self._decisions[(d.spec, d.context)] = d
        log.warning("attnhub: %s", note)

    # -- the call path ----------------------------------------------------------------------
    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        _only_keywords: Any = _KEYWORDS,
        causal: bool = False, causal_alignment: str = "bottom_right",
        window: int | tuple[int, int] | None = None, softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None, scale: float | None = None,
        cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
        layout: str = "bshd", phase: str | None = None, return_lse: bool = False,
        backend: str | None = None, prefix_lens: torch.Tensor | None = None,
        colmask_start: torch.Tensor | None = None, colmask_end: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None, seqlens_k: torch.Tensor | None = None,
        score_mod: Any = None, mask_mod: Any = None, deterministic: bool = False,
        context: BindContext | None = None, extra: dict[str, Any] | None = None,
        dropout_p: float = 0.0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One attention call; see ``docs/contract.md`` for what each argument must be.

        A call whose shapes, dtypes, devices and flags were seen before takes the
        exact-shape table: only ``scale``/``softcap`` values are checked again, and the
        contents of paged tables / ``cu_seqlens`` once per change (a memo). Everything else
        goes through :func:`attnhub.core.contract.check_call` first.

        Everything after ``v`` is keyword-only in effect: ``_only_keywords`` takes a fourth
        positional argument and refuses it. (Declared keyword-only, the 27 defaults would
        be bound by a dict lookup each, about 0.2 us per call; positional defaults are a
        copy.)
        """
        if _only_keywords is not _KEYWORDS:
            raise TypeError("Hub.attention() takes q, k, v positionally and every other "
                            "argument by keyword (e.g. causal=True)")
        try:  # grad mode first: inference (no_grad) reads no tensor flag
            needs_grad = torch.is_grad_enabled() and (
                q.requires_grad or k.requires_grad or v.requires_grad)
        except AttributeError:  # not tensors: the contract says which and how
            check_qkv(q, k, v, layout)
            raise
        fast_key = grow_key = None
        positions = False  # int position tensors given (prefix_lens, colmask_*)
        det_on = _torch_deterministic()  # torch's own switch: honoured, never bypassed
        try:
            # Hot path: every check of the slow path depends only on what this key holds
            # (side tensors by shape/dtype/device, callables by kind), so a call that matches
            # reuses the checked binding; scale/softcap values are checked per call, paged
            # tables and cu_seqlens by their contents (PAGED/THD: memos that in-place edits
            # cannot fool).
            if (alibi_slopes is None and prefix_lens is None and colmask_start is None
                    and colmask_end is None and cu_seqlens_q is None and cu_seqlens_k is None):
                if block_table is None and seqlens_k is None:
                    side = None
                elif layout == "paged" and block_table is not None and seqlens_k is not None:
                    side = _PAGED_TABLES  # their types and shapes: the memo, or PAGED.check
                else:
                    side = (_meta(block_table), _meta(seqlens_k))
            elif (layout == "thd" and cu_seqlens_q is not None and cu_seqlens_k is not None
                  and alibi_slopes is None and prefix_lens is None and colmask_start is None
                  and colmask_end is None and block_table is None and seqlens_k is None):
                # types and devices: the memo, or THD.check; the shape (the batch) here
                side = (_THD_TABLES, cu_seqlens_q.shape)
            else:
                side = (_meta(alibi_slopes), _meta(prefix_lens), _meta(colmask_start),
                        _meta(colmask_end), _meta(block_table), _meta(seqlens_k),
                        _meta(cu_seqlens_q), _meta(cu_seqlens_k))
                positions = prefix_lens is not None or colmask_start is not None
            if not (window is None or window.__class__ is int or window.__class__ is tuple):
                # a numpy int compares with a tuple as an array, whose truth raises: such a
                # key could never be compared (or looked up) again; the slow path converts
                raise TypeError
            device, dtype = q.device, q.dtype
            q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
            # flags first, shapes last: comparing with the last key fails fast on a flag
            fast_key = (layout, causal, causal_alignment, window, softcap is not None, side,
                        max_seqlen_q, max_seqlen_k,
                        score_mod if score_mod is None
                        else _mod_kind(score_mod, self._registry.variant_of),
                        mask_mod if mask_mod is None
                        else _mod_kind(mask_mod, self._registry.variant_of),
                        phase, return_lse, backend, context, deterministic, det_on,
                        needs_grad,
                        dropout_p > 0.0,  # as the spec's flag, whatever number type
                        dtype, k.dtype, v.dtype, device, k.device, v.device,
                        # a lazily negated view reads un-negated in a kernel that takes raw
                        # pointers: such a call takes the slow path's refusal
                        q.is_neg() or k.is_neg() or v.is_neg(),
                        q_shape, k_shape, v_shape)
            # the layers of a step repeat one key: comparing it with the last one costs
            # about half a lookup (no hash of ~25 items)
            last = self._last_exact
            # (a given max_seqlen_q must be checked against each call's Sq: slow path)
            grows = side is None and max_seqlen_k is None and max_seqlen_q is None and (
                layout == "bshd" or layout == "bhsd")
            if fast_key == last[0]:
                hit = last[1]
            else:
                hit = base = None
                if grows:
                    # a contiguous KV cache grows by a key per decode step, prompts come at a
                    # new length per call: look the call up by its length buckets too (the
                    # slow path depends on Sq and Sk only through them), the last such key
                    # first (a growing cache's next step: an equality test, no hash)
                    axis = 1 if layout == "bshd" else 2
                    grow_key = _grow_key(fast_key, q_shape, k_shape, v_shape, axis)
                    lg = self._last_grow
                    if grow_key is not None and grow_key == lg[0]:
                        base = lg[1]
                if base is None:
                    hit = self._exact.get(fast_key)
                    if hit is not None:
                        self._last_exact = (fast_key, hit)
                        grow_key = None
                    elif grow_key is not None:
                        base = self._exact.get(grow_key)
                        if base is not None:
                            self._last_grow = (grow_key, base)
                if base is not None:
                    sq, sk = q_shape[axis], k_shape[axis]
                    hit = None if v_shape[axis] != sk else (
                        *base[:-3], (q_shape[0], sq, q_shape[3 - axis], v_shape[-1]), sq, sk)
                    if hit is not None:  # the next layers of this step: the last-key compare
                        self._last_exact = (fast_key, hit)
        except (TypeError, AttributeError, ValueError, RuntimeError):  # unhashable, not a
            # tensor, a key element whose == raises (a numpy array), a nested tensor's shape:
            # the slow path checks
            hit, fast_key = None, None
        if hit is not None and not (
                causal.__class__ is bool and return_lse.__class__ is bool
                and deterministic.__class__ is bool
                and ((dropout_p.__class__ is float and 0.0 <= dropout_p < 1.0)
                     or (dropout_p.__class__ is int and dropout_p == 0))
                and (window is None or window.__class__ is int
                     or (window.__class__ is tuple and window[0].__class__ is int
                         and window[1].__class__ is int))
                and (max_seqlen_q is None or max_seqlen_q.__class__ is int)
                and (max_seqlen_k is None or max_seqlen_k.__class__ is int)):
            # the key compares by ==, under which True == 1 == 1.0: a flag, window, length or
            # dropout probability of another type or range than the slow path takes goes
            # there (and is refused or checked)
            hit = None
        if hit is not None:
            if (scale is not None or softcap is not None) and not (
                    (scale is None or (scale.__class__ is float
                                       and SCALAR_MIN <= scale <= SCALAR_MAX))
                    and (softcap is None or (softcap.__class__ is float
                                             and SCALAR_MIN <= softcap <= SCALAR_MAX))
                    and (scale is None or softcap is None or scale / softcap <= SCALAR_MAX)):
                check_scalars(scale, softcap)  # raises; an int or odd value is checked
            # ``bounded``: the binding's window, its edges normalised for its length bucket
            # (check_call); the caller's ``window`` stays as given, for the slow path that a
            # paged or thd call of another bucket falls to below (normalised for its own)
            (spec, run, bounded, named, named_score, named_mask, default_scale, want,
             max_q, max_k) = hit
            # the snapshots backends read (the caller's tensors go on to check_call on a miss)
            bt, sl, cu_q, cu_k = block_table, seqlens_k, cu_seqlens_q, cu_seqlens_k
            if layout == "paged":
                # the tables' types and shapes are not in the key: the memo vouches for them
                # (same tensors, unchanged, checked for this cache, batch and device), else
                # the full check of tables and contents runs. The layers of a step: the
                # memo this binding last took, still in place, needs only the tensors'
                # identity and stamps (its geometry and length bucket were checked for it)
                memo, last = PAGED._memo, self._paged_last
                hit_tables = (PAGED.still(memo, block_table, seqlens_k)
                              if last[0] is memo and last[1] is hit and max_seqlen_k is None
                              else None)
                if hit_tables is not None:
                    bt, sl, max_k = hit_tables
                else:
                    geometry = (k_shape, q_shape[0], device)
                    hit_tables = PAGED.unchanged(block_table, seqlens_k, geometry)
                    bt, sl, max_k = hit_tables or PAGED.check(q, k, block_table, seqlens_k)
                    if max_seqlen_k is not None:  # an upper bound, as check_call takes it
                        max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, max_k,
                                                 bt.shape[1] * k_shape[1])
                    limit = spec.max_seqlen_k  # a power of two: max_k in (limit/2, limit] fits
                    if not limit >> 1 < max_k <= limit and bucket(max_k) != limit:
                        hit = None  # another length bucket: rebind
                    elif max_seqlen_k is None:
                        memo = PAGED._memo  # this call's, unless another thread's came since
                        if (memo and memo[0] is block_table and memo[1] is seqlens_k
                                and memo[2] == geometry):
                            self._paged_last = (memo, hit)
            elif layout == "thd":
                # as for paged tables: the memo vouches for the offsets' types (the key
                # holds them only with side tensors), else the full check runs
                hit_tables = THD.unchanged(cu_seqlens_q, cu_seqlens_k,
                                           (q_shape[0], k_shape[0], device))
                cu_q, cu_k, max_q, max_k = hit_tables or THD.check(
                    q, k, cu_seqlens_q, cu_seqlens_k)
                if max_seqlen_q is not None:  # upper bounds, as check_call takes them
                    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, max_q, q_shape[0])
                if max_seqlen_k is not None:
                    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, max_k, k_shape[0])
                if (bucket(max_q) != spec.max_seqlen_q or bucket(max_k) != spec.max_seqlen_k
                        or (phase is None and spec.phase != _phase(needs_grad, False,
                                                                   max_q, max_k))):
                    hit = None  # another length bucket or phase: rebind
        if hit is not None:
            if named:  # named variants (strings in the key): their callables, resolved once
                if score_mod.__class__ is str:
                    score_mod = named_score
                if mask_mod.__class__ is str:
                    mask_mod = named_mask
            if layout == "bhsd":
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if positions:  # as the slow path hands them on
                prefix_lens = fit_positions(prefix_lens, max_k)
                colmask_start = fit_positions(colmask_start, max_q)
                colmask_end = fit_positions(colmask_end, max_q)
            # positional: field order checked at import (_PARAM_FIELDS), ~1 us cheaper
            fields = (default_scale if scale is None else scale, causal, causal_alignment,
                      bounded, softcap, alibi_slopes, prefix_lens, colmask_start, colmask_end,
                      cu_q, cu_k, max_q, max_k, bt, sl, score_mod, mask_mod,
                      deterministic or det_on, return_lse)
            params = AttnParams(*fields, _extra(extra, k.dtype), dropout_p)
            first = run.first
            if first is not None and first._loaded and not self.debug:
                try:  # Runner.__call__ inlined for the first candidate: a frame less
                    if _any_autocast():  # off, as the slow lane ran it: q's dtype computes
                        with torch.autocast(device.type, enabled=False):
                            res = first.forward(q, k, v, spec, params)
                    else:
                        res = first.forward(q, k, v, spec, params)
                    # metadata only, the cheap tests first (classes and dtypes are
                    # singletons); the details (and a result of another type) when one
                    # fails or an LSE is asked for
                    if not (res.__class__ is AttentionOutput
                            and (out := res[0]).__class__ is _TENSOR and out.dtype is dtype
                            and out.device == device and not return_lse
                            and out.shape == want
                            and (not needs_grad or out.grad_fn is not None)):
                        res = Runner._checked(first, res, q, v, spec, params, want, device,
                                              dtype, needs_grad)
                except (InputError, *CONTROL_FLOW):
                    raise
                except (Exception, SystemExit, GeneratorExit) as exc:  # a kernel
                    # library's exit() too, as the slow lane (watched_forward) takes them
                    if not isinstance(exc, Exception):
                        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
                    # what the failed backend may have changed in params stays with it
                    params = AttnParams(*fields, _extra(extra, k.dtype), dropout_p)
                    res = run.recover(exc, first, q, k, v, spec, params, want, device, dtype)
            else:
                res = run(q, k, v, spec, params, want, device, dtype)
            out, lse = res
            if layout == "bhsd":
                out = out.transpose(1, 2)
            return (out, lse) if return_lse else out
        a = check_call(
            q, k, v, layout=layout, causal=causal, causal_alignment=causal_alignment,
            window=window, softcap=softcap, scale=scale, alibi_slopes=alibi_slopes,
            prefix_lens=prefix_lens, colmask_start=colmask_start, colmask_end=colmask_end,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, block_table=block_table, seqlens_k=seqlens_k,
            phase=phase, return_lse=return_lse, deterministic=deterministic)
        dropout_p = check_dropout(dropout_p)
        deterministic = deterministic or det_on  # (checked a bool above)
        if context is not None and not isinstance(context, BindContext):
            raise ArgumentError(f"context={context!r} ({type(context).__name__}); pass an "
                                "attnhub.BindContext(model=..., layer=..., layer_kind=...) or "
                                "None")
        if backend is not None and (not isinstance(backend, str) or not backend):
            # "" or 0 would be read as "no backend named" (the policy binds), silently; a str
            # subclass (numpy.str_) is taken, as the hot path's key (==) takes it
            raise ArgumentError(f"backend={backend!r} ({type(backend).__name__}); pass a "
                                "backend's name as a non-empty str (e.g. backend='torch_sdpa'"
                                "; `attnhub backends` lists them), or None for the policy")
        if backend is not None:
            backend = str.__str__(backend)  # a plain str in the runner key and the decision
        transposed = layout == "bhsd"
        q, k, v, layout, window = a.q, a.k, a.v, a.layout, a.window
        score_named, mask_named = isinstance(score_mod, str), isinstance(mask_mod, str)
        named = score_named or mask_named
        variants = (score_mod if score_named else None, mask_mod if mask_named else None)
        if named:
            score_mod, mask_mod = self._variant(score_mod, mask_mod)
        if score_mod is not None and not callable(score_mod):
            raise ArgumentError(f"score_mod={score_mod!r} is not callable; pass a function "
                                "(score, b, h, q_idx, kv_idx) -> score or a variant name")
        if mask_mod is not None and not callable(mask_mod):
            raise ArgumentError(f"mask_mod={mask_mod!r} is not callable; pass a function "
                                "(b, h, q_idx, kv_idx) -> bool or a variant name")
        _check_arity("score_mod", score_mod, variants[0])
        _check_arity("mask_mod", mask_mod, variants[1])
        max_seqlen_q, max_seqlen_k, batch = a.max_seqlen_q, a.max_seqlen_k, a.batch
        if phase is None:
            phase = _phase(needs_grad, layout == "paged", max_seqlen_q, max_seqlen_k)
        # a named variant is its name to the policy (``when: {variant: [name]}``), whatever
        # its callable's ``__name__`` (a plugin may register a lambda under a name)
        names = self.registry.variant_of
        score_kind = variants[0] or _callable_name(score_mod, names)
        mask_kind = variants[1] or _callable_name(mask_mod, names)
        # everything the spec holds (backends' checks read the window's values: a window
        # one backend refuses must not reuse the runner of another window it took)
        key = (phase, q.dtype, k.dtype, q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2],
               layout, causal, causal_alignment, window, alibi_slopes is not None,
               softcap is not None, prefix_lens is not None, layout == "thd",
               colmask_start is not None, score_kind, mask_kind, bucket(max_seqlen_q),
               bucket(max_seqlen_k), bucket(batch), needs_grad, deterministic, return_lse,
               backend, context, k.shape[1] if layout == "paged" else 0, dropout_p > 0)
        default_scale = 1.0 / math.sqrt(q.shape[-1])
        params = AttnParams(
            scale=scale if scale is not None else default_scale,
            causal=causal, alignment=causal_alignment, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, prefix_lens=fit_positions(prefix_lens, max_seqlen_k),
            colmask_start=fit_positions(colmask_start, max_seqlen_q),
            colmask_end=fit_positions(colmask_end, max_seqlen_q),
            cu_seqlens_q=a.cu_seqlens_q, cu_seqlens_k=a.cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_table=a.block_table,
            seqlens_k=a.seqlens_k, score_mod=score_mod, mask_mod=mask_mod,
            deterministic=deterministic, return_lse=return_lse,
            extra=_extra(extra, k.dtype), dropout_p=dropout_p)
        self._bind_current()
        with self._lock:
            hit = self._runners.get(key)
            gen = self._generation  # what this call resolves under (see ``_rebind``)
            if hit is not None:
                self._runners.move_to_end(key)
        if hit is None:
            spec = AttentionSpec(
                phase=phase, dtype=dtype_name(q.dtype), kv_dtype=dtype_name(k.dtype),
                head_dim=q.shape[-1], head_dim_v=v.shape[-1], num_q_heads=q.shape[-2],
                num_kv_heads=k.shape[-2], layout=layout,
                mask=MaskSpec(causal=causal, alignment=causal_alignment, window=window,
                              alibi=alibi_slopes is not None, softcap=softcap is not None,
                              prefix_lm=prefix_lens is not None, document=layout == "thd",
                              column_sparse=colmask_start is not None,
                              score_mod=score_kind, mask_mod=mask_kind),
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, batch=batch,
                needs_grad=needs_grad, deterministic=deterministic, return_lse=return_lse,
                page_size=k.shape[1] if layout == "paged" else 0, dropout=dropout_p > 0,
            ).bucketed()
            ctx = context or BindContext()
            run = self.runner_for(spec, ctx, backend)
            run.generation = gen
            if run.decision.tied and self.settle_ties:
                run = self._settle(run, spec, ctx, q, k, v, params)
            hit = (spec, run)
            with self._lock:
                if self._generation == gen:
                    self._runners[key] = hit
                while len(self._runners) > RUNNER_LIMIT:
                    self._runners.popitem(last=False)
        spec, run = hit
        if fast_key is not None:
            # only a variant's callables are kept: a caller's closure (and the tensors it
            # holds) is never retained by the table; bshd lengths are fixed by the key
            # (paged/thd: memos)
            self._remember(run, fast_key, grow_key, (
                spec, run, window, named, score_mod if score_named else None,
                mask_mod if mask_named else None, default_scale,
                (*q.shape[:-1], v.shape[-1]), max_seqlen_q, max_seqlen_k))
        out, lse = run(q, k, v, spec, params)
        if transposed:
            out = out.transpose(1, 2)
        return (out, lse) if return_lse else out

    def _remember(self, run: Runner, fast_key: tuple, grow_key: tuple | None,
                  entry: tuple) -> None:
        """Put a binding in the exact table the hot path looks up, unless a rebind ran
        while it resolved (``_rebind``): that one was made under the old settings."""
        with self._lock:
            if run.generation != self._generation:
                return
            if len(self._exact) >= _EXACT_CACHE_LIMIT:
                self._exact.clear()  # bounded: many shapes (growing KV) just re-check
            self._exact[fast_key] = entry
            self._last_exact = (fast_key, entry)
            if grow_key is not None:
                self._exact[grow_key] = entry

    def _settle(self, run: Runner, spec: AttentionSpec, ctx: BindContext, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, params: AttnParams) -> Runner:
        """A pack's near-tie timed once per bucket on this call (``attnhub.settle``); the
        settled decision is what ``decide``/``explain`` report from then on."""
        d = run.decision
        key = (spec, d.rule, d.tied)
        with self._lock:
            done = self._settled.get(key)
        if done is None:
            done = settle(d, {n: self.registry.get(n) for n in d.tied}, q, k, v, spec, params)
            with self._lock:
                if self._generation == run.generation:
                    self._settled[key] = done
        if done.context != ctx:
            done = dataclasses.replace(done, context=ctx)
        with self._lock:
            if self._generation == run.generation:
                self._decisions[(spec, ctx)] = done
        settled = Runner(done, [self.registry.get(n) for n in (done.backend, *done.fallbacks)],
                         self)
        settled.generation = run.generation
        return settled

    def _variant(self, score_mod: Any, mask_mod: Any) -> tuple[Any, Any]:
        """Named variants from plugins (``score_mod="softcap30"``) turned into callables."""
        named = []
        for slot, name in (("score_mod", score_mod), ("mask_mod", mask_mod)):
            if isinstance(name, str) and name not in self.registry.variants:
                known = ", ".join(sorted(self.registry.variants)) or "none"
                raise ArgumentError(f"{slot}={name!r}: no variant of that name is registered "
                                    f"(registered: {known}); pass a callable, or install the "
                                    "plugin that registers it")
        if isinstance(score_mod, str):
            named.append(("score_mod", score_mod))
            score_mod = self.registry.variant(score_mod).score_mod
        if isinstance(mask_mod, str):
            named.append(("mask_mod", mask_mod))
            mask_mod = self.registry.variant(mask_mod).mask_mod
        for slot, name in named:  # a variant without this slot would be silently ignored
            if (score_mod if slot == "score_mod" else mask_mod) is None:
                other = "mask_mod" if slot == "score_mod" else "score_mod"
                raise ArgumentError(f"{slot}={name!r}: the variant {name!r} has no {slot} "
                                    f"(it defines a {other}); pass it as {other}={name!r}")
        return score_mod, mask_mod

    def bound(self) -> list[Runner]:
        """The runners the call path has resolved (the most recent ``RUNNER_LIMIT``)."""
        return [r for _, r in self._runners.values()]

    def __copy__(self) -> Hub:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Hub:
        """Shared, as ``HubRef`` shares it: a hub is a service (locks, loaded plugins, caches
        of decisions), so a deep copy of what holds one (a trainer state) holds the same."""
        return self

    def __reduce__(self) -> Any:
        raise TypeError("attnhub.Hub cannot be pickled (it holds locks and loaded plugin "
                        "modules): pickle the model (its layers drop their hub, see HubRef) "
                        "and bind it again after loading, or build a new Hub(policy=...) there")

    def bind(self, model: Any, **shapes: Any) -> Any:
        """Resolve every ``attnhub.nn.Attention`` of ``model`` for every phase now and route
        the model through this hub; returns the ``BindingTable`` (see ``attnhub.bind``)."""
        from .bind import bind

        return bind(model, self, **shapes)


class HubRef:
    """A hub held by a model's layer (``attnhub.bind``, ``bind_model``), so that the model
    stays an ordinary module: a deep copy shares the hub (a ``Hub`` holds locks and plugin
    modules, which neither copy nor pickle), and pickling (``torch.save(model)``) drops it,
    so a loaded model is served by the default hub until it is bound again."""

    __slots__ = ("hub",)

    def __init__(self, hub: Hub | None) -> None:
        self.hub = hub

    def __deepcopy__(self, memo: dict[int, Any]) -> HubRef:
        return self

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return (HubRef, (None,))


#: The fast key's side entry of a paged call: its tables are vouched for by ``PAGED``.
_PAGED_TABLES = ("paged tables",)
#: The first of a varlen call's side entry (then ``cu_seqlens_q.shape``): ``THD`` vouches.
_THD_TABLES = "thd offsets"


def _attends_nothing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str,
                     return_lse: bool) -> AttentionOutput:
    """The answer of a call without queries or keys: 0 out (in the autograd graph of q, k
    and v, zero gradients) and LSE -inf, (Hq, Tq) for thd, else (B, Hq, Sq)."""
    lse = None
    if return_lse:
        shape = (q.shape[1], q.shape[0]) if layout == "thd" else (q.shape[0], q.shape[2],
                                                                 q.shape[1])
        lse = no_keys_lse(shape, q.device)
    return AttentionOutput(attends_nothing(q, k, v), lse)


def _failure_reason(exc: Exception) -> str:
    """One line for the log and the error: a refusal's reasons (they follow its first line,
    "cannot serve this call:"), else the exception's first line."""
    try:
        if isinstance(exc, BackendUnavailableError) and exc.reasons:
            said = "; ".join(map(str, exc.reasons))
        else:
            said = next(iter(str(exc).splitlines()), "")
    except Exception as inner:  # a plugin's exception whose str() raises: still a reason
        said = f"(its message could not be read: str() raised {type(inner).__name__})"
    return f"{type(exc).__name__}: {said}"[:500]


def _extra(extra: Any, kv_dtype: torch.dtype) -> dict[str, Any]:
    """The call's backend options: ``check_extra``'s private copy of the caller's dict; any
    non-dict (``[]``, 0, an array, whose truth test would raise) is refused there, never
    taken for "no options"; None and ``{}`` are none (no check to run)."""
    if extra is None or (extra.__class__ is dict and not extra):
        return {}
    return check_extra(extra, kv_dtype)


def _grow_key(fast_key: tuple, qs: torch.Size, ks: torch.Size, vs: torch.Size,
              axis: int) -> tuple | None:
    """``fast_key`` with the query and key lengths replaced by their buckets: the shapes
    lose their sequence axis (a hit checks that v's length equals k's and recomputes the
    output shape and the lengths). Bucket 1 is length 1 only, so the phase a call gets
    without ``phase=`` (decode for one query) is the same for every call of one key. None
    for shapes that are not 4-D (the slow path says what is wrong with them). Built from
    the sizes as ints: slicing and adding ``torch.Size`` objects cost ~2 us a call."""
    try:  # unpacked (one step each): indexing a torch.Size is ~0.06 us a size
        if axis == 1:
            qb, sq, qh, qd = qs
            kb, sk, kh, kd = ks
            vb, _, vh, vd = vs
        else:
            qb, qh, sq, qd = qs
            kb, kh, sk, kd = ks
            vb, vh, _, vd = vs
    except ValueError:
        return None
    # the lengths' buckets, as ``bucket`` (inlined: half the time of two calls)
    return ("grow", *fast_key[:-3], qb, qh, qd, kb, kh, kd, vb, vh, vd,
            1 << (sq - 1).bit_length() if sq > 0 else 0,
            1 << (sk - 1).bit_length() if sk > 0 else 0)


def _phase(needs_grad: bool, paged: bool, max_q: int, max_k: int) -> str:
    """The phase a call without ``phase=`` is bound for."""
    if needs_grad:
        return "train"
    return "decode" if paged or (max_q == 1 and max_k > 1) else "prefill"


def _callable_name(fn: Any, names: dict[int, str]) -> str | None:
    """The kind of a score/mask callable, as the policy sees it (``MaskSpec.score_mod``): a
    registered variant's callable is that variant's name (``names``:
    ``Registry.variant_of``; a plugin may register a lambda), any other its ``__name__``."""
    if fn is None:
        return None
    return names.get(id(fn)) or getattr(fn, "__name__", type(fn).__name__)


def _mod_kind(fn: Any, names: dict[int, str]) -> Any:
    """Exact-table key of a score/mask argument: a variant name as itself, a callable by its
    kind (a fresh lambda per call shares one entry; the caller's own callable always runs)
    and what its arity check reads (a partial, method or lambda of another arity, same name,
    goes to the slow path's check)."""
    if fn.__class__ is str:
        return fn
    return ("callable", _callable_name(fn, names), shape_key(fn))


def _check_arity(slot: str, fn: Any, variant: str | None) -> None:
    """A score_mod takes 5 arguments, a mask_mod 4: a callable of the other kind is the
    caller's mistake, refused here (never a backend's TypeError, retried on a fallback)."""
    why = arity_error(slot, fn, variant)
    if why is not None:
        raise ArgumentError(why)


def _meta(t: Any) -> tuple | None:
    """What the contract checks of a side tensor: shape, dtype, device, and that it is a
    dense strided tensor holding its values (``contract.check_plain``)."""
    return None if t is None else (t.__class__, t.shape, t.dtype, t.device, t.layout,
                                   t.is_neg())


#: The order ``AttnParams`` is built in positionally on the hot path (a keyword call costs
#: about a microsecond more); checked here so that a reordered dataclass fails at import.
_PARAM_FIELDS = ("scale", "causal", "alignment", "window", "softcap", "alibi_slopes",
                 "prefix_lens", "colmask_start", "colmask_end", "cu_seqlens_q",
                 "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "block_table", "seqlens_k",
                 "score_mod", "mask_mod", "deterministic", "return_lse", "extra", "dropout_p")
if tuple(f.name for f in dataclasses.fields(AttnParams)) != _PARAM_FIELDS:
    raise ImportError("attnhub.hub: AttnParams fields changed order; update _PARAM_FIELDS "
                      "and the positional AttnParams(...) call of the hot path")


def _is_resolver(obj: object) -> bool:
    # a pathlib.Path has .resolve() too: paths are policy files, not resolvers
    return (obj is not None and not isinstance(obj, (str, os.PathLike))
            and hasattr(obj, "resolve"))


_default: Hub | None = None
_default_lock = threading.Lock()


def default_hub() -> Hub:
    """The process-wide hub, created on first use (never at import)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Hub()
    return _default


def set_default_hub(hub: Hub | None) -> None:
    """Replace the process-wide hub (a new policy, a test); None resets to lazy creation."""
    global _default
    _default = hub


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention through the policy. See :meth:`Hub.attention` for the arguments.

    Tensors are BSHD by default; ``backend="name"`` forces a backend and raises with its
    reasons if it cannot serve. Fully masked rows give 0 output and -inf LSE.
    """
    return default_hub().attention(q, k, v, **kwargs)
