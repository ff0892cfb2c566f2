"""The NVIDIA backends on one GPU, in one run: tests, wrapper overhead, cell grid, FP8.

    python benchmarks/nvidia_backends.py --out docs/benchmarks        # on the H200
    python benchmarks/nvidia_backends.py --smoke --out /tmp/x          # CPU: logic only

Sections (each guarded by the deadline, results saved after each):
1. the GPU tests of sm80_fa2 and sm90_fa3 (pytest -m gpu), FlashInfer's last, after its JIT
   compile (started in the background at once, ~90 s per kernel module);
2. FP8 against BF16 FA3 forward at 16k: kernel only, with an FP8 KV cache (only Q quantized),
   and with per-call quantization (plain, smooth_k); errors vs fp32 on random inputs, a x20
   query channel and a +20 key-channel offset;
3. the cell grid (training fwd+bwd, prefill, decode) with every available backend side by
   side, each output checked against torch_sdpa's before it is timed, plus what the default
   policy binds;
4. FlashInfer decode with and without tensor cores per GQA ratio and shape (feeds
   attnhub_sm80_fa2/data/decode_tensor_cores.json);
5. each wrapper against the raw library call at 4k, back-to-back calls, host time included.
Writes nvidia_backends.json and nvidia_backends.md (date, GPU, commit) into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from attnhub.timing import source_commit

ROOT = Path(__file__).resolve().parents[1]
MINE = ("fa2", "fa2_torch", "flashinfer_decode", "flashinfer_prefill", "fa3", "cudnn",
        "fa3_fp8")
#: Other plugins' backends timed last (a fault there cannot cost this run's own results).
#: flex is left out: torch.compile per shape costs more device time than this run has.
OTHERS = ("torch_sdpa", "triton", "triton_decode")


# -- timing -----------------------------------------------------------------------------------
def gpu_ms(fn: Callable[[], Any], smoke: bool = False) -> float:
    """Median kernel time (triton's do_bench, as the GPU README prescribes)."""
    if smoke or not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def host_ms(fn: Callable[[], Any], calls: int = 50, repeats: int = 7) -> float:
    """Wall time per call of back-to-back calls, host work included (median of repeats)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


# -- shapes and inputs ------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    phase: str  # train | prefill | decode
    b: int
    sq: int
    sk: int
    hq: int
    hkv: int
    d: int = 128
    causal: bool = True

    @property
    def label(self) -> str:
        return (f"{self.phase} b={self.b} sq={self.sq} sk={self.sk} h={self.hq}:{self.hkv} "
                f"d={self.d}{' causal' if self.causal else ''}")

    def work(self, ms: float) -> str:
        """TFLOP/s (fwd 4*b*h*sq*sk*d, halved when causal; train x3.5) or KV TB/s."""
        if self.phase == "decode":
            return f"{2 * self.b * self.sk * self.hkv * self.d * 2 / ms / 1e9:.2f} TB/s"
        flops = 4 * self.b * self.hq * self.sq * self.sk * self.d * (0.5 if self.causal else 1)
        return f"{flops * (3.5 if self.phase == 'train' else 1) / ms / 1e9:.0f} TFLOP/s"


def spec_for(cell: Cell, layout: str = "bshd", page: int = 0, kv_dtype: str | None = None):
    import attnhub

    return attnhub.AttentionSpec(
        phase=cell.phase, dtype="bf16", kv_dtype=kv_dtype, head_dim=cell.d,
        num_q_heads=cell.hq, num_kv_heads=cell.hkv, layout=layout,
        mask=attnhub.MaskSpec(causal=cell.causal), max_seqlen_q=cell.sq, max_seqlen_k=cell.sk,
        batch=cell.b, needs_grad=cell.phase == "train", page_size=page).bucketed()


def rand(*shape: int, dev: str, seed: int, grad: bool = False) -> torch.Tensor:
    g = torch.Generator(dev).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=dev).to(torch.bfloat16).requires_grad_(grad)


def paged_view(k: torch.Tensor, v: torch.Tensor, page: int):
    """The contiguous (B, S, H, D) cache as pages, with its block table and lengths."""
    b, s, h, d = k.shape
    n = s // page
    table = torch.arange(b * n, device=k.device, dtype=torch.int32).view(b, n)
    lens = torch.full((b,), s, device=k.device, dtype=torch.int32)
    return k.reshape(b * n, page, h, d), v.reshape(b * n, page, h, d), table, lens


# -- the run ----------------------------------------------------------------------------------
class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.monotonic()
        self.dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if self.dev == "cuda" else "cpu (smoke)",
            "commit": source_commit(ROOT),
            "torch": torch.__version__, "sections": {}, "errors": {}}
        import attnhub

        self.hub = attnhub.Hub()
        self.data["versions"] = dict(self.hub.device.versions)
        self.reg = self.hub.registry

    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.t0)

    def section(self, name: str, need_s: float, fn: Callable[[], Any]) -> None:
        if self.left() < need_s:
            self.data["sections"][name] = {"skipped": f"deadline: {self.left():.0f} s left, "
                                                      f"needs ~{need_s:.0f} s"}
            print(f"[{name}] skipped (deadline)", flush=True)
            return
        t = time.monotonic()
        print(f"[{name}] start at {t - self.t0:.0f} s", flush=True)
        try:
            self.data["sections"][name] = fn()
        except Exception as exc:  # noqa: BLE001 - a section's failure is recorded, not fatal
            import traceback

            self.data["errors"][name] = traceback.format_exc()[-3000:]
            print(f"[{name}] FAILED: {exc!r}", flush=True)
        print(f"[{name}] done in {time.monotonic() - t:.0f} s", flush=True)
        self.save()

    def backend(self, name: str) -> Any:
        b = self.reg.get(name)
        b.load()
        return b

    def usable(self, name: str, spec: Any) -> str | None:
        if name not in self.reg.backends:
            return "not registered"
        why = self.reg.get(name).check(spec, self.hub.device)
        return why[0] if why else None

    def save(self) -> None:
        (self.out / "nvidia_backends.json").write_text(json.dumps(self.data, indent=1,
                                                                  default=str) + "\n")
        (self.out / "nvidia_backends.md").write_text(markdown(self.data))


def run_tests(r: Run, which: str) -> dict[str, Any]:
    paths = [str(ROOT / "plugins/sm90_fa3/tests/test_gpu.py"),
             str(ROOT / "plugins/sm80_fa2/tests/test_gpu.py")]
    sel = "flashinfer" if which == "flashinfer" else "not flashinfer"
    opts = ["-o", "addopts=", "--import-mode=importlib", "-p", "no:cacheprovider", "-q", "-rs"]
    proc = subprocess.run([sys.executable, "-m", "pytest", *paths, "-m", "gpu", "-k", sel,
                           *opts], cwd=ROOT, text=True,
                          capture_output=True, timeout=max(30, r.left() - 20))
    tail = proc.stdout.strip().splitlines()
    print("\n".join(tail[-40:]), flush=True)
    return {"returncode": proc.returncode, "summary": tail[-1] if tail else "",
            "output_tail": "\n".join(tail[-80:]), "stderr_tail": proc.stderr[-2000:]}


# -- FP8 at 16k -------------------------------------------------------------------------------
def fp8_section(r: Run) -> dict[str, Any]:
    from attnhub_sm90_fa3.fp8 import quantize, quantize_operands

    from attnhub.plugin import AttnParams, reference_attention

    s = 256 if r.args.smoke else 16384
    h, d, rows = 16, 128, (64 if r.args.smoke else 1024)
    fa3, fp8 = r.backend("fa3"), r.backend("fa3_fp8")
    fa = fa3._run.fa
    res: dict[str, Any] = {"shape": f"b=1 s={s} h={h}:{h} d={d}", "rows_checked": rows,
                           "cases": []}
    for causal in (False, True):
        cell = Cell("prefill", 1, s, s, h, h, d, causal)
        spec = spec_for(cell)
        q, k, v = (rand(1, s, h, d, dev=r.dev, seed=i) for i in range(3))
        p = AttnParams(scale=d ** -0.5, causal=causal, max_seqlen_q=s, max_seqlen_k=s)
        ops = quantize_operands(q, k, v, "plain")
        k8, kd = quantize(k, h)
        v8, vd = quantize(v, h)
        spec_kv8 = spec_for(cell, kv_dtype="fp8_e4m3")
        paths = {
            "bf16 fa3 (raw)": lambda: fa.flash_attn_func(q, k, v, causal=causal),
            "fp8 kernel only (pre-quantized)": lambda: fa.flash_attn_func(
                ops.q, ops.k, ops.v, causal=causal, **ops.descales()),
            "fp8 KV cache (Q quantized per call)": lambda: fp8.forward(
                q, k8, v8, spec_kv8, _extra(p, k_descale=kd, v_descale=vd)),
            "fp8 plain (all quantized per call)": lambda: fp8.forward(
                q, k, v, spec, _extra(p, fp8_recipe="plain")),
            "fp8 smooth_k (all quantized per call)": lambda: fp8.forward(
                q, k, v, spec, _extra(p, fp8_recipe="smooth_k")),
            "quantize plain only": lambda: quantize_operands(q, k, v, "plain"),
            "quantize smooth_k only": lambda: quantize_operands(q, k, v, "smooth_k"),
        }
        times = {name: gpu_ms(fn, r.args.smoke) for name, fn in paths.items()}
        base = times["bf16 fa3 (raw)"]
        res["cases"].append({"causal": causal, "ms": times, "work": {
            n: cell.work(t) for n, t in times.items() if not n.startswith("quantize")},
            "speedup_vs_bf16": {n: base / t for n, t in times.items()
                                if not n.startswith("quantize")}})
        errs = {}
        for kind in ("random", "q_channel x20", "k_bias +20"):
            qi, ki = q.clone(), k.clone()
            if kind.startswith("q_"):
                qi[..., 7] *= 20
            elif kind.startswith("k_"):
                ki[..., 7] += 20
            ref, _ = reference_attention(qi[:, -rows:], ki, v, p, compute_dtype=torch.float32)
            outs = {"bf16 fa3": fa3.forward(qi, ki, v, spec, p).out,
                    "fp8 plain": fp8.forward(qi, ki, v, spec, _extra(p, fp8_recipe="plain")).out,
                    "fp8 smooth_k": fp8.forward(qi, ki, v, spec,
                                                _extra(p, fp8_recipe="smooth_k")).out}
            errs[kind] = {n: _err(o[:, -rows:], ref) for n, o in outs.items()}
        res["cases"][-1]["errors"] = errs
    return res


def _extra(p: Any, **extra: Any) -> Any:
    from dataclasses import replace

    return replace(p, extra=dict(extra))


def _err(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = out.double() - ref.double()
    return {"rel": float(diff.norm() / ref.double().norm()), "max": float(diff.abs().max())}


# -- the cell grid ----------------------------------------------------------------------------
def grid_cells(smoke: bool) -> list[Cell]:
    if smoke:
        return [Cell("train", 1, 128, 128, 4, 4), Cell("prefill", 1, 256, 256, 8, 2),
                Cell("decode", 2, 1, 512, 8, 2, causal=False)]
    return [Cell("train", 4, 4096, 4096, 16, 16), Cell("train", 1, 16384, 16384, 16, 16),
            Cell("prefill", 4, 4096, 4096, 32, 8), Cell("prefill", 1, 16384, 16384, 32, 8),
            Cell("decode", 1, 1, 32768, 32, 8, causal=False),
            Cell("decode", 16, 1, 8192, 32, 8, causal=False),
            Cell("decode", 64, 1, 4096, 32, 8, causal=False)]


def grid_section(r: Run, names: tuple[str, ...], policy: bool = False) -> dict[str, Any]:
    from attnhub.plugin import AttnParams

    rows = []
    for cell in grid_cells(r.args.smoke):
        train = cell.phase == "train"
        q = rand(cell.b, cell.sq, cell.hq, cell.d, dev=r.dev, seed=0, grad=train)
        k = rand(cell.b, cell.sk, cell.hkv, cell.d, dev=r.dev, seed=1, grad=train)
        v = rand(cell.b, cell.sk, cell.hkv, cell.d, dev=r.dev, seed=2, grad=train)
        page = 16
        kp, vp, table, lens = paged_view(k.detach(), v.detach(), page)
        p = AttnParams(scale=cell.d ** -0.5, causal=cell.causal, max_seqlen_q=cell.sq,
                       max_seqlen_k=cell.sk)
        pp = AttnParams(scale=p.scale, causal=cell.causal, block_table=table, seqlens_k=lens,
                        max_seqlen_q=cell.sq, max_seqlen_k=cell.sk)
        dout = torch.randn_like(q) if train else None
        base = None
        for name in names:
            paged = name.startswith("flashinfer")
            spec = spec_for(cell, "paged" if paged else "bshd", page if paged else 0)
            row: dict[str, Any] = {"cell": cell.label, "backend": name,
                                   "layout": f"paged/{page}" if paged else "bshd"}
            why = r.usable(name, spec) or (None if r.left() > 15 else "deadline")
            if why:
                rows.append(dict(row, skipped=why))
                continue
            b = r.backend(name)
            args = (q, kp, vp, spec, pp) if paged else (q, k, v, spec, p)
            try:
                out = b.forward(*args).out
                ref = base if base is not None else out.detach()
                base = ref if base is None else base
                row["max_diff_vs_first"] = float((out.detach().float() - ref.float()).abs().max())
                fn = (lambda b=b, args=args: b.forward(*args).out.backward(dout)) if train \
                    else (lambda b=b, args=args: b.forward(*args))
                ms = gpu_ms(fn, r.args.smoke)
                row.update(ms=ms, work=cell.work(ms))
            except Exception as exc:  # noqa: BLE001 - a backend's failure is a result here
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
        if policy:
            rows.append({"cell": cell.label, "backend": "(default policy binds)",
                         "pick": _policy_pick(r, cell)})
        del q, k, v, kp, vp
        if r.dev == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows}


def _policy_pick(r: Run, cell: Cell) -> str:
    try:
        spec = spec_for(cell, "paged" if cell.phase == "decode" else "bshd",
                        16 if cell.phase == "decode" else 0)
        return r.hub.decide(spec).backend or "none"
    except Exception as exc:  # noqa: BLE001 - the policy is another engineer's work
        return f"n/a ({type(exc).__name__}: {str(exc)[:120]})"


# -- FlashInfer decode: tensor cores or not ---------------------------------------------------
def decode_tc_section(r: Run) -> dict[str, Any]:
    import flashinfer
    from attnhub_sm80_fa2.paged_csr import block_table_to_csr

    shapes = [(1, 32768), (16, 8192), (64, 4096)] if not r.args.smoke else [(1, 64)]
    rows = []
    ws = torch.zeros(128 * 2**20, dtype=torch.uint8, device=r.dev)
    for hkv in (32, 8, 4):
        for b, ctx in shapes:
            k = rand(b, ctx, hkv, 128, dev=r.dev, seed=1)
            v = rand(b, ctx, hkv, 128, dev=r.dev, seed=2)
            kp, vp, table, lens = paged_view(k, v, 16)
            csr = block_table_to_csr(table, lens, 16)
            q = rand(b, 32, 128, dev=r.dev, seed=0)
            row: dict[str, Any] = {"gqa": 32 // hkv, "batch": b, "seqlen_k": ctx,
                                   "page_size": 16}
            for tc in (False, True):
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD",
                                                                  use_tensor_cores=tc)
                w.plan(csr.indptr, csr.indices, csr.last_page_len, 32, hkv, 128, 16,
                       q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                ms = gpu_ms(lambda w=w: w.run(q, (kp, vp)))
                row["tensor_cores_us" if tc else "cuda_cores_us"] = ms * 1e3
            row["kv_tb_s_best"] = 2 * b * ctx * hkv * 128 * 2 / (
                min(row["tensor_cores_us"], row["cuda_cores_us"]) * 1e-6) / 1e12
            rows.append(row)
            print(row, flush=True)
    return {"rows": rows}


# -- wrapper vs raw library at 4k -------------------------------------------------------------
def overhead_section(r: Run) -> dict[str, Any]:
    from attnhub.plugin import AttnParams

    out = []
    s = 4096 if not r.args.smoke else 128
    cell = Cell("prefill", 1, s, s, 32, 8)
    q, k, v = (rand(1, s, h, 128, dev=r.dev, seed=i) for i, h in enumerate((32, 8, 8)))
    p = AttnParams(scale=128 ** -0.5, causal=True, max_seqlen_q=s, max_seqlen_k=s)

    def pair(name: str, raw: Callable[[], Any], args: tuple, hub_kw: dict,
             label: str = cell.label) -> None:
        b = r.backend(name)
        t = {"raw library": host_ms(raw), "backend.forward": host_ms(lambda: b.forward(*args)),
             "attnhub.attention": host_ms(lambda: r.hub.attention(*args[:3], backend=name,
                                                                  **hub_kw))}
        out.append({"backend": name, "shape": label, "ms": t,
                    "overhead_pct": {n: 100 * (x / t["raw library"] - 1) for n, x in t.items()
                                     if n != "raw library"}})
        print(out[-1], flush=True)

    spec = spec_for(cell)
    if not r.usable("fa3", spec):
        fa = r.backend("fa3")._run.fa
        pair("fa3", lambda: fa.flash_attn_func(q, k, v, softmax_scale=p.scale, causal=True),
             (q, k, v, spec, p), {"causal": True})
    if not r.usable("fa2_torch", spec):
        pair("fa2_torch", lambda: _sdpa(q, k, v, "FLASH_ATTENTION"), (q, k, v, spec, p),
             {"causal": True})
    if not r.usable("cudnn", spec):
        kr, vr = k.repeat_interleave(4, dim=2), v.repeat_interleave(4, dim=2)
        pair("cudnn", lambda: _sdpa(q, kr, vr, "CUDNN_ATTENTION"), (q, k, v, spec, p),
             {"causal": True})
    for b_, ctx in ((32, 4096), (1, 4096)):
        dcell = Cell("decode", b_, 1, ctx, 32, 8, causal=False)
        dspec = spec_for(dcell, "paged", 16)
        if r.usable("flashinfer_decode", dspec) or r.left() < 10:
            continue
        kd, vd = rand(b_, ctx, 8, 128, dev=r.dev, seed=1), rand(b_, ctx, 8, 128, dev=r.dev, seed=2)
        kp, vp, table, lens = paged_view(kd, vd, 16)
        qd = rand(b_, 1, 32, 128, dev=r.dev, seed=0)
        pd = AttnParams(scale=p.scale, block_table=table, seqlens_k=lens, max_seqlen_q=1,
                        max_seqlen_k=ctx)
        fi = r.backend("flashinfer_decode")
        plan = fi.plan(qd, kp, pd)
        q3 = qd.reshape(b_, 32, 128)
        pair("flashinfer_decode", lambda plan=plan, q3=q3, kp=kp, vp=vp: plan.wrapper.run(
            q3, (kp, vp)), (qd, kp, vp, dspec, pd),
            {"layout": "paged", "block_table": table, "seqlens_k": lens},
            dcell.label + " paged/16")
    return {"rows": out, "note": "ms per call of 50 back-to-back calls (host time included), "
                                 "median of 7; raw = the library call with the same arguments"}


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, which: str) -> torch.Tensor:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, which)):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True,
                                              enable_gqa=q.shape[2] != k.shape[2])


# -- FlashInfer JIT warm-up (a child process, so the compile overlaps the other sections) -----
def warm_flashinfer(kind: str) -> None:
    """Compile FlashInfer's bf16 d=128 module for ``kind`` by running it once."""
    import flashinfer
    from attnhub_sm80_fa2.paged_csr import block_table_to_csr

    ws = torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda")
    k = rand(2, 64, 8, 128, dev="cuda", seed=1)
    kp, vp, table, lens = paged_view(k, k, 16)
    csr = block_table_to_csr(table, lens, 16)
    if kind == "decode":
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(csr.indptr, csr.indices, csr.last_page_len, 32, 8, 128, 16,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        w.run(rand(2, 32, 128, dev="cuda", seed=0), (kp, vp))
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        qo = torch.tensor([0, 4, 8], dtype=torch.int32, device="cuda")
        w.plan(qo, csr.indptr, csr.indices, csr.last_page_len, 32, 8, 128, 16, causal=True,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        w.run(rand(8, 32, 128, dev="cuda", seed=0), (kp, vp))
    torch.cuda.synchronize()


def start_warmups() -> list[subprocess.Popen]:
    procs = []
    for kind in ("decode", "prefill"):
        procs.append(subprocess.Popen([sys.executable, __file__, "--warm-flashinfer", kind],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def wait_warmups(r: Run, procs: list[subprocess.Popen]) -> dict[str, Any]:
    res = {}
    for kind, proc in zip(("decode", "prefill"), procs):
        try:
            out, _ = proc.communicate(timeout=max(1, r.left() - 60))
            res[kind] = {"returncode": proc.returncode, "seconds": time.monotonic() - r.t0,
                         "tail": out[-1500:]}
        except subprocess.TimeoutExpired:
            proc.kill()
            res[kind] = {"returncode": None, "tail": "compile did not finish before deadline"}
    return res


# -- report -----------------------------------------------------------------------------------
def _md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(d: dict[str, Any]) -> str:
    sec = d["sections"]
    out = [f"# NVIDIA backends on {d['gpu']}", "",
           f"Date {d['date']}, commit `{d['commit']}` (plus the working tree of the run), "
           f"torch {d['torch']}. Produced by `benchmarks/nvidia_backends.py`; raw numbers in "
           "`nvidia_backends.json`.", ""]
    for name in ("tests", "tests_flashinfer"):
        t = sec.get(name)
        if t:
            out += [f"## GPU tests ({name})", "", f"`{t.get('summary', t.get('skipped'))}`", ""]
    fp8 = sec.get("fp8")
    if fp8 and "cases" in fp8:
        out += ["## FP8 vs BF16 FA3 forward, " + fp8["shape"], ""]
        for c in fp8["cases"]:
            out.append(f"### {'causal' if c['causal'] else 'full'}")
            out.append(_md_table(["path", "ms", "throughput", "vs bf16"], [
                [n, f"{ms:.3f}", c["work"].get(n, "-"),
                 f"{c['speedup_vs_bf16'][n]:.2f}x" if n in c["speedup_vs_bf16"] else "-"]
                for n, ms in c["ms"].items()]))
            out.append("")
            out.append(f"Errors vs fp32 on the last {fp8['rows_checked']} query rows "
                       "(relative L2 / max abs):")
            out.append(_md_table(["inputs", *next(iter(c["errors"].values())).keys()], [
                [kind, *(f"{e['rel']:.4f} / {e['max']:.3f}" for e in errs.values())]
                for kind, errs in c["errors"].items()]))
            out.append("")
    grid = sec.get("grid")
    if grid and "rows" in grid:
        out += ["## Cell grid (bf16)", "", _grid_table(
            grid["rows"] + sec.get("grid_flashinfer", {}).get("rows", [])
            + sec.get("grid_others", {}).get("rows", [])), ""]
    tc = sec.get("decode_tc")
    if tc and "rows" in tc:
        out += ["## FlashInfer decode: tensor cores or CUDA cores (bf16, d=128, page 16)", "",
                _md_table(["gqa", "batch x ctx", "CUDA cores us", "tensor cores us",
                           "best KV TB/s"],
                          [[x["gqa"], f"{x['batch']} x {x['seqlen_k']}",
                            f"{x['cuda_cores_us']:.1f}", f"{x['tensor_cores_us']:.1f}",
                            f"{x['kv_tb_s_best']:.2f}"] for x in tc["rows"]]), ""]
    ov = sec.get("overhead")
    if ov and "rows" in ov:
        out += ["## Wrapper vs raw library call", "", ov["note"], "",
                _md_table(["backend", "shape", "raw ms", "backend.forward", "attnhub.attention"],
                          [[x["backend"], x["shape"], f"{x['ms']['raw library']:.4f}",
                            f"{x['ms']['backend.forward']:.4f} "
                            f"({x['overhead_pct']['backend.forward']:+.1f}%)",
                            f"{x['ms']['attnhub.attention']:.4f} "
                            f"({x['overhead_pct']['attnhub.attention']:+.1f}%)"]
                           for x in ov["rows"]]), ""]
    skipped = {k: v["skipped"] for k, v in sec.items() if isinstance(v, dict) and "skipped" in v}
    if skipped or d["errors"]:
        out += ["## Not run or failed", ""]
        out += [f"- {k}: {v}" for k, v in skipped.items()]
        out += [f"- {k}: failed, `{v.strip().splitlines()[-1][:200]}`"
                for k, v in d["errors"].items()]
    return "\n".join(out) + "\n"


def _grid_table(rows: list[dict[str, Any]]) -> str:
    body = []
    for x in rows:
        if "pick" in x:
            body.append([x["cell"], x["backend"], "", x["pick"], "", ""])
            continue
        state = (f"skipped: {x['skipped']}" if "skipped" in x else
                 f"error: {x['error']}" if "error" in x else "")
        body.append([x["cell"], x["backend"], x["layout"],
                     f"{x['ms']:.3f}" if "ms" in x else "-", x.get("work", "-"),
                     state or f"{x.get('max_diff_vs_first', 0):.3g}"])
    return _md_table(["cell", "backend", "layout", "ms", "throughput",
                      "max diff vs first / note"], body)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds for the whole run")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the logic only")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--warm-flashinfer", choices=("decode", "prefill"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.warm_flashinfer:
        warm_flashinfer(args.warm_flashinfer)
        return 0
    r = Run(args)
    have_fi = "flashinfer_decode" in r.reg.backends and not r.reg.get(
        "flashinfer_decode").available(r.hub.device)
    procs = start_warmups() if have_fi and r.dev == "cuda" else []
    if not args.skip_tests and r.dev == "cuda":
        r.section("tests", 60, lambda: run_tests(r, "core"))
    if not r.usable("fa3_fp8", spec_for(Cell("prefill", 1, 256, 256, 16, 16))) or args.smoke:
        r.section("fp8", 25, lambda: fp8_section(r))
    mine = tuple(n for n in MINE if not n.startswith("flashinfer")) + ("torch_sdpa",)
    r.section("grid", 40, lambda: grid_section(r, mine, policy=True))
    if procs:
        r.data["sections"]["flashinfer_warmup"] = wait_warmups(r, procs)
        r.save()
    if have_fi and r.dev == "cuda":
        if not args.skip_tests:
            r.section("tests_flashinfer", 30, lambda: run_tests(r, "flashinfer"))
        r.section("grid_flashinfer", 15,
                  lambda: grid_section(r, ("flashinfer_decode", "flashinfer_prefill")))
        r.section("decode_tc", 20, lambda: decode_tc_section(r))
    r.section("overhead", 20, lambda: overhead_section(r))
    others = tuple(n for n in OTHERS if n in r.reg.backends)
    if len(others) > 1:
        r.section("grid_others", 40, lambda: grid_section(r, others))
    r.save()
    print(f"wrote {r.out / 'nvidia_backends.json'} and .md in {time.monotonic() - r.t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
