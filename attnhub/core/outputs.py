"""The result side of a backend call: what it returns and what it must leave as it was.

* :func:`check_result` / :func:`check_output` are the output contract every backend result
  meets before it is returned (metadata only); :func:`shared_memory` its memory checks (once
  per binding) and :func:`nan_violation` its debug-mode extension.
* :func:`watched_forward` runs a backend watching its inputs (:func:`call_inputs`,
  :func:`versions`): :func:`written_inputs` is the error for one that wrote into them.
* :func:`autocast_on` and :func:`grad_needed`: the call's modes a result is checked under.

``docs/contract.md`` is the same contract in prose.
"""

from __future__ import annotations

from typing import Any

import torch

from . import process_state
from .tables import _forget_tables
from ..errors import OutputContractError


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
    for what, t in (("out", out), ("lse", lse if return_lse else None)):
        if isinstance(t, torch.Tensor) and (t.layout is not torch.strided or t.is_nested):
            kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
            raise OutputContractError(f"backend {backend!r} returned {what} as a {kind} "
                                      "tensor; the contract is a dense strided tensor")
    if out.shape != want or out.dtype != q.dtype or out.device != q.device:
        raise OutputContractError(
            f"backend {backend!r} returned out {tuple(out.shape)} {out.dtype} on {out.device}; "
            f"the contract is {want} {q.dtype} on {q.device}")
    if out.__class__ is not torch.Tensor and out.__class__ is not q.__class__:
        raise OutputContractError(
            f"backend {backend!r} returned out as a {type(out).__name__} (a torch.Tensor "
            f"subclass); the contract is a plain tensor like q ({type(q).__name__})")
    if needs_grad and out.grad_fn is None:  # a leaf (requires_grad_() on a detached result)
        raise OutputContractError(  # is no more in the graph than a tensor without grad
            f"backend {backend!r} returned an output cut from the autograd graph for a call "
            "that needs gradients (no grad_fn): no gradient would reach q, k or v through it")
    if return_lse:
        lwant = (q.shape[1], q.shape[0]) if layout == "thd" else (
            q.shape[0], q.shape[2], q.shape[1])
        if (not isinstance(lse, torch.Tensor) or lse.shape != lwant
                or lse.dtype != torch.float32 or lse.device != q.device):
            got = (f"{tuple(lse.shape)} {lse.dtype} on {lse.device}"
                   if isinstance(lse, torch.Tensor) else repr(type(lse).__name__))
            raise OutputContractError(f"backend {backend!r} returned lse {got}; the contract "
                                      f"is {lwant} torch.float32 on {q.device}")
        if lse.__class__ is not torch.Tensor and lse.__class__ is not q.__class__:
            raise OutputContractError(  # as out: a subclass's __torch_function__ would run
                f"backend {backend!r} returned lse as a {type(lse).__name__} (a torch.Tensor "
                f"subclass); the contract is a plain tensor like q ({type(q).__name__})")


