"""Capabilities declared as data, and the generic check that turns them into reasons.

A backend states what it can do once, here; ``check`` compares a spec and a device with it
and returns every mismatch as a sentence, so ``explain`` never has to guess.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .device import DeviceInfo
from .spec import DTYPES, LAYOUTS, MASK_KINDS, PHASES, AttentionSpec

ALL_MASKS = frozenset(MASK_KINDS)
FLOAT_DTYPES = frozenset({"fp32", "fp16", "bf16"})
HALF_DTYPES = frozenset({"fp16", "bf16"})
#: Input classes an error budget may be stated on; the conformance kit builds each one and
#: judges the budget there (attnhub/conformance/budget.py, docs/plugins.md).
BUDGET_INPUTS = frozenset({"random", "local", "clustered"})


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend supports; the defaults claim no optional feature.

    Left out, a backend serves unmasked (``none``) dense forward attention in bshd/bhsd with
    equal Q and KV head counts, no LSE, no backward, no top-left causal and no determinism
    promise: every feature it has must be listed (docs/plugins.md has each field). Empty
    ``archs`` means any arch of the listed vendors.

    ``min_capability``/``max_capability`` bound the CUDA compute capability (inclusive).
    ``head_dims`` is either an explicit set or ``None`` with ``max_head_dim`` and
    ``head_dim_multiple`` as the rule. ``exact=False`` marks an approximate backend whose
    ``error_budget`` (relative RMSE against dense attention) must be declared, with the
    input class it holds on (``error_budget_inputs``, one of :data:`BUDGET_INPUTS`): a
    budget is only checkable, and only true, on the inputs it is stated for. With
    ``backward``, ``grad_error_budget`` bounds dq, dk and dv the same way (each against
    dense attention's, on the same inputs); left out, they are held to ``error_budget``.
    """

    vendors: frozenset[str] = frozenset({"cpu", "cuda", "rocm"})
    archs: frozenset[str] = frozenset()
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    dtypes: frozenset[str] = FLOAT_DTYPES
    kv_dtypes: frozenset[str] | None = None
    head_dims: frozenset[int] | None = None
    max_head_dim: int = 256
    head_dim_multiple: int = 1
    different_v_dim: bool = False
    masks: frozenset[str] = frozenset({"none"})
    phases: frozenset[str] = frozenset(PHASES)
    layouts: frozenset[str] = frozenset({"bshd", "bhsd"})
    backward: bool = False
    deterministic_backward: bool = False
    deterministic_forward: bool = False
    gqa: bool = False
    returns_lse: bool = False
    #: True when the LSE is (on some device) not the kernel's own but a second pass over
    #: materialised fp32 scores (torch SDPA on GPUs, the reference): fine for one call, not as
    #: the local kernel of a distributed backend, which needs the LSE of every block (the
    #: resolver refuses it there).
    lse_second_pass: bool = False
    top_left_causal: bool = False
    exact: bool = True
    error_budget: float | None = None
    error_budget_inputs: str = "random"
    max_query_len_decode: int | None = None
    page_size_multiple: int = 1
    #: Attention dropout (``dropout_p > 0``, training), drawn from torch's generator.
    dropout: bool = False
    #: Approximate with backward: relative RMSE each of dq, dk, dv stays within against
    #: dense attention's gradients, on the ``error_budget_inputs`` class (None: the forward
    #: ``error_budget``; last, so that positional declarations keep their meaning).
    grad_error_budget: float | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        bad = (set(self.dtypes) | set(self.kv_dtypes or ())) - set(DTYPES)
        bad |= set(self.masks) - ALL_MASKS
        bad |= set(self.phases) - set(PHASES)
        bad |= set(self.layouts) - set(LAYOUTS)
        if bad:
            raise ValueError(f"capabilities name unknown values: {sorted(bad)}")
        if not self.exact and self.error_budget is None:
            raise ValueError("an approximate backend (exact=False) must declare error_budget")

    @property
    def gradient_budget(self) -> float | None:
        """The budget the conformance kit holds dq, dk and dv to (None: exact backend)."""
        if self.exact:
            return None
        return self.error_budget if self.grad_error_budget is None else self.grad_error_budget

    @property
    def fp8(self) -> bool:
        return any(d.startswith("fp8") for d in self.dtypes | (self.kv_dtypes or frozenset()))

    def check(self, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """Every reason this backend cannot serve ``spec`` on ``device``; empty means it can."""
        r: list[str] = []
        r += self._check_device(device)
        if spec.dtype not in self.dtypes:
            r.append(f"dtype {spec.dtype} not supported (supports {_fmt(self.dtypes)})")
        kv_ok = self.kv_dtypes if self.kv_dtypes is not None else frozenset({spec.dtype})
        if spec.kv_dtype != spec.dtype and spec.kv_dtype not in kv_ok:
            r.append(f"kv dtype {spec.kv_dtype} not supported with {spec.dtype}")
        r += self._check_head_dim(spec)
        missing = spec.mask.kinds - self.masks - {"none"}
        if missing:
            r.append(f"mask {_fmt(missing)} not supported (supports {_fmt(self.masks)})")
        if spec.mask.causal and spec.mask.alignment == "top_left" and not self.top_left_causal:
            r.append("top-left causal alignment not supported (only bottom-right)")
        if spec.phase not in self.phases:
            r.append(f"phase {spec.phase} not supported (serves {_fmt(self.phases)})")
        if spec.layout not in self.layouts:
            r.append(f"layout {spec.layout} not supported (supports {_fmt(self.layouts)})")
        if (spec.layout == "paged" and spec.page_size
                and spec.page_size % self.page_size_multiple):
            r.append(f"page size {spec.page_size} not supported (must be a multiple of "
                     f"{self.page_size_multiple})")
        if spec.needs_grad and not self.backward:
            r.append("no backward pass (gradients requested)")
        if spec.deterministic and spec.needs_grad and not self.deterministic_backward:
            r.append("backward is not deterministic (deterministic requested)")
        if spec.deterministic and not self.deterministic_forward:
            r.append("forward is not deterministic (deterministic requested)")
        if spec.num_q_heads != spec.num_kv_heads and not self.gqa:
            r.append(f"GQA/MQA ({spec.num_q_heads}:{spec.num_kv_heads} heads) not supported")
        if spec.dropout and not self.dropout:
            r.append("no attention dropout (dropout_p > 0 requested)")
        if spec.return_lse and not self.returns_lse:
            r.append("cannot return LSE (return_lse requested)")
        if (spec.phase == "decode" and self.max_query_len_decode is not None
                and spec.max_seqlen_q > self.max_query_len_decode):
            r.append(f"decode with up to {spec.max_seqlen_q} query tokens per sequence (the "
                     f"call's length bucket) not supported (at most "
                     f"{self.max_query_len_decode})")
        return r

    def _check_device(self, device: DeviceInfo) -> list[str]:
        if device.vendor not in self.vendors:
            return [f"runs on {_fmt(self.vendors)}, this device is {device.vendor} ({device.arch})"]
        if self.archs and device.arch not in self.archs:
            return [f"needs arch {_fmt(self.archs)}, this device is {device.arch}"]
        cap = device.capability
        if cap is not None and self.min_capability and cap < self.min_capability:
            return [f"needs compute capability >= {_cc(self.min_capability)}, "
                    f"this device has {_cc(cap)}"]
        if cap is not None and self.max_capability and cap > self.max_capability:
            return [f"needs compute capability <= {_cc(self.max_capability)}, "
                    f"this device has {_cc(cap)}"]
        return []

    def _check_head_dim(self, spec: AttentionSpec) -> list[str]:
        r = []
        for label, d in (("head dim", spec.head_dim), ("value head dim", spec.head_dim_v)):
            if self.head_dims is not None:
                if d not in self.head_dims:
                    r.append(f"{label} {d} not supported (supports {_fmt(self.head_dims)})")
            elif d > self.max_head_dim or d % self.head_dim_multiple:
                mult = f", multiple of {self.head_dim_multiple}" if self.head_dim_multiple > 1 else ""
                r.append(f"{label} {d} not supported (at most {self.max_head_dim}{mult})")
        if spec.head_dim_v != spec.head_dim and not self.different_v_dim:
            r.append(f"value head dim {spec.head_dim_v} != {spec.head_dim} not supported")
        return r


_SETS = ("vendors", "archs", "dtypes", "masks", "phases", "layouts")
_NON_EMPTY = ("vendors", "dtypes", "phases", "layouts")
_VENDORS = frozenset({"cpu", "cuda", "rocm"})
_ARCH_RE = re.compile(r"(cpu|sm[0-9]{2,3}|gfx[0-9a-f]{3,4})\Z")
_BOOLS = ("different_v_dim", "backward", "deterministic_backward", "deterministic_forward",
          "gqa", "returns_lse", "top_left_causal", "exact", "dropout")


def _check_types(c: Capabilities) -> None:
    """Declarations are data a host trusts: wrong types fail here, at the plugin's import,
    not later inside ``backends`` or ``doctor``; so do values that make a backend serve
    nothing (no vendor, dtype or phase, an arch no device reports, a vendor typo) or that
    would compare wrongly (a NaN error budget, a head dim of 0, ``True`` as a count)."""
    bad: list[str] = []
    for name in _SETS + ("kv_dtypes", "head_dims"):
        v = getattr(c, name)
        if v is None and name in ("kv_dtypes", "head_dims"):
            continue
        if isinstance(v, (set, list, tuple)):
            v = frozenset(v)
            object.__setattr__(c, name, v)
        if name == "head_dims":
            if not isinstance(v, frozenset) or not v or not all(_count(x) for x in v):
                bad.append(f"head_dims must be a non-empty set of positive ints (got {v!r})")
        elif not isinstance(v, frozenset) or not all(isinstance(x, str) for x in v):
            bad.append(f"{name} must be a set of str (got {v!r})")
        elif not v and name in _NON_EMPTY:
            bad.append(f"{name} is empty: the backend would serve nothing (leave it out for "
                       "the default)")
    if isinstance(c.vendors, frozenset) and not c.vendors <= _VENDORS:
        bad.append(f"vendors must be among {_fmt(_VENDORS)} (got {_fmt(c.vendors - _VENDORS)})")
    if isinstance(c.archs, frozenset):
        odd = sorted(a for a in c.archs if isinstance(a, str) and not _ARCH_RE.match(a))
        if odd:
            bad.append(f"archs must be device archs such as sm90 or gfx942, lower case, as "
                       f"`attnhub doctor` shows them (got {', '.join(map(repr, odd))})")
    for name in _BOOLS:
        if not isinstance(getattr(c, name), bool):
            bad.append(f"{name} must be True or False (got {getattr(c, name)!r})")
    for name in ("max_head_dim", "head_dim_multiple", "page_size_multiple",
                 "max_query_len_decode"):
        v = getattr(c, name)
        if not (_count(v) or (v is None and name == "max_query_len_decode")):
            bad.append(f"{name} must be a positive int (got {v!r})")
    for name in ("min_capability", "max_capability"):
        v = getattr(c, name)
        if v is not None and not (isinstance(v, tuple) and len(v) == 2
                                  and all(_count(x, 0) for x in v)):
            bad.append(f"{name} must be a (major, minor) tuple of non-negative ints or None "
                       f"(got {v!r})")
    if not bad:
        bad += _contradictions(c)
    for name in ("error_budget", "grad_error_budget"):
        b = getattr(c, name)
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float))
                              or math.isnan(b) or b < 0):
            bad.append(f"{name} must be a non-negative number (math.inf: no bound) or None "
                       f"(got {b!r})")
    if c.grad_error_budget is not None and c.exact:
        bad.append("grad_error_budget is for approximate backends (exact=False): an exact "
                   "backend's gradients are held to the FlashAttention rule")
    if not isinstance(c.error_budget_inputs, str) or c.error_budget_inputs not in BUDGET_INPUTS:
        bad.append(f"error_budget_inputs must be one of {_fmt(BUDGET_INPUTS)} (got "
                   f"{c.error_budget_inputs!r})")
    if bad:
        raise TypeError("invalid Capabilities: " + "; ".join(bad))


