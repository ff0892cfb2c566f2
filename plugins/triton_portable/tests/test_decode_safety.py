"""``triton_decode`` never reads outside the cache, whatever the block table and lengths hold.

The kernel clamps lengths to [0, capacity] and page ids to [0, num_pages) itself (the hub
rejects bad tables before, issue 12; this is the kernel's own guarantee). Each cache here is
a view into a larger buffer whose guard regions hold NaN, so any read just outside the cache
turns the output NaN (a read far outside crashes); ``seqlens_k`` and ``block_table`` are
views followed by values that would change the answer if they were read. The cases run in a
subprocess, so that a regression that crashes (the interpreter, or the GPU with an illegal
address) fails this test instead of killing the run. On a machine with CUDA the compiled
kernels run on the GPU; elsewhere Triton's interpreter runs them on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent('''
    import json, os
    import torch
    DEV = "cuda" if torch.cuda.is_available() else "cpu"
    if DEV == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    from attnhub_triton_portable.decode import decode_attention

    g = torch.Generator().manual_seed(0)
    B, HQ, HKV, D, PAGE, NPAGES, GUARD = 2, 4, 2, 16, 4, 6, 3

    def guarded(n, *shape, dtype=torch.bfloat16):
        """n rows of `shape`, inside NaN guard rows on both sides."""
        buf = torch.full((n + 2 * GUARD, *shape), float("nan"), dtype=torch.float32)
        buf[GUARD:GUARD + n] = torch.randn(n, *shape, generator=g)
        return buf.to(DEV, dtype)[GUARD:GUARD + n]

    q = torch.randn(B, 1, HQ, D, generator=g).to(DEV, torch.bfloat16)
    kc, vc = guarded(NPAGES, PAGE, HKV, D), guarded(NPAGES, PAGE, HKV, D)
    k8 = (kc.float() * 8).to(torch.float8_e4m3fn)  # an FP8 cache inside the same guards
    buf8 = torch.full((NPAGES + 2 * GUARD, PAGE, HKV, D), float("nan"), device=DEV).to(
        torch.float8_e4m3fn)
    buf8[GUARD:GUARD + NPAGES] = k8
    k8 = buf8[GUARD:GUARD + NPAGES]
    desc = torch.full((NPAGES, HKV), 0.125, device=DEV)
    kcont, vcont = guarded(B, 12, HKV, D), guarded(B, 12, HKV, D)

    def tail(vals, extra):
        """An int32 tensor `vals` followed in memory by `extra` (read only past its end)."""
        t = torch.tensor(list(vals) + list(extra), dtype=torch.int32, device=DEV)
        return t[:len(vals)]

    def table(rows, extra_row=(0, 1, 2)):
        flat = [p for r in rows for p in r] + list(extra_row)
        t = torch.tensor(flat, dtype=torch.int32, device=DEV)
        return t[:len(rows) * len(rows[0])].view(len(rows), len(rows[0]))

    def run(name, **kw):
        try:
            out, lse = decode_attention(q, scale=D ** -0.5, **kw)
            if DEV == "cuda":
                torch.cuda.synchronize()  # an illegal address surfaces here (or kills us)
        except Exception as exc:
            return {"case": name, "error": f"{type(exc).__name__}: {exc}"}
        return {"case": name, "finite": bool(out.float().isfinite().all()),
                "rows_zero": [bool((out[i] == 0).all()) for i in range(out.shape[0])],
                "lse_neg_inf": [bool((lse[i] == float("-inf")).all()) for i in range(out.shape[0])]}

    good = [[0, 1, 2], [3, 4, 5]]
    paged = dict(k=kc, v=vc)
    results = [
        run("huge page ids", block_table=table([[0, 2**31 - 1, 5], [3, 10**6, 4]]),
            seqlens_k=tail([12, 11], []), **paged),
        run("negative page ids", block_table=table([[-1, -2**31, 1], [-7, 4, 5]]),
            seqlens_k=tail([12, 12], []), **paged),
        run("lengths past the table", block_table=table(good),
            seqlens_k=tail([10**6, 2**31 - 1], []), **paged),
        run("negative lengths", block_table=table(good), seqlens_k=tail([-5, -2**31], []),
            **paged),
        run("seqlens shorter than the batch", block_table=table(good),
            seqlens_k=tail([9], [11]), **paged),
        run("block table shorter than the batch", block_table=table([[0, 1, 2]], (3, 4, 5)),
            seqlens_k=tail([9, 11], []), **paged),
        run("fp8 cache, huge page ids and lengths", k=k8, v=k8, k_descale=desc,
            v_descale=desc, block_table=table([[2**31 - 1, -3, 5], [9, 9, 9]]),
            seqlens_k=tail([10**6, 7], []), num_splits=2),
        run("contiguous, lengths past the cache", k=kcont, v=kcont,
            seqlens_k=tail([10**6, -4], [])),
        run("contiguous, seqlens shorter than the batch", k=kcont, v=vcont,
            seqlens_k=tail([5], [12])),
    ]
    # a column-strided table and strided lengths read as their contiguous copies would
    wide = torch.tensor([[0, 9, 1, 9, 2, 9], [3, 9, 4, 9, 5, 9]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([12, 99, 11, 99], dtype=torch.int32, device=DEV)
    strided = decode_attention(q, kc, vc, scale=D ** -0.5, block_table=wide[:, ::2],
                               seqlens_k=lens[::2])[0]
    dense = decode_attention(q, kc, vc, scale=D ** -0.5, block_table=wide[:, ::2].contiguous(),
                             seqlens_k=lens[::2].contiguous())[0]
    results.append({"case": "strided table and lengths", "finite": True,
                    "equal": bool(torch.equal(strided, dense))})
    print("RESULTS " + json.dumps(results))
''')


def _run_cases() -> list[dict]:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert proc.returncode == 0, f"decode subprocess died ({proc.returncode}):\n{proc.stderr[-3000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def test_bad_tables_and_lengths_read_nothing_outside_the_cache() -> None:
    results = {r["case"]: r for r in _run_cases()}
    for name, r in results.items():
        assert "error" not in r, f"{name}: {r['error']}"
        # NaN would mean a read of a guard region outside the cache
        assert r["finite"], f"{name}: output not finite, the kernel read outside the cache"
    # a sequence past the end of seqlens_k / the block table, or with a length <= 0, is
    # empty: output 0, LSE -inf (the values after those tensors were not read)
    for name, row in (("negative lengths", 0), ("negative lengths", 1),
                      ("seqlens shorter than the batch", 1),
                      ("block table shorter than the batch", 1),
                      ("contiguous, lengths past the cache", 1),
                      ("contiguous, seqlens shorter than the batch", 1)):
        assert results[name]["rows_zero"][row] and results[name]["lse_neg_inf"][row], (name, row)
    assert results["strided table and lengths"]["equal"]
    for name in ("lengths past the table", "seqlens shorter than the batch",
                 "block table shorter than the batch"):
        assert not results[name]["rows_zero"][0], name  # a valid row still attends
