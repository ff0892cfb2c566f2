"""The call contract at the hub boundary: what each layout needs, forbids and returns.

Every argument of ``attnhub.attention`` is checked here before any backend runs, so a backend
never sees bad input and an input error is never mistaken for a backend failure (nor retried
on a fallback). ``docs/contract.md`` is the same contract in prose.

* :func:`check_call` is the slow path: ranks, shapes, dtypes, devices, ranges and which
  arguments a layout needs or forbids. It reads tensor *contents* only for ``cu_seqlens``
  (see :class:`CuSeqlens`) and paged tables (see :class:`PagedTables`), once per change.
* :func:`check_scalars` is what the exact-shape hot path still checks per call: the values
  of ``scale`` and ``softcap``, which are not part of its key.
* :func:`check_output` is the output contract every backend result meets before it is
  returned (metadata only); :func:`nan_violation` is its debug-mode extension.
"""

from __future__ import annotations

import logging
import operator
import threading
import weakref
from typing import Any, NamedTuple

import torch

from .spec import DTYPES, torch_dtype
from ..errors import (
    ArgumentError,
    DeviceMismatchError,
    DTypeMismatchError,
    LayoutError,
    OutputContractError,
    SeqlensError,
    ShapeError,
)

log = logging.getLogger("attnhub")

_RANK = {"bshd": 4, "bhsd": 4, "thd": 3, "paged": 4}
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
#: The only k/v dtypes that may differ from q's: an FP8 KV cache (the spec's fp8 dtypes).
FP8_KV = frozenset(torch_dtype(n) for n in DTYPES if n.startswith("fp8"))
#: The range of ``scale``/``softcap``: kernels compute scores in float32 at best, where a
#: larger finite Python float is inf (inf * 0 = NaN) and a smaller one is 0 or a subnormal
#: that GPUs flush to 0 (a softcap of 0 makes a zero score 0/0 = NaN): silent NaN answers.
SCALAR_MIN, SCALAR_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
_PHASES = ("train", "prefill", "decode")
#: Arguments that belong to one family of layouts; passing one elsewhere is an error rather
#: than silently ignored (a ``seqlens_k`` with ``bshd`` would otherwise change nothing).
_ONLY_FOR = {
    "cu_seqlens_q": ("thd",), "cu_seqlens_k": ("thd",),
    "block_table": ("paged",), "seqlens_k": ("paged",),
    "colmask_start": ("bshd", "bhsd"), "colmask_end": ("bshd", "bhsd"),
}