def _contradictions(c: Capabilities) -> list[str]:
    """Well-typed declarations that still serve nothing: no call could pass them all."""
    bad = []
    lo, hi = c.min_capability, c.max_capability
    if lo is not None and hi is not None and lo > hi:
        bad.append(f"min_capability {_cc(lo)} is above max_capability {_cc(hi)}: no device "
                   "has both")
    if c.head_dims is None and c.head_dim_multiple > c.max_head_dim:
        bad.append(f"head_dim_multiple {c.head_dim_multiple} is above max_head_dim "
                   f"{c.max_head_dim}: no head dim is both")
    if c.archs:
        vendor = {a: "cpu" if a == "cpu" else "cuda" if a.startswith("sm") else "rocm"
                  for a in c.archs}
        if not set(vendor.values()) & c.vendors:
            bad.append(f"archs {_fmt(c.archs)} are of no vendor in {_fmt(c.vendors)}")
    if c.phases == {"train"} and not c.backward:
        bad.append("phases is only train but backward is False: a training call needs "
                   "gradients (declare backward=True, or add prefill/decode)")
    return bad


def _count(v: object, least: int = 1) -> bool:
    """An int of at least ``least``, and not a bool (``True`` is an int in Python)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _fmt(values: object) -> str:
    return ", ".join(str(v) for v in sorted(values))  # type: ignore[call-overload]


def _cc(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"
