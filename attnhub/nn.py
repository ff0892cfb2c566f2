"""``attnhub.nn.Attention``: the attention op of one model layer, bound by the policy.

Model code projects q/k/v (and applies rotary embeddings); this module stores the new k/v in
the paged KV cache and runs attention through a hub, with the layer's bind context (model
name, layer index, layer kind) so that a policy can bind each layer and phase differently.
``attnhub.bind`` resolves every layer for every phase at start-up; the call path is then the
hub's dict lookup, never a policy resolution. A layer that ``bind`` marks stateful (bound to
a backend that keeps per-sequence state, such as a linear layer's recurrent state) passes the
state store its KV cache holds for it (``attach_sequence_states``) in ``extra``, so that its
decode costs O(1) per token instead of recomputing the context.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .core.contract import bounding_window, check_dropout, check_scalars, check_window
from .core.decision import BindContext
from .core.kvcache import CacheStep, PagedKVCache
from .core.kvquant import is_fp8
from .core.masking import window_within
from .core.seqstate import StateGeometry
from .core.spec import AttentionSpec, MaskSpec, bucket, dtype_name
from .errors import ArgumentError
from .hub import Hub, HubRef, default_hub

#: How a layer reads the cache in decode: ``paged`` hands block tables to the backend,
#: ``gather`` copies the context into contiguous tensors first (for a backend bound to the
#: layer that has no paged layout, such as a linear/recurrent one; an FP8 cache's values
#: come dequantized, in q's dtype).
DECODE_LAYOUTS = ("paged", "gather")

_timer: Callable[[Callable[[], torch.Tensor]], torch.Tensor] | None = None


@contextlib.contextmanager
def timed_attention(timer: Callable[[Callable[[], torch.Tensor]], torch.Tensor]) -> Iterator[None]:
    """Route every ``Attention`` call through ``timer(fn)`` (``attnhub profile`` uses this to
    measure the attention share of a step); no cost when unused beyond one global check."""
    global _timer
    old, _timer = _timer, timer
    try:
        yield
    finally:
        _timer = old


class Attention(nn.Module):
    """Attention of one layer: q (B, S, Hq, D), k/v (B, S, Hkv, D) of the new tokens.

    Without a cache, attends over the given k/v (training, or a prefill without cache). With
    a ``CacheStep``, writes k/v into the cache first, then attends over the sequence so far:
    directly on the new tokens for a fresh prefill, through the paged layout (or a gathered
    copy, see ``decode_layout``) otherwise. ``dropout`` is attention dropout on the
    probabilities, applied in training mode to calls without a cache, as in
    ``nn.MultiheadAttention``.
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                 head_dim_v: int | None = None, causal: bool = True,
                 window: tuple[int, int] | None = None, softcap: float | None = None,
                 scale: float | None = None, layer_idx: int | None = None,
                 layer_kind: str = "softmax", model: str | None = None, dropout: float = 0.0):
        super().__init__()
        try:
            self.dropout = check_dropout(dropout)
        except ArgumentError as e:
            raise ValueError(f"Attention: {str(e).replace('dropout_p=', 'dropout=')}") from None
        for what, n in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
            if isinstance(n, bool) or not isinstance(n, int):  # 4.0 / True ran as heads
                raise ValueError(f"Attention: {what}={n!r}; pass a positive int")
        if num_kv_heads <= 0 or num_q_heads <= 0 or num_q_heads % num_kv_heads:
            raise ValueError(f"Attention: {num_q_heads} query heads are not a positive "
                             f"multiple of {num_kv_heads} KV heads")
        if not isinstance(causal, bool):  # None passed bind and failed at the first call
            raise ValueError(f"Attention: causal={causal!r}; pass True or False")
        try:  # checked here, not at the first call after a bind that took them
            check_window(window, causal)
            check_scalars(scale, softcap)
        except ArgumentError as e:
            raise ValueError(f"Attention: {e}") from None
        for what, n in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
                raise ValueError(f"Attention: {what}={n!r}; pass a positive int"
                                 + (" (or None: head_dim)" if what == "head_dim_v" else ""))
        _check_layer_idx(layer_idx, "Attention")
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.causal = causal
        self.window = window
        self.softcap = softcap
        self.scale = scale
        self.layer_idx = layer_idx
        self.context = BindContext(model=model, layer=layer_idx, layer_kind=layer_kind)
        self._hub_ref = HubRef(None)
        self.decode_layout = "paged"
        #: The dtype of the paged KV cache this layer reads (None: the model's dtype). Set it
        #: for an FP8 (e4m3) cache before ``bind``: its paged decode is then resolved with
        #: kv_dtype ``fp8_e4m3``, as the calls make it (``spec``), not as a 16-bit cache.
        self.kv_cache_dtype: torch.dtype | None = None
        #: Force a backend for this layer (reference checks, decode comparisons).
        self.backend_override: str | None = None
        #: The stateful backend every cached call of this layer is bound to (``bind`` sets
        #: it): such calls pass the layer's state store from the KV cache in ``extra``.
        self.state_backend: str | None = None
        self._warned_no_state = False
        #: The dtype ``bind`` resolved this layer for (None: not bound); a call in another
        #: (the model cast with ``.to()`` after bind) is warned about once.
        self.bound_dtype: torch.dtype | None = None

    def extra_repr(self) -> str:
        c = self.context
        return (f"heads={self.num_q_heads}:{self.num_kv_heads}, head_dim={self.head_dim}, "
                f"causal={self.causal}, kind={c.layer_kind}, layer={c.layer}, "
                f"decode={self.decode_layout}"
                + (f", kv_cache={self.kv_cache_dtype}" if self.kv_cache_dtype else "")
                + (f", dropout={self.dropout}" if self.dropout else "")
                + (f", state={self.state_backend}" if self.state_backend else ""))

    def set_context(self, model: str | None, layer: int) -> None:
        """Name the model and layer this op sits in (``bind`` calls this)."""
        self.layer_idx = layer
        self.context = replace(self.context, model=model, layer=layer)

    # -- what a call asks for (bind resolves these ahead of the calls) ----------------------
    def spec(self, phase: str, *, batch: int, seqlen_q: int, seqlen_k: int,
             dtype: torch.dtype, layout: str | None = None, page_size: int = 16,
             kv_dtype: torch.dtype | None = None) -> AttentionSpec:
        """The bucketed spec that a call of this layer in ``phase`` makes, as the hub keys it
        (``page_size``: the KV cache's, for the paged layout; ``kv_dtype``: the cache's dtype,
        default ``kv_cache_dtype``). A paged call reads the cache as stored (an FP8 cache:
        kv_dtype ``fp8_e4m3``); a gathered decode of an FP8 cache reads dequantized values
        in ``dtype``, so it never claims an FP8 kernel."""
        if layout is None:
            layout = "paged" if phase == "decode" and self.decode_layout == "paged" else "bshd"
        cache = kv_dtype or self.kv_cache_dtype or dtype
        if layout == "paged" or (phase == "decode" and not is_fp8(cache)):
            kv = cache  # read as stored (a gathered 16/32-bit copy too)
        else:
            kv = dtype  # the call's own new k/v, or an FP8 cache gathered in q's dtype
        return call_spec(phase, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, head_dim_v=self.head_dim_v,
                         causal=self._causal_for(seqlen_q), window=self.window,
                         softcap=self.softcap is not None, batch=batch, seqlen_q=seqlen_q,
                         seqlen_k=seqlen_k, dtype=dtype, layout=layout,
                         page_size=page_size if layout == "paged" else 0,
                         dropout=phase == "train" and self.training and self.dropout > 0,
                         kv_dtype=kv)

    def _causal_for(self, new_tokens: int) -> bool:
        # one query at the end of its context sees every key: causal is a no-op there, and
        # dropping it leaves more backends eligible for decode
        return self.causal and new_tokens > 1

    # -- the call ---------------------------------------------------------------------------
    @property
    def hub(self) -> Hub | None:
        """The hub this layer is bound to (``attnhub.bind`` sets it); None: the default hub.
        Held through ``HubRef``: the layer deep-copies (sharing it) and pickles (dropping it)."""
        return self._hub_ref.hub

    @hub.setter
    def hub(self, hub: Hub | None) -> None:
        self._hub_ref = HubRef(hub)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: CacheStep | None = None) -> torch.Tensor:
        if _timer is not None:
            return _timer(lambda: self._forward(q, k, v, cache))
        return self._forward(q, k, v, cache)

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cache: CacheStep | None) -> torch.Tensor:
        if q.dim() == 4 and k.dim() == 4 and v.dim() == 4:
            self._check_heads(q, k, v)
        if self.bound_dtype is not None and q.dtype != self.bound_dtype:
            self._warn_stale(q.dtype)
        hub = self.hub or default_hub()
        kw = {"window": self.window, "softcap": self.softcap, "scale": self.scale,
              "context": self.context, "backend": self.backend_override}
        if cache is not None:
            if self.layer_idx is None:
                raise ValueError("Attention with a KV cache needs layer_idx (the cache layer); "
                                 "pass layer_idx= or bind the model first")
            cache.write(self.layer_idx, k, v)
            kw["extra"] = self._state_extra(cache)
        if cache is None:
            return hub.attention(q, k, v, causal=self._causal_for(q.shape[1]),
                                 dropout_p=self.dropout if self.training else 0.0, **kw)
        if cache.fresh:
            return hub.attention(q, k, v, causal=self._causal_for(q.shape[1]), **kw)
        phase = "decode" if cache.new_tokens == 1 else "prefill"
        causal = self._causal_for(cache.new_tokens)
        if self.decode_layout == "gather":
            kc, vc = cache.cache.gather(self.layer_idx, cache.seq_ids)
            if cache.cache.scales is not None:  # an e4m3 cache's values, dequantized (fp32),
                kc, vc = _narrow(kc, q.dtype), _narrow(vc, q.dtype)  # in q's dtype, as FP8
                # kernels widen them
            return hub.attention(q, kc, vc, causal=causal, phase=phase, **kw)
        if cache.cache.scales is not None:  # an e4m3 cache: its page descales go along
            kw["extra"] = {**(kw["extra"] or {}), **cache.cache.scales.descales(self.layer_idx)}
        return hub.attention(
            q, cache.cache.k_cache(self.layer_idx), cache.cache.v_cache(self.layer_idx),
            layout="paged", block_table=cache.block_table, seqlens_k=cache.seqlens,
            causal=causal, phase=phase, **kw)

    def _check_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The call's heads and head dims are the layer's: ``bind`` resolved (and the KV
        cache and state stores are sized for) the declared ones; others ran anyway, on a
        decision made on the hot path that the binding table never showed."""
        got = (q.shape[2], k.shape[2], v.shape[2], q.shape[3], k.shape[3], v.shape[3])
        want = (self.num_q_heads, self.num_kv_heads, self.num_kv_heads, self.head_dim,
                self.head_dim, self.head_dim_v)
        if got != want:
            raise ValueError(
                f"Attention (layer {self.layer_idx}): q/k/v have {got[0]}/{got[1]}/{got[2]} "
                f"heads of dim {got[3]}/{got[4]}/{got[5]}; this layer was built for "
                f"{want[0]}:{want[1]} heads of dim {want[3]} (v: {want[5]}), as bind resolved "
                "it; build the Attention with the sizes the model projects")

    def _warn_stale(self, dtype: torch.dtype) -> None:
        """A call in a dtype that bind did not resolve: each new spec is then decided on the
        hot path, by a policy decision the binding table does not show; said once."""
        bound, self.bound_dtype = self.bound_dtype, None  # once per layer (until a rebind)
        warnings.warn(f"attnhub: layer {self.layer_idx} was bound for {dtype_name(bound)} "
                      f"but is called with {dtype_name(dtype)} (the model cast after bind?): "
                      "its calls are resolved as they come and the binding table is stale; "
                      "call attnhub.bind(model, ...) again after .to()", stacklevel=3)

    def _state_extra(self, cache: CacheStep) -> dict[str, Any] | None:
        """The state store entries for ``extra`` when this layer runs its stateful backend."""
        name = self.state_backend
        if name is None or self.backend_override not in (None, name):
            return None
        extra = cache.cache.states.extra(self.layer_idx, cache.seq_ids)  # type: ignore[arg-type]
        if extra is None and not self._warned_no_state:
            self._warned_no_state = True
            warnings.warn(f"layer {self.layer_idx} is bound to {name}, which keeps per-sequence "
                          "state, but its KV cache has no state store for it: every step "
                          "recomputes the context (correct, O(context)); build the cache with "
                          "attach_sequence_states(model, cache, max_seqs) (Decoder.new_cache "
                          "does)", stacklevel=2)
        return extra


def _check_layer_idx(layer_idx: object, where: str) -> None:
    """A layer index is a KV cache layer: a non-negative int (a negative one is refused by
    the cache, not counted from the end), or None (``bind`` numbers the layer)."""
    if layer_idx is not None and (isinstance(layer_idx, bool) or not isinstance(layer_idx, int)
                                  or layer_idx < 0):
        raise ValueError(f"{where}: layer_idx={layer_idx!r}; pass the layer's index, an int "
                         ">= 0 (or None: bind numbers the layers in module order)")


def call_spec(phase: str, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
              head_dim_v: int, causal: bool, window: tuple[int, int] | None, softcap: bool,
              batch: int, seqlen_q: int, seqlen_k: int, dtype: torch.dtype, layout: str,
              page_size: int = 0, dropout: bool = False,
              kv_dtype: torch.dtype | None = None) -> AttentionSpec:
    """The bucketed spec ``Hub.attention`` builds for a call of these sizes and flags: what
    binding resolves ahead of the calls, so that the calls find their decision cached.
    ``kv_dtype``: k/v's dtype as the call passes them (an FP8 cache read in place), default
    ``dtype``."""
    return AttentionSpec(
        phase=phase, dtype=dtype_name(dtype),  # type: ignore[arg-type]
        kv_dtype=dtype_name(kv_dtype or dtype),  # type: ignore[arg-type]
        head_dim=head_dim, head_dim_v=head_dim_v, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, layout=layout,  # type: ignore[arg-type]
        # the window as the call's check normalises it: an unbounded one is none, an edge
        # past every key of the lengths' bucket unbounded (a sentinel such as 2**31 - 1)
        mask=MaskSpec(causal=causal, window=bounding_window(window_within(
            check_window(window, causal), bucket(max(seqlen_q, seqlen_k, 1))), causal, False),
            softcap=softcap),
        max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k, batch=batch,
        needs_grad=phase == "train", page_size=page_size, dropout=dropout,
    ).bucketed()


def _narrow(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized e4m3 values in ``dtype``, saturated at its largest finite value: an e4m3
    code times a power-of-two descale can round past it (an fp16 65504 is stored as 256 x
    256 = 65536), which the cast alone makes inf; NaN stays NaN."""
    top = torch.finfo(dtype).max
    return x.clamp(-top, top).to(dtype)


