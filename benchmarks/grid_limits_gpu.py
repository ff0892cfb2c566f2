"""GPU check of the launch grids past CUDA's 65535 second axis (review 11, 58419fe): thd
forward and backward over more than 65535 (document, head) pairs, paged decode at batch 8193
x 8 KV heads (sliced launches against a small batch), GLA over 65792 (sequence, head) pairs
and over 4M tokens of one sequence, each against a reference. Compiled kernels only: the
interpreter has no grid limit.

    PYTHONPATH=.:plugins/triton_portable:plugins/hybrid_linear python3 benchmarks/grid_limits_gpu.py
"""
import torch
torch.manual_seed(0)
dev = "cuda"
print(torch.__version__, torch.cuda.get_device_name(), flush=True)
import triton; print("triton", triton.__version__, flush=True)
from attnhub_triton_portable import fwd, bwd, decode
from attnhub_triton_portable.configs import fwd_config, bwd_config
from attnhub_triton_portable.launch import DenseArgs
from attnhub.plugin import AttnParams
import torch.nn.functional as F

def ref_thd(q, k, v, cu, scale, causal):
    outs = []
    for i in range(len(cu) - 1):
        a, b = int(cu[i]), int(cu[i + 1])
        qq, kk, vv = (x[a:b].transpose(0, 1).float() for x in (q, k, v))
        rep = qq.shape[0] // kk.shape[0]
        kk, vv = kk.repeat_interleave(rep, 0), vv.repeat_interleave(rep, 0)
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=scale).transpose(0, 1))
    return torch.cat(outs)

def dense(docs, lens, hq, hkv, d, causal, dtype=torch.bfloat16, grad=True):
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    t = int(cu[-1])
    q = torch.randn(t, hq, d, device=dev, dtype=dtype)
    k = torch.randn(t, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(t, hkv, d, device=dev, dtype=dtype)
    args = DenseArgs.from_params(q, k, v, AttnParams(scale=d ** -0.5, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu), "thd")
    cfg = fwd_config("sm90", d, "bf16", causal)
    out, lse = fwd.flash_fwd(args, cfg)
    torch.cuda.synchronize()
    # reference on a sample of documents (all short ones batched would be slow): all docs with loop limited
    idx = list(range(0, docs, max(1, docs // 50))) + [docs - 1]
    err = 0.0
    for i in idx:
        a, b = int(cu[i]), int(cu[i + 1])
        r = ref_thd(q[a:b], k[a:b], v[a:b], [0, b - a], d ** -0.5, causal)
        err = max(err, (out[a:b].float() - r).abs().max().item())
    res = f"fwd maxerr {err:.3e}"
    if grad:
        dout = torch.randn_like(out)
        dq, dk, dv = bwd.flash_bwd(args, out, lse, dout, bwd_config("sm90", d, "bf16", causal))
        torch.cuda.synchronize()
        gerr = 0.0
        for i in idx[:10]:
            a, b = int(cu[i]), int(cu[i + 1])
            qq, kk, vv = (x[a:b].detach().float().requires_grad_() for x in (q, k, v))
            r = ref_thd(qq, kk, vv, [0, b - a], d ** -0.5, causal)
            r.backward(dout[a:b].float())
            for g1, g2 in ((dq, qq), (dk, kk), (dv, vv)):
                gerr = max(gerr, (g1[a:b].float() - g2.grad).abs().max().item())
        res += f" bwd maxerr {gerr:.3e}"
    return res

cases = [("bshd-like 4x1000 causal", 4, [1000, 777, 1500, 64], 32, 8, 128, True),
         ("thd 2100 docs x 32 heads (67200 pairs)", 2100, [int(x) for x in torch.randint(1, 200, (2100,))], 32, 8, 128, True),
         ("thd 1025 one-token docs x 64 heads", 1025, [1] * 1025, 64, 8, 64, False)]
for name, docs, lens, hq, hkv, d, causal in cases:
    try:
        print(name, dense(docs, lens, hq, hkv, d, causal), flush=True)
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:300], flush=True)

# decode at batch 8193 x 8 KV heads, paged
try:
    b, hkv, hq, d = 8193, 8, 32, 128
    q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.bfloat16)
    kc = torch.randn(2048, 16, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randint(0, 2048, (b, 4), device=dev, dtype=torch.int32)
    lens = torch.randint(1, 65, (b,), device=dev, dtype=torch.int32)
    out, lse = decode.decode_attention(q, kc, vc, scale=d ** -0.5, block_table=table, seqlens_k=lens)
    out2, lse2 = decode.decode_attention(q[:100], kc, vc, scale=d ** -0.5, block_table=table[:100], seqlens_k=lens[:100])
    torch.cuda.synchronize()
    # reference for a few sequences
    err = 0.0
    for i in list(range(0, b, 800)) + [b - 1]:
        n = int(lens[i]); pages = table[i]
        kk = kc[pages].reshape(-1, hkv, d)[:n]; vv = vc[pages].reshape(-1, hkv, d)[:n]
        qq = q[i, 0].float().view(hkv, hq // hkv, d)
        s = torch.einsum("hgd,nhd->hgn", qq, kk.float()) * d ** -0.5
        o = torch.einsum("hgn,nhd->hgd", s.softmax(-1), vv.float()).reshape(hq, d)
        err = max(err, (out[i, 0].float() - o).abs().max().item())
    print("decode 8193x8 paged maxerr", f"{err:.3e}", "slice-vs-small", (out[:100] - out2).abs().max().item(), flush=True)
except Exception as e:
    print("decode FAILED", type(e).__name__, str(e)[:300], flush=True)

# GLA
from attnhub_hybrid_linear import linear_triton as lt, linear_torch
for (b, t, h, kd, vd) in [(2, 300, 4, 64, 128), (257, 70, 256, 16, 16), (1, 64 * 65536 + 10, 1, 16, 16)]:
    try:
        q, k = torch.randn(b, t, h, kd, device=dev), torch.randn(b, t, h, kd, device=dev)
        v = torch.randn(b, t, h, vd, device=dev)
        g = F.logsigmoid(torch.randn(b, t, h, kd, device=dev)) / 4
        ours = [x.clone().requires_grad_() for x in (q, k, v, g)]
        o, fin = lt.chunked(*ours, 0.3, None, True)
        do = torch.randn_like(o)
        (o * do).sum().backward()
        torch.cuda.synchronize()
        msg = f"gla {b}x{t}x{h} finite {bool(torch.isfinite(o).all())}"
        if t <= 400:
            ref = [x.double().requires_grad_() for x in (q, k, v, g)]
            o_r, s_r = linear_torch.chunked(*ref, 0.3)
            (o_r * do.double()).sum().backward()
            rr = lambda a, b_: ((a.double() - b_).norm() / b_.norm()).item()
            msg += f" o {rr(o, o_r):.2e} s {rr(fin, s_r):.2e} " + " ".join(f"d{n} {rr(a.grad, r.grad):.2e}" for n, a, r in zip("qkvg", ours, ref))
            o_rec, s_rec = lt.recurrent(q[:, :5], k[:, :5], v[:, :5], g[:, :5], 0.3)
            want, _ = linear_torch.recurrent(*(x[:, :5].double() for x in (q, k, v, g)), 0.3)
            msg += f" rec {rr(o_rec, want):.2e}"
        else:
            fin2 = lt.state_after(k, v, g)
            msg += f" state_vs_scan {((fin - fin2).norm() / fin2.norm()).item():.2e}"
        print(msg, flush=True)
    except Exception as e:
        print("gla", (b, t, h), "FAILED", type(e).__name__, str(e)[:300], flush=True)
