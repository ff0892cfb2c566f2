"""The policy file schema: pydantic v2 models that reject every unknown key.

One file is a :class:`PolicyFile`. Shorthands are normalised *before* validation so that
each field has exactly one shape and error messages stay plain: ``hardware: sm90`` is a list
of one, ``head_dim: 128`` is ``{in: [128]}``, ``use: [a, b]`` is ``{order: [a, b]}``,
``requires: {accuracy: true}`` is an accuracy requirement without metric bounds.
docs/policy.md documents every key.
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from typing import Annotated, Any, Callable, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      ValidationInfo, field_validator, model_validator)

from ..core.device import known_hardware, simulate
from ..core.registry import MAX_NAME as REGISTRY_MAX_NAME
from ..core.spec import DTYPES, LAYOUTS, MASK_KINDS, PHASES
from ..errors import HardwareError
from .located import show

PhaseName = Literal[PHASES]  # type: ignore[valid-type]
DtypeName = Literal[DTYPES]  # type: ignore[valid-type]
MaskKind = Literal[MASK_KINDS]  # type: ignore[valid-type]
LayoutName = Literal[tuple(x for x in LAYOUTS if x != "bhsd")]  # type: ignore[valid-type]
OnFailure = Literal["next", "error"]

VENDORS = ("cpu", "cuda", "rocm")
#: ``\Z``, not ``$`` (which also matches before a final newline: ``"cpu\n"`` loaded and never
#: matched), and ASCII digits only (``\d`` took ``sm٩٠``, Arabic-Indic digits, which no device
#: has).
_HARDWARE_RE = re.compile(r"(cpu|cuda|rocm|sm[0-9]{2,3}|gfx[0-9a-f]{3,4})\Z")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_RULE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")


def _listify(v: Any) -> Any:
    """A scalar where a list is expected becomes a list of one."""
    return v if isinstance(v, list) else [v]


def _hardware(v: Any) -> Any:
    if isinstance(v, str) and _HARDWARE_RE.match(v):
        return v
    raise ValueError(f"got {show(v)}, expected an arch ({', '.join(known_hardware())}, any "
                     f"smNN or gfxNNN) or a vendor ({', '.join(VENDORS)}){_hardware_hint(v)}")


def _hardware_hint(v: Any) -> str:
    """The fix for a ``when.hardware`` entry in another case or with spaces around it
    (conditions match names exactly, as phases, dtypes and backends do), or naming a device
    model (``h100``: its arch, or ``device_name`` for that model alone)."""
    if not isinstance(v, str) or len(v) > MAX_NAME:
        return ""
    name = v.strip().lower()
    if _HARDWARE_RE.match(name):
        return f"; conditions match names exactly: write {name!r}"
    if name and _unsimulable(name) is None:  # a model alias (targets take those)
        arch = simulate(name).arch
        return (f"; {v!r} is a device model: write {arch!r} (every {arch} device), or match "
                f"the model with device_name: '*{v.strip().upper()}*'")
    return ""


def _target(v: Any) -> Any:
    """A ``targets`` entry, as loaded: an arch, a vendor or a device alias (``h100``). Only
    ``plan`` and ``policy check`` read targets; whether each names a device they can
    simulate is theirs to check (:func:`target_problem`), so a policy that serves calls is
    never refused at run time for them. Case aside (``H200`` is the ``h200`` alias), the
    name is taken as written: ``simulate`` strips, so ``"cpu\\n"`` or ``" sm90 "`` loaded,
    and split every message that printed the target."""
    if isinstance(v, str) and len(v) <= MAX_NAME and (_HARDWARE_RE.match(v) or (
            v.isascii() and v == v.strip() and _unsimulable(v) is None)):
        return v
    if isinstance(v, str) and len(v) <= MAX_NAME and v != v.strip() and (
            _HARDWARE_RE.match(v.strip().lower()) or _unsimulable(v) is None):
        raise ValueError(f"got {show(v)}, expected a target name exactly: write "
                         f"{v.strip()!r} (no spaces or line breaks around it)")
    names = str(_unsimulable("")).split("; use ", 1)[-1]  # "one of ... (or an alias: ...)"
    raise ValueError(f"got {show(v)}, expected an arch, a vendor or a device: {names}")


def target_problem(v: str) -> str | None:
    """Why ``plan`` and ``policy check`` cannot plan for target ``v``, or None. A vendor
    (``cuda``) or an arch without a preset (``sm999``) holds in ``when.hardware`` but names
    no device to simulate."""
    if _unsimulable(v) is None:
        return None
    vendor = (" (a vendor names no one device: list its archs, e.g. sm80, sm90)"
              if v.strip().lower() in VENDORS else "")
    names = str(_unsimulable("")).split("; use ", 1)[-1]
    return f"got {show(v)}, expected a device to plan for{vendor}: {names}"


@functools.lru_cache(maxsize=256)
def _unsimulable(name: str) -> str | None:
    """Why ``simulate(name)`` refuses ``name`` (its message lists the names it takes), or
    None: the one source of the known devices and their aliases."""
    try:
        simulate(name)
    except HardwareError as exc:
        return str(exc)
    return None


#: Longer names are typos or generated garbage: refused before they fill every message (the
#: registry refuses longer backend names too).
MAX_NAME = REGISTRY_MAX_NAME
#: Longest ``device_name``/``model`` glob: no device or model name comes near it, and matching
#: grows with the pattern's square (24,000 ``[`` took tens of seconds per call).
MAX_GLOB = 256


def _at_most(limit: int, what: str, why: str) -> Callable[[Any], Any]:
    """A validator refusing text longer than ``limit`` (``what``: the expected value), said
    with its length and start, not echoed whole: every message would carry megabytes."""

    def check(v: Any) -> Any:
        if isinstance(v, str) and len(v) > limit:
            raise ValueError(f"got {len(v)} characters ({v[:20]!r}...), expected {what} of at "
                             f"most {limit} characters ({why})")
        return v

    return check


def _blank(v: str) -> bool:
    """Only spaces and invisible format characters (a zero-width space, a BOM): a name
    every message and record would show as nothing."""
    return not "".join(c for c in v if unicodedata.category(c) != "Cf").strip()


def _not_blank(what: str, expected: str) -> Callable[[Any], Any]:
    """A validator refusing text that is empty or only spaces, as ``got an empty {what}``."""

    def check(v: Any) -> Any:
        if isinstance(v, str) and _blank(v):
            raise ValueError(f"got an empty {what} ({v!r}), expected {expected}")
        return v

    return check


def _one_line(what: str) -> Callable[[Any], Any]:
    """A validator refusing text that is blank or holds a tab or line break: a name every
    message and record prints on one line (``name: "a\\nb"`` split each of them in two)."""

    def check(v: Any) -> Any:
        if isinstance(v, str) and (_blank(v) or any(c in v for c in "\t\n\r")):
            got = "an empty" if _blank(v) else "a tab or line break in the"
            raise ValueError(f"got {got} {what} {show(v)}, expected one line of printable "
                             "text")
        return v

    return check


def _name(v: Any, pattern: re.Pattern[str], what: str) -> Any:
    """``v`` when it is a name ``pattern`` allows; else why not, pointing at the character
    that is wrong (a Cyrillic 'а' in "triton" reads like the Latin one in every message)."""
    if isinstance(v, str) and len(v) <= MAX_NAME and pattern.match(v):
        return v
    if isinstance(v, str) and len(v) > MAX_NAME:
        raise ValueError(f"got a name of {len(v)} characters ({v[:20]!r}...), expected {what} "
                         f"of at most {MAX_NAME}")
    if isinstance(v, bool) or v is None:
        raise ValueError(f"got {v!r} (YAML reads unquoted yes/no/on/off/true/false as a flag "
                         f"and an empty value or ~ as null), expected {what} (quote it)")
    shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
    odd = next((i for i, c in enumerate(v) if not c.isascii() or c.isspace()), None) \
        if isinstance(v, str) else None
    if odd is None:
        raise ValueError(f"got {shown}, expected {what}")
    c = v[odd]
    raise ValueError(f"got {shown}, expected {what}: character {odd + 1} is U+{ord(c):04X} "
                     f"{unicodedata.name(c, 'a control character')}, not an ASCII letter or digit "
                     "(retype the name)")


def _identifier(v: Any) -> Any:
    return _name(v, _IDENT_RE, "a name made of ASCII letters, digits and _")


def _rule_name(v: Any) -> Any:
    return _name(v, _RULE_NAME_RE, "a rule name of ASCII letters, digits, '_', '-' and '.'")


def _number(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError(f"got {v!r}, expected a number")
    if isinstance(v, str) and _numeric(v):
        raise ValueError(_text_not_number(v))
    return v  # other text: pydantic says it is not a number


def _numeric(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


_INT_TEXT = re.compile(r"\s*[-+]?[0-9]+\s*\Z")
_EXPONENT_TEXT = re.compile(r"^([-+]?\d+)(\.\d+)?\.?[eE]([-+]?)(\d+)$")


def _text_not_number(v: str) -> str:
    """Pydantic's lax mode would read ``"1e3"`` or ``"128"`` (text) as a number, silently; and
    YAML 1.1 reads ``1e3`` (no dot, or no exponent sign) or ``08`` as text, so the fix is
    said."""
    x = float(v)
    if not math.isfinite(x):
        return f"got the text {show(v)}, expected a finite number"
    if len(v) > 60:  # thousands of digits: no rewrite of it is worth showing
        return f"got the text {show(v)}, expected a number (unquoted)"
    if _INT_TEXT.match(v):  # an integer stays one: through float, 17+ digits changed value
        n = int(v)
        if n.bit_length() > 64:
            return f"got the text {show(v)}, expected a number of at most 64 bits (unquoted)"
        return f"got the text {show(v)}, expected a number (write it unquoted as {n})"
    m = _EXPONENT_TEXT.match(v)
    if not m:
        return f"got the text {show(v)}, expected a number (write it unquoted as {_yaml_number(x)})"
    plain = f"{int(x)} or " if x.is_integer() and abs(x) < _LONGEST_INT else ""
    return (f"got the text {show(v)}, expected a number (YAML 1.1 reads an exponent without a "
            f"dot and a sign as text: write {plain}{m[1]}{m[2] or '.0'}e{m[3] or '+'}{m[4]})")


#: Integral values from here on are suggested in exponent form (``1e308`` written out was an
#: integer of 309 digits).
_LONGEST_INT = 1e16


def _yaml_number(x: float) -> str:
    """``x`` written so YAML 1.1 reads it back as a number, short: an integer of up to 16
    digits, else Python's shortest form with the dot and exponent sign YAML 1.1 needs."""
    if x.is_integer() and abs(x) < _LONGEST_INT:
        return str(int(x))
    mantissa, e, exponent = repr(x).partition("e")
    if not e:
        return mantissa
    sign = "" if exponent[0] in "+-" else "+"
    return f"{mantissa if '.' in mantissa else mantissa + '.0'}e{sign}{exponent}"


