"""Decode throughput of ``triton_decode`` (contiguous and paged KV) against SDPA, FA3 and Flex.

One query token, 32 query / 8 KV heads, head dim 128, bf16, batch x context in
{1x32k, 1x128k, 16x8k, 64x4k, 64x32k}. TB/s counts the KV bytes read (2 x B x S x Hkv x D x
2 bytes) over the time per call. Two clocks:

* GPU time: CUDA-graph replay of many calls (the way serving engines run decode), cycling
  over copies of the cache so that no call finds its KV in L2;
* eager time: ``triton.testing.do_bench`` (L2 flushed), which also counts the host's launch
  work whenever that is longer than the kernels (small shapes).

Every kernel's output is checked against an fp32 reference in the same run (FlashAttention
rule against SDPA's own bf16 error). ``--sweep`` also times a grid of tile configs and split
counts (GPU time), which is how the sm90 row of ``decode_configs`` is chosen.

    python benchmarks/triton_decode.py [--out docs/benchmarks] [--sweep] [--commit abc1234]

Writes ``triton_decode.json`` and ``triton_decode.md`` (date, GPU, commit) into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "triton_portable")]
SMOKE = "--smoke" in sys.argv  # the script's own check on a CPU: tiny shapes, interpreter
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEV = "cpu" if SMOKE else "cuda"

import triton
from attnhub_triton_portable.decode import decode_attention
from attnhub_triton_portable.decode_configs import (
    DecodeConfig,
    choose_splits,
    decode_config,
)

from attnhub.timing import source_commit


def sweep_setup(out_dir: str) -> tuple[Path, str, int, str]:
    """A sweep's output folder (made) and the device it runs on: (out, GPU name, SM count,
    arch such as ``sm90``); the CPU interpreter under ``--smoke``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if SMOKE:
        return out, "CPU interpreter", 4, "cpu"
    props = torch.cuda.get_device_properties(0)
    return out, props.name, props.multi_processor_count, f"sm{props.major}{props.minor}"


SHAPES = [(1, 64), (2, 32)] if SMOKE else [(1, 32768), (1, 131072), (16, 8192), (64, 4096),
                                           (64, 32768)]
#: Flex compiles once per shape (tens of seconds): timed on one shape only.
FLEX_SHAPES = {(1, 32768), (1, 64)}
HQ, HKV, D, PAGE = (8, 2, 32, 16) if SMOKE else (32, 8, 128, 16)
SCALE = D ** -0.5
#: Tile configs tried by --sweep: (block_n, warps, stages).
SWEEP_TILES = [(64, 4, 3), (64, 4, 4), (128, 8, 3), (128, 4, 3)]


def kv_bytes(batch: int, ctx: int) -> int:
    return 2 * batch * ctx * HKV * D * 2


L2_BYTES = 60e6