def attention_layers(model: nn.Module) -> list[tuple[str, Attention]]:
    """Every ``Attention`` in ``model`` with its module path, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Attention)]


def attach_sequence_states(model: nn.Module, cache: PagedKVCache, max_seqs: int) -> int:
    """Attach to ``cache`` a state store for the layers of ``model`` bound to a stateful
    backend (one store per backend and layer shape, made by that backend), for up to
    ``max_seqs`` live sequences; returns how many stores were attached."""
    groups: dict[tuple, tuple[Attention, list[int]]] = {}
    for _, m in attention_layers(model):
        if m.state_backend is not None and m.layer_idx is not None:
            key = (id(m.hub), m.state_backend, m.num_q_heads, m.num_kv_heads, m.head_dim,
                   m.head_dim_v)
            groups.setdefault(key, (m, []))[1].append(m.layer_idx)
    for m, layers in groups.values():
        backend = (m.hub or default_hub()).registry.get(m.state_backend)  # type: ignore[arg-type]
        geometry = StateGeometry(tuple(layers), m.num_q_heads, m.num_kv_heads, m.head_dim,
                                 m.head_dim_v, max_seqs, cache.device, cache.dtype)
        cache.attach_state(layers, backend.new_sequence_store(geometry))
    return len(groups)


@contextlib.contextmanager
def override_backend(model: nn.Module, backend: str | None,
                     only: Callable[[Attention], bool] | None = None) -> Iterator[None]:
    """Force ``backend`` on the model's attention layers (those ``only`` accepts) for a while:
    reference checks and side-by-side decode timings."""
    layers = [m for _, m in attention_layers(model) if only is None or only(m)]
    old = [m.backend_override for m in layers]
    for m in layers:
        m.backend_override = backend
    try:
        yield
    finally:
        for m, o in zip(layers, old):
            m.backend_override = o
