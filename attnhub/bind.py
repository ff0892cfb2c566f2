"""Bind a model: resolve every attention layer for every phase at start-up.

``bind(model)`` walks the module tree for ``attnhub.nn.Attention`` layers, names each with
its model and layer index, and asks the hub's policy for a decision per (layer, phase, spec
bucket) of the shapes the model will run. The decisions are cached in the hub, so the call
path afterwards is a lookup; the returned ``BindingTable`` says what was chosen and why. A
different policy file (a different hub) rebinds the same model without code changes. A layer
whose prefill and decode bind one backend that keeps per-sequence state is marked stateful
(``Attention.state_backend``; ``+state`` in the table): it decodes from a state kept beside
the KV cache (see ``attnhub.core.seqstate``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .core.decision import BindContext, Decision
from .core.spec import bucket
from .errors import NoBackendError
from .hub import Hub, default_hub
from .nn import Attention, _check_layer_idx, attention_layers

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class Binding:
    """One row: a layer in a phase at a spec bucket, and the decision that bound it."""

    layer: int
    module: str
    phase: str
    decision: Decision
    decode_layout: str | None = None
    #: True when the layer keeps per-sequence state for this backend (O(1) decode).
    sequence_state: bool = False

    @property
    def backend(self) -> str | None:
        return self.decision.backend

    def to_json(self) -> dict[str, Any]:
        d = self.decision.to_json()
        return {"layer": self.layer, "module": self.module, "phase": self.phase,
                "layer_kind": self.decision.context.layer_kind, "backend": self.backend,
                "rule": self.decision.rule, "rule_location": self.decision.rule_location,
                "decode_layout": self.decode_layout, "sequence_state": self.sequence_state,
                "spec": d["spec"],
                "rejected": d["rejected"], "decision": d}


class BindingTable:
    """Every binding of a model; prints as a table (consecutive identical layers grouped)."""

    def __init__(self, model: str, policy: str, device: str, rows: list[Binding]):
        self.model = model
        self.policy = policy
        self.device = device
        self.rows = rows

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def backends(self, phase: str | None = None) -> dict[int, str | None]:
        """layer -> backend for a phase (the largest bucket's binding when several)."""
        return {r.layer: r.backend for r in self.rows if phase in (None, r.phase)}

    def unbound(self) -> list[Binding]:
        return [r for r in self.rows if r.backend is None]

    def check(self) -> None:
        """Raise ``NoBackendError`` with the explanation if any row found no backend."""
        bad = self.unbound()
        if bad:
            r = bad[0]
            raise NoBackendError(
                f"{len(bad)} binding(s) of {self.model} found no backend; first: layer "
                f"{r.layer} ({r.module}) {r.phase}:\n{r.decision.explain()}", decision=r.decision)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "policy": self.policy, "device": self.device,
                "bindings": [r.to_json() for r in self.rows]}

    def grouped(self) -> list[tuple[str, Binding]]:
        """(layer range, row) with runs of consecutive layers that bind alike merged."""
        out: list[tuple[list[int], Binding]] = []
        order = sorted(self.rows, key=lambda r: (PHASE_ORDER.get(r.phase, 9), r.phase,
                                                 r.decision.spec.max_seqlen_k, r.layer))
        for r in order:
            if out and _same(out[-1][1], r) and out[-1][0][-1] + 1 == r.layer:
                out[-1][0].append(r.layer)
            else:
                out.append(([r.layer], r))
        return [(f"{ls[0]}-{ls[-1]}" if len(ls) > 1 else str(ls[0]), r) for ls, r in out]

    def __str__(self) -> str:
        from .cli._common import table

        rows = []
        for layers, r in self.grouped():
            s = r.decision.spec
            page = f"/{s.page_size}" if s.page_size else ""
            shape = f"sq<={s.max_seqlen_q} sk<={s.max_seqlen_k} b<={s.batch} {s.layout}{page}"
            rej = "; ".join(f"{x.backend}: {x.reasons[0]}" + (" (+more)" if len(x.reasons) > 1
                                                              else "")
                            for x in r.decision.rejected) or "-"
            backend = (r.backend or "NONE") + (" +state" if r.sequence_state else "")
            rows.append((layers, r.decision.context.layer_kind, r.phase, shape, backend,
                         _rule(r.decision), rej))
        head = f"model {self.model} | policy {self.policy} | device {self.device}\n"
        return head + table(rows, ("layers", "kind", "phase", "spec bucket", "backend", "rule",
                                   "rejected candidates"))


