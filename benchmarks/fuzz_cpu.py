"""Differential fuzzer of the public API on the CPU: random ``attnhub.attention`` calls, each
forced onto every registered exact CPU backend that serves it (and once with the policy's own
choice), compared with the fp64 reference by the FlashAttention rule (``attnhub.testing``).

Each case is drawn as a family of calls of one shape and run two or three times on the same
hub with fresh data, tables and side tensors (and, for bshd/bhsd, new lengths in the same
power-of-two bucket), so the hot path and the grow path are exercised as well as the slow
path. Triton runs under ``TRITON_INTERPRET=1`` on tiny shapes only.

An output over the rule is ``peaked`` (reported, not a failure) where every element is within
the rule plus twice its ``score_rounding_floor``: the first-order error of rounding each
score once in fp32, which grows with the scores; where they are large it, not the
reference's luck with its order of operations, sets what a kernel can reach
(docs/contract.md). A tool, not a test:

    python benchmarks/fuzz_cpu.py --cases 500 --seed 1 --budget-s 600
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import attnhub  # noqa: E402
from attnhub import AttnParams, BackendUnavailableError, InputError, NoBackendError  # noqa: E402
from attnhub.plugin import reference_attention  # noqa: E402
from attnhub.testing import fa_references, fa_rule_error  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
POLICY = "<policy>"


def _mask_mod_mod3(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
    return (q_idx - kv_idx) % 3 != 1


def _score_mod_rel(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
    return score + 0.25 * (q_idx - kv_idx).clamp(-4, 4)


def _batch_bias_mod(bias: torch.Tensor) -> Any:
    def batch_bias(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + bias[b, h]
    return batch_bias


def _head_bias_mod(bias: torch.Tensor) -> Any:
    def head_bias(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + bias[h]
    return head_bias


@dataclass
class Family:
    """The shape-level draw of a case: what stays fixed over its repeated calls."""

    layout: str
    dtype: str
    b: int
    hq: int
    hkv: int
    d: int
    sq: int
    sk: int
    causal: bool
    alignment: str
    window: Any
    softcap: float | None
    alibi: str | None  # None, "h" (Hq,), "bh" (B, Hq)
    prefix: bool
    colmask: str | None  # None, "1", "hkv"
    colmask_end: bool
    score_mod: str | None  # None, variant name, "rel", "head_bias"
    mask_mod: str | None
    scale: float | None
    return_lse: bool
    grad: bool
    strided: str | None  # None, "head", "seq"
    page_size: int = 1
    pages_per_seq: int = 1
    phase: str | None = None
    small: bool = False
    dv: int = 0
    deterministic: bool = False
    extra: dict = field(default_factory=dict)


def draw_family(rng: random.Random) -> Family:
    layout = rng.choice(["bshd", "bshd", "bhsd", "thd", "thd", "paged", "paged"])
    dtype = rng.choice(["fp32", "fp32", "bf16", "fp16"])
    hkv = rng.choice([1, 1, 2, 3])
    hq = hkv * rng.choice([1, 1, 2, 3, 4])
    d = rng.choice([8, 16, 24, 32, 40, 64, 72])
    b = rng.choice([1, 1, 2, 3])
    sq = rng.choice([1, 1, 2, 3, 5, 7, 8, 13, 16, 24])
    sk = rng.choice([1, 2, 3, 5, 8, 11, 16, 24, 33])
    causal = rng.random() < 0.5
    alignment = rng.choice(["bottom_right", "bottom_right", "top_left"])
    window = None
    if rng.random() < 0.3:
        left = rng.choice([-1, 0, 1, 2, 3, 7, 40, 2**31 - 1])
        right = rng.choice([-1, 0, 1, 2, 5, 100]) if not causal else rng.choice([-1, 0, 0, 2])
        window = rng.choice([(left, right), left]) if left >= 0 else (left, right)
    softcap = rng.choice([None, None, None, 0.1, 2.0, 10.0, 30.0])
    alibi = rng.choice([None, None, None, "h", "bh"])
    prefix = causal and rng.random() < 0.2
    colmask = None
    if layout in ("bshd", "bhsd") and rng.random() < 0.2:
        colmask = rng.choice(["1", "hkv"])
    score_mod = mask_mod = None
    if rng.random() < 0.15:
        score_mod = rng.choice(["rel", "head_bias", "softcap30", "alibi8"]
                               + (["batch_bias"] if layout in ("bshd", "bhsd") else []))
    if rng.random() < 0.12:
        mask_mod = rng.choice(["mod3", "window1024", "prefix_lm128"])
    scale = rng.choice([None, None, None, 1e-3, 0.05, 0.5, 2.0, 1e-30, 100.0, 1e4])
    grad = rng.random() < 0.25
    if grad:  # the peaked-softmax regime is a documented limit of every flash backward
        scale = rng.choice([None, 0.05])
        softcap = softcap if softcap is None else 30.0
    small = rng.random() < 0.5
    if small:  # tiny enough for the Triton interpreter
        sq, sk, d, b = min(sq, 8), min(sk, 11), rng.choice([8, 16, 24]), min(b, 2)
        hkv = min(hkv, 2)
        hq = hkv * rng.choice([1, 2])
    fam = Family(layout, dtype, b, hq, hkv, d, sq, sk, causal, alignment, window, softcap,
                 alibi, prefix, colmask, rng.random() < 0.5, score_mod, mask_mod, scale,
                 rng.random() < 0.4, grad, rng.choice([None, None, "head", "seq"]))
    fam.small = small
    if rng.random() < 0.35:  # lean: masks every exact backend serves, the others' edges
        fam.softcap = fam.alibi = fam.score_mod = fam.mask_mod = fam.colmask = None
        fam.prefix = False
    fam.dv = rng.choice([fam.d] * 4 + [8, 24, 40])
    fam.deterministic = rng.random() < 0.1
    if layout == "paged":
        fam.page_size = rng.choice([1, 2, 3, 4, 8])
        fam.pages_per_seq = max(1, math.ceil(sk / fam.page_size) + rng.choice([0, 0, 1, 2]))
    if rng.random() < 0.15 and sq <= 4:
        fam.phase = "decode"
    return fam


@dataclass
class Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kw: dict
    ref: tuple  # (q, k, v) in bshd/thd for the reference (graph-connected to q, k, v)
    ref_layout: str
    params: AttnParams
    to_out: Any  # reference out (bshd/thd) -> the call's out layout
    to_lse: Any
    leaves: list


def _strided(x: torch.Tensor, how: str | None, seq_dim: int) -> torch.Tensor:
    if how == "head":
        return x.new_zeros(*x.shape[:-1], 2 * x.shape[-1])[..., ::2].copy_(x)
    if how == "seq" and x.dim() >= 3:
        shape = list(x.shape)
        shape[seq_dim] *= 2
        idx = [slice(None)] * x.dim()
        idx[seq_dim] = slice(None, None, 2)
        return x.new_full(shape, 7.0)[tuple(idx)].copy_(x)
    return x


def _leaf(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return x.detach().requires_grad_(True) if grad else x


def _mod(name: str | None, b: int, hq: int, gen: torch.Generator) -> tuple[Any, Any]:
    """(what the call passes, the callable the reference runs)."""
    if name is None:
        return None, None
    if name == "rel":
        return _score_mod_rel, _score_mod_rel
    if name == "mod3":
        return _mask_mod_mod3, _mask_mod_mod3
    if name == "batch_bias":
        fn = _batch_bias_mod(torch.randn(b, hq, generator=gen))
        return fn, fn
    if name == "head_bias":
        fn = _head_bias_mod(torch.randn(hq, generator=gen))
        return fn, fn
    var = attnhub.default_hub().registry.variant(name)
    return name, var.score_mod or var.mask_mod


def make_call(fam: Family, gen: torch.Generator, rng: random.Random, lens_q: list[int],
              lens_k: list[int]) -> Call:
    dt = DTYPES[fam.dtype]
    hq, hkv, d, dv = fam.hq, fam.hkv, fam.d, fam.dv or fam.d
    amp = 3.0 if fam.softcap and not fam.grad else 1.0
    b = len(lens_q)
    kw: dict[str, Any] = dict(causal=fam.causal, causal_alignment=fam.alignment,
                              return_lse=fam.return_lse)
    if fam.window is not None:
        kw["window"] = fam.window
    if fam.softcap is not None:
        kw["softcap"] = fam.softcap
    if fam.scale is not None:
        kw["scale"] = fam.scale
    if fam.phase:
        kw["phase"] = fam.phase
    if fam.deterministic:
        kw["deterministic"] = True
    win = fam.window
    if isinstance(win, int):
        win = (win, 0) if fam.causal else (win, win)
    params = AttnParams(scale=fam.scale if fam.scale is not None else 1 / math.sqrt(d),
                        causal=fam.causal, alignment=fam.alignment, window=win,
                        softcap=fam.softcap)
    if fam.alibi:
        shape = (hq,) if fam.alibi == "h" else (b, hq)
        slopes = torch.rand(shape, generator=gen) * 0.5 + 0.01
        if rng.random() < 0.2:
            slopes = slopes * torch.randn(shape, generator=gen).sign()  # negative slopes too
        slopes = slopes.to(rng.choice([torch.float32, torch.float32, torch.float64,
                                       torch.bfloat16, torch.float16]))
        kw["alibi_slopes"] = params.alibi_slopes = slopes
    if fam.prefix:
        pdt = rng.choice([torch.int32, torch.int64, torch.int64, torch.int16, torch.uint8])
        wild = [-5, 2**40, 1000] if pdt == torch.int64 else []
        pl = torch.tensor([rng.choice([rng.randint(0, max(lens_k) + 1)] * 3 + wild)
                           for _ in range(b)], dtype=pdt)
        kw["prefix_lens"] = params.prefix_lens = pl
    kw["score_mod"], params.score_mod = _mod(fam.score_mod, b, hq, gen)
    kw["mask_mod"], params.mask_mod = _mod(fam.mask_mod, b, hq, gen)
    if kw["score_mod"] is None:
        del kw["score_mod"]
    if kw["mask_mod"] is None:
        del kw["mask_mod"]
    rnd = lambda *s: amp * torch.randn(*s, generator=gen)  # noqa: E731
    if fam.layout in ("bshd", "bhsd"):
        sq, sk = lens_q[0], lens_k[0]
        q0, k0, v0 = rnd(b, sq, hq, d), rnd(b, sk, hkv, d), torch.randn(b, sk, hkv, dv,
                                                                         generator=gen)
        if fam.colmask:
            hs = 1 if fam.colmask == "1" else hkv
            st = torch.randint(0, sq + 1, (b, hs, sk), generator=gen)
            cdt = rng.choice([torch.int32, torch.int64, torch.int8, torch.uint8])
            if cdt == torch.int64 and rng.random() < 0.5:  # clamped to [0, Sq]
                st = st + torch.randint(-1, 2, st.shape, generator=gen) * (sq + 3)
            kw["colmask_start"] = params.colmask_start = st.to(cdt)
            if fam.colmask_end:
                en = st.clamp(0, sq) + torch.randint(0, sq + 1, (b, hs, sk), generator=gen)
                if cdt != torch.int64:
                    en = en.clamp(max=sq)
                kw["colmask_end"] = params.colmask_end = en.to(cdt)
        if fam.layout == "bhsd":
            q0, k0, v0 = (x.transpose(1, 2).to(dt) for x in (q0, k0, v0))
            q, k, v = (_leaf(_strided(x, fam.strided, 2), fam.grad) for x in (q0, k0, v0))
            kw["layout"] = "bhsd"
            ref = tuple(x.transpose(1, 2) for x in (q, k, v))
            return Call(q, k, v, kw, ref, "bshd", params, lambda o: o.transpose(1, 2),
                        lambda s: s, [q, k, v])
        q, k, v = (_leaf(_strided(x.to(dt), fam.strided, 1), fam.grad) for x in (q0, k0, v0))
        if rng.random() < 0.15:
            kw["max_seqlen_k"] = sk + rng.choice([0, 1, 10**6])
        return Call(q, k, v, kw, (q, k, v), "bshd", params, lambda o: o, lambda s: s,
                    [q, k, v])
    if fam.layout == "thd":
        tq, tk = sum(lens_q), sum(lens_k)
        q0, k0, v0 = rnd(tq, hq, d), rnd(tk, hkv, d), torch.randn(tk, hkv, dv, generator=gen)
        q, k, v = (_leaf(_strided(x.to(dt), fam.strided, 0), fam.grad) for x in (q0, k0, v0))
        cq = torch.tensor([0] + list(_cumsum(lens_q)), dtype=torch.int32)
        ck = torch.tensor([0] + list(_cumsum(lens_k)), dtype=torch.int32)
        kw.update(layout="thd", cu_seqlens_q=cq, cu_seqlens_k=ck)
        if rng.random() < 0.3:
            kw["max_seqlen_q"] = max(lens_q) + rng.choice([0, 1])
            kw["max_seqlen_k"] = max(lens_k) + rng.choice([0, 2, 10**6])
        params.cu_seqlens_q, params.cu_seqlens_k = cq, ck
        return Call(q, k, v, kw, (q, k, v), "thd", params, lambda o: o, lambda s: s, [q, k, v])
    # paged: q (B, Sq, Hq, D), caches (pages, page_size, Hkv, D)
    ps, mp = fam.page_size, fam.pages_per_seq
    sq = lens_q[0]
    used = [math.ceil(n / ps) for n in lens_k]
    n_pages = sum(used) + rng.randint(0, 3)
    perm = torch.randperm(max(n_pages, 1), generator=gen).tolist()
    table = torch.full((b, mp), -1, dtype=torch.int32)
    pos = 0
    for i, u in enumerate(used):
        for j in range(u):
            table[i, j] = perm[pos]
            pos += 1
        if rng.random() < 0.3 and u < mp:  # keep a stale valid id past the length sometimes
            table[i, u:] = perm[0] if rng.random() < 0.5 else -1
    kc0 = torch.full((max(n_pages, 1), ps, hkv, d), float("nan"))
    vc0 = torch.full((max(n_pages, 1), ps, hkv, dv), float("nan"))
    for i, n in enumerate(lens_k):  # garbage (finite) past the length in a used page
        for j in range(used[i]):
            pg = int(table[i, j])
            kc0[pg] = 50.0
            vc0[pg] = 1e3
    for i, n in enumerate(lens_k):
        for t in range(n):
            pg, off = int(table[i, t // ps]), t % ps
            kc0[pg, off] = amp * torch.randn(hkv, d, generator=gen)
            vc0[pg, off] = torch.randn(hkv, dv, generator=gen)
    q0 = rnd(b, sq, hq, d)
    q = _leaf(_strided(q0.to(dt), fam.strided, 1), fam.grad)
    kc = _leaf(kc0.to(dt), fam.grad)
    vc = _leaf(vc0.to(dt), fam.grad)
    seqlens = torch.tensor(lens_k, dtype=torch.int32)
    kw.update(layout="paged", block_table=table, seqlens_k=seqlens)
    if rng.random() < 0.25:
        kw["max_seqlen_k"] = max(lens_k) + rng.choice([0, 1, 10**6])
    if rng.random() < 0.15:
        kw["max_seqlen_q"] = sq + rng.choice([0, 3])
    # reference: thd over the gathered keys (graph-connected to the caches)
    idx_p = [int(table[i, t // ps]) for i, n in enumerate(lens_k) for t in range(n)]
    idx_o = [t % ps for i, n in enumerate(lens_k) for t in range(n)]
    kg, vg = kc[idx_p, idx_o], vc[idx_p, idx_o]
    rq = q.reshape(b * sq, hq, d)
    params.cu_seqlens_q = torch.arange(0, b * sq + 1, max(sq, 1), dtype=torch.int32)[:b + 1]
    if sq == 0:
        params.cu_seqlens_q = torch.zeros(b + 1, dtype=torch.int32)
    params.cu_seqlens_k = torch.tensor([0] + list(_cumsum(lens_k)), dtype=torch.int32)
    return Call(q, kc, vc, kw, (rq, kg, vg), "thd", params,
                lambda o: o.reshape(b, sq, hq, o.shape[-1]),
                lambda s: s.reshape(hq, b, sq).transpose(0, 1), [q, kc, vc])


def reuse_in_place(call: Call, prev: Call) -> None:
    """Hand this call the previous call's side tensors (tables, offsets, slopes, lengths),
    their contents overwritten in place with this call's values where the shapes agree."""
    for key, new in list(call.kw.items()):
        old = prev.kw.get(key)
        if (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)
                and old.shape == new.shape and old.dtype == new.dtype):
            old.copy_(new)
            call.kw[key] = old
            for f in ("alibi_slopes", "prefix_lens", "colmask_start", "colmask_end"):
                if getattr(call.params, f) is new:
                    setattr(call.params, f, old)


