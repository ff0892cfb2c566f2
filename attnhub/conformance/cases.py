"""The conformance grid: the cases a backend's declared capabilities commit it to.

Every case is small (a few sequences of at most ~40 tokens) so that the whole grid runs on a
CPU (Triton under ``TRITON_INTERPRET=1``) in seconds to minutes, and on a GPU in seconds.
A case is one call; a *feature* (``mask softcap``, ``layout paged page=16``) groups the
cases that exercise it, and the report gives each feature its worst outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..core.capabilities import BUDGET_INPUTS, Capabilities

#: Head dims tried when a backend declares a rule (max/multiple) rather than a set.
HEAD_DIM_BUCKETS = (16, 32, 64, 128, 256)
#: Page sizes tried for the paged layout (each rounded up to the declared multiple).
PAGE_SIZES = (1, 16, 64)
SOFTCAP = 2.0  # small, with scaled-up inputs, so that a backend ignoring it is far off
#: Softmax scale, times 1/sqrt(head_dim): not 1, so that a backend using the default is off.
SCALE = 1.5


def relative_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """The kit's score_mod: a relative-position bias (FlexAttention signature)."""
    return score + 0.25 * (q_idx - kv_idx).clamp(-4, 4)


def skip_every_third(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """The kit's mask_mod: drops keys where (q + kv) % 3 == 0 (never a whole row)."""
    return (q_idx + kv_idx) % 3 != 0


@dataclass(frozen=True)
class Case:
    """One call of the grid. Lengths are per sequence: ``seqlens_q[i]`` queries attend to
    ``seqlens_k[i]`` keys (equal lengths for bshd)."""

    feature: str
    dtype: str = "fp32"
    head_dim: int = 32
    head_dim_v: int | None = None
    heads: tuple[int, int] = (4, 2)
    layout: str = "bshd"
    phase: str = "prefill"
    seqlens_q: tuple[int, ...] = (9, 9)
    seqlens_k: tuple[int, ...] = (9, 9)
    page_size: int = 0
    causal: bool = False
    alignment: str = "bottom_right"
    window: tuple[int, int] | None = None
    softcap: float | None = None
    alibi: bool = False
    #: ALiBi slopes of shape (B, Hq), one set per sequence, instead of (Hq,)
    alibi_per_batch: bool = False
    prefix_lm: bool = False
    column_sparse: bool = False
    score_mod: bool = False
    mask_mod: bool = False
    return_lse: bool = False
    backward: bool = False
    deterministic: bool = False
    repeat: bool = False  # run twice, outputs (and gradients) must be bitwise equal
    #: q/k/v as views whose head dim has stride 2 (every other element of wider tensors):
    #: the API passes such views on, and a kernel reading the head dim as dense is wrong
    strided: bool = False
    #: Attention dropout: judged by its law (``kit._judge_dropout``), not against values.
    dropout_p: float = 0.0
    #: An approximate backend's error budget, judged on inputs of this class
    #: (``conformance.budget``: random, local, clustered); "" for every other case.
    budget_inputs: str = ""
    #: ``local`` inputs: how peaked the scores are (0: the kit tunes it to the budget).
    sharpness: float = 0.0
    #: ``local`` inputs: one key's value 20x the others (dropped mass on a large value).
    heavy_value: bool = False
    #: A budget case's grid base: declining the budget case while serving this one is a
    #: failure (the budget would go unjudged), not a skip.
    basis: Case | None = None
    seed: int = 0
    #: A declaration the kit finds inconsistent by itself (reported as a failure).
    notes: tuple[str, ...] = field(default=())
    #: A declared feature the kit cannot exercise (reported as skipped, with this reason).
    untested: str = ""

    def describe(self) -> str:
        bits = [self.phase, self.dtype, f"d={self.head_dim}", f"heads={self.heads[0]}:"
                f"{self.heads[1]}", self.layout + (f"/{self.page_size}" if self.page_size else ""),
                f"sq={list(self.seqlens_q)}", f"sk={list(self.seqlens_k)}"]
        for flag in ("causal", "alibi", "alibi_per_batch", "prefix_lm", "column_sparse",
                     "score_mod", "mask_mod", "return_lse", "backward", "deterministic",
                     "repeat", "strided"):
            if getattr(self, flag):
                bits.append(flag)
        if self.causal and self.alignment != "bottom_right":
            bits.append(self.alignment)
        if self.window is not None:
            bits.append(f"window={self.window}")
        if self.softcap:
            bits.append(f"softcap={self.softcap:g}")
        if self.dropout_p:
            bits.append(f"dropout={self.dropout_p:g}")
        if self.budget_inputs:
            bits.append(f"{self.budget_inputs} inputs" + (" heavy value" * self.heavy_value)
                        + f" seed={self.seed}")
        return " ".join(bits)


#: Masks tried, in order, for the base case: a backend that cannot serve an unmasked call
#: (a causal recurrence, a window-only kernel) is tested on the first mask it accepts.
BASE_MASKS: tuple[dict[str, Any], ...] = (
    {}, {"causal": True}, {"causal": True, "window": (3, 0)}, {"window": (3, 3)})


def base_masks(caps: Capabilities) -> list[dict[str, Any]]:
    """The base masks of :data:`BASE_MASKS` that ``caps`` declares."""
    out = []
    for m in BASE_MASKS:
        if m.get("causal") and "causal" not in caps.masks:
            continue
        if m.get("window") and "sliding_window" not in caps.masks:
            continue
        out.append(m)
    return out


def grid(caps: Capabilities, quick: bool = False,
         base_mask: dict[str, Any] | None = None) -> list[Case]:
    """Every case ``caps`` declares, from a base case the backend must serve (its first
    phase and layout, its widest dtype, equal or grouped heads as declared, ``base_mask``
    on every case that does not set a mask of its own)."""
    base = replace(_base(caps), **(base_mask or {}))
    out: list[Case] = [replace(base, feature="basic")]
    out += _dtypes(base, caps, quick)
    out += _head_dims(base, caps, quick)
    masks = _masks(base, caps, quick)
    out += masks + _under_masks(masks, caps)
    out += _layouts(base, caps, quick)
    out += _phases(base, caps)
    out += _shapes(base, caps, quick)
    out += _results(base, caps)
    out += _budget(base, caps)
    for kv in sorted((caps.kv_dtypes or frozenset()) - caps.dtypes):
        out.append(replace(base, feature=f"kv dtype {kv}", untested=(
            f"the kit does not build {kv} caches; check accuracy with `attnhub fp8-check`")))
    return out


def _base(caps: Capabilities) -> Case:
    dtype = next((d for d in ("fp32", "bf16", "fp16") if d in caps.dtypes), "fp32")
    phase = "prefill" if "prefill" in caps.phases else sorted(caps.phases)[0]
    layout = next((x for x in ("bshd", "thd", "paged") if x in caps.layouts), "bshd")
    hd = 32 if _head_dim_ok(caps, 32) else _head_dims_declared(caps)[0]
    heads = (4, 2) if caps.gqa else (2, 2)
    base = Case(feature="basic", dtype=dtype, phase=phase, layout=layout, head_dim=hd,
                heads=heads)
    return _fit(base, caps)


def _fit(c: Case, caps: Capabilities) -> Case:
    """Adjust lengths to the phase and layout (decode: few queries; varlen: ragged)."""
    if c.phase == "decode":
        if max(c.seqlens_q) > (caps.max_query_len_decode or 16) or c.seqlens_q == (9, 9):
            c = replace(c, seqlens_q=(1,) * len(c.seqlens_q))
        if c.layout == "bshd" and c.seqlens_k == (9, 9):
            c = replace(c, seqlens_k=(37, 37))
    if c.layout == "thd" and len(set(c.seqlens_q)) == 1 and c.phase != "decode":
        c = replace(c, seqlens_q=(9, 1, 14), seqlens_k=(9, 1, 14))
    if c.layout == "paged":
        ps = c.page_size or _page_sizes(caps, True)[0]
        c = replace(c, page_size=ps, seqlens_k=(37, 2 * ps + 3)[: len(c.seqlens_q)])
    return c


def _head_dim_ok(caps: Capabilities, d: int) -> bool:
    if caps.head_dims is not None:
        return d in caps.head_dims
    return d <= caps.max_head_dim and d % caps.head_dim_multiple == 0


def _head_dims_declared(caps: Capabilities) -> list[int]:
    if caps.head_dims is not None:
        return sorted(caps.head_dims)
    dims = [d for d in HEAD_DIM_BUCKETS if _head_dim_ok(caps, d)]
    return dims or [caps.head_dim_multiple]


def _page_sizes(caps: Capabilities, quick: bool) -> list[int]:
    m = caps.page_size_multiple
    sizes = sorted({-(-p // m) * m for p in PAGE_SIZES})
    return sizes[1:2] or sizes[:1] if quick else sizes


def _dtypes(base: Case, caps: Capabilities, quick: bool) -> list[Case]:
    return [replace(base, feature=f"dtype {d}", dtype=d, causal="causal" in caps.masks)
            for d in sorted(caps.dtypes & {"fp32", "fp16", "bf16"}) if d != base.dtype]


def _head_dims(base: Case, caps: Capabilities, quick: bool) -> list[Case]:
    dims = _head_dims_declared(caps)
    if quick:
        dims = sorted({dims[0], dims[-1]} - {base.head_dim})
    out = [replace(base, feature=f"head_dim {d}", head_dim=d) for d in dims
           if d != base.head_dim]
    if caps.different_v_dim:
        dv = next((d for d in dims if d != base.head_dim), base.head_dim // 2 or 1)
        out.append(replace(base, feature="head_dim_v != head_dim", head_dim_v=dv))
    return out


def _masks(base: Case, caps: Capabilities, quick: bool) -> list[Case]:
    m = caps.masks
    out: list[Case] = []
    causal = "causal" in m
    if causal:
        out.append(replace(base, feature="mask causal", causal=True))
        aligns = ("bottom_right", "top_left") if caps.top_left_causal else ("bottom_right",)
        for al in aligns:
            out += _misaligned(base, caps, f"mask causal {al} (Sq != Sk)", al)
    if "sliding_window" in m:
        out.append(replace(base, feature="mask sliding_window", window=(3, 0), causal=causal))
        if base.phase != "decode":  # non-causal: each edge is checked on its own
            out.append(replace(base, feature="mask sliding_window", window=(2, 2)))
            out.append(replace(base, feature="mask sliding_window", window=(1, 4)))
        if base.layout == "bshd" and base.phase != "decode":  # chunked prefill: Sq < Sk,
            n = len(base.seqlens_q)  # the window sits on the bottom-right diagonal
            out.append(replace(base, feature="mask sliding_window", window=(3, 1),
                               seqlens_q=(5,) * n, seqlens_k=(12,) * n))
        out += _ragged(base, caps, replace(base, feature="mask sliding_window", window=(3, 1)),
                       both=False)
    if "alibi" in m:
        out.append(replace(base, feature="mask alibi", alibi=True, causal=causal))
        out.append(replace(base, feature="mask alibi", alibi=True, alibi_per_batch=True,
                           causal=causal))
    if "softcap" in m:
        out.append(replace(base, feature="mask softcap", softcap=SOFTCAP))
        if causal and not quick:
            out.append(replace(base, feature="mask softcap", softcap=SOFTCAP, causal=True))
    if "prefix_lm" in m and base.layout == "bshd" and base.phase != "decode":
        out.append(replace(base, feature="mask prefix_lm", prefix_lm=True, causal=causal))
    if "document" in m:
        if "thd" in caps.layouts:
            doc = _fit(replace(base, feature="mask document", layout="thd", page_size=0,
                               seqlens_k=base.seqlens_q if base.phase != "decode"
                               else (9, 1, 14)), caps)
            out.append(replace(doc, causal=causal))
        else:
            out.append(replace(base, feature="mask document",
                               notes=("declares document but not the thd layout",)))
    if "column_sparse" in m and base.layout == "bshd":
        out.append(replace(base, feature="mask column_sparse", column_sparse=True,
                           causal=causal))
    if "score_mod" in m:
        out.append(replace(base, feature="mask score_mod", score_mod=True))
    if "mask_mod" in m:
        out.append(replace(base, feature="mask mask_mod", mask_mod=True))
    return out


def _misaligned(base: Case, caps: Capabilities, feature: str, alignment: str) -> list[Case]:
    """Causal with Sq < Sk (chunked prefill) and, outside decode, Sq > Sk (bottom-right:
    the first rows see no key at all, so output 0 and LSE -inf); in ``thd`` too, per
    document (``_ragged``)."""
    if base.phase == "decode" or base.layout == "paged":
        return [replace(base, feature=feature, causal=True, alignment=alignment)]
    n = len(base.seqlens_q)
    out = [replace(base, feature=feature, causal=True, alignment=alignment,
                   seqlens_q=(5,) * n, seqlens_k=(12,) * n)]
    out.append(replace(base, feature=feature, causal=True, alignment=alignment,
                       seqlens_q=(12,) * n, seqlens_k=(5,) * n,
                       return_lse=caps.returns_lse))
    return out + _ragged(base, caps, replace(base, feature=feature, causal=True,
                                             alignment=alignment))


#: Packed documents whose query and key counts differ, per document (ragged, one empty of
#: neither): fewer queries than keys (chunked prefill), then more.
RAGGED_LESS = ((3, 1, 6), (9, 1, 14))
RAGGED_MORE = ((9, 2, 14), (4, 1, 6))


def _ragged(base: Case, caps: Capabilities, mask: Case, both: bool = True) -> list[Case]:
    """``mask`` on packed documents with Sq != Sk per document: the alignment is each
    document's own, which equal lengths (the ``thd`` layout case) cannot show; empty where
    ``thd`` is not declared, or is already the base layout's equal-length cases' own."""
    if "thd" not in caps.layouts or base.layout == "thd" or base.phase == "decode":
        return []
    thd = replace(mask, layout="thd", page_size=0)
    out = [replace(thd, seqlens_q=RAGGED_LESS[0], seqlens_k=RAGGED_LESS[1])]
    if both:
        out.append(replace(thd, seqlens_q=RAGGED_MORE[0], seqlens_k=RAGGED_MORE[1],
                           return_lse=caps.returns_lse))
    return out


def _under_masks(masks: list[Case], caps: Capabilities) -> list[Case]:
    """Every mask case again with its LSE, and (Sq == Sk) as a training call, where declared: a
    kernel's LSE and backward handle each mask in code of their own (a ring merges blocks
    by the LSE; a backward that ignores the softcap trains a different model), which the
    unmasked ``lse`` and ``backward`` cases cannot show."""
    judged = [c for c in masks if not c.notes and not c.untested and c.phase != "decode"
              and c.layout != "paged"]
    out = []
    if caps.returns_lse:
        out += [replace(c, feature="masks: lse", return_lse=True) for c in judged
                if not c.return_lse]
    if caps.backward and "train" in caps.phases:  # training calls are self-attention:
        out += [replace(c, feature="masks: backward", phase="train", backward=True,
                        return_lse=False) for c in judged if c.seqlens_q == c.seqlens_k]
    return out


def _layouts(base: Case, caps: Capabilities, quick: bool) -> list[Case]:
    out: list[Case] = []
    causal = "causal" in caps.masks
    served = set(caps.layouts) | ({"bhsd"} if "bshd" in caps.layouts else set())
    for layout in ("bshd", "bhsd", "thd"):  # bhsd reaches a backend as a strided bshd view
        if layout in served and layout != base.layout and (
                base.phase != "decode" or layout != "thd"):
            out.append(_fit(replace(base, feature=f"layout {layout}", layout=layout,
                                    causal=causal, page_size=0), caps))
    for layout in ("bshd", "thd"):
        if layout in caps.layouts and (layout == "bshd" or base.phase != "decode"):
            out.append(_fit(replace(base, feature=f"head dim stride 2 ({layout} views)",
                                    layout=layout, causal=causal, page_size=0, strided=True,
                                    return_lse=caps.returns_lse), caps))
    if "paged" in caps.layouts:
        for ps in _page_sizes(caps, quick):
            phase = "decode" if "decode" in caps.phases else base.phase
            out.append(_fit(replace(base, feature=f"layout paged page={ps}", layout="paged",
                                    phase=phase, page_size=ps, causal=causal,
                                    seqlens_q=(1, 1), seqlens_k=(1, 1)), caps))
    return out


def _phases(base: Case, caps: Capabilities) -> list[Case]:
    out: list[Case] = []
    causal = "causal" in caps.masks
    if "decode" in caps.phases and base.phase != "decode":
        layout = base.layout if base.layout != "thd" else next(
            (x for x in ("bshd", "paged") if x in caps.layouts), base.layout)
        out.append(_fit(replace(base, feature="phase decode", phase="decode", layout=layout,
                                causal=causal, seqlens_q=(1, 1), seqlens_k=(37, 37)), caps))
        if (caps.max_query_len_decode or 1) > 1 or caps.max_query_len_decode is None:
            n = min(caps.max_query_len_decode or 4, 4)
            out.append(_fit(replace(base, feature="phase decode", phase="decode", layout=layout,
                                    causal=causal, seqlens_q=(n, n), seqlens_k=(37, 37)), caps))
    if caps.backward and "train" in caps.phases:
        layout = "bshd" if "bshd" in caps.layouts else base.layout
        out.append(_fit(replace(base, feature="backward", phase="train", layout=layout,
                                backward=True, causal=causal, page_size=0), caps))
        if caps.deterministic_backward:
            out.append(_fit(replace(base, feature="deterministic backward", phase="train",
                                    layout=layout, backward=True, causal=causal,
                                    deterministic=True, repeat=True, page_size=0), caps))
    return out


def _shapes(base: Case, caps: Capabilities, quick: bool) -> list[Case]:
    out: list[Case] = []
    if caps.gqa:
        out.append(replace(base, feature="gqa 4:1 (MQA)", heads=(4, 1)))
        if not quick:
            out.append(replace(base, feature="gqa 6:2", heads=(6, 2)))
    if base.layout == "bshd" and base.phase != "decode":
        n = len(base.seqlens_q)
        out.append(replace(base, feature="Sq < Sk", seqlens_q=(4,) * n, seqlens_k=(13,) * n))
        out.append(replace(base, feature="Sq > Sk", seqlens_q=(13,) * n, seqlens_k=(4,) * n))
    return out


#: Tokens per sequence of a budget case (bshd; thd: this and 5/8 of it).
BUDGET_LEN = 32
#: The window of ``local`` budget cases: (W, 0) causal, (W, W) otherwise.
LOCAL_WINDOW = 4


def _budget(base: Case, caps: Capabilities) -> list[Case]:
    """An approximate backend's declared ``error_budget``, judged on the inputs it is stated
    for (``conformance.budget``): two draws (one for an unbounded budget, which can only be
    shown), and with a backward two more whose dq, dk, dv are held to its
    ``gradient_budget``; no budget, an unknown input class or a class the masks cannot serve
    is a failure naming the fix."""
    if caps.exact:
        return []
    cls = caps.error_budget_inputs
    feature = f"error budget ({cls} inputs)"
    fix = ""
    if caps.error_budget is None:
        feature, fix = "error budget", (
            "approximate (exact=False) but no error_budget declared: declare "
            "Capabilities(error_budget=<relative RMSE vs dense attention it stays within>, "
            f"error_budget_inputs=<one of {', '.join(sorted(BUDGET_INPUTS))}>), or "
            "error_budget=math.inf for another operator with no bound")
    elif not isinstance(cls, str) or cls not in BUDGET_INPUTS:
        fix = (f"error_budget_inputs {cls!r} is no input class the kit can build: use one of "
               f"{', '.join(sorted(BUDGET_INPUTS))}")
    elif cls == "local" and "sliding_window" not in caps.masks:
        fix = ("error_budget_inputs 'local' is defined by the call's window, but the "
               "sliding_window mask is not declared: declare it, or state the budget on "
               "another input class")
    if fix:
        return [replace(base, feature=feature, notes=(fix,))]
    out = _budget_draws(base, feature, cls, caps.error_budget == float("inf"))
    grads = caps.gradient_budget
    if caps.backward and "train" in caps.phases and grads is not None and grads < float("inf"):
        layout = "bshd" if "bshd" in caps.layouts else base.layout
        if layout != "paged":  # the forward draws' mask, in training (as ``_phases``)
            train = _fit(replace(base, phase="train", layout=layout, backward=True,
                                 page_size=0), caps)
            out += _budget_draws(train, f"gradient budget ({cls} inputs)", cls, False)
    return out


def _budget_draws(base: Case, feature: str, cls: str, one: bool) -> list[Case]:
    """The draws of a budget on ``cls`` inputs from ``base`` (also their basis): the second
    one, for ``local``, with a heavy value; only the first when ``one``."""
    c = replace(base, feature=feature, budget_inputs=cls, return_lse=False, strided=False,
                basis=base)
    if base.phase != "decode" and base.layout in ("bshd", "thd"):
        lens = (BUDGET_LEN, BUDGET_LEN if base.layout == "bshd" else BUDGET_LEN * 5 // 8)
        c = replace(c, seqlens_q=lens, seqlens_k=lens)
    if cls == "local":
        w = LOCAL_WINDOW
        c = replace(c, window=(w, 0) if base.causal else (w, w))
    cases = [c, replace(c, seed=1, heavy_value=cls == "local")]
    return cases[:1] if one else cases


def _results(base: Case, caps: Capabilities) -> list[Case]:
    out: list[Case] = []
    causal = "causal" in caps.masks
    if caps.returns_lse:
        out.append(replace(base, feature="lse", return_lse=True, causal=causal))
    if caps.deterministic_forward:
        out.append(replace(base, feature="deterministic forward", deterministic=True,
                           repeat=True, causal=causal))
    if caps.dropout:
        out.append(replace(base, feature="dropout", dropout_p=0.25, causal=causal))
        for layout in sorted(set(caps.layouts) - {base.layout, "bhsd"}):
            # each layout draws in its own code (packed documents, pages)
            c = _fit(replace(base, layout=layout, page_size=0, seqlens_q=(9, 9),
                             seqlens_k=(9, 9)), caps)
            out.append(replace(c, feature=f"dropout {layout}", dropout_p=0.25, causal=causal))
    return out