def eager_us(fn: Callable[[], Any], rep: int = 40) -> float:
    """do_bench median (L2 flushed before each call); host-bound shapes show launch cost."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")) * 1e3


def gpu_us(fns: list[Callable[[], Any]], est_us: float) -> float:
    """GPU time per call: a CUDA graph of many calls cycling over ``fns`` (one per cache
    copy), replayed 5 times; median replay / calls."""
    if SMOKE:
        return eager_us(fns[0])
    calls = int(min(40, max(4, 3000 / max(est_us, 1.0))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return sorted(times)[2]


def host_us(fn: Callable[[], Any], calls: int = 300) -> float:
    """Host time per call on a tiny shape (the GPU never holds the host back)."""
    if SMOKE:
        calls = 2
    for _ in range(2 if SMOKE else 20):
        fn()
    if not SMOKE:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


class Case:
    """Tensors of one shape: q, contiguous k/v, and the same cache in shuffled 16-key pages."""

    def __init__(self, batch: int, ctx: int, seed: int = 0):
        g = torch.Generator(device=DEV).manual_seed(batch * 7 + ctx + 1000 * seed)
        mk = lambda *s: torch.randn(*s, device=DEV, generator=g,
                                    dtype=torch.bfloat16)
        self.batch, self.ctx = batch, ctx
        self.q, self.k, self.v = mk(batch, 1, HQ, D), mk(batch, ctx, HKV, D), mk(batch, ctx, HKV, D)
        pages = batch * ctx // PAGE
        perm = torch.randperm(pages, device=DEV, generator=g)
        self.table = perm.view(batch, ctx // PAGE).to(torch.int32)
        self.kc = torch.empty(pages, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16)
        self.vc = torch.empty_like(self.kc)
        self.kc[perm] = self.k.reshape(pages, PAGE, HKV, D)
        self.vc[perm] = self.v.reshape(pages, PAGE, HKV, D)
        self.seqlens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)

    def ours(self, paged: bool, **kw: Any) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        if paged:
            return lambda: decode_attention(self.q, self.kc, self.vc, scale=SCALE,
                                            block_table=self.table, seqlens_k=self.seqlens,
                                            max_seqlen_k=self.ctx, **kw)
        return lambda: decode_attention(self.q, self.k, self.v, scale=SCALE, **kw)

    def sdpa(self) -> Callable[[], torch.Tensor]:
        qt, kt, vt = self.q.transpose(1, 2), self.k.transpose(1, 2), self.v.transpose(1, 2)
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, scale=SCALE,
                                                      enable_gqa=True).transpose(1, 2)

    def fa3(self, fa3: Callable[..., Any]) -> Callable[[], torch.Tensor]:
        return lambda: fa3(self.q, self.k, self.v, softmax_scale=SCALE, num_splits=0)

    def reference(self) -> torch.Tensor:
        """fp32 attention, one KV head group at a time (keeps memory small)."""
        out = torch.empty(self.batch, 1, HQ, D, device=DEV, dtype=torch.float32)
        g = HQ // HKV
        for h in range(HKV):
            q = self.q[:, 0, h * g:(h + 1) * g].float()  # (B, g, D)
            k, v = self.k[:, :, h].float(), self.v[:, :, h].float()  # (B, S, D)
            p = torch.softmax(torch.bmm(q, k.transpose(1, 2)) * SCALE, dim=-1)
            out[:, 0, h * g:(h + 1) * g] = torch.bmm(p, v)
        return out


def fa_rule(out: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor) -> dict[str, Any]:
    """FlashAttention rule against SDPA's bf16 error (x2, plus the rounding floor)."""
    err = float((out.float() - ref).abs().max())
    base = float((baseline.float() - ref).abs().max())
    floor = float(((ref.bfloat16() + 0.3 - 0.3).float() - ref).abs().max())
    return {"max_err": err, "sdpa_err": base, "ok": err <= 2 * base + floor + 1e-5}


def load_fa3() -> Callable[..., Any] | None:
    try:
        import fa3_fwd_config

        sys.modules.setdefault("flash_attn_config", fa3_fwd_config)
        from fa3_fwd_interface import flash_attn_with_kvcache
    except Exception as exc:  # report, never hide: the table says why the column is empty
        print(f"FA3 not available: {type(exc).__name__}: {exc}")
        return None
    return flash_attn_with_kvcache