def _cumsum(xs: list[int]) -> list[int]:
    out, t = [], 0
    for x in xs:
        t += x
        out.append(t)
    return out


def draw_lengths(fam: Family, rng: random.Random, rep: int) -> tuple[list[int], list[int]]:
    """Per-sequence lengths; repeats after the first keep bshd lengths in the same bucket."""
    def same_bucket(n: int) -> int:
        if rep == 0 or n <= 2:
            return n
        lo = 1 << (n - 1).bit_length() - 1
        return rng.randint(lo + 1, 1 << (n - 1).bit_length())
    if fam.layout in ("bshd", "bhsd"):
        return [same_bucket(fam.sq)] * fam.b, [same_bucket(fam.sk)] * fam.b
    if fam.layout == "thd":
        lq = [rng.choice([0, 1, fam.sq, rng.randint(0, fam.sq)]) for _ in range(fam.b)]
        lk = [rng.choice([0, fam.sk, rng.randint(0, fam.sk)]) for _ in range(fam.b)]
        if fam.alignment == "top_left" or rng.random() < 0.5:
            lk = [max(x, 0) for x in lk]
        return lq, lk
    cap = fam.pages_per_seq * fam.page_size
    return [fam.sq] * fam.b, [rng.choice([0, cap, rng.randint(0, cap), fam.sk if fam.sk <= cap
                                          else cap]) for _ in range(fam.b)]