class CallArgs(NamedTuple):
    """What :func:`check_call` hands back to the hub: normalised and checked."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: str  # "bhsd" comes back as "bshd" views
    window: tuple[int, int] | None
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor | None = None
    seqlens_k: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None  # thd: the private snapshots backends read
    cu_seqlens_k: torch.Tensor | None = None


def check_call(q: Any, k: Any, v: Any, *, layout: Any, causal: Any, causal_alignment: Any,
               window: Any, softcap: Any, scale: Any, alibi_slopes: Any, prefix_lens: Any,
               colmask_start: Any, colmask_end: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
               max_seqlen_q: Any, max_seqlen_k: Any, block_table: Any, seqlens_k: Any,
               phase: Any, return_lse: Any, deterministic: Any) -> CallArgs:
    """Check one call against the contract of its layout; raise a typed ``InputError`` that
    names the argument and the fix, or return the normalised arguments."""
    check_qkv(q, k, v, layout)
    given = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
             "block_table": block_table, "seqlens_k": seqlens_k,
             "colmask_start": colmask_start, "colmask_end": colmask_end}
    for name, value in given.items():
        if value is not None and layout not in _ONLY_FOR[name]:
            raise ArgumentError(
                f"{name} was given with layout={layout!r}, which does not read it; it belongs "
                f"to layout {' or '.join(map(repr, _ONLY_FOR[name]))} (pass "
                f"layout={_ONLY_FOR[name][0]!r} with tensors in that layout, or drop {name})")
    for name, flag in (("causal", causal), ("return_lse", return_lse),
                       ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise ArgumentError(f"{name}={flag!r}; pass True or False")
    if causal_alignment not in ("bottom_right", "top_left"):
        raise ArgumentError(f"causal_alignment={causal_alignment!r}; use 'bottom_right' "
                            "(default, FlashAttention convention) or 'top_left'")
    if phase is not None and phase not in _PHASES:
        raise ArgumentError(f"phase={phase!r}; use one of {', '.join(_PHASES)} or leave it None")
    check_scalars(scale, softcap)
    if layout == "bhsd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        layout = "bshd"
    window = check_window(window, causal)
    tables: list[Any] = [None, None, None, None]
    if layout == "thd":
        *tables[2:], mq, mk = THD.check(q, k, cu_seqlens_q, cu_seqlens_k)
        batch, cap_q, cap_k = cu_seqlens_q.numel() - 1, q.shape[0], k.shape[0]
    elif layout == "paged":
        *tables[:2], mk = PAGED.check(q, k, block_table, seqlens_k)
        mq, batch = q.shape[1], q.shape[0]
        cap_q, cap_k = mq, block_table.shape[1] * k.shape[1]
    else:
        mq, mk, batch = q.shape[1], k.shape[1], q.shape[0]
        cap_q, cap_k = mq, mk
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, mq, cap_q)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, mk, cap_k)
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if alibi_slopes is not None:
        _check_side("alibi_slopes", alibi_slopes, q.device, floating=True,
                    shapes=((heads_q,), (batch, heads_q)), what="(Hq,) or (B, Hq) fp32")
    if prefix_lens is not None:
        if not causal:
            raise ArgumentError("prefix_lens needs causal=True: prefix-LM attention is causal "
                                "after the prefix (without causal every key is visible)")
        _check_side("prefix_lens", prefix_lens, q.device, floating=False, shapes=((batch,),),
                    what="(B,) integer")
    if colmask_end is not None and colmask_start is None:
        raise ArgumentError("colmask_end was given without colmask_start; pass both "
                            "(rows [start, end) of each key column are masked)")
    if colmask_start is not None:
        sk = k.shape[1]
        shapes = ((batch, 1, sk), (batch, heads_kv, sk))
        for name, t in (("colmask_start", colmask_start), ("colmask_end", colmask_end)):
            if t is not None:
                _check_side(name, t, q.device, floating=False, shapes=shapes,
                            what="(B, Hkv or 1, Sk) int32")
    return CallArgs(q, k, v, layout, window, batch, max_q, max_k, *tables)


def canonical_device(device: str | torch.device,
                     current: Any = None) -> torch.device:
    """``device`` as tensors on it report it: ``torch.device("cuda")`` becomes
    ``cuda:<current device>``, so a cache made for ``"cuda"`` accepts tensors on ``cuda:0``.
    ``current(kind)`` gives the current index of an accelerator kind (default: ask torch;
    tests pass a fake). The CPU, and kinds without an index, are returned unchanged."""
    d = torch.device(device)
    if d.index is not None or d.type in ("cpu", "meta"):
        return d
    index = (current or _current_index)(d.type)
    return d if index is None else torch.device(d.type, index)


def same_device(a: str | torch.device, b: str | torch.device, current: Any = None) -> bool:
    """Whether two devices are the same once canonical (``"cuda"`` is ``"cuda:0"`` when 0
    is the current device)."""
    return canonical_device(a, current) == canonical_device(b, current)


def _current_index(kind: str) -> int | None:
    mod = getattr(torch, kind, None)
    try:
        if mod is not None and mod.is_available() and hasattr(mod, "current_device"):
            return int(mod.current_device())
    except RuntimeError:  # a kind torch knows but cannot start here
        return None
    return None


def check_qkv(q: Any, k: Any, v: Any, layout: Any) -> None:
    """Rank, device, dtype, head dims, head counts and batch agreement of q, k, v."""
    if layout not in _RANK:
        raise LayoutError(f"layout={layout!r} is unknown; use one of {', '.join(_RANK)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != _RANK[layout]:
            raise ShapeError(
                f"{name} has rank {t.dim()} {tuple(t.shape)}, layout {layout!r} needs rank "
                f"{_RANK[layout]} ({_shape_hint(layout)}); pass layout= to match your tensors")
    if not (q.device == k.device == v.device):
        raise DeviceMismatchError(
            f"q is on {q.device}, k on {k.device}, v on {v.device}; move them to one device "
            "(e.g. k = k.to(q.device))")
    if k.dtype != v.dtype:
        raise DTypeMismatchError(f"k is {k.dtype} but v is {v.dtype}; cast both to one dtype")
    if q.dtype not in _FLOAT:
        raise DTypeMismatchError(
            f"q is {q.dtype}; attention takes fp16, bf16 or fp32 queries (FP8 goes through an "
            "FP8 backend with descales)")
    if k.dtype != q.dtype and k.dtype not in FP8_KV:
        raise DTypeMismatchError(
            f"q is {q.dtype} but k/v are {k.dtype}; cast them to q's dtype "
            f"(only an FP8 KV cache, {' or '.join(sorted(map(str, FP8_KV)))}, may differ "
            "from q)")
    head_axis = 1 if layout == "bhsd" else -2
    hq, hk, hv = q.shape[head_axis], k.shape[head_axis], v.shape[head_axis]
    if q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"q head dim {q.shape[-1]} != k head dim {k.shape[-1]}; "
                         "q and k must share the last dimension")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ShapeError(f"head dim is 0 (q {tuple(q.shape)}, v {tuple(v.shape)}); the last "
                         "dimension of q, k and v holds the features and must be at least 1")
    if hk != hv:
        raise ShapeError(f"k has {hk} heads but v has {hv}; they must match")
    if hk == 0 or hq == 0 or hq % hk:
        raise ShapeError(
            f"q has {hq} heads, k/v have {hk}: Hq % Hkv must be 0 and both at least 1 (GQA "
            "groups whole heads); check the head axis of your layout")
    if layout in ("bshd", "bhsd"):
        if not (q.shape[0] == k.shape[0] == v.shape[0]):
            raise ShapeError(
                f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
        seq = 2 if layout == "bhsd" else 1
        if k.shape[seq] != v.shape[seq]:
            raise ShapeError(f"k has {k.shape[seq]} keys but v has {v.shape[seq]}")
    elif layout == "thd" and k.shape[0] != v.shape[0]:
        raise ShapeError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
    elif layout == "paged" and k.shape[:2] != v.shape[:2]:
        raise ShapeError(f"k cache is {tuple(k.shape[:2])} (pages, page_size) but v cache is "
                         f"{tuple(v.shape[:2])}; both must hold the same pages")
    elif layout == "paged" and k.shape[1] < 1:
        raise ShapeError(f"k/v caches {tuple(k.shape)} have page_size 0 (axis 1): a page "
                         "holds at least one token; allocate (pages, page_size >= 1, Hkv, D)")


def check_scalars(scale: Any, softcap: Any) -> None:
    """``scale`` and ``softcap``: real numbers that float32 holds as normal numbers, in
    [``SCALAR_MIN``, ``SCALAR_MAX``] (or None)."""
    for name, x, off in (("scale", scale, "leave scale=None for 1/sqrt(head_dim)"),
                         ("softcap", softcap, "pass softcap=None to turn capping off")):
        if x is None:
            continue
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise ArgumentError(f"{name}={x!r} ({type(x).__name__}); pass a Python float "
                                f"(e.g. float({name})), or {off}")
        if not SCALAR_MIN <= x <= SCALAR_MAX:  # False for NaN too
            raise ArgumentError(f"{name}={x!r}; it must be a number in [{SCALAR_MIN:.4g}, "
                                f"{SCALAR_MAX:.4g}], float32's normal range (kernels compute "
                                f"scores in float32, where it would be 0 or inf) ({off})")


#: Keys of ``extra`` that every backend ignores, and why: what attention here never does,
#: or takes as an argument of its own (FlashAttention's names). Passing one is refused: an
#: ignored key is a silent wrong answer (dropout not applied, a scale not used).
_IGNORED_EXTRA = {
    "dropout_p": "attention here has no dropout (every backend is exact); apply dropout "
                 "outside it (on the output), or drop dropout_p",
    "q_descale": "queries are fp16/bf16/fp32 here, never FP8 (fa3_fp8 quantizes them itself, "
                 "with its own descale); drop q_descale",
    "softmax_scale": "pass scale= to attention",
    "window_size": "pass window=(left, right) to attention",
    "is_causal": "pass causal= to attention",
    "attn_mask": "pass the mask as causal=, window=, prefix_lens=, colmask_start/end= or a "
                 "mask_mod",
}
_IGNORED_EXTRA["dropout"] = _IGNORED_EXTRA["dropout_p"].replace("dropout_p", "dropout")
for _name in ("scale", "causal", "window", "softcap", "alibi_slopes"):
    _IGNORED_EXTRA[_name] = f"pass {_name}= to attention itself"
#: FP8 descales: read only beside an FP8 k/v, and needed there (both).
_DESCALES = ("k_descale", "v_descale")


def check_extra(extra: Any, kv_dtype: torch.dtype) -> dict[str, Any]:
    """``extra`` (backend-specific options, a dict) as a private copy for ``AttnParams``,
    refused where a backend would silently ignore part of it: a key of ``_IGNORED_EXTRA``,
    FP8 descales beside a 16/32-bit k/v, or an FP8 k/v without both descales. Checked for
    every backend here, on every call that passes ``extra`` (``extra`` is not in the hot
    path's key; a call without it pays one truth test)."""
    if not isinstance(extra, dict):
        raise ArgumentError(f"extra={extra!r} ({type(extra).__name__}); pass a dict of "
                            "backend options, or None")
    for name in extra:
        why = _IGNORED_EXTRA.get(name)
        if why is not None:
            raise ArgumentError(f"extra[{name!r}] is read by no backend (it would be silently "
                                f"ignored): {why}")
    given = [n for n in _DESCALES if n in extra]
    if kv_dtype in FP8_KV:
        missing = [n for n in _DESCALES if n not in given]
        if missing:
            raise ArgumentError(
                f"k/v are {kv_dtype} (an FP8 KV cache) but extra has no "
                f"{' or '.join(missing)}; pass both descales, float32 per (page or batch, KV "
                "head), e.g. extra=PagedKVCache.scales.descales(layer)")
    elif given:
        raise ArgumentError(
            f"extra {' and '.join(given)} given for {kv_dtype} k/v, which every backend reads "
            "as is (descales scale an FP8 KV cache, float8_e4m3fn); drop them, or pass the "
            "FP8 k/v they scale")
    return dict(extra)


def check_window(window: Any, causal: bool) -> tuple[int, int] | None:
    """``window``: an int ``w`` (``(w, 0)`` if causal, else ``(w, w)``) or ``(left, right)``
    of ints >= -1, -1 meaning unbounded on that side."""
    if window is None:
        return None
    try:
        if isinstance(window, bool):
            raise TypeError
        if isinstance(window, (tuple, list)):
            if len(window) != 2 or any(isinstance(w, bool) for w in window):
                raise TypeError
            left, right = operator.index(window[0]), operator.index(window[1])
        else:
            left = operator.index(window)
            right = 0 if causal else left
    except TypeError:
        raise ArgumentError(f"window={window!r}; pass an int or (left, right) of ints, -1 "
                            "for unbounded (e.g. window=(128, 0))") from None
    if min(left, right) < -1:
        raise ArgumentError(f"window={window!r}; use (left, right) with -1 for unbounded "
                            "(each side >= -1)")
    return (left, right)


def check_cu_seqlens_meta(name: str, cu: Any, device: torch.device) -> None:
    """Type, rank, dtype and device of cumulative lengths (no contents read)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise SeqlensError(f"{name} must be a 1-D tensor of B+1 offsets starting at 0, got "
                           f"{tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu)}")
    if cu.dtype != torch.int32:
        raise SeqlensError(f"{name} is {cu.dtype}; it must be torch.int32 "
                           f"(use {name}.to(torch.int32))")
    if cu.device != device:
        raise DeviceMismatchError(f"{name} is on {cu.device} but q is on {device}; move it")


def _check_cu_contents(name: str, cu: torch.Tensor, total: int) -> int:
    """Offsets start at 0, never decrease, end at the packed length (one host copy);
    returns the longest sequence."""
    host = cu.tolist()
    if host[0] != 0:
        raise SeqlensError(f"{name}[0] is {host[0]}; offsets must start at 0")
    if any(b < a for a, b in zip(host, host[1:])):
        raise SeqlensError(f"{name} is not monotonic non-decreasing: {host[:8]}...")
    if host[-1] > total:
        raise SeqlensError(
            f"{name}[-1]={host[-1]} is past the {total} tokens of the packed tensor")
    if host[-1] < total:
        raise SeqlensError(
            f"{name}[-1]={host[-1]} but the packed tensor holds {total} tokens; the last "
            f"offset must equal the packed length (slice the tensor to [:{host[-1]}])")
    return max(b - a for a, b in zip(host, host[1:]))


def check_max_seqlen(name: str, given: Any, true_max: int, cap: int) -> int:
    """A caller's ``max_seqlen`` may be an upper bound, never below the true longest length
    (kernels size their grids by it and would drop rows). It comes back at most ``cap``, the
    most tokens a sequence can hold (packed length, table capacity): a loose bound such as
    2**31 would size a kernel's grid (hours under the Triton interpreter, a failed launch
    past the grid limit) and the spec's bucket by it."""
    if given is None:
        return true_max
    try:
        if isinstance(given, bool):
            raise TypeError
        given = operator.index(given)
    except TypeError:
        raise ArgumentError(f"{name}={given!r}; pass an int (or None to compute it)") from None
    if given < true_max:
        raise SeqlensError(f"{name}={given} is below the longest sequence ({true_max}); pass "
                           f"{name}={true_max} or leave it None to have it computed")
    return min(given, cap)


