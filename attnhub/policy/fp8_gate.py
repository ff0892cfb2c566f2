"""What a passing accuracy record must also show before it opts a backend in (FP8).

``passed`` alone was trusted: a record measured by emulation (``fp8-check --emulate``: the
kernel never ran), one for another recipe than the backend now runs, one made by another
version of the plugin serving the backend (its kernel changed; the device key holds only the
libraries' versions), or one whose recorded error exceeds the backend's own error budget (a
loose ``--budget``, a hand edit) and, for an approximate backend, one that records no error
at all (``ProfileStore.record_accuracy(passed=True)`` without metrics) all bound FP8. The
reference text ``fp8-check`` writes carries the recipe, the plugin's version and whether it emulated;
``reference`` writes it and ``record_problems`` reads it back, so the two cannot drift.
"""

from __future__ import annotations

import math
import re
from typing import Any

EMULATED = "(FP8 emulated)"
#: The outlier inputs ``fp8-check`` plants; each kind's errors are recorded per magnitude.
OUTLIER_KINDS = ("q_channel", "k_bias")
#: Metrics ``fp8-check`` records, which ``requires.accuracy.max`` can bound (plus per outlier:
#: ``rel_error_q_channel_x20``, ...). A record lacking a bounded metric fails the gate, so a
#: misspelt name there turned the gate off for good, found only at run time (lint warns).
METRICS = ("rel_error", "max_error", "bf16_rel_error", "budget")
_PER_OUTLIER = re.compile(rf"(rel_error|max_error)_({'|'.join(OUTLIER_KINDS)})_x[0-9][0-9.e+-]*\Z")
_RECIPE = re.compile(r", recipe (\S+)(?:, by |$)")
_BY = re.compile(r", by (.+)$")


def known_metric(name: str) -> bool:
    """Whether ``fp8-check`` records metric ``name`` (a record of one's own may hold others)."""
    return name in METRICS or _PER_OUTLIER.match(name) is not None


def reference(emulated: bool, recipe: str, provider: str) -> str:
    """The ``reference`` text of an ``fp8-check`` record (``provider``: the plugin's
    distribution and version, ``Registry.provider_text``)."""
    return ("fp32" + (f" {EMULATED}" if emulated else "") + f", recipe {recipe}, by "
            f"{provider}")


def record_problems(rec: Any, backend: Any, provider: str) -> list[str]:
    """Why a passing record ``rec`` (an ``AccuracyRecord``) must not opt ``backend`` in
    (``provider``: who serves it now; a record without one, from an older attnhub or the
    API, is not judged on it)."""
    out = []
    if EMULATED in rec.reference:
        out.append(f"accuracy record ({rec.key}) was measured by emulation (fp8-check "
                   "--emulate), not by the kernel on this device; run attnhub fp8-check "
                   "here without --emulate")
    found = _RECIPE.search(rec.reference)
    runs = getattr(backend, "recipe", None)
    if found and isinstance(runs, str) and found.group(1) != runs:
        out.append(f"accuracy record ({rec.key}) checked recipe {found.group(1)}, but "
                   f"{backend.name} runs recipe {runs} (ATTNHUB_FP8_RECIPE); run attnhub "
                   f"fp8-check --recipe {runs}, or set ATTNHUB_FP8_RECIPE={found.group(1)}")
    by = _BY.search(rec.reference)
    if by and by.group(1) != provider:
        out.append(f"accuracy record ({rec.key}) was made with {by.group(1)}; {backend.name} "
                   f"is now served by {provider}, whose kernel it did not check; run "
                   "attnhub fp8-check again")
    err, cap = rec.metrics.get("rel_error"), backend.capabilities.error_budget
    if err is None and not backend.capabilities.exact:
        out.append(f"accuracy record ({rec.key}) says passed but records no rel_error: an "
                   f"approximate backend ({backend.name}, error budget {cap:g}) is opted in "
                   "only by a measured error within its budget; run attnhub fp8-check, or "
                   "pass metrics={'rel_error': ...} to ProfileStore.record_accuracy")
    elif err is not None and cap is not None and not (math.isfinite(err) and err <= cap):
        out.append(f"accuracy record ({rec.key}) has rel_error={err:g}, over {backend.name}'s "
                   f"error budget {cap:g} (recorded against budget "
                   f"{rec.metrics.get('budget', 'unknown')}); rerun attnhub fp8-check "
                   "without a looser --budget")
    return out


def passed_note(name: str, rec: Any) -> str:
    """What ``explain`` says when a record opts ``name`` in (never silently)."""
    err = rec.metrics.get("rel_error")
    return (f"{name}: opted in by a passing accuracy record ({rec.key}, against "
            f"{rec.reference or 'unknown'}, rel_error="
            f"{'unrecorded' if err is None else f'{err:g}'}, updated {rec.updated or '?'})")


def record_hint(name: str, spec: Any) -> str:
    """The command that writes the missing record (``attnhub bench`` was named, which writes
    none): ``fp8-check`` for an FP8 path (its shape flags give this bucket), else the API."""
    if "fp8" not in name and not spec.kv_dtype.startswith("fp8"):
        return "ProfileStore.record_accuracy"
    shape = (f"{spec.batch},{spec.max_seqlen_k},{spec.num_q_heads},{spec.num_kv_heads},"
             f"{spec.head_dim}")
    kv = (f" --kv --page-size {spec.page_size}" if spec.kv_dtype.startswith("fp8") else "")
    causal = " --causal" if spec.mask.causal else ""
    return f"`attnhub fp8-check{kv} --backend {name} --shape {shape}{causal}` on this device"
