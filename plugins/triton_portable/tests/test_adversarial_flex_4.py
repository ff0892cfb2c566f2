"""Adversarial flex tests (round 4): fully masked rows on every flex path, the arity of any
callable (partials, methods, objects, defaults, ``*args``) at the hub and at registration,
what a score_mod/mask_mod returns, and FlashMask-style sparse masks at odd lengths and with
documents, each against the fp64 reference.

Compiled flex on the CPU has no LSE (Inductor: 'return_lse is not supported yet'); a row
that sees no key came back NaN from it when a value it cannot see held NaN (0 x NaN), where
eager flex and every other backend write 0."""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from attnhub_triton_portable.backend_flex import FlexBackend

from attnhub import AttentionSpec, Hub, MaskSpec
from attnhub.errors import ArgumentError, InputError
from attnhub.plugin import AttnParams, reference_attention
from attnhub.testing import assert_fa_rule, assert_lse

B, HQ, HKV, D = 2, 4, 2, 16


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _qkv(sq: int, sk: int, g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(B, s, h, D, generator=g) for s, h in ((sq, HQ), (sk, HKV), (sk, HKV))]


@pytest.fixture(scope="module")
def hub() -> Hub:
    return Hub()


# -- fully masked rows: 0 on every path, with or without the LSE -----------------------------
@pytest.mark.parametrize("compiled", [False, True])
def test_dead_rows_are_zero_without_lse_when_an_unseen_value_is_nan(compiled: bool) -> None:
    """Rows below ``cut`` see no key (mask_mod), rows in [cut, cut2) neither (a score_mod
    setting every score to -inf); key ``j`` holds NaN in v and no row sees it."""
    g = _gen(f"dead{compiled}")
    sq, sk = 24, 40
    q, k, v = _qkv(sq, sk, g)
    cut = int(torch.randint(2, 8, (), generator=g))
    cut2 = cut + int(torch.randint(1, 6, (), generator=g))
    j = int(torch.randint(0, sk, (), generator=g))
    p = AttnParams(scale=D ** -0.5, mask_mod=lambda b, h, qi, kv: (qi >= cut) & (kv != j),
                   score_mod=lambda s, b, h, qi, kv: torch.where(qi >= cut2, s, -float("inf")))
    spec = AttentionSpec(phase="prefill", dtype="fp32", head_dim=D, num_q_heads=HQ,
                         num_kv_heads=HKV, mask=MaskSpec(score_mod="<lambda>",
                                                         mask_mod="<lambda>"))
    backend = FlexBackend(compiled=compiled)
    backend.load()
    bad = v.clone()
    bad[:, j] = float("nan")
    out = backend.forward(q, k, bad, spec, p).out
    assert torch.equal(out[:, :cut2], torch.zeros_like(out[:, :cut2])), \
        f"compiled={compiled}: a fully masked row is not 0"
    clean = backend.forward(q, k, v, spec, p).out  # the same call without NaN: exact
    ref64, _ = reference_attention(q, k, v, p)
    same, _ = reference_attention(q, k, v, p, compute_dtype=torch.float32)
    assert_fa_rule(clean, ref64, same)


# -- arity: any callable -------------------------------------------------------------------
def _score6(extra, score, b, h, q_idx, kv_idx):
    return score * extra


def _mask5(extra, b, h, q_idx, kv_idx):
    return q_idx + extra >= kv_idx


class _Mods:
    def score(self, score, b, h, q_idx, kv_idx):
        return score * 0.5

    def mask(self, b, h, q_idx, kv_idx):
        return q_idx >= kv_idx


class _ScoreObj:
    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + 1.0


class _MaskObj:
    def __call__(self, b, h, q_idx, kv_idx):
        return q_idx >= kv_idx


def _arity_cases() -> list[tuple[str, Callable[..., Any], str]]:
    """(name, callable, the slot it fits: score, mask, both or none)."""
    return [
        ("partial_score", functools.partial(_score6, 2.0), "score"),
        ("partial_mask", functools.partial(_mask5, 1), "mask"),
        ("partial_kw_mask", functools.partial(_mask5, extra=1), "none"),  # then keyword-only
        ("method_score", _Mods().score, "score"),
        ("method_mask", _Mods().mask, "mask"),
        ("object_score", _ScoreObj(), "score"),
        ("object_mask", _MaskObj(), "mask"),
        ("lambda_default", lambda a, b, c, d, e=None: a * 0.5 if e is not None else c >= d,
         "both"),
        ("lambda_star", lambda *a: a[0] * 0.5 if len(a) == 5 else a[-2] >= a[-1], "both"),
        ("lambda_kwonly", lambda b, h, q, kv, *, extra: q >= kv, "none"),
        ("lambda_three", lambda h, q, kv: q >= kv, "none"),
    ]