#: Integer dtypes a position tensor (``prefix_lens``, ``colmask_*``) may have: the ones
#: every kernel reads (unsigned 16-64 bit types have partial torch support).
_INT_SIDE = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def fit_positions(t: torch.Tensor | None, hi: int) -> torch.Tensor | None:
    """An int64 position tensor clamped to ``[0, hi]`` (``hi``: the keys for ``prefix_lens``,
    the queries for ``colmask_*``), which means the same (a prefix past the last key shows
    every key; a row range past the last query ends there; negative ones are empty), and
    fits the int32 kernels read it in: 2**32 + 2 would wrap to 2 (a silent wrong answer).
    Narrower dtypes are returned as they are. A device op, no host sync."""
    if t is None or t.dtype != torch.int64:
        return t
    return t.clamp(0, hi)


def _check_side(name: str, t: Any, device: torch.device, *, floating: bool,
                shapes: tuple[tuple[int, ...], ...], what: str) -> None:
    """A side tensor: a tensor on q's device, of the right kind of dtype and one of ``shapes``."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor {what}, got {type(t).__name__}")
    if t.device != device:
        raise DeviceMismatchError(f"{name} is on {t.device} but q is on {device}; move it "
                                  f"({name}.to(q.device))")
    if floating != t.dtype.is_floating_point or t.dtype == torch.bool or (
            not floating and t.dtype not in _INT_SIDE):
        kind = "a floating" if floating else "an integer (int8-int64 or uint8)"
        raise DTypeMismatchError(f"{name} is {t.dtype}; it must be {kind} tensor {what} "
                                 f"(e.g. {name}.to(torch.{'float32' if floating else 'int32'}))")
    if tuple(t.shape) not in shapes:
        raise ShapeError(f"{name} has shape {tuple(t.shape)}; this call needs {what}: "
                         f"one of {', '.join(map(str, shapes))}")


class _Memo:
    """A one-entry memo of a checked pair of tensors: the layers of a model step pass the
    same two tensors, so their contents are read once per change, not once per layer.

    A hit needs the same tensor objects and geometry (what the check depended on). On the
    CPU the contents are then compared with the snapshot (``torch.equal``, under a
    microsecond for small tables), so every edit is seen. On an accelerator that comparison
    would be a host sync per layer, so a stamp (``_version``, data pointer) stands in for
    it. A stamp is no full proof: an edit through ``.data`` does not bump ``_version``. So
    backends always read the *snapshot* (a private copy taken when the pair was checked):
    nothing a caller does to its own tensors afterwards can make a backend read an
    unchecked value; on an accelerator an edit that bypasses ``_version`` between calls is
    not seen (the call reads the values as they were checked: in bounds, never an error).
    Normal in-place edits and new tensors are re-checked.
    """

    #: the tables a memo holds, as the caller names them (its messages say these)
    TABLES = "tables"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memo: tuple = ()

    def _hit(self, a: torch.Tensor, b: torch.Tensor, geometry: tuple) -> tuple | None:
        """``(snap_a, snap_b, *facts)`` if ``a``/``b`` are the checked pair, unchanged, for
        this ``geometry``; else None. The hot path's cost: the result tuple is built once
        at ``_store``, and whether contents or a stamp prove the pair was settled there too
        (a tensor object never changes device: ``.data`` of another device is refused)."""
        memo = self._memo  # (a, b, geometry, stamp, result, dtypes): one read, swapped whole
        if memo and memo[0] is a and memo[1] is b and memo[2] == geometry:
            return self.still(memo, a, b)
        return None

    @staticmethod
    def still(memo: tuple, a: torch.Tensor, b: torch.Tensor) -> tuple | None:
        """``memo``'s result if ``a``/``b`` are its pair, unchanged since it was stored (its
        geometry is the caller's to vouch for: the hub's per-binding shortcut); else None."""
        if memo[0] is a and memo[1] is b:
            stamp, result = memo[3], memo[4]
            if stamp is None:  # the contents themselves (CPU, inference tensors: _stamp)
                # dtypes too: ``equal`` holds across dtypes, and ``t.data = t.long()``
                # neither bumps ``_version`` nor changes the values
                if (result[0].equal(a) and result[1].equal(b)
                        and (a.dtype, b.dtype) == memo[5]):
                    return result
            elif (a._version == stamp[0] and b._version == stamp[1]
                  and a.data_ptr() == stamp[2] and b.data_ptr() == stamp[3]):
                return result
        return None

    #: The hot path's check, ``_hit`` itself (no wrapper: one call less per layer): the
    #: result of :meth:`check` (paged: ``(snap_bt, snap_sl, longest)`` for the geometry
    #: ``(k.shape, batch, device)``; thd: ``(snap_q, snap_k, max_q, max_k)`` for
    #: ``(total_q, total_k, device)``) or None, and then :meth:`check` must run, the
    #: tables' types and shapes too.
    unchanged = _hit

    def _store(self, a: torch.Tensor, b: torch.Tensor, geometry: tuple, snap_a: torch.Tensor,
               snap_b: torch.Tensor, *facts: Any) -> None:
        stamp = None if a.is_cpu else _stamp(a, b)
        if stamp is None and not a.is_cpu:
            _warn_unstamped(self.TABLES, a.device)
        memo = (a, b, geometry, stamp, (snap_a, snap_b, *facts), (a.dtype, b.dtype))
        with self._lock:
            self._memo = memo


def _stamp(a: torch.Tensor, b: torch.Tensor) -> tuple | None:
    """(versions, data pointers) of a pair; None for inference tensors (made under
    ``torch.inference_mode``), which keep no version counter and are edited in place
    unrecorded: only their contents prove them unchanged (a host sync on an accelerator)."""
    try:
        return (a._version, b._version, a.data_ptr(), b.data_ptr())
    except RuntimeError:
        return None


_warned_unstamped: set[str] = set()


def _warn_unstamped(tables: str, device: torch.device) -> None:
    """Once per pair of tables: tables on an accelerator made under ``torch.inference_mode``
    carry no version counter, so every call proves them unchanged by reading them (a host
    sync per call, per layer). Said, never silent."""
    if tables in _warned_unstamped:
        return
    _warned_unstamped.add(tables)
    log.warning(
        "attnhub: %s on %s are inference tensors (made under torch.inference_mode): they "
        "keep no version counter, so each call compares their contents with the checked "
        "copy, a host sync per call. Build them outside inference_mode (PagedKVCache."
        "block_table/seqlens do), or as t = x.clone() under torch.inference_mode(False).",
        tables, device)


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A private copy backends read, with a version counter even when the caller's tensor
    was made under ``torch.inference_mode`` (backends may stamp the tables they get)."""
    with torch.inference_mode(False):
        return t.clone()


