"""The call contract at the hub boundary: what each layout needs and forbids.

Every argument of ``attnhub.attention`` is checked here before any backend runs, so a backend
never sees bad input and an input error is never mistaken for a backend failure (nor retried
on a fallback). ``docs/contract.md`` is the same contract in prose.

* :func:`check_call` is the slow path: ranks, shapes, dtypes, devices, ranges and which
  arguments a layout needs or forbids. It reads tensor *contents* only for ``cu_seqlens``
  and paged tables, once per change (the memos of :mod:`attnhub.core.tables`).
* :func:`check_scalars` is what the exact-shape hot path still checks per call: the values
  of ``scale`` and ``softcap``, which are not part of its key.

What a backend returns is checked by :mod:`attnhub.core.outputs`.
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

import torch

from .masking import window_within
from .spec import DTYPES, bucket, torch_dtype
from .env import env_flag
from .tables import PAGED, THD, check_plain
from ..errors import (
    ArgumentError,
    DeviceMismatchError,
    DTypeMismatchError,
    LayoutError,
    SeqlensError,
    ShapeError,
)

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
    window = check_window(window, causal, prefix_lens is not None)
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
    if window is not None:
        # an edge past every key is "unbounded" (exact), for every backend: a sentinel such
        # as 2**31 - 1 or sys.maxsize would overflow kernels' int32/int64 index arithmetic.
        # Bounded by the longest lengths' bucket (the spec's), not the lengths: calls of one
        # bucket share a binding (a growing cache's steps), so they must normalise alike; not
        # by a paged table's capacity either: ``bind`` resolves decode by the lengths it will
        # run (``nn.call_spec``), and a wider table made the call's spec differ from it
        window = bounding_window(window_within(window, bucket(max(max_q, max_k, 1))), causal,
                                 prefix_lens is not None)
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
    if not isinstance(layout, str) or layout not in _RANK:
        raise LayoutError(f"layout={layout!r} is unknown; use one of {', '.join(_RANK)} (a "
                          "string)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        check_plain(name, t)
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


def check_dropout(p: Any) -> float:
    """``dropout_p`` as a float in [0, 1): the probability of zeroing each attention
    probability. 1 is refused (it zeroes every output and scales by 1/0)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise ArgumentError(f"dropout_p={p!r} ({type(p).__name__}); pass a Python float in "
                            "[0, 1), e.g. dropout_p=0.1 in training and 0.0 in eval")
    if not 0 <= p < 1:  # False for NaN too
        raise ArgumentError(f"dropout_p={p!r}; it must be in [0, 1) (0: no dropout; model "
                            "code passes its attention_dropout while training, 0.0 in eval)")
    return float(p)


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
    if scale is not None and softcap is not None and scale / softcap > SCALAR_MAX:
        raise ArgumentError(f"scale={scale!r} with softcap={softcap!r}: kernels cap scores as "
                            "tanh(score * scale / softcap) * softcap, and scale / softcap "
                            "overflows float32 (a score of 0 would give NaN); a softcap this "
                            "small caps every score at about 0: use a larger softcap, or "
                            "softcap=None")


#: Keys of ``extra`` that every backend ignores, and why: what attention here never does,
#: or takes as an argument of its own (FlashAttention's names). Passing one is refused: an
#: ignored key is a silent wrong answer (dropout not applied, a scale not used).
_IGNORED_EXTRA = {
    "dropout_p": "pass dropout_p= to attention itself (backends that declare dropout "
                 "serve it)",
    "q_descale": "queries are fp16/bf16/fp32 here, never FP8 (fa3_fp8 quantizes them itself, "
                 "with its own descale); drop q_descale",
    "softmax_scale": "pass scale= to attention",
    "window_size": "pass window=(left, right) to attention",
    "is_causal": "pass causal= to attention",
    "attn_mask": "pass the mask as causal=, window=, prefix_lens=, colmask_start/end= or a "
                 "mask_mod",
}
_IGNORED_EXTRA["dropout"] = _IGNORED_EXTRA["dropout_p"]
for _name in ("scale", "causal", "window", "softcap", "alibi_slopes"):
    _IGNORED_EXTRA[_name] = f"pass {_name}= to attention itself"
#: FP8 descales: read only beside an FP8 k/v, and needed there (both).
_DESCALES = ("k_descale", "v_descale")
#: Dropout keys: a probability of 0 is what every backend does, so it passes.
_DROPOUT = ("dropout_p", "dropout")