def candidates(fam: Family) -> list[str]:
    reg = attnhub.default_hub().registry
    names = []
    for n in reg.names():
        caps = reg.get(n).capabilities
        if "cpu" not in caps.vendors or not caps.exact:
            continue
        if n == "ring":  # needs a process group of 2 or more ranks
            continue
        if n.startswith("triton") and not fam.small:
            continue
        names.append(n)
    return names + [POLICY]


def _lse_ok(lse: torch.Tensor, ref: torch.Tensor) -> str | None:
    inf_ref = torch.isneginf(ref)
    if not torch.equal(torch.isneginf(lse), inf_ref):
        return "LSE -inf pattern differs from the reference"
    if torch.isnan(lse).any():
        return "NaN in LSE"
    diff = (lse.detach().double() - ref.double())[~inf_ref].abs()
    tol = 1e-3 + 1e-5 * float(ref[~inf_ref].detach().abs().max()) if diff.numel() else 0.0
    if diff.numel() and float(diff.detach().max()) > tol:
        return f"LSE error {float(diff.max()):.3e} > {tol:.3e}"
    return None


def score_rounding_floor(call: Call, ref64: torch.Tensor) -> torch.Tensor:
    """Per output element, in the call's layout: ``sum_j p_ij * u * |scale| * sum_d
    |q_id k_jd| * |v_j - o_i|`` (``u``: fp32's unit roundoff), the first-order change of
    attention when each score moves by one fp32 rounding of its dot product, which no kernel
    holding its scores in fp32 avoids (in half precision too: the scores are fp32 there).
    It grows with the scores: where they are large, rounding them decides the error, and
    the rule's yardstick (the reference's error) is one order of operations' luck.
    Softcap, ALiBi and mods round more, not counted: classified conservatively there.
    Probabilities come from the reference itself (values one-hot in the key position)."""
    q, k, v = (x.detach().double() for x in call.ref)
    tk = k.shape[-3]
    eye = torch.eye(tk, dtype=torch.float64).unsqueeze(-2).expand(*k.shape[:-1], tk)
    probs, _ = reference_attention(q, k, eye.contiguous(), call.params,
                                   layout=call.ref_layout)
    if call.ref_layout == "thd":  # one packed row: cross-document pairs have p = 0
        q, k, v, probs, ref64 = (x.unsqueeze(0) for x in (q, k, v, probs, ref64))
    g = q.shape[-2] // k.shape[-2]
    k, v = (x.repeat_interleave(g, dim=-2) for x in (k, v))
    unit = torch.finfo(torch.float32).eps / 2
    mag = torch.einsum("bqhd,bkhd->bqhk", q.abs(), k.abs()) * abs(call.params.scale) * unit
    spread = (v.unsqueeze(1) - ref64.detach().unsqueeze(2)).abs()  # (B, Sq, Sk, H, Dv)
    floor = torch.einsum("bqhk,bqkhc->bqhc", probs * mag, spread)
    return call.to_out(floor[0] if call.ref_layout == "thd" else floor)


