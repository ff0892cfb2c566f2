"""attnhub's mask vocabulary as FlexAttention ``score_mod`` / ``mask_mod``, with cached BlockMasks.

FlexAttention takes (B, H, S, D) tensors and two callables: ``score_mod(score, b, h, q, kv)``
and ``mask_mod(b, h, q, kv)``. This module writes every attnhub mask kind as those callables,
with the semantics of ``attnhub.core.masking`` / ``reference_attention``:

* positions: query ``i`` of a sequence sits at key position ``i + Sk - Sq`` (bottom-right)
  or ``i`` (top-left); causal keeps ``j <= pos``, a window ``pos - left <= j <= pos + right``;
* prefix-LM: causal, or ``j < prefix_lens[b]``; column-sparse: rows ``[start, end)`` of key
  column ``j`` are masked (rows are raw query indices, as in ``masking._column_sparse``);
* softcap, then ALiBi ``-slope * |pos - j|``, then the user's score_mod, then the masks;
* thd (documents): q/k are packed into one sequence; each packed index maps to its document
  by ``cu_seqlens``, masks apply per document, and the user's callables see what the
  reference shows them: batch 0 and positions inside the document.

Building a BlockMask evaluates the mask over every (query block, key block), so it is built
once per (mask data, shape) and kept in a small LRU cache. A cache entry must prove that the
mask data is the same: tensors in the key are identified by object (held by weak reference),
version counter (``t._version``, moved by in-place ops) and data pointer, plus their content
when they are small CPU tensors (an edit through ``.data`` does not move the version). GPU
tensors are never read back on the hot path: change them in place through ordinary ops, or
pass new ones. A ``mask_mod``/``score_mod`` is keyed by the callable object itself, and a
``mask_mod`` also by what it reads besides its arguments (closure cells, defaults, globals its
code names, attributes of a callable object, recursively; tensors by the proof above): one
function over a buffer edited between calls, or a ``nonlocal`` rebound, gets a new BlockMask
(a stale one makes compiled flex skip blocks the new mask shows). A mask_mod whose state
cannot be proven cheaply (an arbitrary object, a large inference tensor) is built per call.

Compiling: ``torch.compile(flex_attention, dynamic=False)`` compiles once per static shape
(Inductor's CPU flex template failed on the second shape under dynamic shapes). Past dynamo's
recompile limit a compiled function silently runs uncompiled, which for flex means the whole
score matrix in memory at 10-100x the time; here the limit is raised for flex's calls to
``RECOMPILE_LIMIT`` shapes, and past it the call raises, so the hub's rule falls back loudly
(counted and warned) instead.
"""

from __future__ import annotations

import functools
import threading
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import flex_attention as _fa

from attnhub.plugin import (
    AttnParams,
    BackendUnavailableError,
    InputError,
    attends_nothing,
    no_keys_lse,
    query_offset,
    unit_head_stride,
    window_within,
)

from .flex_checks import check_user_mods
from .variants import heads_mismatch, positions_mismatch

Mod = Callable[..., torch.Tensor]

_CACHE_SIZE = 32

#: Compiled shapes (and callables) per process before a flex call raises instead of running
#: uncompiled; dynamo's own default is 8.
RECOMPILE_LIMIT = 64

#: CPU tensors up to this many elements are also keyed by their content.
_HASHED_NUMEL = 4096


@dataclass(frozen=True)
class FlexMods:
    """What one flex call needs besides q/k/v; ``None`` parts are simply not passed."""

    score_mod: Mod | None
    block_mask: Any | None


class _Positions:
    """Maps flex's (b, q_idx, kv_idx) to (sequence, query index, key index, query position,
    same-sequence flag) for bshd (one sequence per batch row) or packed thd documents."""

    def __init__(self, params: AttnParams, sq: int, sk: int, packed: bool,
                 device: torch.device):
        self.packed = packed
        self.bottom_right = params.alignment == "bottom_right"
        if not packed:
            self.off = query_offset(sq, sk, params.alignment)
            return
        cu_q = params.cu_seqlens_q.to(device=device, dtype=torch.int64)
        cu_k = params.cu_seqlens_k.to(device=device, dtype=torch.int64)
        self.cu_q, self.cu_k = cu_q, cu_k
        self.doc_q = _doc_ids(cu_q, sq)
        self.doc_k = _doc_ids(cu_k, sk)
        lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        self.doc_off = (lens_k - lens_q) if self.bottom_right else torch.zeros_like(lens_q)

    def __call__(self, b: torch.Tensor, q: torch.Tensor, kv: torch.Tensor):
        if not self.packed:
            return b, q, kv, q + self.off, None
        dq, dk = self.doc_q[q], self.doc_k[kv]
        seq = dq.clamp(min=0)
        qi = q - self.cu_q[seq]
        kj = kv - self.cu_k[dk.clamp(min=0)]
        return seq, qi, kj, qi + self.doc_off[seq], (dq == dk) & (dq >= 0)