#: What pydantic's lax mode would read as a boolean besides true/false (``1``, ``"no"``...).
_BOOLISH = frozenset({"0", "1", "y", "n", "t", "f", "on", "off", "yes", "no", "true", "false"})


def _flag(v: Any) -> Any:
    if (isinstance(v, (int, float)) and not isinstance(v, bool)) or (
            isinstance(v, str) and v.lower() in _BOOLISH):
        raise ValueError(f"got {show(v)}, expected true or false (unquoted)")
    return v


Hardware = Annotated[str, BeforeValidator(_hardware)]
Target = Annotated[str, BeforeValidator(_target)]
Glob = Annotated[str, BeforeValidator(_at_most(MAX_GLOB, "a glob", "`*` matches any run"))]
VariantName = Annotated[str, BeforeValidator(_at_most(
    MAX_NAME, "a variant name", "plugins register identifiers of at most that"))]
PolicyName = Annotated[str, BeforeValidator(_at_most(
    MAX_NAME, "a policy name", "every decision record and message shows it")),
    BeforeValidator(_one_line("policy name"))]
Identifier = Annotated[str, BeforeValidator(_identifier)]
#: ``extends: ''`` was read as the policy's own folder ("Is a directory").
Extends = Annotated[str, BeforeValidator(_not_blank("extends", "a file path or a packaged "
                                                    "name such as `default`")),
                    BeforeValidator(_one_line("extends path"))]