def peaked(out: torch.Tensor, call: Call, ref64: torch.Tensor, allowed: float) -> str | None:
    """Why an output over the rule (``allowed``) is the large-score regime (None: a
    failure): every element within the rule plus 2x its :func:`score_rounding_floor` (2x,
    as the rule takes its yardstick). At the default scale that adds at most ~17% to the
    fp32 rule (nothing in half precision); a wrong mask or formula is off by far more."""
    floor = score_rounding_floor(call, ref64)
    err = (out.detach().double() - call.to_out(ref64)).abs()
    if not bool((err <= allowed + 2 * floor).all()):
        return None
    return (f"every element within the rule ({allowed:.3e}) plus 2x its score-rounding "
            f"floor: error up to {float(err.max()):.3e}, floor up to "
            f"{float(floor.max()):.3e}")


def check_one(call: Call, backend: str, refs: tuple, grad_out: torch.Tensor | None,
              ) -> tuple[str, str]:
    """('ok'|'refused'|'input'|'peaked'|'FAIL', detail); 'peaked' (``peaked``) is reported,
    not failed."""
    kw = dict(call.kw)
    if backend != POLICY:
        kw["backend"] = backend
    try:
        res = attnhub.attention(call.q, call.k, call.v, **kw)
    except BackendUnavailableError as exc:
        if not exc.reasons or not all(str(r).strip() for r in exc.reasons):
            return "FAIL", f"refusal without a reason: {exc!r}"
        return "refused", "; ".join(exc.reasons)[:200]
    except NoBackendError as exc:
        if backend == POLICY:
            return "refused", str(exc).splitlines()[0][:200]
        return "FAIL", f"NoBackendError (forced backend failed at run time): {exc}"[:2000]
    except InputError as exc:
        return "input", f"{type(exc).__name__}: {exc}"[:300]
    except Exception:
        return "FAIL", "raised:\n" + traceback.format_exc()[-2500:]
    out, lse = (res if call.kw.get("return_lse") else (res, None))
    ref64, ref_lse, ref_same = refs[:3]
    r64, rsame = call.to_out(ref64), call.to_out(ref_same)
    if out.shape != r64.shape:
        return "FAIL", f"out shape {tuple(out.shape)} != {tuple(r64.shape)}"
    if torch.isnan(out).any():
        return "FAIL", "NaN in output"
    err, allowed = fa_rule_error(out, r64, rsame)
    if err > allowed:
        why = peaked(out, call, ref64, allowed)
        return ("peaked", why) if why else ("FAIL", f"output error {err:.3e} > allowed "
                                                    f"{allowed:.3e}")
    if lse is not None:
        want = call.to_lse(ref_lse)
        if lse.shape != want.shape:
            return "FAIL", f"lse shape {tuple(lse.shape)} != {tuple(want.shape)}"
        bad = _lse_ok(lse, want)
        if bad:
            return "FAIL", bad
    if grad_out is not None and out.requires_grad:
        grads = torch.autograd.grad(out, call.leaves, grad_out, allow_unused=True)
        for name, g, g64, gs in zip("qkv", grads, refs[3], refs[4]):
            if g is None:
                g = torch.zeros_like(g64)
            if torch.isnan(g).any():
                return "FAIL", f"NaN in d{name}"
            err, allowed = fa_rule_error(g, g64, gs, mult=3.0)
            if err > allowed:
                return "FAIL", f"d{name} error {err:.3e} > allowed {allowed:.3e}"
    elif grad_out is not None and not out.requires_grad:
        return "FAIL", "output not in the autograd graph"
    return "ok", ""