@pytest.mark.parametrize("slot", ["score_mod", "mask_mod"])
@pytest.mark.parametrize("case", _arity_cases(), ids=lambda c: c[0])
def test_arity_of_any_callable_is_checked_at_the_hub(hub: Hub, slot: str, case) -> None:
    name, fn, fits = case
    q, k, v = (x * 0.5 for x in _qkv(7, 9, _gen(name + slot)))
    ok = fits == "both" or fits == slot[:-4]
    if not ok:
        with pytest.raises(ArgumentError, match=rf"{slot}=.*takes .*not the "
                                                rf"{5 if slot == 'score_mod' else 4} "):
            hub.attention(q, k, v, backend="reference", **{slot: fn})
        return
    out = hub.attention(q, k, v, backend="flex", **{slot: fn})
    ref = hub.attention(q, k, v, backend="reference", **{slot: fn})
    assert (out - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["partial", "object", "method", "lambda_default"])
def test_a_second_callable_of_one_name_and_another_arity_is_checked(hub: Hub, kind) -> None:
    """The exact-shape table keyed a callable by name and ``__code__.co_argcount``: a partial
    (or a callable object, a method, a lambda with a default) has the same key whatever it
    wraps, so a wrong one after a right one skipped the check and failed in the backend."""
    good, bad = {
        "partial": (functools.partial(_score6, 2.0), functools.partial(_mask5, 1)),
        "object": (_ScoreObj(), _MaskObj()),
        "method": (_Mods().score, _Mods().mask),
        "lambda_default": (lambda s, b, h, q, kv, x=0: s + x, lambda s, b, h, q, kv, x: s),
    }[kind]
    if kind == "object":  # one class name, other arity
        bad = type("_ScoreObj", (_MaskObj,), {})()
        good = type("_ScoreObj", (_ScoreObj,), {})()
    if kind == "method":
        bad = type("M", (), {"score": _Mods.mask})().score
    q, k, v = _qkv(5, 6, _gen(kind))
    hub.attention(q, k, v, backend="reference", score_mod=good)
    with pytest.raises(ArgumentError, match="score_mod=.*takes"):
        hub.attention(q, k, v, backend="reference", score_mod=bad)


def _registry_with(score_mod=None, mask_mod=None):
    from attnhub.core.registry import Registry
    from attnhub.hookspecs import hookimpl

    class Plugin:
        @hookimpl
        def attnhub_register_variants(self, register):
            register("myvariant", score_mod=score_mod, mask_mod=mask_mod)

    reg = Registry.load(entry_points=False, modules=[])
    return reg, reg.add_plugin(Plugin(), "varplug")


@pytest.mark.parametrize("slot,fn,fits", [
    ("score_mod", functools.partial(_mask5, 1), False),
    ("mask_mod", functools.partial(_score6, 1.0), False),
    ("score_mod", _Mods().mask, False),
    ("mask_mod", _ScoreObj(), False),
    ("score_mod", functools.partial(_score6, 1.0), True),
    ("mask_mod", lambda *a: a[0] >= 0, True),
])
def test_a_variant_of_the_wrong_arity_is_refused_at_registration(slot, fn, fits) -> None:
    reg, rec = _registry_with(**{slot: fn})
    if fits:
        assert "myvariant" in reg.variants and not rec.errors
        return
    assert "myvariant" not in reg.variants
    assert len(rec.errors) == 1
    assert "variant 'myvariant'" in rec.errors[0]
    assert SIG[slot] in rec.errors[0]


SIG = {"score_mod": "(score, b, h, q_idx, kv_idx) -> score",
       "mask_mod": "(b, h, q_idx, kv_idx) -> bool"}


def test_registered_defaults_sit_in_their_slots(hub: Hub) -> None:
    from attnhub_triton_portable import variants

    for fn in variants.DEFAULTS:
        var = hub.registry.variants[fn.__name__]
        assert (var.score_mod is fn) != (var.mask_mod is fn)


# -- what a score_mod / mask_mod returns ----------------------------------------------------
_META = torch.zeros(HQ, device="meta")