RuleName = Annotated[str, BeforeValidator(_rule_name)]
#: Flags, counts and numbers are never coerced: pydantic's lax mode reads ``needs_grad: "no"``
#: or ``1`` as True, ``every: true`` as 1 and ``ge: true`` as 1.0, silently.
Flag = Annotated[bool, BeforeValidator(_flag)]
Count = Annotated[int, BeforeValidator(_number)]

#: Largest ``version``: the file's own number, a counter (3) or a date (20250131); past int32
#: it is a typo (17 digits were accepted and printed in every decision and lock).
MAX_VERSION = 2**31 - 1


def _version_range(v: int) -> int:
    """``version`` within 0..MAX_VERSION (-1 and 17 digits loaded, as any 64-bit int)."""
    if not 0 <= v <= MAX_VERSION:
        raise ValueError(f"got {show(v)}, expected a version from 0 to {MAX_VERSION} (a "
                         "counter such as 3, or a date such as 20250131)")
    return v


Version = Annotated[int, BeforeValidator(_number), AfterValidator(_version_range)]
Number = Annotated[float, BeforeValidator(_number)]


class Strict(BaseModel):
    """Base of every policy model: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Condition(Strict):
    """Base of the models whose keys narrow a match (``when``, ranges, layer selectors).

    A key written with no value (``hardware:``, ``~``, ``null``) read as "no condition": the
    rule matched every device, phase or length, the opposite of what was being written."""

    @field_validator("*", mode="before")
    @classmethod
    def _not_null(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            key = cls.model_fields[str(info.field_name)].alias or info.field_name
            raise ValueError(f"got no value (an empty value, ~ or null), expected a value for "
                             f"{key} (or remove the key: a condition left out matches "
                             "everything)")
        return v


class Range(Condition):
    """A numeric condition: ``in`` (one of these values) and/or bounds ge, gt, le, lt."""

    #: ``in`` only: the Python name ``in_`` is no key of the policy language
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=False)

    in_: list[Number] | None = Field(None, alias="in")
    ge: Number | None = None
    gt: Number | None = None
    le: Number | None = None
    lt: Number | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError(f"got {v!r}, expected a number, a list of numbers or a mapping "
                             "of ge/gt/le/lt bounds")
        if isinstance(v, (int, float)):
            return {"in": [v]}
        if isinstance(v, list):
            return {"in": v}
        if isinstance(v, str) and _numeric(v):
            raise ValueError(_text_not_number(v))
        return v

    @model_validator(mode="after")
    def _not_empty(self) -> "Range":
        if all(x is None for x in (self.in_, self.ge, self.gt, self.le, self.lt)):
            raise ValueError("got an empty range, expected at least one of in, ge, gt, le, lt")
        bad = [x for x in self.numbers() if not math.isfinite(x)]
        if bad:
            raise ValueError(f"got {bad[0]}, expected a finite number")
        return self

    def numbers(self) -> list[float]:
        """Every number written in the range (values and bounds)."""
        return [*(self.in_ or ()), *(x for x in (self.ge, self.gt, self.le, self.lt)
                                      if x is not None)]

    def below(self, minimum: float) -> float | None:
        """A number in this range smaller than ``minimum`` (``gt`` may be one less), else
        None: ``head_dim: -1`` or ``seqlen: {ge: -5}`` can only be a mistake."""
        for x in (*(self.in_ or ()), self.ge, self.le, self.lt):
            if x is not None and x < minimum:
                return x
        return self.gt if self.gt is not None and self.gt < minimum - 1 else None

    def empty(self) -> bool:
        """True when no number satisfies the range (``{ge: 8192, lt: 1024}``)."""
        if self.in_ is not None:
            return not any(self.contains(x) for x in self.in_)
        lo, hi = _lower(self), _upper(self)
        if lo[0] is None or hi[0] is None:
            return False
        return lo[0] > hi[0] or (lo[0] == hi[0] and (lo[1] or hi[1]))

    def contains(self, x: float) -> bool:
        return ((self.in_ is None or x in self.in_)
                and (self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
                and (self.le is None or x <= self.le) and (self.lt is None or x < self.lt))

    def within(self, other: "Range") -> bool:
        """True when every value this range admits is admitted by ``other`` (for the linter)."""
        if self.in_ is not None:
            return all(other.contains(x) for x in self.in_)
        if other.in_ is not None:
            return False
        return (_inside(_lower(self), _lower(other), 1)
                and _inside(_upper(self), _upper(other), -1))


Bound = tuple[float | None, bool]  # (value, open)


def _lower(r: Range) -> Bound:
    if r.gt is not None and (r.ge is None or r.gt >= r.ge):
        return r.gt, True
    return r.ge, False


def _upper(r: Range) -> Bound:
    if r.lt is not None and (r.le is None or r.lt <= r.le):
        return r.lt, True
    return r.le, False


def _inside(mine: Bound, theirs: Bound, sign: int) -> bool:
    """Is bound ``mine`` at least as tight as ``theirs`` (sign +1: lower, -1: upper)?"""
    if theirs[0] is None:
        return True
    if mine[0] is None:
        return False
    if mine[0] != theirs[0]:
        return sign * (mine[0] - theirs[0]) > 0
    return mine[1] or not theirs[1]


def _many(t: Any) -> Any:
    return Annotated[list[t], BeforeValidator(_listify), Field(min_length=1)]


class LayerSelector(Condition):
    """Which layers of a model: by index, every n-th (with offsets), or by layer kind."""

    index: Range | None = None
    every: Count | None = Field(None, ge=1)
    offset: _many(Annotated[Count, Field(ge=0)]) | None = None  # type: ignore[valid-type]
    kind: _many(Identifier) | None = None  # type: ignore[valid-type]

    @field_validator("index", mode="after")
    @classmethod
    def _index_not_negative(cls, v: Range | None) -> Range | None:
        bad = v.below(0) if v is not None else None
        if bad is not None:
            raise ValueError(f"got {bad:g}, expected layer indices >= 0")
        return v

    @model_validator(mode="after")
    def _offset_needs_every(self) -> "LayerSelector":
        if self.offset is not None and self.every is None:
            raise ValueError("got offset without every, expected `every: N` with `offset`")
        if self.index is None and self.every is None and self.kind is None:
            raise ValueError("got an empty layer selector, expected at least one of index, "
                             "every, kind (an empty one selects every layer, and would let "
                             "an approximate backend bind on all of them)")
        return self


class ProfileCondition(Condition):
    """Conditions on measurements in the profile store (see attnhub.policy.profile)."""

    attention_share: Range | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> "ProfileCondition":
        if self.attention_share is None:
            raise ValueError("got an empty profile condition, expected attention_share")
        return self


#: Smallest meaningful value of each numeric ``when`` key (a count or a length).
RANGE_MINIMUM: dict[str, float] = {
    "capability": 0, "head_dim": 1, "head_dim_v": 1, "num_q_heads": 1, "num_kv_heads": 1,
    "gqa_ratio": 1, "seqlen": 0, "seqlen_q": 0, "seqlen_k": 0, "batch": 0, "world_size": 1,
}


class When(Condition):
    """Conditions of a rule; all given keys must hold (an empty ``when`` matches everything)."""

    hardware: _many(Hardware) | None = None  # type: ignore[valid-type]
    capability: Range | None = None
    device_name: _many(Glob) | None = None  # type: ignore[valid-type]
    phase: _many(PhaseName) | None = None  # type: ignore[valid-type]
    dtype: _many(DtypeName) | None = None  # type: ignore[valid-type]
    kv_dtype: _many(DtypeName) | None = None  # type: ignore[valid-type]
    mask: _many(MaskKind) | None = None  # type: ignore[valid-type]
    mask_any: _many(MaskKind) | None = None  # type: ignore[valid-type]
    variant: _many(VariantName) | None = None  # type: ignore[valid-type]
    layout: _many(LayoutName) | None = None  # type: ignore[valid-type]
    head_dim: Range | None = None
    head_dim_v: Range | None = None
    num_q_heads: Range | None = None
    num_kv_heads: Range | None = None
    gqa_ratio: Range | None = None
    seqlen: Range | None = None
    seqlen_q: Range | None = None
    seqlen_k: Range | None = None
    batch: Range | None = None
    needs_grad: Flag | None = None
    deterministic: Flag | None = None
    return_lse: Flag | None = None
    dropout: Flag | None = None
    world_size: Range | None = None
    model: _many(Glob) | None = None  # type: ignore[valid-type]
    layer: LayerSelector | None = None
    profile: ProfileCondition | None = None

    @field_validator(*RANGE_MINIMUM, mode="after")
    @classmethod
    def _at_least(cls, v: Range | None, info: ValidationInfo) -> Range | None:
        low = RANGE_MINIMUM[str(info.field_name)]
        bad = v.below(low) if v is not None else None
        if bad is not None:
            raise ValueError(f"got {bad:g}, expected {info.field_name} values >= {low:g} "
                             "(it counts or measures something)")
        return v


class Use(Strict):
    """Candidates: ``order`` (first that can serve) or ``fastest`` (by measured speed)."""

    order: list[Identifier] | None = Field(None, min_length=1)
    fastest: list[Identifier] | None = Field(None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, str):
            return {"order": [v]}
        if isinstance(v, list):
            return {"order": v}
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> "Use":
        if (self.order is None) == (self.fastest is None):
            raise ValueError("got both or neither of order/fastest, expected a list of "
                             "backends or `{fastest: [backends]}`")
        return self

    @property
    def names(self) -> list[str]:
        return list(self.order or self.fastest or [])


def _error_bound(v: float) -> float:
    """A ``requires.accuracy.max`` bound: every metric a record holds is an error, never
    negative, so a bound below 0 refused every record and the backend never bound."""
    if v < 0:
        raise ValueError(f"got {v:g}, expected a bound >= 0 (accuracy metrics are errors, "
                         "never negative: no record could pass this gate)")
    return v


class AccuracyRequirement(Strict):
    """A passing accuracy record must exist for ``backends`` (default: every candidate of the
    rule); ``max`` bounds metrics of that record (e.g. ``{rel_error: 0.05}``)."""

    backends: _many(Identifier) | None = None  # type: ignore[valid-type]
    max: dict[str, Annotated[Number, Field(allow_inf_nan=False),
                             AfterValidator(_error_bound)]] = Field(default_factory=dict)

    def applies(self, backend: str) -> bool:
        return self.backends is None or backend in self.backends


def _accuracy(v: Any) -> Any:
    if v is True:
        return {}
    if v is False:
        return None
    return v


class Requires(Strict):
    accuracy: Annotated[AccuracyRequirement | None, BeforeValidator(_accuracy)] = None


class Rule(Strict):
    name: RuleName
    when: When = Field(default_factory=When)
    use: Use
    on_failure: OnFailure | None = None
    requires: Requires | None = None
    #: rule names (``before: ''`` read as no placement: the rule went first, silently)
    before: RuleName | None = None
    after: RuleName | None = None

    @model_validator(mode="after")
    def _one_placement(self) -> "Rule":
        if self.before is not None and self.after is not None:
            raise ValueError("got both before and after, expected at most one placement")
        return self


class Defaults(Strict):
    on_failure: OnFailure = "next"


class PolicyFile(Strict):
    """One YAML file. ``extends`` overlays it on another file (see docs/policy.md)."""

    name: PolicyName = Field(min_length=1)
    version: Version = 1
    description: str = ""
    extends: Extends | None = None
    targets: _many(Target) | None = None  # type: ignore[valid-type]
    defaults: Defaults = Field(default_factory=Defaults)
    remove: list[RuleName] = Field(default_factory=list)
    rules: list[Rule] = Field(default_factory=list)