class CuSeqlens(_Memo):
    """Checks ``cu_seqlens_q``/``cu_seqlens_k`` of a ``thd`` call once per change (a host
    copy then) and hands backends a private snapshot (see :class:`_Memo`)."""

    TABLES = "cu_seqlens_q/cu_seqlens_k"

    def check(self, q: torch.Tensor, k: torch.Tensor, cu_q: Any,
              cu_k: Any) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Validate; returns the snapshots backends must read and the longest lengths."""
        if cu_q is None or cu_k is None:
            raise SeqlensError("layout='thd' needs cu_seqlens_q and cu_seqlens_k "
                               "(int32, B+1 offsets into the packed tokens)")
        check_cu_seqlens_meta("cu_seqlens_q", cu_q, q.device)
        check_cu_seqlens_meta("cu_seqlens_k", cu_k, q.device)
        if cu_q.numel() != cu_k.numel():
            raise SeqlensError(f"cu_seqlens_q has {cu_q.numel()} entries and "
                               f"cu_seqlens_k {cu_k.numel()}; both must be B+1 long")
        return self.values(cu_q, cu_k, q.shape[0], k.shape[0], q.device)

    def values(self, cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """The contents check alone (types and shapes already checked)."""
        # what the check depended on: the packed lengths, and q's device (the hot path
        # leaves the offsets' device to this memo)
        geometry = (total_q, total_k, device)
        hit = self._hit(cu_q, cu_k, geometry)
        if hit is not None:
            return hit  # type: ignore[return-value]
        snap_q, snap_k = _snapshot(cu_q), _snapshot(cu_k)
        mq = _check_cu_contents("cu_seqlens_q", snap_q, total_q)
        mk = _check_cu_contents("cu_seqlens_k", snap_k, total_k)
        self._store(cu_q, cu_k, geometry, snap_q, snap_k, mq, mk)
        return snap_q, snap_k, mq, mk


#: The process-wide varlen check (one memo: the layers of a step share their offsets).
THD = CuSeqlens()


class PagedTables(_Memo):
    """Checks ``block_table``/``seqlens_k`` of a paged call, reading their contents once per
    change, and hands backends a private snapshot that a stale check cannot outlive (see
    :class:`_Memo`).

    Tables built by :class:`~attnhub.core.kvcache.PagedKVCache` come with a proof
    (:meth:`vouch`): the cache built them from host lists it knows, so a new step's tables
    are taken without reading them back (no host sync on an accelerator).
    """

    TABLES = "block_table/seqlens_k"

    def __init__(self) -> None:
        super().__init__()
        self._vouched: dict[int, tuple] = {}
        #: tables their cache has taken back (``revoke``): id -> (weakref, why)
        self._revoked: dict[int, tuple] = {}

    def check(self, q: torch.Tensor, k: torch.Tensor, block_table: Any,
              seqlens_k: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Validate; returns the snapshot (block_table, seqlens_k) backends must read and
        the longest length."""
        if block_table is None or seqlens_k is None:
            raise SeqlensError("layout='paged' needs block_table (B, pages) int32 and "
                               "seqlens_k (B,) int32")
        batch = q.shape[0]
        for name, t, rank in (("block_table", block_table, 2), ("seqlens_k", seqlens_k, 1)):
            if not isinstance(t, torch.Tensor):
                raise SeqlensError(f"{name} must be an int32 tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise SeqlensError(f"{name} is {t.dtype}; it must be torch.int32 "
                                   f"(use {name}.to(torch.int32))")
            if t.device != q.device:
                raise DeviceMismatchError(f"{name} is on {t.device} but q is on {q.device}; "
                                          f"move it ({name}.to(q.device))")
            if t.dim() != rank or t.shape[0] != batch:
                want = f"(B={batch}, pages)" if rank == 2 else f"(B={batch},)"
                raise SeqlensError(f"{name} must be {want} for q of batch {batch}, got "
                                   f"{tuple(t.shape)}")
        return self.values(q, k, block_table, seqlens_k)

    def values(self, q: torch.Tensor, k: torch.Tensor, block_table: torch.Tensor,
               seqlens_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The contents check alone (types and shapes already checked)."""
        if self._revoked:
            self._refuse_revoked(block_table)
        # what the check depended on: the cache's (pages, page_size, ...), q's batch (the
        # tables' rows) and device (the snapshots')
        geometry = (k.shape, q.shape[0], q.device)
        hit = self._hit(block_table, seqlens_k, geometry)
        if hit is not None:
            return hit  # type: ignore[return-value]
        proof = self._proof(block_table, seqlens_k, k.shape[0], k.shape[1])
        if proof is not None:
            snap_bt, snap_sl, max_len = proof
        else:
            snap_bt, snap_sl = _snapshot(block_table), _snapshot(seqlens_k)
            max_len = _check_paged_contents(snap_bt, snap_sl, k.shape[0], k.shape[1])
        self._store(block_table, seqlens_k, geometry, snap_bt, snap_sl, max_len)
        return snap_bt, snap_sl, max_len

    def vouch(self, t: torch.Tensor, snapshot: torch.Tensor, fact: int) -> None:
        """Record a proof for a table the caller built from host data it checked:
        ``fact`` is, for a block table, the number of pages every entry is below, for
        lengths the longest length (all >= 0). ``snapshot`` is a private copy of ``t``
        (same values) that backends will read. The proof holds while ``t`` is unchanged
        (stamp as in :class:`_Memo`); only the last few proofs are kept."""
        if t.is_inference():  # no version counter to hold the proof: checked by reading
            return
        entry = (weakref.ref(t), t._version, t.data_ptr(), tuple(t.shape), snapshot, fact)
        with self._lock:
            self._vouched[id(t)] = entry
            while len(self._vouched) > 8:
                del self._vouched[next(iter(self._vouched))]

    def revoke(self, t: torch.Tensor, why: str) -> None:
        """Take back a block table its cache built: some page it names went back to the free
        list (``why`` says how), so it may point at another sequence's tokens. Every later
        check of ``t`` raises; the memo that held it is dropped, so the hub's per-layer
        shortcut cannot take it either (no cost on the hot path)."""
        with self._lock:
            self._vouched.pop(id(t), None)
            if self._memo and self._memo[0] is t:
                self._memo = ()
            self._revoked[id(t)] = (weakref.ref(t), why)
            if len(self._revoked) > 64:  # the tables themselves are gone: forget them
                self._revoked = {i: e for i, e in self._revoked.items() if e[0]() is not None}

    def _refuse_revoked(self, bt: torch.Tensor) -> None:
        entry = self._revoked.get(id(bt))
        if entry is not None and entry[0]() is bt:
            raise SeqlensError(
                f"block_table was built by a PagedKVCache whose pages it names were freed "
                f"since ({entry[1]}): it may point at another sequence's tokens. Build the "
                "tables again from the cache (cache.step(...) or cache.block_table(...))")

    def _proof(self, bt: torch.Tensor, sl: torch.Tensor, num_pages: int,
               page: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Snapshots and longest length from two vouched tables, if both still hold and fit
        this call's cache (every page id < num_pages, longest <= the table's capacity)."""
        pa, pb = self._vouched.get(id(bt)), self._vouched.get(id(sl))
        if pa is None or pb is None:
            return None
        for t, (ref, version, ptr, shape, _, _) in ((bt, pa), (sl, pb)):
            if ref() is not t or t._version != version or t.data_ptr() != ptr or (
                    tuple(t.shape) != shape):
                return None
        if pa[5] > num_pages or pb[5] > bt.shape[1] * page:
            return None
        if bt.is_cpu and not (torch.equal(pa[4], bt) and torch.equal(pb[4], sl)):
            return None  # edited through .data since it was vouched: check it the long way
        return pa[4], pb[4], pb[5]


def _check_paged_contents(bt: torch.Tensor, sl: torch.Tensor, num_pages: int,
                          page: int) -> int:
    """Lengths in [0, capacity], every page a sequence uses in [0, num_pages); returns the
    longest length. One host copy of each table."""
    lens = sl.cpu().to(torch.int64)
    if lens.numel() and int(lens.min()) < 0:
        raise SeqlensError(f"seqlens_k has a negative length: {lens.tolist()[:8]}; lengths "
                           "count the cached tokens of each sequence (>= 0)")
    cap = bt.shape[1] * page
    longest = int(lens.max()) if lens.numel() else 0
    if longest > cap:
        raise SeqlensError(f"seqlens_k max {longest} exceeds block_table capacity {cap} "
                           f"({bt.shape[1]} pages x {page}); add pages to the table")
    used = torch.arange(bt.shape[1]).view(1, -1) < ((lens + page - 1) // page).view(-1, 1)
    ids = bt.cpu()[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
        raise SeqlensError(f"block_table refers to a page outside 0..{num_pages - 1} (the k/v "
                           "caches hold that many pages) for a token within seqlens_k")
    return longest


#: The process-wide paged check (one memo: the layers of a step share their tables).
PAGED = PagedTables()


def check_result(backend: str, res: Any) -> tuple[Any, Any]:
    """``(out, lse)`` of a backend's result: an ``AttentionOutput`` (any pair is taken);
    anything else (a bare tensor, None, a dict, an iterator) is that backend failing, said
    in words rather than as the unpacking error it would otherwise raise."""
    if isinstance(res, tuple) and len(res) == 2:
        return res[0], res[1]
    what = (f"a tuple of {len(res)}" if isinstance(res, tuple) else
            f"a bare tensor {tuple(res.shape)}" if isinstance(res, torch.Tensor) else
            type(res).__name__)
    raise OutputContractError(f"backend {backend!r} returned {what}; the contract is "
                              "AttentionOutput(out, lse) (attnhub.plugin.AttentionOutput, "
                              "lse None unless return_lse)")


def check_output(backend: str, out: Any, lse: Any, q: torch.Tensor, v: torch.Tensor,
                 layout: str, return_lse: bool, needs_grad: bool | None = None) -> None:
    """A backend's result against the contract: out is ``q.shape[:-1] + (Dv,)`` in q's dtype
    on q's device, a plain tensor (or q's own class), in the autograd graph when the call
    needs gradients (``needs_grad``; an output in a graph of its own is fine: learned side
    tensors such as ALiBi slopes or a captured score bias put it there); LSE (when asked
    for) fp32, (B, Hq, Sq) or (Hq, T) for thd. Metadata only."""
    want = (*q.shape[:-1], v.shape[-1])
    if not isinstance(out, torch.Tensor):
        raise OutputContractError(f"backend {backend!r} returned {type(out).__name__} as the "
                                  "output, not a tensor")
    if out.shape != want or out.dtype != q.dtype or out.device != q.device:
        raise OutputContractError(
            f"backend {backend!r} returned out {tuple(out.shape)} {out.dtype} on {out.device}; "
            f"the contract is {want} {q.dtype} on {q.device}")
    if out.__class__ is not torch.Tensor and out.__class__ is not q.__class__:
        raise OutputContractError(
            f"backend {backend!r} returned out as a {type(out).__name__} (a torch.Tensor "
            f"subclass); the contract is a plain tensor like q ({type(q).__name__})")
    if needs_grad and not out.requires_grad:
        raise OutputContractError(
            f"backend {backend!r} returned an output cut from the autograd graph for a call "
            "that needs gradients: no gradient would reach q, k or v through it")
    if return_lse:
        lwant = (q.shape[1], q.shape[0]) if layout == "thd" else (
            q.shape[0], q.shape[2], q.shape[1])
        if (not isinstance(lse, torch.Tensor) or lse.shape != lwant
                or lse.dtype != torch.float32 or lse.device != q.device):
            got = (f"{tuple(lse.shape)} {lse.dtype} on {lse.device}"
                   if isinstance(lse, torch.Tensor) else repr(type(lse).__name__))
            raise OutputContractError(f"backend {backend!r} returned lse {got}; the contract "
                                      f"is {lwant} torch.float32 on {q.device}")


def shared_memory(backend: str, out: torch.Tensor, lse: Any,
                  inputs: dict[str, Any]) -> OutputContractError | None:
    """The memory checks of a result (once per binding: the slow path, settle, debug mode):
    ``out``/``lse`` must not share memory with an input (the caller's q, k, v, side tensors:
    writing the output would change them) nor with itself (a stride-0 dimension: one element
    seen at many places, which an in-place op on the output refuses or smears)."""
    for what, t in (("out", out), ("lse", lse)):
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        if any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride())):
            return OutputContractError(
                f"backend {backend!r} returned {what} with stride {tuple(t.stride())} for "
                f"shape {tuple(t.shape)}: elements share memory (an expanded tensor); the "
                "contract is a tensor of its own (.contiguous() it)")
        ptr = _storage_ptr(t)
        if not ptr:
            continue
        for name, x in inputs.items():
            if isinstance(x, torch.Tensor) and x.numel() and _storage_ptr(x) == ptr:
                return OutputContractError(
                    f"backend {backend!r} returned {what} in the memory of its input {name}; "
                    "the contract is a new tensor (writing the output would change the "
                    "caller's input)")
    return None


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # no storage to compare (a tensor subclass, a functional wrapper)
        return 0


def call_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                params: Any) -> dict[str, Any]:
    """What a backend is handed and must leave as it is (the caller's tensors, the hub's
    checked copies of tables and offsets), by the names errors use."""
    return {"q": q, "k": k, "v": v, "alibi_slopes": params.alibi_slopes,
            "prefix_lens": params.prefix_lens, "colmask_start": params.colmask_start,
            "colmask_end": params.colmask_end, "cu_seqlens_q": params.cu_seqlens_q,
            "cu_seqlens_k": params.cu_seqlens_k, "block_table": params.block_table,
            "seqlens_k": params.seqlens_k}