def shared_memory(backend: str, out: torch.Tensor, lse: Any,
                  inputs: dict[str, Any]) -> OutputContractError | None:
    """The memory checks of a result (once per binding: the slow path, settle, debug mode):
    ``out``/``lse`` must not share memory with an input (the caller's q, k, v, side tensors:
    writing the output would change them) nor with itself (a stride-0 dimension: one element
    seen at many places, which an in-place op on the output refuses or smears), nor with
    each other; under ``no_grad`` neither is in a graph, and outside
    ``torch.inference_mode`` neither is an inference tensor."""
    outside = None  # whether the caller runs outside inference_mode (read once, if needed)
    for what, t in (("out", out), ("lse", lse)):
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        if t.requires_grad and not torch.is_grad_enabled():
            # under no_grad nothing the caller passed can put it in a graph: the backend
            # turned grad mode on inside forward(), and the graph it built (with every
            # tensor it saved) lives as long as the result: a leak per decode step
            return OutputContractError(
                f"backend {backend!r} returned {what} in an autograd graph to a caller under "
                "torch.no_grad(); the contract is a tensor outside any graph there (a "
                "backend must not turn grad mode on around its kernel)")
        if t.is_inference():
            if outside is None:
                outside = not torch.is_inference_mode_enabled()
            if outside:  # a kernel run under inference_mode inside forward()
                return OutputContractError(
                    f"backend {backend!r} returned {what} as an inference tensor (made under "
                    "torch.inference_mode) to a caller outside inference_mode, which can "
                    "neither write it in place nor save it for backward (a trainable layer "
                    "after it fails); the contract is a normal tensor (run the kernel under "
                    "torch.no_grad(), or clone the result outside inference_mode)")
        if _self_overlapping(t):
            return OutputContractError(
                f"backend {backend!r} returned {what} with stride {tuple(t.stride())} for "
                f"shape {tuple(t.shape)}: elements share memory (an expanded tensor, or "
                "strides that overlap, so one write changes several elements); the contract "
                "is a tensor of its own (.contiguous() it)")
        ptr, span = _storage_ptr(t), _extent(t)
        if not ptr:
            continue
        shared = [name for name, x in inputs.items()
                  if isinstance(x, torch.Tensor) and x.numel() and x.device == t.device
                  and (_storage_ptr(x) == ptr or _overlap(span, _extent(x)))]
        if shared:
            return OutputContractError(
                f"backend {backend!r} returned {what} in the memory of its input "
                f"{' / '.join(shared)}; the contract is a new tensor (writing the output "
                "would change the caller's input)")
    if (isinstance(lse, torch.Tensor) and lse.numel() and out.numel()
            and lse.device == out.device and _overlap(_extent(out), _extent(lse))):
        # one workspace for both is fine, overlapping bytes are not: a write to the output
        # (an in-place residual add) would change the LSE the caller holds, or the reverse
        return OutputContractError(
            f"backend {backend!r} returned out and lse in overlapping memory; the contract "
            "is two tensors of their own (writing one would change the other)")
    return None


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may lie at one address: a stride-0 dimension, or, with
    the dimensions of more than one element ordered by stride, one whose stride is less
    than the span of those before it (every dense, permuted, sliced or padded view passes)."""
    span = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride < span:
            return True
        span = stride * size
    return False


def reused_output(backend: str, result: tuple[torch.Tensor, Any],
                  previous: tuple[torch.Tensor | None, Any]) -> OutputContractError | None:
    """A second call's output (or LSE) in the memory of the first call's, which the caller
    still holds (a static buffer, CUDA-graph style): the second call rewrote the first
    result."""
    for what, now, before in (("output", result[0], previous[0]), ("LSE", result[1],
                                                                   previous[1])):
        if (not isinstance(now, torch.Tensor) or not isinstance(before, torch.Tensor)
                or not before.numel() or before.device != now.device):
            continue
        ptr = _storage_ptr(now)
        if ptr and (_storage_ptr(before) == ptr or _overlap(_extent(now), _extent(before))):
            return OutputContractError(
                f"backend {backend!r} returned its {what} in the memory of its previous "
                f"call's {what}, which the caller still holds: that result was overwritten; "
                "the contract is a new tensor per call (clone a static buffer before "
                "returning it)")
    return None


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, past the last)`` a tensor's elements lie in. A fresh allocation
    never reaches into a live input's: overlap means the output is in the input's memory,
    even when it comes back as a storage object of its own (DLPack, ``from_numpy``, a raw
    pointer at an inner offset), which the storage comparison misses."""
    try:
        first = t.data_ptr()
    except Exception:  # no data pointer (a tensor subclass, a functional wrapper)
        return (0, 0)
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1)
    return (first, first + (last + 1) * t.element_size()) if first else (0, 0)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] != a[1] and b[0] != b[1]


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # no storage to compare (a tensor subclass, a functional wrapper)
        return 0