def _is_zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def check_extra(extra: Any, kv_dtype: torch.dtype) -> dict[str, Any]:
    """``extra`` (backend-specific options, a dict) as a private copy for ``AttnParams``,
    refused where a backend would silently ignore part of it: a key of ``_IGNORED_EXTRA``,
    FP8 descales beside a 16/32-bit k/v, or an FP8 k/v without both descales. Checked for
    every backend here, on every call that passes ``extra`` (``extra`` is not in the hot
    path's key; a call without it pays one truth test)."""
    if not isinstance(extra, dict):
        raise ArgumentError(f"extra={extra!r} ({type(extra).__name__}); pass a dict of "
                            "backend options, or None")
    for name, value in extra.items():
        why = _IGNORED_EXTRA.get(name)
        if why is not None and not (name in _DROPOUT and _is_zero(value)):
            raise ArgumentError(f"extra[{name!r}] is read by no backend (it would be silently "
                                f"ignored): {why}")
    given = [n for n in _DESCALES if extra.get(n) is not None]  # None: not given
    if kv_dtype in FP8_KV:
        missing = [n for n in _DESCALES if n not in given]
        if missing:
            raise ArgumentError(
                f"k/v are {kv_dtype} (an FP8 KV cache) but extra has no "
                f"{' or '.join(missing)}; pass both descales, float32 per (page or batch, KV "
                "head), e.g. extra=PagedKVCache.scales.descales(layer)")
        for name in _DESCALES:
            _check_descale(name, extra[name])
    elif given:
        raise ArgumentError(
            f"extra {' and '.join(given)} given for {kv_dtype} k/v, which every backend reads "
            "as is (descales scale an FP8 KV cache, float8_e4m3fn); drop them, or pass the "
            "FP8 k/v they scale")
    return dict(extra)


def _check_descale(name: str, d: Any) -> None:
    """A descale is a floating tensor (or number) of finite values > 0: a negative, zero or
    NaN one gave wrong scores without a word. Values are read on the CPU, or with
    ``ATTNHUB_DEBUG=1``: on an accelerator that read is a host sync per call."""
    if isinstance(d, bool) or not isinstance(d, (torch.Tensor, int, float)):
        raise ArgumentError(f"extra[{name!r}] is {type(d).__name__}; pass float32 descales "
                            "(a tensor per page or batch and KV head, or a number)")
    if isinstance(d, torch.Tensor):
        if not d.is_floating_point():
            raise ArgumentError(f"extra[{name!r}] has dtype {d.dtype}; descales are float32 "
                                f"(use {name}.float())")
        if not d.is_cpu and not env_flag("ATTNHUB_DEBUG", False):
            return
        bad = int((~(d > 0) | ~torch.isfinite(d)).sum())
    else:
        bad = int(not (0 < d < math.inf))
    if bad:
        raise ArgumentError(f"extra[{name!r}] holds {bad} value(s) that are <= 0, NaN or inf; "
                            "a descale multiplies e4m3 values back to their scale (amax / "
                            "448 per page and KV head, as PagedKVCache.scales keeps them)")


def check_window(window: Any, causal: bool, prefix: bool = False) -> tuple[int, int] | None:
    """``window``: an int ``w`` (``(w, 0)`` if causal, else ``(w, w)``) or ``(left, right)``
    of ints >= -1, -1 meaning unbounded on that side. None where it bounds nothing: (-1, -1),
    or (-1, r >= 0) under causal without a prefix (prefix rows see keys right of the
    diagonal, which r still bounds)."""
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
    return bounding_window((left, right), causal, prefix)


def bounding_window(window: tuple[int, int] | None, causal: bool,
                    prefix: bool) -> tuple[int, int] | None:
    """``window``, or None where it bounds nothing: (-1, -1), or (-1, r >= 0) under causal
    without a prefix (prefix rows see keys right of the diagonal, which r still bounds)."""
    if window is None:
        return None
    left, right = window
    if left == -1 and (right == -1 or (causal and not prefix and right >= 0)):
        return None  # unbounded, or bounded only where causal masks anyway: no window
    return window


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
    check_plain(name, t)
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


def _shape_hint(layout: str) -> str:
    return {"bshd": "B,S,H,D", "bhsd": "B,H,S,D", "thd": "T,H,D",
            "paged": "q B,S,H,D; k/v pages,page_size,H,D"}[layout]
