"""Near-ties of a shipped profile pack, settled by timing them on the first call.

A pack is measured on one machine; backends it puts within a few percent of each other can
rank differently on another (on the H200, fa2_torch, torch_sdpa and triton_decode timed within
1% in one run and 8% apart in the next, on another host). So the hub times the tied
candidates once, on the call that binds them, with that call's own tensors, and binds the
fastest for the bucket. Never inside CUDA graph capture or a ``torch.compile`` trace (a sync
there is an error), never for a training call (its backward, which a forward timing cannot
see, is part of its cost), and never for a call that updates per-sequence state (each timed
run would advance it): those keep the pack's order, with a note saying why.
"""

from __future__ import annotations

from dataclasses import replace
import torch

from .core.backend import Backend
from .core.bounded import safe_str
from .core.outputs import (
    CONTROL_FLOW,
    autocast_on,
    call_inputs,
    check_output,
    check_result,
    grad_needed,
    shared_memory,
    watched_forward,
)
from .core.decision import Decision
from .core.seqstate import STATE_KEY
from .core.spec import AttentionSpec, AttnParams
from .errors import OutputContractError
from .timing import interleaved_ms

#: The timing: short, interleaved, batched (``interleaved_ms``): a few ms for decode calls.
WARMUP, REPEATS, BATCH_MS = 2, 7, 0.3


def blocker(q: torch.Tensor, spec: AttentionSpec,
            params: AttnParams | None = None) -> str | None:
    """Why this call cannot time its candidates (None: it can)."""
    if spec.needs_grad:
        return "a training call (its backward is part of its cost; a forward timing misses it)"
    if spec.dropout:  # each timed run would draw from the caller's generator
        return ("a dropout call (timing would draw from torch's generator many times, so one "
                "seed would no longer repeat the call's draw)")
    if params is not None and STATE_KEY in (params.extra or {}):
        # every timed forward would advance the sequences' recurrent state once more
        return "a call that updates per-sequence state (timing would run it many times)"
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "the first call came inside CUDA graph capture, where timing cannot sync"
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and compiler.is_compiling():
        return "the first call came inside a torch.compile trace"
    return None


def settle(d: Decision, backends: dict[str, Backend], q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, spec: AttentionSpec, params: AttnParams) -> Decision:
    """``d`` with its tied candidates timed on this call's tensors and the fastest bound
    (the others follow it as fallbacks where the rule has them); a candidate that raises is
    left out, with its reason in the notes."""
    if autocast_on(q.device.type):  # timed as the slow lane runs them: autocast off
        with torch.autocast(q.device.type, enabled=False):
            return settle(d, backends, q, k, v, spec, params)
    why = blocker(q, spec, params)
    if why is not None:
        return replace(d, tied=(), notes=(*d.notes, f"near-tie not timed: {why}; the "
                                          f"pack's order binds {d.backend}"))
    fns, failed = {}, []
    inputs = call_inputs(q, k, v, params)
    needs_grad = grad_needed(q, k, v)
    for name in d.tied:
        b = backends[name]
        # the first call: a compile or a refusal shows, and its result is held to the
        # output contract (a candidate that breaks it is never timed, nor bound)
        res, failure, written = watched_forward(b, q, k, v, spec, params.fresh(), inputs,
                                                vet=True)
        if written is not None:  # the caller's tensors changed: timing would repeat it
            raise written from failure
        if failure is None:
            try:
                out, lse = check_result(name, res)
                check_output(name, out, lse, q, v, spec.layout, params.return_lse,
                             needs_grad)
                failure = shared_memory(name, out, lse, inputs)
            except OutputContractError as exc:
                failure = exc
        if failure is not None:  # reported in the notes, never bound
            failed.append(f"{name} raised {type(failure).__name__}: "
                          f"{safe_str(failure)[:120]}")
            continue
        fns[name] = (lambda b=b, p=params.fresh(): b.forward(q, k, v, spec, p))
    if not fns:
        return replace(d, tied=(), notes=(*d.notes, "near-tie not timed: " + "; ".join(failed)))
    try:
        ms = interleaved_ms(fns, q.device, warmup=WARMUP, repeats=REPEATS, rounds=1,
                            batch_ms=BATCH_MS, batch_below_ms=BATCH_MS).ms
    except (KeyboardInterrupt, *CONTROL_FLOW):
        raise
    except BaseException as exc:  # noqa: BLE001 - a candidate failing on a later call: the
        # timing is an optimisation, so the pack's order binds (the call itself must not fail;
        # a kernel library's exit(), SystemExit, ended the host, and an exception whose str()
        # raises failed the call)
        return replace(d, tied=(), notes=(*d.notes, f"near-tie not timed: a candidate raised "
                                          f"{type(exc).__name__} while timed: "
                                          f"{safe_str(exc)[:120]}; the pack's order binds "
                                          f"{d.backend}"))
    winner = min(ms, key=ms.__getitem__)
    timed = ", ".join(f"{n} {ms[n] * 1e3:.1f} us" for n in sorted(ms, key=ms.__getitem__))
    note = (f"fastest (timed at bind time): {timed} on this machine's first call of the "
            f"bucket; the pack had {', '.join(d.tied)} within its tie margin")
    if failed:
        note += "; left out: " + "; ".join(failed)
    chain = [d.backend, *d.fallbacks]
    fallbacks = tuple(n for n in chain if n != winner) if d.fallbacks else ()
    return replace(d, backend=winner, fallbacks=fallbacks, tied=(), notes=(note, *d.notes))