def call_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                params: Any) -> dict[str, Any]:
    """What a backend is handed and must leave as it is (the caller's tensors, the hub's
    checked copies of tables and offsets), by the names errors use."""
    named = {"q": q, "k": k, "v": v, "alibi_slopes": params.alibi_slopes,
             "prefix_lens": params.prefix_lens, "colmask_start": params.colmask_start,
             "colmask_end": params.colmask_end, "cu_seqlens_q": params.cu_seqlens_q,
             "cu_seqlens_k": params.cu_seqlens_k, "block_table": params.block_table,
             "seqlens_k": params.seqlens_k}
    for key, value in (params.extra or {}).items():  # FP8 descales: the cache's own scales
        if isinstance(value, torch.Tensor):
            named[f"extra[{key!r}]"] = value
    return named


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


def _control_flow() -> tuple[type[BaseException], ...]:
    """What torch raises through a backend's forward() to steer its own machinery, never a
    backend failure (no fallback, no count): non-reentrant activation checkpointing ends a
    recomputation early with ``_StopRecomputationError`` once it holds the tensors it needs,
    which is inside attention when the checkpointed region ends with it."""
    import torch.utils.checkpoint as checkpoint

    stop = getattr(checkpoint, "_StopRecomputationError", None)
    return (stop,) if isinstance(stop, type) and issubclass(stop, BaseException) else ()


#: Exceptions passed through the hub untouched (``except CONTROL_FLOW: raise``).
CONTROL_FLOW = _control_flow()


def watched_forward(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    spec: Any, params: Any, inputs: dict[str, Any], vet: bool = False
                    ) -> tuple[Any, Exception | None, OutputContractError | None]:
    """Load and run ``backend`` once, as the slow lane and settle's first calls do, watching
    ``inputs`` (:func:`call_inputs`): ``(result, failure, written)``, ``failure`` what it
    raised (None if nothing), ``written`` :func:`written_inputs`'s error when it wrote into
    an input (the caller then raises it, chained from ``failure``: never retried).

    torch's settings it changed (:data:`process_state.CALL_SETTINGS`) are put back and are
    its ``failure``. With ``vet`` (the call that admits a backend to the hot path, or debug
    mode) the inputs' bits are summed too: a write through ``.data`` or a raw pointer moves
    no version counter (one reduction per input; on a GPU, one host sync)."""
    watched = written_watch(inputs)
    before, sums, settings = versions(watched), bit_sums(watched) if vet else None, \
        process_state.call_snapshot()
    res = failure = None
    try:
        if not backend._loaded:
            backend.load()
        res = backend.forward(q, k, v, spec, params)
    except CONTROL_FLOW:
        process_state.call_restore(settings)
        raise
    except Exception as exc:  # noqa: BLE001 - handed to the caller, which decides
        failure = exc
    except (SystemExit, GeneratorExit) as exc:  # a plugin's kernel library calling exit():
        # its fault, as in check() and imports, not the host's end
        failure = RuntimeError(f"{type(exc).__name__}: {exc}")
    changed = process_state.call_restore(settings)
    if changed and failure is None:
        failure = OutputContractError(
            f"backend {getattr(backend, 'name', '?')!r} (plugin "
            f"{getattr(backend, 'plugin', '?')!r}) changed process-wide settings in forward(): "
            f"{'; '.join(changed)}; put back (a backend must leave torch's settings as it "
            "found them: use a context manager inside forward())")
    return res, failure, written_inputs(backend, before, watched, sums)


