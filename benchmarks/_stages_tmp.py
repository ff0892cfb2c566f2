import torch, sys, inspect, textwrap, time, statistics, math
import attnhub, attnhub.hub as H
from attnhub.core.kvcache import PagedKVCache
from attnhub.core.spec import AttnParams

def ab(cases, rounds=300, chunk=50, sync=lambda: None):
    c = time.perf_counter_ns
    names = list(cases)
    for f in cases.values():
        for _ in range(500): f()
    sync()
    out = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 else names[::-1]):
            f = cases[n]
            t = c()
            for _ in range(chunk): f()
            out[n].append((c() - t) / chunk / 1e3)
        sync()
    return {n: statistics.median(v) for n, v in out.items()}

src = textwrap.dedent(inspect.getsource(H.Hub.attention))
markers = {"grad": "fast_key = grow_key = None", "key": "# the layers of a step repeat one key",
           "lookup": "if hit is None and side is None and max_seqlen_k is None",
           "types": "(spec, run, window, named, named_score", "tables": "if hit is not None:\n        if named:",
           "params": "first = run.first", "full": None}
fns = {}
for name, m in markers.items():
    s = src
    if m:
        i = s.index(m)
        indent = s[:i].split("\n")[-1]
        s = s[:i] + "return None\n" + indent + s[i:]
    ns = dict(vars(H))
    exec(compile("from __future__ import annotations\n" + s, "x", "exec"), ns)
    fns[name] = ns["attention"]

dev = torch.device("cuda"); dtype = torch.bfloat16
hub = attnhub.Hub()
q = torch.randn(1, 1, 32, 128, device=dev, dtype=dtype)
k = torch.randn(1, 1024, 8, 128, device=dev, dtype=dtype); v = torch.randn_like(k)
b, ctx, page = 8, 1024, 16
cache = PagedKVCache(num_layers=1, num_pages=b * ctx // page, page_size=page, num_kv_heads=8, head_dim=128, dtype=dtype, device=dev)
seqs = [cache.allocate() for _ in range(b)]
kv = torch.randn(b * ctx, 8, 128, device=dev, dtype=dtype)
cache.write(0, cache.reserve(seqs, ctx), kv, kv.clone())
table, lens = cache.block_table(seqs), cache.seqlens(seqs)
kc, vc = cache.k_cache(0), cache.v_cache(0)
qp = torch.randn(b, 1, 32, 128, device=dev, dtype=dtype)
for label, call, mk in (
        ("tiny", lambda f: f(hub, q, k, v, causal=True), lambda: (q, k, v, AttnParams(scale=1/math.sqrt(128), causal=True, max_seqlen_q=1, max_seqlen_k=1024))),
        ("paged", lambda f: f(hub, qp, kc, vc, layout="paged", block_table=table, seqlens_k=lens, causal=True),
         lambda: (qp, kc, vc, AttnParams(scale=1/math.sqrt(128), causal=True, block_table=table, seqlens_k=lens, max_seqlen_q=1, max_seqlen_k=ctx)))):
    call(fns["full"])
    runner = hub.bound()[-1]
    be, spec = runner.chain[0], runner.decision.spec
    qq, kk, vv, pp = mk()
    cases = {"direct": lambda: be.forward(qq, kk, vv, spec, pp)}
    for n, f in fns.items():
        cases[n] = (lambda f=f: call(f))
    for rep in range(2):
        res = ab(cases, sync=torch.cuda.synchronize)
        prev = 0.0; parts = []
        for n, x in res.items():
            if n == "direct": continue
            parts.append(f"{n} {x:.2f} (+{x-prev:.2f})"); prev = x
        print(f"{label} [{be.name}] direct {res['direct']:.2f} | " + "  ".join(parts) + f" | added {res['full']-res['direct']:.2f}", flush=True)
