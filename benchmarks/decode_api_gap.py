"""Where a paged decode call through the API spends the time its kernels do not (issue 16).

Through ``attnhub.attention``, e4m3 paged decode at 64 x 32k ran 1.109-1.115 ms per call
back to back on the H200 (sessions 9 and 10), against 1.060 ms for the same kernels under
``do_bench``; bf16 1.992-2.002 against 1.927. Per call that is about the host's work of one
call, as if each call waited for the previous one. This times the same call four ways in
one process, back to back (CUDA events around ``--calls`` calls, median of ``--repeats``),
bf16 and e4m3, random page table:

- ``kernel``: ``decode_attention`` with the arguments the backend passes;
- ``backend``: the bound backend's ``forward`` with the hub's spec and params;
- ``api``: ``attnhub.attention(..., backend=...)``;
- ``graph``: the ``kernel`` calls captured in one CUDA graph (no host at all);

then a ``torch.profiler`` trace of a few API calls back to back: the idle gaps between one
call's last kernel and the next call's first (``gaps_us``; all near zero if the host runs
ahead, about the host's time per call if each call waits).

The eight figures (four ways, two dtypes) are timed interleaved (``attnhub.timing.
interleaved_ms``: every repeat takes one sample of each, in balanced orders), each sample
``--calls`` calls back to back. Timed one after the other, on 2026-12-03 the H200 reached
its 700 W cap and lowered its clocks during the run, and whichever way was timed late
looked 12-15% slower: the API's e4m3 call at first (1.306 against 1.162 ms), the kernel
when the order was reversed.

    python benchmarks/decode_api_gap.py [--batch 64] [--ctx 32768] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from triton_decode import DEV, SCALE, SMOKE, PagedCase, decode_attention  # noqa: E402

import attnhub  # noqa: E402
from attnhub.core.spec import AttnParams  # noqa: E402
from attnhub.timing import interleaved_ms  # noqa: E402


def graph_replay(fn: Any, calls: int) -> Any:
    """A callable replaying ``calls`` calls of ``fn`` captured in one CUDA graph, or None
    on the CPU."""
    if SMOKE:
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g.replay


def gaps_us(fn: Any, calls: int = 6) -> list[float]:
    """Idle time between consecutive kernels of ``calls`` back-to-back calls (profiler)."""
    if SMOKE:
        return []
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ks = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type.name == "CUDA")
    return [round(b[0] - a[1], 1) for a, b in zip(ks, ks[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2 if SMOKE else 64)
    ap.add_argument("--ctx", type=int, default=64 if SMOKE else 32768)
    ap.add_argument("--calls", type=int, default=2 if SMOKE else 18)
    ap.add_argument("--repeats", type=int, default=1 if SMOKE else 15)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    c = PagedCase(a.batch, a.ctx, fp8=True)
    t = c.tables["random"]
    hub = attnhub.Hub()
    res: dict[str, Any] = {"batch": a.batch, "ctx": a.ctx, "calls": a.calls, "rows": {}}
    timed: dict[tuple[str, str], Any] = {}
    apis: dict[str, Any] = {}
    for name, k, v, backend, extra in (
            ("bf16", c.kc, c.vc, "triton_decode", None),
            ("e4m3", c.k8, c.v8, "triton_decode_fp8", {"k_descale": c.kd, "v_descale": c.vd})):
        kw: dict[str, Any] = {"layout": "paged", "block_table": t, "seqlens_k": c.seqlens,
                              "backend": backend, "scale": SCALE}
        if extra:
            kw["extra"] = extra
        api = lambda k=k, v=v, kw=kw: hub.attention(c.q, k, v, **kw)
        api()
        run = hub.bound()[-1]
        be, spec = run.chain[0], run.decision.spec
        params = AttnParams(scale=SCALE, block_table=t, seqlens_k=c.seqlens, max_seqlen_q=1,
                            max_seqlen_k=a.ctx, extra=dict(extra or {}))
        desc = {"k_descale": c.kd, "v_descale": c.vd} if extra else {}
        fns = {"kernel": lambda k=k, v=v, d=desc: decode_attention(
                   c.q, k, v, scale=SCALE, block_table=t, seqlens_k=c.seqlens,
                   max_seqlen_k=a.ctx, return_lse=False, **d),
               "backend": lambda k=k, v=v, p=params, be=be, spec=spec: be.forward(
                   c.q, k, v, spec, p),
               "api": api}
        for way, fn in fns.items():
            timed[name, way] = lambda fn=fn: [fn() for _ in range(a.calls)]
        replay = graph_replay(fns["kernel"], a.calls)
        if replay is not None:
            timed[name, "graph"] = replay
        apis[name] = (api, fns["kernel"])
    ms = interleaved_ms(timed, DEV, warmup=2, repeats=a.repeats, rounds=2).ms
    for name, (api, kernel) in apis.items():
        row: dict[str, Any] = {way: ms[n, way] / a.calls for n, way in ms if n == name}
        row["api_gaps_us"] = gaps_us(api)
        row["kernel_gaps_us"] = gaps_us(kernel)
        res["rows"][name] = row
        print(name, json.dumps(row), flush=True)
    bf, e4 = res["rows"]["bf16"], res["rows"]["e4m3"]
    res["e4m3_speedup"] = {way: bf[way] / e4[way] for way in ("kernel", "backend", "api")}
    print("e4m3 over bf16", json.dumps(res["e4m3_speedup"]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