class _Pages:
    """The pages of a paged k/v cache that one call reads (those its sequences hold): the
    only part of the cache whose bits are summed for it."""

    def __init__(self, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor) -> None:
        self.cache, self.table, self.lens = cache, table, lens
        self.idx: torch.Tensor | None = None

    def bits(self) -> torch.Tensor:
        """The pages' contents; their indices found on first use only (a boolean index and
        ``unique`` wait on the device: the vetting call pays it, the others never)."""
        if self.idx is None:
            page = self.cache.shape[1]
            used = torch.arange(self.table.shape[1], device=self.table.device)[None, :] < (
                (self.lens.to(self.table.device, torch.int64) + page - 1) // page)[:, None]
            self.idx = self.table[used].long().unique().to(self.cache.device)
        return self.cache.index_select(0, self.idx)


def written_watch(inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs whose writes are watched. A paged call's k/v cache is shared state that
    another thread's step writes (its own slots) while this call runs: its version counter
    then moves, and a correct backend was blamed and distrusted (serving threads failed).
    So only the pages this call reads are watched, by their bits (``bit_sums``); the output
    must still not live in the cache (``shared_memory``)."""
    table, lens = inputs.get("block_table"), inputs.get("seqlens_k")
    if table is None or lens is None:
        return inputs
    out = {n: t for n, t in inputs.items() if n not in ("k", "v")}
    for n in ("k", "v"):
        if isinstance(inputs[n], torch.Tensor) and inputs[n].dim() == 4:
            out[n] = _Pages(inputs[n], table, lens)
    return out


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


def bit_sums(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each input tensor's elements read as integers of their width, summed (int64, on its
    device): :func:`written_inputs` compares them to find writes no version counter saw."""
    out: dict[str, torch.Tensor] = {}
    if torch.compiler.is_compiling():  # traced, not run: nothing to sum
        return out
    for name, t in inputs.items():
        if isinstance(t, _Pages):
            t = t.bits()
        if isinstance(t, torch.Tensor) and t.numel() and t.device.type != "meta":
            ints = _INT_OF_WIDTH.get(t.element_size())
            if ints is not None and not t.is_complex():
                out[name] = (t if t.dtype == ints else t.detach().view(ints)).sum(
                    dtype=torch.int64)
    return out


_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def written_inputs(backend: Any, before: dict[str, int], inputs: dict[str, Any],
                   sums: dict[str, torch.Tensor] | None = None) -> OutputContractError | None:
    """A backend that wrote into an input in place (its version counter moved): the caller's
    tensors (or the hub's checked copies of the tables) no longer hold what was passed, so
    no fallback can give the right answer and none is tried. The table memos are dropped
    (a copy a backend wrote into must not serve the next call)."""
    moved = [n for n, ver in before.items() if inputs[n]._version != ver]
    if sums and not moved:
        now = bit_sums({n: inputs[n] for n in sums})
        moved = [n for n, s in sums.items() if not torch.equal(now[n], s)]
    if not moved:
        return None
    _forget_tables()
    name, plugin = getattr(backend, "name", "?"), getattr(backend, "plugin", "?")
    return OutputContractError(
        f"backend {name!r} (plugin {plugin!r}) wrote into its input {', '.join(moved)} in "
        "place; those tensors no longer hold the values passed, so no fallback is tried. A "
        "backend must leave its inputs as they are: report it to the plugin's authors and "
        f"keep {name!r} out of the policy (or ATTNHUB_PLUGINS=-{plugin}) until it is fixed")


def nan_violation(backend: str, out: torch.Tensor, lse: Any, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor) -> OutputContractError | None:
    """Debug mode: NaN in the output or the LSE when no input held NaN (a host sync per
    call; a fully masked row's LSE is -inf, never NaN)."""
    found = [what for what, t in (("output", out), ("LSE", lse))
             if isinstance(t, torch.Tensor) and bool(torch.isnan(t).any())]
    if found and not any(
            t.dtype.itemsize > 1 and bool(torch.isnan(t).any()) for t in (q, k, v)):
        return OutputContractError(f"backend {backend!r} returned NaN in its "
                                   f"{' and '.join(found)} from inputs without NaN (found by "
                                   "ATTNHUB_DEBUG=1 / Hub(debug=True))")
    return None