def ceilings() -> dict[str, float]:
    """Read-only and copy bandwidth of this GPU (TB/s) on 2 GiB of bf16."""
    x = torch.randn(2 ** 12 if SMOKE else 2 ** 30, device=DEV, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    read = eager_us(lambda: x.sum(dtype=torch.float32))
    copy = eager_us(lambda: y.copy_(x))
    return {"read_sum_TBps": x.nbytes / read / 1e6, "copy_rw_TBps": 2 * x.nbytes / copy / 1e6}


def copies_of(batch: int, ctx: int) -> list[Case]:
    """Enough copies of the cache that cycling through them overflows L2 three times."""
    n = max(1, min(4, math.ceil(3 * L2_BYTES / kv_bytes(batch, ctx))))
    return [Case(batch, ctx, seed=i) for i in range(1 if SMOKE else n)]


def est(batch: int, ctx: int) -> float:
    return kv_bytes(batch, ctx) / 4e6 + 5.0


def timed(cases: list[Case], make: Callable[[Case], Callable[[], Any]], ref: torch.Tensor,
          sdpa_out: torch.Tensor, eager: bool = False) -> dict[str, Any]:
    c = cases[0]
    out = make(c)()
    out = out[0] if isinstance(out, tuple) else out
    res = {"gpu_us": gpu_us([make(x) for x in cases], est(c.batch, c.ctx)),
           **fa_rule(out, ref, sdpa_out)}
    if eager:
        res["eager_us"] = eager_us(make(c))
    return res


def peer(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A peer's measurement, or the error it raised (a peer failing is a result too)."""
    try:
        return measure()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def sweep_splits(batch: int, ctx: int, sms: int) -> list[int]:
    """Split counts that fill 1, 2 and 4 rounds of SMs, at most one per 32 keys."""
    base = batch * HKV
    cands = {max(1, min(ctx // 32, round(k * sms / base))) for k in (1, 2, 4)}
    return sorted(cands | {1})


def run_sweep(cases: list[Case], sms: int, deadline: float) -> list[dict[str, Any]]:
    rows = []
    c = cases[0]
    for bn, warps, stages in SWEEP_TILES:
        cfg = DecodeConfig(block_n=bn, num_warps=warps, num_stages=stages)
        for splits in sweep_splits(c.batch, c.ctx, sms):
            for paged in (False, True):
                if time.time() > deadline:
                    return rows
                us = gpu_us([x.ours(paged, num_splits=splits, config=cfg) for x in cases],
                            est(c.batch, c.ctx))
                rows.append({"batch": c.batch, "ctx": c.ctx, "block_n": bn, "warps": warps,
                             "stages": stages, "splits": splits, "paged": paged,
                             "gpu_us": us, "TBps": kv_bytes(c.batch, c.ctx) / us / 1e6})
    return rows


def time_flex(flex: Callable[..., Any], case: Case) -> dict[str, Any]:
    qt, kt, vt = (x.transpose(1, 2) for x in (case.q, case.k, case.v))
    fn = lambda: flex(qt, kt, vt, scale=SCALE, enable_gqa=True)
    try:
        out = fn().transpose(1, 2)
    except Exception as exc:  # Inductor failures are a result here (the README saw one)
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return {"eager_us": eager_us(fn), **fa_rule(out, case.reference(), case.sdpa()())}


def _add_tbps(row: dict[str, Any]) -> None:
    nbytes = kv_bytes(row["batch"], row["ctx"])
    for val in row.values():
        if isinstance(val, dict):
            for key in ("gpu_us", "eager_us"):
                if key in val:
                    val[key.replace("_us", "_TBps")] = nbytes / val[key] / 1e6


def host_overheads(fa3: Callable[..., Any] | None) -> dict[str, float]:
    """Host us per call at 1 x 1k; ``*_triton_dispatch``: every launch through Triton's
    dispatch (``fastlaunch.DIRECT = False``), i.e. without the direct launch path."""
    from attnhub_triton_portable import fastlaunch

    c = Case(1, 1024)
    res = {"ours": host_us(c.ours(False)), "ours_paged16": host_us(c.ours(True)),
           "sdpa": host_us(c.sdpa())}
    fastlaunch.DIRECT = False
    res["ours_triton_dispatch"] = host_us(c.ours(False))
    res["ours_paged16_triton_dispatch"] = host_us(c.ours(True))
    fastlaunch.DIRECT = True
    if fa3 is not None:
        res["fa3"] = host_us(c.fa3(fa3))
    return res


def measure_shape(batch: int, ctx: int, arch: str, sms: int,
                  fa3: Callable[..., Any] | None) -> dict[str, Any]:
    """One row: ours (table config, contiguous and paged, two-pass and fused merge), SDPA and
    FA3, each timed and checked; plus bit-for-bit checks between our variants."""
    cases = copies_of(batch, ctx)
    c = cases[0]
    ref, sdpa_out = c.reference(), c.sdpa()()
    # the rows decode_attention picks for this grid (paged: the few-programs row when the
    # (sequence, KV head) pairs fit one round)
    cfg_c = decode_config(arch)
    cfg_p = decode_config(arch, paged=True, programs=(batch * HKV, sms))
    fused_c, fused_p = cfg_c.with_(fused_merge=True), cfg_p.with_(fused_merge=True)
    row: dict[str, Any] = {"batch": batch, "ctx": ctx, "kv_MB": kv_bytes(batch, ctx) / 1e6,
                           "splits": choose_splits(batch, HKV, ctx, sms, cfg_c),
                           "splits_paged": choose_splits(batch, HKV, ctx, sms, cfg_p)}
    row["ours"] = timed(cases, lambda x: x.ours(False), ref, sdpa_out, eager=True)
    row["ours_paged16"] = timed(cases, lambda x: x.ours(True), ref, sdpa_out, eager=True)
    row["ours_fused"] = timed(cases, lambda x: x.ours(False, config=fused_c), ref, sdpa_out)
    row["ours_paged16_fused"] = timed(cases, lambda x: x.ours(True, config=fused_p), ref,
                                      sdpa_out)
    two_pass, paged = c.ours(False)()[0], c.ours(True)()[0]
    fused = [c.ours(False, config=fused_c)()[0] for _ in range(3)]
    row["paged_equal_contiguous"] = bool(torch.equal(paged, two_pass))
    row["fused_repeat_equal"] = all(torch.equal(f, fused[0]) for f in fused)
    row["fused_vs_two_pass_max_diff"] = float((fused[0].float() - two_pass.float()).abs().max())
    row["sdpa"] = peer(lambda: timed(cases, lambda x: x.sdpa(), ref, sdpa_out, eager=True))
    if fa3 is not None:
        row["fa3"] = peer(lambda: timed(cases, lambda x: x.fa3(fa3), ref, sdpa_out,
                                        eager=True))
    _add_tbps(row)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--sweep", action="store_true", help="also time tile configs x splits")
    ap.add_argument("--commit", default=None, help="git commit of the tree (default: git)")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; optional parts stop")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter check of the script")
    ap.add_argument("--paged-study", action="store_true",
                    help="only the paged study (sequential vs random tables, tiles, FP8)")
    ap.add_argument("--second", action="store_true",
                    help="with --paged-study: the second variant set (table rows, FP8 tiles)")
    args = ap.parse_args()
    t0 = time.time()
    deadline = t0 + args.budget
    if SMOKE:
        name, sms, arch = "CPU (interpreter smoke run)", 4, "cpu"
    else:
        props = torch.cuda.get_device_properties(0)
        name, sms, arch = props.name, props.multi_processor_count, \
            f"sm{props.major}{props.minor}"
    commit = args.commit or source_commit(ROOT)
    meta: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "gpu": name, "sm_count": sms,
        "commit": commit or "unknown", "torch": torch.__version__, "triton": triton.__version__,
        "config": repr(decode_config(arch)), "config_paged": repr(decode_config(arch, paged=True))}
    print(json.dumps(meta), flush=True)
    if args.paged_study:
        meta["ceilings"] = ceilings()
        meta["config_paged_fp8"] = repr(decode_config(arch, paged=True, kv_fp8=True))
        meta["paged_study"] = paged_study(Path(args.out), arch, sms, deadline, args.second)
        meta["seconds"] = time.time() - t0
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "triton_decode_paged.json").write_text(json.dumps(meta, indent=1))
        return
    meta["ceilings"] = ceilings()
    fa3 = None if SMOKE else load_fa3()
    meta["host_us"] = host_overheads(fa3)
    print(meta["ceilings"], meta["host_us"], flush=True)
    rows, sweep = [], []
    for batch, ctx in SHAPES:
        row = measure_shape(batch, ctx, arch, sms, fa3)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if not SMOKE:
            torch.cuda.empty_cache()
    for batch, ctx in sorted(SHAPES, key=lambda s: s[0]) if args.sweep else []:
        if time.time() < deadline:  # small batches first: that is where splits matter
            sweep += run_sweep(copies_of(batch, ctx), sms, deadline)
            if not SMOKE:
                torch.cuda.empty_cache()
    if not args.no_flex:  # last: each shape compiles for tens of seconds
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention)
        for row in rows:
            if (row["batch"], row["ctx"]) in FLEX_SHAPES and time.time() < deadline - 45:
                row["flex"] = time_flex(flex, Case(row["batch"], row["ctx"]))
                _add_tbps(row)
                print(json.dumps({"flex": row["flex"], "batch": row["batch"]}), flush=True)
    result = {**meta, "rows": rows, "sweep": sweep, "seconds": time.time() - t0}
    write(result, Path(args.out))


class PagedCase:
    """One batch x context over one pool of 16-key pages, read through a sequential table
    (page b * P + j) and through a random one (pages scattered, as after a server ran a
    while); bf16 and e4m3 (per-(page, head) descales, ``core.kvquant``) copies of the pool."""

    def __init__(self, batch: int, ctx: int, seed: int = 0, fp8: bool = True):
        g = torch.Generator(device=DEV).manual_seed(batch * 7 + ctx + 1000 * seed)
        self.batch, self.ctx = batch, ctx
        pages = batch * ctx // PAGE
        self.q = torch.randn(batch, 1, HQ, D, device=DEV, generator=g, dtype=torch.bfloat16)
        self.kc = torch.randn(pages, PAGE, HKV, D, device=DEV, generator=g, dtype=torch.bfloat16)
        self.vc = torch.randn(pages, PAGE, HKV, D, device=DEV, generator=g, dtype=torch.bfloat16)
        self.tables = {
            "sequential": torch.arange(pages, device=DEV, dtype=torch.int32).view(batch, -1),
            "random": torch.randperm(pages, device=DEV, generator=g).to(torch.int32).view(
                batch, -1)}
        self.seqlens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
        self.k8 = self.v8 = None
        if fp8:
            from attnhub.core.kvquant import FP8_MAX

            self.kd = self.kc.float().abs().amax(dim=(1, 3)) / FP8_MAX[torch.float8_e4m3fn]
            self.vd = self.vc.float().abs().amax(dim=(1, 3)) / FP8_MAX[torch.float8_e4m3fn]
            self.k8 = (self.kc.float() / self.kd[:, None, :, None]).to(torch.float8_e4m3fn)
            self.v8 = (self.vc.float() / self.vd[:, None, :, None]).to(torch.float8_e4m3fn)

    def ours(self, table: str, fp8: bool = False, **kw: Any) -> Callable[[], Any]:
        t = self.tables[table]
        if fp8:
            return lambda: decode_attention(self.q, self.k8, self.v8, scale=SCALE, block_table=t,
                                            seqlens_k=self.seqlens, max_seqlen_k=self.ctx,
                                            k_descale=self.kd, v_descale=self.vd, **kw)
        return lambda: decode_attention(self.q, self.kc, self.vc, scale=SCALE, block_table=t,
                                        seqlens_k=self.seqlens, max_seqlen_k=self.ctx, **kw)

    def reference(self, table: str) -> torch.Tensor:
        """fp32 attention over the bf16 pool through ``table``, one sequence at a time."""
        out = torch.empty(self.batch, 1, HQ, D, device=DEV, dtype=torch.float32)
        g = HQ // HKV
        for b in range(self.batch):
            pages = self.tables[table][b].long()
            k = self.kc[pages].flatten(0, 1).float()  # (S, Hkv, D)
            v = self.vc[pages].flatten(0, 1).float()
            q = self.q[b, 0].float().view(HKV, g, D)
            s = torch.einsum("hgd,shd->hgs", q, k) * SCALE
            out[b, 0] = torch.einsum("hgs,shd->hgd", torch.softmax(s, -1), v).reshape(HQ, D)
        return out

    def sdpa_contiguous(self, table: str) -> Callable[[], Any]:
        pages = self.tables[table].long()
        k = self.kc[pages].flatten(1, 2).transpose(1, 2)  # (B, Hkv, S, D), a gathered copy
        v = self.vc[pages].flatten(1, 2).transpose(1, 2)
        qt = self.q.transpose(1, 2)
        return lambda: F.scaled_dot_product_attention(qt, k, v, scale=SCALE, enable_gqa=True)


#: --paged-study: shapes and the tile configs tried on top of the table's (GPU time).
STUDY_SHAPES = [(2, 64)] if SMOKE else [(64, 32768), (1, 131072), (1, 32768)]
STUDY_TILES = [dict(), dict(prefetch_pages=True), dict(block_n=128, num_warps=8, num_stages=3),
               dict(block_n=128, num_warps=8, num_stages=3, prefetch_pages=True),
               dict(block_n=64, num_stages=3, prefetch_pages=True),
               dict(block_n=32, num_stages=6, prefetch_pages=True)]
#: One-sequence shapes also try the merge fused into the last split (one launch less).
STUDY_FUSED = [dict(fused_merge=True), dict(fused_merge=True, prefetch_pages=True)]
#: FP8 cache (64 x 32k, random table): e4m3 tiles are half the bytes, so deeper pipelines fit.
STUDY_FP8 = [dict(), dict(num_stages=6), dict(num_stages=8), dict(prefetch_pages=True),
             dict(num_stages=6, prefetch_pages=True), dict(block_n=128, num_stages=4),
             dict(block_n=128, num_warps=8, num_stages=4, prefetch_pages=True)]


#: --second: after the first set picked prefetch_pages for the table (``{}`` is now the
#: table's config), the old row beside it and FP8 tile sizes around the FP8 row.
STUDY_SECOND = {
    "tiles": [dict(), dict(prefetch_pages=False)],
    "fused": [],
    "fp8": [dict(), dict(block_n=64), dict(block_n=128, num_stages=3),
            dict(block_n=128, num_warps=8)],
}


def paged_study(out_dir: Path, arch: str, sms: int, deadline: float,
                second: bool = False) -> dict[str, Any]:
    """Paged decode, sequential vs random tables: the table config, tile variants x splits
    (GPU time), eager time host included (kernel, backend and hub), FP8 vs bf16 cache."""
    from attnhub import Hub

    global STUDY_TILES, STUDY_FUSED, STUDY_FP8
    if second:
        STUDY_TILES, STUDY_FUSED, STUDY_FP8 = (STUDY_SECOND["tiles"], STUDY_SECOND["fused"],
                                               STUDY_SECOND["fp8"])
    res: dict[str, Any] = {"rows": [], "sweep": [], "eager": [], "fp8": []}
    base = decode_config(arch, paged=True)
    base8 = decode_config(arch, paged=True, kv_fp8=True)
    hub = Hub()
    for batch, ctx in STUDY_SHAPES:
        c = PagedCase(batch, ctx)
        nbytes = kv_bytes(batch, ctx)
        e = est(batch, ctx)
        for table in ("sequential", "random"):
            ref = c.reference(table)
            sdpa_fn = c.sdpa_contiguous(table)
            sdpa_out = sdpa_fn().transpose(1, 2)
            row: dict[str, Any] = {"batch": batch, "ctx": ctx, "table": table}
            out = c.ours(table)()[0]
            row["ours"] = {"gpu_us": gpu_us([c.ours(table)], e), **fa_rule(out, ref, sdpa_out)}
            row["sdpa_contiguous"] = {"gpu_us": gpu_us([sdpa_fn], e)}
            o8 = c.ours(table, fp8=True)()[0]
            row["ours_fp8"] = {"gpu_us": gpu_us([c.ours(table, fp8=True)], e / 2),
                               "rel_err": float((o8.float() - ref).norm() / ref.norm()),
                               "bf16_rel_err": float((out.float() - ref).norm() / ref.norm()),
                               "max_err": float((o8.float() - ref).abs().max())}
            for k in ("ours", "sdpa_contiguous"):
                row[k]["TBps"] = nbytes / row[k]["gpu_us"] / 1e6
            row["ours_fp8"]["tokens_per_s_ratio"] = row["ours"]["gpu_us"] / row["ours_fp8"]["gpu_us"]
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
            splits0 = choose_splits(batch, HKV, ctx, sms, base)
            variants = [(t, False) for t in STUDY_TILES + (STUDY_FUSED if batch == 1 else [])]
            if table == "random" and (batch > 1 or second):
                variants += [(t, True) for t in STUDY_FP8]
            for tiles, fp8 in variants:
                cfg = (base8 if fp8 else base).with_(**tiles)
                cands = sorted({splits0, min(128, splits0 * 2)}) if batch == 1 else [splits0]
                for splits in cands:
                    if time.time() > deadline:
                        break
                    cell = {"batch": batch, "ctx": ctx, "table": table, "cfg": tiles,
                            "splits": splits, "fp8": fp8}
                    try:
                        fn = c.ours(table, fp8=fp8, config=cfg, num_splits=splits)
                        o = fn()[0]
                        us = gpu_us([fn], e)
                    except Exception as exc:  # a config that does not compile is a result
                        res["sweep"].append({**cell, "error": f"{type(exc).__name__}: "
                                                              f"{str(exc)[:150]}"})
                        continue
                    check = ({"rel_err": float((o.float() - ref).norm() / ref.norm())} if fp8
                             else {"ok": fa_rule(o, ref, sdpa_out)["ok"]})
                    res["sweep"].append({**cell, "gpu_us": us, "TBps": nbytes / us / 1e6,
                                         **check})
                    print("cell", json.dumps(res["sweep"][-1]), flush=True)
            best = [r for r in res["sweep"] if r["batch"] == batch and r["ctx"] == ctx
                    and r["table"] == table and "gpu_us" in r and not r["fp8"]]
            if best:
                print("best", json.dumps(min(best, key=lambda r: r["gpu_us"])), flush=True)
        # eager, host included: kernel call, backend forward, hub.attention (policy binds)
        t = c.tables["random"]
        kw = {"layout": "paged", "block_table": t, "seqlens_k": c.seqlens}
        bound = hub.attention(c.q, c.kc, c.vc, **kw)  # first call binds
        ev = {"batch": batch, "ctx": ctx, "table": "random",
              "ours_kernel_us": eager_us(c.ours("random")),
              "ours_kernel_fused_us": eager_us(c.ours(
                  "random", config=base.with_(fused_merge=True, prefetch_pages=True))),
              "ours_kernel_prefetch_us": eager_us(c.ours(
                  "random", config=base.with_(prefetch_pages=True))),
              "hub_us": eager_us(lambda: hub.attention(c.q, c.kc, c.vc, **kw)),
              "hub_forced_triton_decode_us": eager_us(
                  lambda: hub.attention(c.q, c.kc, c.vc, backend="triton_decode", **kw)),
              "sdpa_contiguous_us": eager_us(c.sdpa_contiguous("random")),
              "ours_fp8_kernel_us": eager_us(c.ours("random", fp8=True))}
        try:
            ev["hub_fp8_forced_us"] = eager_us(lambda: hub.attention(
                c.q, c.k8, c.v8, backend="triton_decode_fp8",
                extra={"k_descale": c.kd, "v_descale": c.vd}, **kw))
        except Exception as exc:
            ev["hub_fp8_forced_us"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        try:
            dec = hub.decide(hub_spec(c, fp8=False))
            ev["bound"] = getattr(dec, "backend", str(dec)[:80])
        except Exception as exc:
            ev["bound"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        del bound
        print(json.dumps(ev), flush=True)
        res["eager"].append(ev)
        del c
        if not SMOKE:
            torch.cuda.empty_cache()
    return res


def hub_spec(c: PagedCase, fp8: bool) -> Any:
    from attnhub import AttentionSpec

    return AttentionSpec(phase="decode", dtype="bf16", kv_dtype="fp8_e4m3" if fp8 else "bf16",
                         head_dim=D, num_q_heads=HQ, num_kv_heads=HKV, layout="paged",
                         max_seqlen_q=1, max_seqlen_k=c.ctx, batch=c.batch,
                         page_size=PAGE).bucketed()


def _cell(row: dict[str, Any], key: str, clock: str = "gpu") -> str:
    v = row.get(key)
    if v is None or f"{clock}_us" not in v and "error" not in v:
        return "-"
    if "error" in v:
        return "failed"
    flag = "" if v["ok"] else " (FA rule failed)"
    return f"{v[clock + '_TBps']:.2f} ({v[clock + '_us']:.1f} us){flag}"


def write(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "triton_decode.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out / "triton_decode.json")
    c, h = result["ceilings"], result["host_us"]
    lines = [
        "# Split-KV decode (`triton_decode`) on one GPU",
        "",
        (f"Date {result['date']}, {result['gpu']} ({result['sm_count']} SMs), commit "
         f"{result['commit']}, torch {result['torch']}, triton {result['triton']}. "
         "One query token, 32 query / 8 KV heads, d=128, bf16. TB/s = KV bytes read / time "
         "per call. GPU time: CUDA-graph replay, cycling over cache copies so that L2 holds "
         "no call's KV; eager: `do_bench` (L2 flushed), which includes host launch work when "
         "that is longer than the kernels. Every cell passed the FlashAttention rule against "
         "an fp32 reference (2x SDPA's bf16 error) unless marked. Ceilings on this GPU: read "
         f"(sum) {c['read_sum_TBps']:.2f} TB/s, copy {c['copy_rw_TBps']:.2f} TB/s "
         "(read+write)."),
        f"Configs: contiguous {result['config']}; paged {result['config_paged']}.",
        "",
        "GPU time (CUDA graphs), TB/s (us per call):",
        "",
        ("| batch x context | KV MB | splits | ours contiguous | ours paged 16 | ours fused "
         "merge | ours paged fused | SDPA (GQA) | FA3 kvcache |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} x {r['ctx'] // 1024}k | {r['kv_MB']:.0f} | {r['splits']} | "
            f"{_cell(r, 'ours')} | {_cell(r, 'ours_paged16')} | {_cell(r, 'ours_fused')} | "
            f"{_cell(r, 'ours_paged16_fused')} | {_cell(r, 'sdpa')} | {_cell(r, 'fa3')} |")
    lines += ["", "Eager (`do_bench`, no graphs), TB/s (us per call):", "",
              "| batch x context | ours contiguous | ours paged 16 | SDPA (GQA) | FA3 | Flex |",
              "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} x {r['ctx'] // 1024}k | {_cell(r, 'ours', 'eager')} | "
            f"{_cell(r, 'ours_paged16', 'eager')} | {_cell(r, 'sdpa', 'eager')} | "
            f"{_cell(r, 'fa3', 'eager')} | {_cell(r, 'flex', 'eager')} |")
    lines += ["", "Host time per call (1 x 1k, us): " + ", ".join(
        f"{k} {v:.1f}" for k, v in h.items()) + ".", "",
        "Checks per shape: paged == contiguous bit for bit: " + ", ".join(
            str(r["paged_equal_contiguous"]) for r in result["rows"])
        + "; fused merge repeatable: " + ", ".join(
            str(r["fused_repeat_equal"]) for r in result["rows"])
        + "; fused vs two-pass max |diff|: " + ", ".join(
            f"{r['fused_vs_two_pass_max_diff']:.1e}" for r in result["rows"]) + "."]
    if result["sweep"]:
        lines += ["", "Best of the sweep (tile config x splits, GPU time) per shape:", "",
                  "| batch x context | layout | block_n | warps | stages | splits | TB/s | us |",
                  "|---|---|---|---|---|---|---|---|"]
        for (b, ctx) in SHAPES:
            for paged in (False, True):
                cand = [s for s in result["sweep"] if s["batch"] == b and s["ctx"] == ctx
                        and s["paged"] == paged]
                if cand:
                    s = min(cand, key=lambda s: s["gpu_us"])
                    lines.append(
                        f"| {b} x {ctx // 1024}k | {'paged 16' if paged else 'contiguous'} | "
                        f"{s['block_n']} | {s['warps']} | {s['stages']} | {s['splits']} | "
                        f"{s['TBps']:.2f} | {s['gpu_us']:.1f} |")
    tmp = out / "triton_decode.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out / "triton_decode.md")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