def references(call: Call, grad: bool) -> tuple[tuple, torch.Tensor | None]:
    with torch.enable_grad():
        ref64, ref_lse, ref_same = fa_references(*call.ref, call.params, layout=call.ref_layout)
    if not grad:
        return (ref64.detach(), ref_lse, ref_same.detach()), None
    out_shape = call.to_out(ref64).shape
    dout = torch.randn(out_shape, dtype=call.q.dtype)
    dref = call.to_out  # the layouts' maps are views: map dout back by autograd itself
    g64 = torch.autograd.grad(dref(ref64), call.leaves, dout.double(), retain_graph=True,
                              allow_unused=True)
    gs = torch.autograd.grad(dref(ref_same), call.leaves, dout, allow_unused=True)
    g64 = [torch.zeros_like(x, dtype=torch.float64) if g is None else g
           for g, x in zip(g64, call.leaves)]
    gs = [torch.zeros_like(x) if g is None else g for g, x in zip(gs, call.leaves)]
    return (ref64.detach(), ref_lse, ref_same.detach(), g64, gs), dout


def repro(fam: Family, seed: int, rep: int, backend: str) -> str:
    return (f"[--case {seed} --only '{backend}'] rep={rep} fam={fam}")


def run_case(seed: int, stats: dict, failures: list, budget_end: float,
             only: set | None = None) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    fam = draw_family(rng)
    names = [n for n in candidates(fam) if only is None or n in only]
    prev = None
    plain = fam.layout in ("bshd", "bhsd") and not (fam.alibi or fam.prefix or fam.colmask)
    for rep in range(rng.choice([2, 2, 3] if not plain else [3, 5, 6])):
        if time.monotonic() > budget_end:
            return
        lens_q, lens_k = draw_lengths(fam, rng, rep)
        if rep and rng.random() < 0.3:  # same shapes, another window / softcap / scale
            if fam.window is not None:
                fam.window = (rng.choice([0, 1, 3, 6]), rng.choice([0, 2]) if not fam.causal
                              else 0)
            if fam.softcap is not None:
                fam.softcap = rng.choice([2.0, 10.0, 30.0])
            if fam.scale is not None and not fam.grad:
                fam.scale = rng.choice([1e-3, 0.05, 0.5, 2.0])
        try:
            call = make_call(fam, gen, rng, lens_q, lens_k)
            if prev is not None and rng.random() < 0.5:
                reuse_in_place(call, prev)
            prev = call
            refs, dout = references(call, fam.grad)
        except InputError as exc:  # a mod that refuses this shape: the case is invalid
            stats["invalid"] += 1
            stats.setdefault("invalid_msgs", set()).add(str(exc)[:120])
            return
        mode = rng.choice(["plain"] * 6 + ["inference", "no_grad"]) if not fam.grad else "plain"
        for name in names:
            kw_show = {k: v for k, v in call.kw.items() if not isinstance(v, torch.Tensor)}
            try:
                if mode == "inference":
                    with torch.inference_mode():
                        status, detail = check_one(call, name, refs, dout)
                elif mode == "no_grad":
                    with torch.no_grad():
                        status, detail = check_one(call, name, refs, dout)
                else:
                    status, detail = check_one(call, name, refs, dout)
            except Exception:
                status, detail = "FAIL", "checker raised:\n" + traceback.format_exc()[-1500:]
            stats[status] += 1
            stats.setdefault("by_backend", {}).setdefault(name, {}).setdefault(status, 0)
            stats["by_backend"][name][status] += 1
            if status == "refused":
                rs = stats.setdefault("refusals", {}).setdefault(name, {})
                rs[detail[:100]] = rs.get(detail[:100], 0) + 1
            if status == "input":
                stats.setdefault("input_msgs", {}).setdefault(detail[:160], repro(
                    fam, seed, rep, name))
            if status == "peaked":
                stats.setdefault("peaked_msgs", []).append(f"{repro(fam, seed, rep, name)}"
                                                           f"\n    {detail}")
            if status == "FAIL":
                failures.append(f"{repro(fam, seed, rep, name)} lens_q={lens_q} "
                                f"lens_k={lens_k} mode={mode} kw={kw_show}\n    {detail}")
                print("FAIL", failures[-1], flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=600.0)
    ap.add_argument("--only", default=None, help="comma-separated backends (and <policy>)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print refusal reasons")
    ap.add_argument("--case", type=int, default=None, help="run this one case seed only")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    end = time.monotonic() + args.budget_s
    stats: dict = {"ok": 0, "refused": 0, "input": 0, "peaked": 0, "FAIL": 0, "invalid": 0}
    failures: list[str] = []
    done = 0
    seeds = ([args.case] if args.case is not None
             else [args.seed * 1_000_003 + i for i in range(args.cases)])
    only = set(args.only.split(",")) if args.only else None
    for seed in seeds:
        if time.monotonic() > end:
            break
        run_case(seed, stats, failures, end, only)
        done += 1
    print(f"fuzz_cpu: {done} cases, {stats['ok']} ok, {stats['refused']} refused, "
          f"{stats['input']} input errors, {stats['invalid']} invalid draws, "
          f"{stats['peaked']} peaked (not failed: module docstring), {len(failures)} FAILED")
    for name, st in sorted(stats.get("by_backend", {}).items()):
        print(f"  {name}: {st}")
    if args.verbose:
        for name, rs in sorted(stats.get("refusals", {}).items()):
            for why, n in sorted(rs.items(), key=lambda x: -x[1])[:8]:
                print(f"  refused {name} x{n}: {why}")
    for msg in sorted(stats.get("invalid_msgs", ())) if args.verbose else ():
        print(f"  invalid draw (the reference refused it): {msg}")
    for msg in stats.get("peaked_msgs", []):
        print(f"  peaked: {msg}")
    for msg, rep in stats.get("input_msgs", {}).items():
        print(f"  input error: {msg}\n    first at {rep}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