def autocast_on(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for this device type (False where it has none).
    Backends run with it off (the slow lane, settle): attention computes in q's dtype."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


def grad_needed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether this call needs gradients (grad mode on and q, k or v requiring grad)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def watched_forward(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    spec: Any, params: Any, inputs: dict[str, Any]
                    ) -> tuple[Any, Exception | None, OutputContractError | None]:
    """Load and run ``backend`` once, as the slow lane and settle's first calls do, watching
    ``inputs`` (:func:`call_inputs`): ``(result, failure, written)``, ``failure`` what it
    raised (None if nothing), ``written`` :func:`written_inputs`'s error when it wrote into
    an input (the caller then raises it, chained from ``failure``: never retried)."""
    before = versions(inputs)
    res = failure = None
    try:
        if not backend._loaded:
            backend.load()
        res = backend.forward(q, k, v, spec, params)
    except Exception as exc:  # noqa: BLE001 - handed to the caller, which decides
        failure = exc
    return res, failure, written_inputs(backend, before, inputs)


def versions(inputs: dict[str, Any]) -> dict[str, int]:
    """The version counters of the tensors in ``inputs`` (inference tensors keep none and
    are left out): :func:`written_inputs` compares them after a backend ran."""
    out = {}
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor):
            try:
                out[name] = t._version
            except RuntimeError:  # made under torch.inference_mode: no counter
                pass
    return out