PHASE_ORDER = {"train": 0, "prefill": 1, "decode": 2}


def _same(a: Binding, b: Binding) -> bool:
    da, db = a.decision, b.decision
    return (a.phase == b.phase and da.spec == db.spec and da.backend == db.backend
            and a.sequence_state == b.sequence_state
            and da.rule == db.rule and da.rejected == db.rejected
            and da.context.layer_kind == db.context.layer_kind)


def _rule(d: Decision) -> str:
    return f"{d.rule} ({d.rule_location})" if d.rule_location else str(d.rule or "-")


def model_name(model: nn.Module) -> str:
    """The name rules match on: ``attnhub_name``, a transformers ``name_or_path``, or the class."""
    for attr in ("attnhub_name", "name_or_path"):
        if getattr(model, attr, None):
            return str(getattr(model, attr))
    return type(model).__name__


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def decode_buckets(prompt_len: int, max_len: int) -> list[int]:
    """The power-of-two context buckets a decode from ``prompt_len + 1`` to ``max_len`` hits."""
    out, n = [], bucket(prompt_len + 1)
    while True:
        out.append(n)
        if n >= max_len:
            return out
        n *= 2


def bind(model: nn.Module, hub: Hub | None = None, *, batch: int = 1, prompt_len: int = 512,
         max_len: int | None = None, dtype: torch.dtype | None = None, page_size: int = 16,
         phases: Sequence[str] = PHASES, name: str | None = None,
         kv_dtype: torch.dtype | None = None) -> BindingTable:
    """Bind every ``Attention`` in ``model`` to ``hub`` (default hub) and resolve each layer
    for each phase at the shapes given: prefill of ``prompt_len`` tokens, decode up to
    ``max_len`` (default ``prompt_len * 2``) from a cache of ``page_size`` tokens per page,
    ``train`` at ``prompt_len`` if asked. ``kv_dtype``: the KV cache's dtype where it is
    not the model's (an e4m3 cache: ``torch.float8_e4m3fn``; default each layer's
    ``kv_cache_dtype``), so that decode binds what reads that cache.

    A decode layer whose paged spec no backend serves (a linear/recurrent layer, say) is
    switched to reading a gathered copy of the cache when that spec binds. A transformers
    model built with ``attn_implementation="attnhub"`` binds its attention modules alike.

    Each layer binds as its ``layer_idx`` (else its position): two layers on one index, or
    one ``Attention`` at two places in the model when a cached phase is bound, are refused
    (they would write one KV cache layer). Every layer is resolved before any is changed, so
    a bind that raises leaves the model bound as it was.
    """
    hub = hub or default_hub()
    name = name or model_name(model)
    dtype = dtype or _model_dtype(model)
    max_len = max_len or prompt_len * 2
    layers = attention_layers(model)
    if not layers and _is_transformers_attnhub(model):
        from .integrations.transformers import bind_model

        return bind_model(model, hub, batch=batch, prompt_len=prompt_len, max_len=max_len,
                          dtype=dtype, phases=phases)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attnhub.nn.Attention layers to bind; "
                         "build its attention with attnhub.nn.Attention (or, for transformers "
                         "models, use attn_implementation='attnhub')")
    indices = _layer_indices(model, layers, phases)
    plans = []  # every layer resolved before any changes: a failing decision changes none
    for (path, layer), index in zip(layers, indices):
        ctx = replace(layer.context, model=name, layer=index)
        plans.append((layer, index, [r for phase in phases for r in _bind_phase(
            hub, layer, ctx, path, phase, batch, prompt_len, max_len, dtype, page_size,
            kv_dtype)]))
    rows: list[Binding] = []
    for layer, index, mine in plans:
        layer.set_context(name, index)
        layer.hub = hub
        layer.decode_layout = next((r.decode_layout for r in mine if r.decode_layout),
                                   layer.decode_layout)
        layer.state_backend = _state_backend(hub, mine)
        layer.bound_dtype = dtype
        rows += [replace(r, sequence_state=True) for r in mine] if layer.state_backend else mine
    return BindingTable(name, getattr(hub.resolver, "name", "?"), hub.device.describe(), rows)


