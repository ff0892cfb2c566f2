import sys, statistics, torch, attnhub
from attnhub_sm90_fa3.build import fa3_build
from attnhub_sm90_fa3.build import import_interface
hub = attnhub.Hub()
fa = import_interface(fa3_build())
dev, dt = "cuda", torch.bfloat16
H, HK, D = 8, 2, 64
top = 8192
bq = torch.randn(top * H * D, device=dev, dtype=dt)
bk = torch.randn(top * HK * D, device=dev, dtype=dt)
bv = torch.randn(top * HK * D, device=dev, dtype=dt)
def views(s):
    return (bq[: s * H * D].view(1, s, H, D), bk[: s * HK * D].view(1, s, HK, D), bv[: s * HK * D].view(1, s, HK, D))
def t(fn, n=10):
    fn(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(3):
        e0.record()
        for _ in range(n): fn()
        e1.record(); e1.synchronize(); ms.append(e0.elapsed_time(e1) / n)
    return min(ms)
lengths = list(range(4097, 4097 + 48)) + [4224, 4352, 4608, 5000, 5826, 6144, 8192]
rows = []
for s in lengths:
    q, k, v = views(s)
    r = {"len": s,
         "hub_fa3": t(lambda: hub.attention(q, k, v, causal=True, backend="fa3")),
         "hub_sdpa": t(lambda: hub.attention(q, k, v, causal=True, backend="torch_sdpa")),
         "fa3_pg_none": t(lambda: fa.flash_attn_func(q, k, v, causal=True)),
         "fa3_pg_false": t(lambda: fa.flash_attn_func(q, k, v, causal=True, pack_gqa=False)),
         "fa3_pg_true": t(lambda: fa.flash_attn_func(q, k, v, causal=True, pack_gqa=True))}
    rows.append(r)
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
for key in ("hub_fa3", "hub_sdpa", "fa3_pg_none", "fa3_pg_false", "fa3_pg_true"):
    xs = [r[key] for r in rows[:48]]
    print(key, "median %.4f min %.4f max %.4f" % (statistics.median(xs), min(xs), max(xs)))
# sequential new length per call (as the regret walk), back to back, 4 per sample
def walk(fn_for, start, stride=7, n=200):
    ls = [start + stride * i for i in range(n)]
    vs = [views(s) for s in ls]
    for q, k, v in vs[:10]: fn_for(q, k, v)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for q, k, v in vs: fn_for(q, k, v)
    e1.record(); e1.synchronize()
    return e0.elapsed_time(e1) / n
for name, f in (("walk hub fa3", lambda q, k, v: hub.attention(q, k, v, causal=True, backend="fa3")),
                ("walk hub sdpa", lambda q, k, v: hub.attention(q, k, v, causal=True, backend="torch_sdpa")),
                ("walk policy", lambda q, k, v: hub.attention(q, k, v, causal=True)),
                ("walk fa3 direct", lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True)),
                ("walk fa3 pg False", lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True, pack_gqa=False))):
    print(name, ["%.4f" % walk(f, 4097 + i) for i in range(1, 4)], flush=True)
print("policy binds", hub.bound()[-1].decision.backend)
