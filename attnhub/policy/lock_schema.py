"""The lockfile's schema, so that a hand-edited lock fails with ``file:line:col`` and the fix.

JSON is YAML, so the located YAML reader gives every value a position; pydantic (strict: a
string is not a number here) checks the shape and types.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, \
    ValidationError, ValidationInfo, field_validator, model_validator

from ..core.decision import BindContext
from ..core.device import simulate
from ..core.spec import DTYPES, LAYOUTS, PHASES
from ..errors import ArgumentError
from .located import Located, pydantic_problems, read_yaml


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class LockPolicy(_Model):
    name: StrictStr
    files: list[StrictStr]
    digest: StrictStr


class LockProvider(_Model):
    plugin: StrictStr
    distribution: StrictStr | None
    version: StrictStr | None


class LockMask(_Model):
    causal: StrictBool = False
    alignment: Literal["bottom_right", "top_left"] = "bottom_right"
    window: list[StrictInt] | None = Field(None, min_length=2, max_length=2)
    alibi: StrictBool = False
    softcap: StrictBool = False
    prefix_lm: StrictBool = False
    document: StrictBool = False
    column_sparse: StrictBool = False
    score_mod: StrictStr | None = None
    mask_mod: StrictStr | None = None


class LockSpec(_Model):
    phase: Literal[PHASES]  # type: ignore[valid-type]
    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    kv_dtype: Literal[DTYPES]  # type: ignore[valid-type]
    head_dim: StrictInt = Field(ge=1)
    head_dim_v: StrictInt = Field(ge=1)
    num_q_heads: StrictInt = Field(ge=1)
    num_kv_heads: StrictInt = Field(ge=1)
    layout: Literal[LAYOUTS]  # type: ignore[valid-type]
    mask: LockMask
    max_seqlen_q: StrictInt = Field(ge=0)
    max_seqlen_k: StrictInt = Field(ge=0)
    batch: StrictInt = Field(ge=0)
    needs_grad: StrictBool
    deterministic: StrictBool
    return_lse: StrictBool
    page_size: StrictInt = Field(0, ge=0)
    dropout: StrictBool = False


class LockContext(_Model):
    model: StrictStr | None
    layer: StrictInt | None = Field(ge=0)
    layer_kind: StrictStr
    world_size: StrictInt = Field(ge=1)

    @model_validator(mode="after")
    def _a_context(self) -> "LockContext":
        """What ``BindContext`` refuses (``layer_kind: ""``) must fail here, located, not
        unlocated from ``lock --check`` as it rebuilds the context."""
        try:
            BindContext(model=self.model, layer=self.layer, layer_kind=self.layer_kind,
                        world_size=self.world_size)
        except ArgumentError as exc:
            raise ValueError(f"got {str(exc).removeprefix('BindContext: ')}") from None
        return self


class LockBinding(_Model):
    simulated: StrictBool  # first: the hardware check reads it
    hardware: StrictStr
    spec: LockSpec
    context: LockContext
    backend: StrictStr | None
    rule: StrictStr | None
    fallbacks: list[StrictStr]
    inner: StrictStr | None

    @field_validator("hardware")
    @classmethod
    def _known(cls, v: str, info: ValidationInfo) -> str:
        """A simulated binding is resolved again on ``simulate(hardware)``: a name it does not
        know must fail here, located, not as a traceback in ``lock --check``."""
        if info.data.get("simulated"):
            try:
                simulate(v)
            except ValueError as exc:
                raise ValueError(f"got {v!r}, expected a known hardware name ({exc})") from None
        return v


class LockFile(_Model):
    schema_: StrictStr = Field(alias="schema")
    policy: LockPolicy
    versions: dict[StrictStr, StrictStr]
    plugins: dict[StrictStr, StrictStr]
    providers: dict[StrictStr, LockProvider]
    bindings: list[LockBinding]


def validate_lock(data: Any, text: str, file: str) -> list[str]:
    """Every located problem of a parsed lock document (empty: it is valid)."""
    from .lock import SCHEMA

    if not isinstance(data, dict):
        return [f"{file}:1:1 (document): got {type(data).__name__}, expected the JSON object "
                f"`attnhub lock` writes; regenerate it with `attnhub lock -o {file}`"]
    if data.get("schema") != SCHEMA:
        where = _located(data, text, file).where(("schema",))
        return [f"{where} schema: got {data.get('schema')!r}, expected "
                f"{SCHEMA!r} (written by another attnhub version, or not a lockfile); "
                f"regenerate it with `attnhub lock -o {file}`"]
    try:
        LockFile.model_validate(data)
    except ValidationError as exc:
        doc = _located(data, text, file)
        return [f"{p}; fix the value or regenerate the lock with `attnhub lock -o {file}`"
                for p in pydantic_problems(exc.errors(), doc, LockFile)]
    return []


def _located(data: Any, text: str, file: str) -> Located:
    """Positions for the error messages (read only when something is wrong)."""
    doc, problems = read_yaml(text, file)
    return doc if not problems and doc.data is not None else Located(file, data)