def written_inputs(backend: Any, before: dict[str, int],
                   inputs: dict[str, Any]) -> OutputContractError | None:
    """A backend that wrote into an input in place (its version counter moved): the caller's
    tensors (or the hub's checked copies of the tables) no longer hold what was passed, so
    no fallback can give the right answer and none is tried. The table memos are dropped
    (a copy a backend wrote into must not serve the next call)."""
    moved = [n for n, ver in before.items() if inputs[n]._version != ver]
    if not moved:
        return None
    _forget_tables()
    name, plugin = getattr(backend, "name", "?"), getattr(backend, "plugin", "?")
    return OutputContractError(
        f"backend {name!r} (plugin {plugin!r}) wrote into its input {', '.join(moved)} in "
        "place; those tensors no longer hold the values passed, so no fallback is tried. A "
        "backend must leave its inputs as they are: report it to the plugin's authors and "
        f"keep {name!r} out of the policy (or ATTNHUB_PLUGINS=-{plugin}) until it is fixed")


def _forget_tables() -> None:
    """Drop the paged and varlen memos and proofs (their snapshots may have been written)."""
    for memo in (PAGED, THD):
        with memo._lock:
            memo._memo = ()
    with PAGED._lock:
        PAGED._vouched.clear()


def nan_violation(backend: str, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> OutputContractError | None:
    """Debug mode: NaN in the output when no input held NaN (a host sync per call)."""
    if bool(torch.isnan(out).any()) and not any(
            t.dtype.itemsize > 1 and bool(torch.isnan(t).any()) for t in (q, k, v)):
        return OutputContractError(f"backend {backend!r} returned NaN from inputs without NaN "
                                   "(found by ATTNHUB_DEBUG=1 / Hub(debug=True))")
    return None


def _shape_hint(layout: str) -> str:
    return {"bshd": "B,S,H,D", "bhsd": "B,H,S,D", "thd": "T,H,D",
            "paged": "q B,S,H,D; k/v pages,page_size,H,D"}[layout]