@pytest.mark.parametrize("slot,fn,needle", [
    ("score_mod", lambda s, b, h, q, kv: s > 0, "torch.bool.*pass it as mask_mod="),
    ("score_mod", lambda s, b, h, q, kv: (s * 4).long(), "torch.int64"),
    ("score_mod", lambda s, b, h, q, kv: torch.tensor(1.0), r"shape \(\)"),
    ("score_mod", lambda s, b, h, q, kv: 1.0, "returned a float"),
    ("score_mod", lambda s, b, h, q, kv: s.sum(-1, keepdim=True), r"shape \(1,\)"),
    ("score_mod", lambda s, b, h, q, kv: torch.stack([s, s], -1), r"shape \(2, 2\)"),
    ("score_mod", lambda s, b, h, q, kv: s + _META[h], "raised RuntimeError.*meta"),
    ("mask_mod", lambda b, h, q, kv: True, "returned a bool"),
    ("mask_mod", lambda b, h, q, kv: torch.stack([q >= kv] * 2, -1), r"shape \(2, 2\)"),
    ("mask_mod", lambda b, h, q, kv: (q >= kv).to(torch.complex64), "complex64"),
    ("mask_mod", lambda b, h, q, kv: q + _META[h].long() >= kv, "raised RuntimeError.*meta"),
])
def test_a_result_of_the_wrong_kind_is_an_input_error(hub: Hub, slot, fn, needle) -> None:
    """flex took these silently (a bool score as 0/1, an int one truncated, a reduction or
    a constant per element) or failed as a backend; now the caller is told, by name."""
    q, k, v = _qkv(9, 11, _gen(needle))
    with pytest.raises(InputError, match=rf"flex: {slot} '<lambda>' .*{needle}"):
        hub.attention(q, k, v, backend="flex", **{slot: fn})


@pytest.mark.parametrize("make", ["fp64", "fp16", "nan_mask", "int_mask", "0d_mask"])
def test_floating_results_of_another_dtype_match_the_reference(hub: Hub, make) -> None:
    """A floating score of another dtype is cast to the score's (as flex does: the
    reference, which cannot mix dtypes, gets the cast written out); a mask's nonzero
    entries (NaN too) are visible; a 0-d mask broadcasts."""
    g = _gen(make)
    q, k, v = (x * 0.5 for x in _qkv(13, 21, g))
    bias = torch.randn(HQ, generator=g, dtype=torch.float64)
    off = int(torch.randint(-3, 6, (), generator=g))
    flex_mods, ref_mods = {
        "fp64": ({"score_mod": lambda s, b, h, qi, kv: s.double() + bias[h]},
                 {"score_mod": lambda s, b, h, qi, kv: s + bias[h].to(s.dtype)}),
        "fp16": ({"score_mod": lambda s, b, h, qi, kv: (s * 1.5).half()},
                 {"score_mod": lambda s, b, h, qi, kv: (s * 1.5).half().to(s.dtype)}),
        "nan_mask": ({"mask_mod": lambda b, h, qi, kv: torch.where(
            qi + off >= kv, float("nan"), 0.0)},) * 2,
        "int_mask": ({"mask_mod": lambda b, h, qi, kv: (qi + off - kv).clamp(min=0)},) * 2,
        "0d_mask": ({"mask_mod": lambda b, h, qi, kv: torch.tensor(True)},) * 2,
    }[make]
    out, lse = hub.attention(q, k, v, backend="flex", return_lse=True, **flex_mods)
    p = AttnParams(scale=D ** -0.5, **ref_mods)
    ref64, ref_lse = reference_attention(q, k, v, p)
    same, _ = reference_attention(q, k, v, p, compute_dtype=torch.float32)
    if make == "fp16":  # flex rounds fp32 scores to fp16, the reference fp64 ones: 1 ulp
        assert (out - ref64).abs().max() <= 2e-3
    else:
        assert_fa_rule(out, ref64, same)
    assert_lse(lse, ref_lse, atol=2e-3 if make == "fp16" else 1e-5)