def _layer_indices(model: nn.Module, layers: list[tuple[str, Attention]],
                   phases: Sequence[str]) -> list[int]:
    """Each layer's index (its ``layer_idx``, else its position), checked to be its own: the
    index is the layer's KV cache layer and policy context, so two layers on one index would
    overwrite each other's k/v (wrong decodes, silently) and bind as one layer."""
    indices = [m.layer_idx if m.layer_idx is not None else i for i, (_, m) in enumerate(layers)]
    seen: dict[int, str] = {}
    for (path, _), index in zip(layers, indices):
        _check_layer_idx(index, f"bind: layer {path!r}")
        if index in seen:
            raise ValueError(f"bind: layers {seen[index]!r} and {path!r} both have layer index "
                             f"{index} (one KV cache layer, one policy context); give each "
                             "attnhub.nn.Attention its own layer_idx= (or leave every "
                             "layer_idx None: bind numbers the layers in module order)")
        seen[index] = path
    if set(phases) & set(PHASES):  # a cache: an op reached twice would write one layer twice
        paths: dict[int, list[str]] = {}
        for path, m in model.named_modules(remove_duplicate=False):
            if isinstance(m, Attention):
                paths.setdefault(id(m), []).append(path)
        shared = next((p for p in paths.values() if len(p) > 1), None)
        if shared:
            raise ValueError(f"bind: one attnhub.nn.Attention sits at {shared}: with a KV "
                             "cache its calls would share one cache layer; give each position "
                             "its own Attention (it holds no weights), or bind for training "
                             "only (phases=('train',))")
    return indices


def _state_backend(hub: Hub, rows: list[Binding]) -> str | None:
    """The backend that keeps this layer's per-sequence state, or None: only when prefill
    and every decode bucket bind the same backend and it keeps state, since the state must
    see every token of a sequence, in order, through that one backend."""
    cached = [r for r in rows if r.phase in PHASES]
    names = {r.backend for r in cached}
    if len(names) != 1 or {r.phase for r in cached} != set(PHASES):
        return None
    name = names.pop()
    return name if name and hub.registry.get(name).keeps_sequence_state else None


def _is_transformers_attnhub(model: nn.Module) -> bool:
    """A transformers model with a (sub-)model built under a registered attnhub name."""
    if getattr(model, "config", None) is None or sys.modules.get("transformers") is None:
        return False  # a transformers model means transformers is imported
    from .integrations.transformers import attention_modules

    return bool(attention_modules(model))


def _bind_phase(hub: Hub, layer: Attention, ctx: BindContext, path: str, phase: str,
                batch: int, prompt_len: int, max_len: int, dtype: torch.dtype,
                page_size: int, kv_dtype: torch.dtype | None = None) -> list[Binding]:
    assert ctx.layer is not None
    if phase != "decode":
        spec = layer.spec(phase, batch=batch, seqlen_q=prompt_len, seqlen_k=prompt_len,
                          dtype=dtype)
        return [Binding(ctx.layer, path, phase, hub.decide(spec, ctx))]

    def decide_all(layout: str) -> list[Decision]:
        return [hub.decide(layer.spec("decode", batch=batch, seqlen_q=1, seqlen_k=sk,
                                      dtype=dtype, layout=layout, page_size=page_size,
                                      kv_dtype=kv_dtype), ctx)
                for sk in decode_buckets(prompt_len, max_len)]

    mode, decisions = "paged", decide_all("paged")
    if not all(d.backend for d in decisions):
        gathered = decide_all("bshd")
        if all(d.backend for d in gathered):
            mode, decisions = "gather", gathered
    return [Binding(ctx.layer, path, "decode", d, mode) for d in decisions]