def _doc_ids(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Document of each packed index from cumulative lengths; -1 past ``cu[-1]`` (padding)."""
    idx = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(cu[1:], idx, right=True)
    return torch.where(idx < cu[-1], doc, torch.full_like(doc, -1))


def _column_sparse_rows(params: AttnParams, sq: int, hq: int, hkv: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(start, end, head divisor, head modulus) so that query head h reads column-sparse
    head ``(h // div) % mod`` (per query head, per KV head, or one for all)."""
    start = params.colmask_start.to(device)
    end = params.colmask_end.to(device) if params.colmask_end is not None else \
        torch.full_like(start, sq)
    hs = start.shape[1]
    if hs == 1:
        return start, end, 1, 1
    if hs == hq:
        return start, end, 1, hq
    return start, end, hq // hkv, hs


def build_mask_mod(params: AttnParams, pos: _Positions, hq: int, hkv: int,
                   sq: int, device: torch.device,
                   sk: int | None = None) -> tuple[Mod | None, bool, bool]:
    """(mask_mod or None when nothing is masked, depends on batch, depends on head).
    ``sk`` (the key length, packed or not) lets window edges past every key count as
    unbounded, so that ``qpos + right`` never wraps int64 (``sys.maxsize``)."""
    conds: list[Mod] = []
    per_b = per_h = False
    prefix = params.prefix_lens.to(device) if params.prefix_lens is not None else None
    if params.causal:
        def causal(seq, h, qi, kj, qpos):
            keep = kj <= qpos
            return keep | (kj < prefix[seq]) if prefix is not None else keep
        conds.append(causal)
        per_b |= prefix is not None
    elif prefix is not None:
        raise ValueError("prefix_lens needs causal=True: prefix-LM is causal after the prefix")
    if params.window is not None:
        left, right = params.window
        if sk is not None:
            left, right = window_within(params.window, max(sq, sk))
        if left >= 0:
            conds.append(lambda seq, h, qi, kj, qpos: kj >= qpos - left)
        if right >= 0:
            conds.append(lambda seq, h, qi, kj, qpos: kj <= qpos + right)
    if params.colmask_start is not None:
        start, end, div, mod = _column_sparse_rows(params, sq, hq, hkv, device)

        def column_sparse(seq, h, qi, kj, qpos):
            hc = (h // div) % mod
            return (qi < start[seq, hc, kj]) | (qi >= end[seq, hc, kj])
        conds.append(column_sparse)
        per_b, per_h = True, per_h or mod > 1
    user = params.mask_mod
    if user is not None:  # nonzero is visible, as the reference reads a mask_mod's result
        conds.append(lambda seq, h, qi, kj, qpos: user(
            seq * 0 if pos.packed else seq, h, qi, kj).to(torch.bool))
        per_b = per_h = True
    if not conds and not pos.packed:
        return None, False, False

    def mask_mod(b, h, q_idx, kv_idx):
        seq, qi, kj, qpos, same = pos(b, q_idx, kv_idx)
        keep = same if same is not None else kj >= 0
        for cond in conds:
            keep = keep & cond(seq, h, qi, kj, qpos)
        return keep

    return mask_mod, per_b, per_h


def build_score_mod(params: AttnParams, pos: _Positions, device: torch.device) -> Mod | None:
    """softcap, then ALiBi, then the user's score_mod, in flex's working precision (fp32,
    fp64 for fp64 scores); None when nothing changes. Flex traces a score_mod with a score
    of q's dtype: a cast back to that dtype would round fp16 scores past 65504 to inf (NaN
    out of finite inputs), so the result is cast to the precision flex computes in."""
    cap = params.softcap
    slopes = params.alibi_slopes.to(device=device, dtype=torch.float32) \
        if params.alibi_slopes is not None else None
    user = params.score_mod
    if not cap and slopes is None and user is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        seq, qi, kj, qpos, _ = pos(b, q_idx, kv_idx)
        # not the user's dtype: a user's fp64 result made eager flex's LSE fp64
        dtype = torch.float64 if score.dtype == torch.float64 else torch.float32
        if cap:
            score = torch.tanh(score / cap) * cap
        if slopes is not None:
            slope = slopes[h] if slopes.dim() == 1 else slopes[seq, h]
            score = score - slope * (qpos - kj).abs()
        if user is not None:
            score = user(score, seq * 0 if pos.packed else seq, h, qi, kj)
        return score.to(dtype)

    return score_mod


#: The token of a tensor whose content nothing cheap can vouch for: its call is not cached.
_UNPROVEN = ("unproven",)


def _token(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """Proof of a tensor's content: identity, version, storage, and bytes when cheap.

    A tensor made under ``torch.inference_mode`` has no version counter (in-place edits
    leave no trace): only its bytes can vouch for it, so a large or device one is
    ``_UNPROVEN`` and its call builds its masks afresh."""
    if t is None:
        return None
    content = None
    if t.device.type == "cpu" and t.numel() <= _HASHED_NUMEL:
        content = hash(t.detach().contiguous().numpy().tobytes()) if t.dtype != torch.bfloat16 \
            else hash(tuple(t.reshape(-1).tolist()))
    if t.is_inference():
        return _UNPROVEN if content is None else (id(t), None, t.data_ptr(), content)
    return (id(t), t._version, t.data_ptr(), content)


class _Unproven(Exception):
    """A captured value whose content nothing cheap can vouch for."""


#: What a mask_mod's captured state may hold before its calls are not cached (walk cost).
_CAPTURE_BUDGET = 256
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_STATIC = (types.ModuleType, types.BuiltinFunctionType, types.CodeType, type,
           types.GetSetDescriptorType, types.MemberDescriptorType, types.WrapperDescriptorType,
           types.MethodDescriptorType, types.ClassMethodDescriptorType,
           types.MethodWrapperType)


class _Captured:
    """Proof of what a callable reads besides its arguments, walked recursively: a key part
    whose equality means the same values (tensors by ``_token``, kept in ``tensors`` for the
    entry's identity check; code, modules and types by ``id``, kept alive in ``held``).

    A module or class is a namespace the code may read attributes of (``cfg.LIMIT``,
    ``type(self).limit``): :meth:`proof` adds the value of each attribute of theirs that
    the walked code names."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.held: list[Any] = []
        self.budget = _CAPTURE_BUDGET
        self._walking: set[int] = set()
        #: names the walked code reads (globals and attributes alike: ``co_names``)
        self.names: set[str] = set()
        #: modules and user classes reached, whose attributes those names may be
        self.spaces: dict[int, Any] = {}

    def proof(self, fn: Any) -> Any:
        """``fn``'s key part, with the named attributes of the namespaces it reaches (walking
        one may name or reach more: until nothing new, within the budget)."""
        key = self.of(fn)
        seen: tuple[int, int] = (-1, -1)
        attrs: tuple = ()
        while seen != (len(self.names), len(self.spaces)):
            seen = (len(self.names), len(self.spaces))
            attrs = tuple((sid, tuple((n, self.of(ns[n])) for n in sorted(self.names & ns.keys())))
                          for sid, ns in ((sid, _attributes(x)) for sid, x in
                                          list(self.spaces.items())))
        return key, attrs

    def of(self, x: Any) -> Any:
        self.budget -= 1
        if self.budget < 0:
            raise _Unproven
        if isinstance(x, _PLAIN):
            return x
        if id(x) in self._walking:  # a cycle (a recursive helper, a self-reference)
            self.held.append(x)
            return ("cycle", id(x))
        self._walking.add(id(x))
        try:
            return self._value(x)
        finally:
            self._walking.discard(id(x))

    def _value(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tok = _token(x)
            if tok is _UNPROVEN:
                raise _Unproven
            self.tensors.append(x)
            return tok
        if isinstance(x, _STATIC):
            self.held.append(x)
            if isinstance(x, types.ModuleType) or (isinstance(x, type)
                                                   and _user_class(x)):
                self.spaces.setdefault(id(x), x)
            return ("id", id(x))
        if isinstance(x, property):
            return ("property", self.of(x.fget))
        if isinstance(x, (staticmethod, classmethod)):
            return (type(x).__name__, self.of(x.__func__))
        if isinstance(x, (tuple, list)):
            return (type(x).__name__, *(self.of(i) for i in x))
        if isinstance(x, dict):
            return ("dict", *((self.of(k), self.of(v)) for k, v in x.items()))
        if isinstance(x, functools.partial):
            return ("partial", self.of(x.func), self.of(x.args), self.of(x.keywords))
        if isinstance(x, types.MethodType):
            return ("method", self.of(x.__func__), self.of(x.__self__))
        if isinstance(x, types.FunctionType):
            return self._function(x)
        state = getattr(x, "__dict__", None)
        if isinstance(state, dict) and not hasattr(type(x), "__slots__"):
            call = getattr(type(x), "__call__", None)
            return ("object", self.of(type(x)), self.of(dict(state)),
                    self.of(call) if isinstance(call, types.FunctionType) else None)
        raise _Unproven

    def _function(self, fn: types.FunctionType) -> tuple:
        code_names = _global_names(fn.__code__)
        self.names |= code_names
        cells = tuple(self.of(c.cell_contents) for c in fn.__closure__ or ())
        names = sorted(n for n in code_names if n in fn.__globals__)
        return ("fn", self.of(fn.__code__), cells, self.of(fn.__defaults__),
                self.of(fn.__kwdefaults__), tuple((n, self.of(fn.__globals__[n])) for n in names))


def _user_class(cls: type) -> bool:
    """A class whose attributes a mask may read as settings: not Python's or torch's own
    (their attributes are methods and descriptors, the same for every call)."""
    return cls.__module__.partition(".")[0] not in ("builtins", "torch", "typing", "abc")


def _attributes(space: Any) -> dict[str, Any]:
    """A module's or class's own attributes (a class's along its MRO, nearest first)."""
    if isinstance(space, type):
        merged: dict[str, Any] = {}
        for c in reversed(space.__mro__):
            merged.update(vars(c))
        return merged
    return vars(space)


def _global_names(code: types.CodeType) -> set[str]:
    """Names a code object (and the functions defined in it) may read as globals."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def _captured_state(fn: Mod | None) -> tuple[Any, list[torch.Tensor], list[Any]]:
    """(proof of ``fn``'s captured state or ``_UNPROVEN``, its tensors, objects to hold)."""
    if fn is None:
        return None, [], []
    walk = _Captured()
    try:
        return walk.proof(fn), walk.tensors, walk.held
    except (_Unproven, ValueError):  # ValueError: an empty closure cell
        return _UNPROVEN, [], []


class ModCache:
    """LRU of FlexMods keyed by mask data and shape; thread-safe.

    Callables are keyed by identity (``id`` plus the object kept in the entry, so the id
    cannot be reused while the entry lives): a callable's own ``__eq__`` never decides.
    """

    def __init__(self, size: int = _CACHE_SIZE):
        self.size = size
        self._items: OrderedDict[tuple, tuple[tuple, tuple, FlexMods]] = OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0

    def get(self, params: AttnParams, batch: int, hq: int, hkv: int, sq: int, sk: int,
            packed: bool, device: torch.device) -> FlexMods:
        # the BlockMask is the mask_mod evaluated now: its captured state is part of the key
        state, captured, held = _captured_state(params.mask_mod)
        tensors = (params.prefix_lens, params.colmask_start, params.colmask_end,
                   params.cu_seqlens_q if packed else None,
                   params.cu_seqlens_k if packed else None, params.alibi_slopes, *captured)
        fns = (params.score_mod, params.mask_mod, *held)
        key = (packed, batch, hq, hkv, sq, sk, str(device), params.causal, params.alignment,
               params.window, params.softcap, tuple(id(f) for f in fns[:2]), state,
               tuple(_token(t) for t in tensors))
        if _UNPROVEN in key[-1] or state is _UNPROVEN:
            with self._lock:
                self.builds += 1
            return _build(params, batch, hq, hkv, sq, sk, packed, device)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and len(hit[1]) == len(fns) and all(
                    a is b for a, b in zip(hit[1], fns)) and len(hit[0]) == len(tensors) and all(
                    (r is None and t is None) or (r is not None and r() is t)
                    for r, t in zip(hit[0], tensors)):
                self._items.move_to_end(key)
                return hit[2]
        mods = _build(params, batch, hq, hkv, sq, sk, packed, device)
        refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        with self._lock:
            self.builds += 1
            self._items[key] = (refs, fns, mods)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return mods


def _build(params: AttnParams, batch: int, hq: int, hkv: int, sq: int, sk: int,
           packed: bool, device: torch.device) -> FlexMods:
    check_user_mods(params, device)
    pos = _Positions(params, sq, sk, packed, device)
    mask_mod, per_b, per_h = build_mask_mod(params, pos, hq, hkv, sq, device, sk)
    block_mask = None
    if mask_mod is not None:
        block_mask = _fa.create_block_mask(mask_mod, batch if per_b else None,
                                           hq if per_h else None, sq, sk, device=device)
    return FlexMods(build_score_mod(params, pos, device), block_mask)


@functools.lru_cache(maxsize=1)
def compiled_flex() -> Callable[..., Any]:
    """``torch.compile(flex_attention, dynamic=False)``, made once per process: Inductor
    compiles per static shape and per callable's code; new closures over new tensors reuse
    the compiled kernel."""
    return torch.compile(_fa.flex_attention, dynamic=False)


class FlexRecompileLimit(BackendUnavailableError):
    """flex has compiled ``RECOMPILE_LIMIT`` variants in this process; running uncompiled
    would materialise the scores, so the call fails and the policy's fallback serves it.
    Lasting: every new shape would fail alike, so the hub moves flex behind that fallback."""

    def __init__(self, message: str):
        super().__init__("flex", [message], lasting=True)


_SEEN_LIMIT = 4096
_seen: set[tuple] = set()  # call signatures that already ran compiled (no compile needed)
_limit_lock = threading.Lock()


def _run_compiled(fn: Callable[..., Any], signature: tuple, *args: Any, **kwargs: Any) -> Any:
    """Run the compiled function; a signature not seen before may compile, so that call runs
    with flex's recompile limit and dynamo told to raise at it (set directly and restored:
    ``config.patch`` costs ~0.5 ms, and a repeated signature needs neither)."""
    if signature in _seen:
        return fn(*args, **kwargs)
    cfg = torch._dynamo.config
    limit = RECOMPILE_LIMIT
    with _limit_lock:
        saved = (cfg.recompile_limit, cfg.accumulated_recompile_limit,
                 cfg.fail_on_recompile_limit_hit)
        cfg.recompile_limit = max(limit, 1)  # flex's own limit, lower or higher
        cfg.accumulated_recompile_limit = max(limit * 4, saved[1])
        cfg.fail_on_recompile_limit_hit = True
        try:
            out = fn(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
            raise FlexRecompileLimit(
                f"flex: torch.compile(flex_attention) reached {limit} compiled variants in "
                "this process (one per static shape and callable); running uncompiled would "
                "materialise the score matrix, so this call is refused (raise "
                "attnhub_triton_portable.flex.RECOMPILE_LIMIT, or bucket sequence lengths)"
            ) from exc
        finally:
            (cfg.recompile_limit, cfg.accumulated_recompile_limit,
             cfg.fail_on_recompile_limit_hit) = saved
    if len(_seen) >= _SEEN_LIMIT:
        _seen.clear()
    _seen.add(signature)
    return out


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttnParams,
                   layout: str, mods: ModCache, *, compiled: bool = True,
                   want_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """attnhub-layout attention through flex. bshd: (B,S,H,D); thd: (T,H,D) with cu_seqlens.

    Returns (out in q's layout, LSE (B,Hq,Sq) or (Hq,T) natural log, or None unless asked).
    ``compiled=False`` runs flex eagerly (it materialises the scores; the backend's choice
    on the CPU, see ``backend_flex.CPU_EAGER_REASON``).
    """
    packed = layout == "thd"
    # compiled flex reads the head dim as dense (H200: error 3.06 on a stride-2 view)
    q, k, v = unit_head_stride(q, k, v)
    qt, kt, vt = (x.unsqueeze(0).transpose(1, 2) if packed else x.transpose(1, 2)
                  for x in (q, k, v))
    batch, hq, sq, _ = qt.shape
    hkv, sk = kt.shape[1], kt.shape[2]
    if batch == 0 or sq == 0 or sk == 0:  # nothing to attend: flex mishandles empty grids
        out = attends_nothing(q, k, v)  # zeros in the autograd graph of q, k, v
        lse_shape = (hq, sq) if packed else (batch, hq, sq)
        lse = no_keys_lse(lse_shape, q.device) if want_lse else None
        return out, lse
    for fn in (params.score_mod, params.mask_mod):
        if fn is not None and (why := _variant_mismatch(fn, params, hq, sq, sk, packed)):
            raise InputError(f"flex: {why}")
    m = mods.get(params, batch, hq, hkv, sq, sk, packed, q.device)
    kwargs: dict[str, Any] = {"score_mod": m.score_mod, "block_mask": m.block_mask,
                              "scale": params.scale, "enable_gqa": hq != hkv}
    # the LSE finds the fully masked rows (below): eager flex returns it at no cost, compiled
    # GPU flex for one fp32 per row; compiled CPU flex cannot (an eager call finds them)
    with_lse = want_lse or not compiled or q.device.type != "cpu"
    if with_lse:
        kwargs["return_aux"] = _fa.AuxRequest(lse=True)
    if compiled:
        grad = qt.requires_grad or kt.requires_grad or vt.requires_grad
        signature = (qt.shape, kt.shape, vt.shape, qt.dtype, kt.dtype, qt.device, grad,
                     torch.is_grad_enabled(), id(m.score_mod), id(m.block_mask),
                     params.scale, with_lse)
        res = _run_compiled(compiled_flex(), signature, qt, kt, vt, **kwargs)
    else:
        res = _eager(qt, kt, vt, kwargs)
    out, lse = (res[0], res[1].lse) if with_lse else (res, None)
    if lse is not None:
        out = _zero_dead_rows(out, lse)
        if want_lse and lse.dtype != torch.float32:
            # eager flex rounds it to q's dtype once a score_mod (softcap, ALiBi) runs: bf16
            # LSEs were 2x the same-precision reference's error; again in fp32 (rare: half
            # precision, a score_mod and the LSE asked for)
            up = {**kwargs, "return_aux": _fa.AuxRequest(lse=True)}
            lse = _eager(qt.float(), kt.float(), vt.float(), up)[1].lse
        lse = lse if want_lse else None
    elif torch.isnan(out).any():  # compiled CPU flex: a host check is cheap there
        dead = _eager(qt, kt, vt, {**kwargs, "return_aux": _fa.AuxRequest(lse=True)})[1].lse
        out = _zero_dead_rows(out, dead)
    if packed:
        return out[0].transpose(0, 1), (lse[0] if lse is not None else None)
    return out.transpose(1, 2), lse


def _variant_mismatch(fn: Mod, params: AttnParams, hq: int, sq: int, sk: int,
                      packed: bool) -> str | None:
    """A variant sized for a model (heads) or a sequence (positions) that this call exceeds;
    packed documents index positions inside a document (read only for such a variant)."""
    why = heads_mismatch(fn, hq)
    if why is None and getattr(fn, "positions", None) is not None:
        if packed:
            sq, sk = (int((c[1:] - c[:-1]).max()) for c in (params.cu_seqlens_q,
                                                              params.cu_seqlens_k))
        why = positions_mismatch(fn, sq, sk)
    return why


def _eager(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor,
           kwargs: dict[str, Any]) -> Any:
    """Eager flex (it materialises the scores), without its per-call 'unfused' warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return _fa.flex_attention(qt, kt, vt, **kwargs)


def _zero_dead_rows(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Flex weighs the masked keys of a partly masked block by 0 (eager flex: every key): a
    row that sees no key (LSE -inf) comes back NaN when such a value holds NaN (0 x NaN); the
    contract keeps it 0. Compiled CPU flex has no LSE: only an output holding NaN pays for
    an eager call to find that call's dead rows (the mask alone would miss rows that a
    score_mod sets to -inf)."""
    return out.masked_fill(torch.isneginf(lse).unsqueeze(-1), 0.0)