# -- FlashMask-style column-sparse masks -----------------------------------------------------
def _check(hub: Hub, q, k, v, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = hub.attention(q, k, v, backend="flex", return_lse=True, phase="prefill", **kw)
    layout = kw.get("layout", "bshd")
    cu = {x: kw[x] for x in ("cu_seqlens_q", "cu_seqlens_k") if x in kw}
    p = AttnParams(scale=D ** -0.5, causal=kw.get("causal", False),
                   colmask_start=kw.get("colmask_start"), colmask_end=kw.get("colmask_end"),
                   mask_mod=kw.get("mask_mod"), **cu)
    ref64, ref_lse = reference_attention(q, k, v, p, layout=layout)
    same, _ = reference_attention(q, k, v, p, layout=layout, compute_dtype=torch.float32)
    assert_fa_rule(out, ref64, same)
    assert_lse(lse, ref_lse)
    return out, lse


def test_column_sparse_masking_every_row(hub: Hub) -> None:
    g = _gen("every_row")
    sq, sk = 131, 259
    q, k, v = _qkv(sq, sk, g)
    start = torch.randint(-3, 1, (B, HKV, sk), generator=g)
    end = torch.randint(sq, sq + 4, (B, HKV, sk), generator=g)
    v[:, int(torch.randint(0, sk, (), generator=g))] = float("nan")
    out, lse = hub.attention(q, k, v, backend="flex", return_lse=True, colmask_start=start,
                             colmask_end=end)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("sq,sk", [(131, 259), (257, 129), (1, 130)])
def test_column_sparse_at_lengths_off_the_block(hub: Hub, sq: int, sk: int) -> None:
    """Lengths not multiples of flex's 128 block; random ranges (some rows fully masked)
    with causal and a mask_mod on top."""
    g = _gen(f"off{sq}{sk}")
    q, k, v = _qkv(sq, sk, g)
    start = torch.randint(-2, sq + 2, (B, 1, sk), generator=g)
    end = start + torch.randint(0, sq, (B, 1, sk), generator=g)
    band = int(torch.randint(8, 64, (), generator=g))
    _check(hub, q, k, v, causal=True, colmask_start=start, colmask_end=end,
           mask_mod=lambda b, h, qi, kv: (qi - kv).abs() <= band)


def test_documents_with_a_mask_mod_and_an_empty_document(hub: Hub) -> None:
    """thd documents (one of zero queries, one whose rows all lose their keys to the
    mask_mod) with causal attention; the mask_mod sees positions inside its document."""
    g = _gen("docs")
    lens_q = [37, 0, 130, 5]
    lens_k = [41, 3, 131, 5]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), HQ, D, generator=g)
    k, v = (torch.randn(sum(lens_k), HKV, D, generator=g) for _ in range(2))
    cut = int(torch.randint(1, 4, (), generator=g))
    out, lse = _check(hub, q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                      causal=True, mask_mod=lambda b, h, qi, kv: kv >= cut * 50)
    assert torch.isneginf(lse[:, :37]).all()  # the first document: no key at or past 50


# -- a variant sized for fewer positions than the call ---------------------------------------
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_document_ids_shorter_than_the_positions_are_refused(hub: Hub, layout: str) -> None:
    """``variants.document(ids)`` indexes ``ids`` by position: compiled flex reads past a
    short ``ids`` without a bound check (eager flex raised IndexError as a backend failure).
    thd documents index positions inside a document, so their longest document counts."""
    from attnhub_triton_portable import variants

    g = _gen(f"docids{layout}")
    lens = torch.randint(3, 12, (3,), generator=g)
    longest = int(lens.max()) if layout == "thd" else 13
    kw: dict[str, Any] = {}
    if layout == "thd":
        cu = torch.tensor([0, *lens.cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(int(cu[-1]), HQ, D, generator=g)
        k, v = (torch.randn(int(cu[-1]), HKV, D, generator=g) for _ in range(2))
        kw = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:
        q, k, v = _qkv(longest, longest, g)
    short = variants.document(torch.randint(0, 3, (longest - 1,), generator=g))
    with pytest.raises(InputError, match=rf"'document' holds ids for {longest - 1} positions"):
        hub.attention(q, k, v, backend="flex", mask_mod=short, **kw)
    fits = variants.document(torch.randint(0, 3, (longest,), generator=g))
    _check(hub, q, k, v, mask_mod=fits, **kw)


def test_chained_indexing_in_a_mod_is_named_with_its_fix(hub: Hub) -> None:
    """``doc[b][q_idx]`` selects whole rows (a (2, S) result on the probe): the error says
    to index in one subscript, and that form runs and matches the reference."""
    g = _gen("chained")
    q, k, v = _qkv(9, 9, g)
    doc = torch.randint(0, 3, (B, 9), generator=g).sort(-1).values
    with pytest.raises(InputError, match=r"doc\[b, q_idx\], not doc\[b\]\[q_idx\]"):
        hub.attention(q, k, v, backend="flex",
                      mask_mod=lambda b, h, qi, ki: doc[b][qi] == doc[b][ki])
    one = hub.attention(q, k, v, backend="flex",
                        mask_mod=lambda b, h, qi, ki: doc[b, qi] == doc[b, ki])
    ref = hub.attention(q, k, v, backend="reference",
                        mask_mod=lambda b, h, qi, ki: doc[b, qi] == doc[b, ki])
    assert torch.allclose(one, ref, atol=1e-5)
