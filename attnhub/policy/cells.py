"""The planning grid: (phase x dtype x mask kind) cells, each a representative spec, and the
training cells once more with attention dropout.

The linter checks that every cell has a backend on each target hardware, ``attnhub plan``
prints the grid per hardware, and ``attnhub lock`` freezes its bindings. FP8 is not in the
grid on purpose: it is opt-in behind an accuracy record, not something every cell must serve.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.spec import MASK_KINDS, PHASES, AttentionSpec, MaskSpec

CELL_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
#: Representative shape: Llama-8B-like heads, 4k context.
HEAD_DIM, Q_HEADS, KV_HEADS, SEQLEN, BATCH = 128, 32, 8, 4096, 4


@dataclass(frozen=True)
class Cell:
    phase: str
    dtype: str
    mask: str
    #: Training with attention dropout: only backends that draw it may serve.
    dropout: bool = False

    @property
    def label(self) -> str:
        return f"{self.phase_label} {self.dtype} {self.mask}"

    @property
    def phase_label(self) -> str:
        return f"{self.phase}+dropout" if self.dropout else self.phase

    def spec(self) -> AttentionSpec:
        return cell_spec(self.phase, self.dtype, self.mask, self.dropout)


def mask_from_kinds(kinds: list[str] | tuple[str, ...], window: int = 1024) -> MaskSpec:
    """A ``MaskSpec`` with the given kinds (``sliding_window`` gets ``(window, 0)``)."""
    unknown = set(kinds) - set(MASK_KINDS)
    if unknown:
        raise ValueError(f"unknown mask kind(s) {sorted(unknown)}; use {', '.join(MASK_KINDS)}")
    k = set(kinds) - {"none"}
    return MaskSpec(causal="causal" in k, window=(window, 0) if "sliding_window" in k else None,
                    alibi="alibi" in k, softcap="softcap" in k, prefix_lm="prefix_lm" in k,
                    document="document" in k, column_sparse="column_sparse" in k,
                    score_mod="score_mod" if "score_mod" in k else None,
                    mask_mod="mask_mod" if "mask_mod" in k else None)


def cell_spec(phase: str, dtype: str, mask: str, dropout: bool = False) -> AttentionSpec:
    """The representative spec of a cell (documents use the ``thd`` layout; prefix-LM is
    causal after the prefix, so that cell is ``prefix_lm`` + ``causal``)."""
    m = mask_from_kinds([mask, "causal"] if mask == "prefix_lm" else [mask])
    return AttentionSpec(
        phase=phase, dtype=dtype, head_dim=HEAD_DIM, num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS,
        layout="thd" if m.document else "bshd", mask=m,
        max_seqlen_q=1 if phase == "decode" else SEQLEN, max_seqlen_k=SEQLEN, batch=BATCH,
        needs_grad=phase == "train", dropout=dropout,
    ).bucketed()


def cells(phases: tuple[str, ...] = PHASES, dtypes: tuple[str, ...] = CELL_DTYPES,
          masks: tuple[str, ...] = MASK_KINDS) -> list[Cell]:
    """Every (phase, dtype, mask) cell, then the training cells again with attention dropout
    (a model trained with ``attention_dropout > 0`` asks for these)."""
    grid = [Cell(p, d, m) for p in phases for d in dtypes for m in masks]
    return grid + [Cell(c.phase, c.dtype, c.mask, True) for c in grid if c.phase == "train"]
