"""Which implementation runs a gated-linear-attention call: our Triton kernels, fla's, or torch.

* ``ATTNHUB_LINEAR_IMPL=triton|fla|torch`` forces one (an error if it cannot run here).
* On the CPU: the torch forms (the Triton interpreter runs ours only when forced with
  ``ATTNHUB_LINEAR_IMPL=triton`` and ``TRITON_INTERPRET=1``: a test tool, slow).
* On a GPU: our Triton kernels, unless fla (``pip install attnhub-hybrid-linear[fla]``) is
  installed, in which case the first call of each shape bucket runs both on the call's own
  inputs, checks that they agree (relative RMSE <= 1e-2) and keeps the faster. A disagreement
  keeps ours and logs a warning. Deterministic requests never use fla (its backward may use
  atomics). Every choice is logged and readable from :data:`CHOICES`.

Operations (all (B, T, H, D), k/v/g expanded to the query heads, fp32 states):
``chunked`` (train/prefill, autograd), ``recurrent`` (decode, no autograd), ``state_after``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from types import ModuleType

import torch

from . import linear_torch
from .metrics import rel_rmse

log = logging.getLogger("attnhub.hybrid_linear")

IMPLS = ("triton", "fla", "torch")
#: (op, device, dtype, K, V, T bucket) -> chosen implementation, with the measured times.
CHOICES: dict[tuple, dict[str, object]] = {}
_lock = threading.Lock()


def _bucket(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def _triton_module() -> ModuleType:
    return importlib.import_module(".linear_triton", __package__)


def _fla_ops() -> tuple[Callable, Callable]:
    from fla.ops.gla import chunk_gla, fused_recurrent_gla

    return chunk_gla, fused_recurrent_gla


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _forced(device: torch.device) -> str | None:
    impl = os.environ.get("ATTNHUB_LINEAR_IMPL") or None
    if impl is None:
        return None
    if impl not in IMPLS:
        raise ValueError(f"ATTNHUB_LINEAR_IMPL={impl!r}; use one of {', '.join(IMPLS)} "
                         "or unset it for the automatic choice")
    if impl == "fla" and not fla_installed():
        raise RuntimeError("ATTNHUB_LINEAR_IMPL=fla but fla is not installed "
                           "(pip install 'attnhub-hybrid-linear[fla]')")
    if impl != "torch" and device.type == "cpu" and not _interpreted():
        raise RuntimeError(f"ATTNHUB_LINEAR_IMPL={impl} needs a GPU, or TRITON_INTERPRET=1 on "
                           "the CPU; unset it to use the torch forms here")
    return impl


# -- the three implementations behind one signature ------------------------------------------
def _run(impl: str, op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
         scale: float, h0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if impl != "torch":  # kernels index raw memory: no broadcast views
        q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    if impl == "torch":
        fn = linear_torch.chunked if op == "chunked" else linear_torch.recurrent
        return fn(q, k, v, g, scale, h0)
    if impl == "triton":
        tt = _triton_module()
        if op == "chunked":
            return tt.chunked(q, k, v, g, scale, h0, True)
        return tt.recurrent(q, k, v, g, scale, h0)
    chunk_gla, fused_recurrent_gla = _fla_ops()
    h0f = h0.float().contiguous() if h0 is not None else None
    if op == "chunked":
        return chunk_gla(q, k, v, g.float(), scale=scale, initial_state=h0f,
                         output_final_state=True)
    return fused_recurrent_gla(q, k, v, gk=g.float(), scale=scale, initial_state=h0f,
                               output_final_state=True)


def _time_ms(fn: Callable[[], object], reps: int = 3) -> float:
    fn()  # compile / warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _probe(key: tuple, op: str, args: tuple) -> str:
    """Time ours and fla's on this call's inputs; keep fla only if it agrees and is faster."""
    with torch.no_grad():
        ours = _run("triton", op, *args)[0]
        try:
            theirs = _run("fla", op, *args)[0]
        except Exception as exc:  # fla present but broken for this shape: say so, use ours
            log.warning("hybrid_linear: fla %s failed (%s: %s); using our Triton kernels",
                        op, type(exc).__name__, exc)
            CHOICES[key] = {"impl": "triton", "reason": f"fla raised {type(exc).__name__}"}
            return "triton"
        err = rel_rmse(theirs, ours)
        if err > 1e-2:
            log.warning("hybrid_linear: fla %s disagrees with ours (relative RMSE %.2e); "
                        "using our Triton kernels", op, err)
            CHOICES[key] = {"impl": "triton", "reason": f"fla disagrees (rel RMSE {err:.2e})"}
            return "triton"
        t_ours = _time_ms(lambda: _run("triton", op, *args))
        t_fla = _time_ms(lambda: _run("fla", op, *args))
    impl = "fla" if t_fla < t_ours else "triton"
    CHOICES[key] = {"impl": impl, "triton_ms": t_ours, "fla_ms": t_fla, "rel_rmse": err}
    log.info("hybrid_linear: %s %s -> %s (triton %.3f ms, fla %.3f ms)", op, key, impl, t_ours,
             t_fla)
    return impl


def choose(op: str, q: torch.Tensor, v: torch.Tensor, deterministic: bool,
           args: tuple) -> str:
    """The implementation for this call (see the module docstring for the rules)."""
    forced = _forced(q.device)
    if forced is not None:
        return forced
    if q.device.type != "cuda":
        return "torch"
    if deterministic or not fla_installed():
        return "triton"
    key = (op, str(q.device), str(q.dtype), q.shape[-1], v.shape[-1], _bucket(q.shape[1]))
    hit = CHOICES.get(key)
    if hit is not None:
        return str(hit["impl"])
    with _lock:
        hit = CHOICES.get(key)
        return str(hit["impl"]) if hit is not None else _probe(key, op, args)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
            h0: torch.Tensor | None = None, deterministic: bool = False,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked GLA (train/prefill), differentiable in q, k, v, g: (o, final state)."""
    args = (q, k, v, g, scale, h0)
    probe_args = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args)
    impl = choose("chunked", q, v, deterministic, probe_args)
    return _run(impl, "chunked", *args)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
              h0: torch.Tensor | None = None,
              deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token GLA (decode): (o, final state)."""
    args = (q, k, v, g, scale, h0)
    impl = choose("recurrent", q, v, deterministic, args)
    o, final = _run(impl, "recurrent", *args)
    assert final is not None
    return o, final


def state_after(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                h0: torch.Tensor | None = None) -> torch.Tensor:
    """The state a prefix leaves (the scan alone): our kernel on a GPU (fla has no scan-only
    op), torch on the CPU unless Triton is forced."""
    impl = _forced(k.device) or ("triton" if k.device.type == "cuda" else "torch")
    if impl == "torch":
        return linear_torch.state_after(k, v, g, h0)
    return _triton_module().state_after(k.contiguous(), v.contiguous(), g, h0)
