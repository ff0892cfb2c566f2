"""Paged tables that once crashed the process (out-of-bounds reads in a kernel) are typed
errors or correct answers. They run in a child process, so a regression fails this test
instead of killing the test run; the child checks everything and prints one line per case."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import math
    import torch
    import attnhub
    from attnhub.core.reference import reference_attention
    from attnhub.core.paged import paged_to_varlen
    from attnhub.core.spec import AttnParams
    from attnhub.errors import SeqlensError
    from attnhub.testing import fa_rule_error

    torch.manual_seed(0)
    hub = attnhub.Hub(hardware="cpu")
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    q = torch.randn(2, 1, 2, 16)
    kc, vc = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)

    def expect_error(label, backend, bt, sl):
        try:
            hub.attention(q, kc, vc, layout="paged", block_table=bt, seqlens_k=sl,
                          backend=backend)
        except SeqlensError as exc:
            print("ok", label, backend, type(exc).__name__)
        else:
            print("FAIL", label, backend, "no error")

    def expect_answer(label, backend, bt, sl):
        out = hub.attention(q, kc, vc, layout="paged", block_table=bt, seqlens_k=sl,
                            backend=backend)
        qv, kv, vv, cq, ck = paged_to_varlen(q, kc, vc, bt.clone(), sl.clone())
        p = AttnParams(scale=1 / math.sqrt(16), cu_seqlens_q=cq, cu_seqlens_k=ck)
        ref, _ = reference_attention(qv, kv, vv, p, layout="thd")
        same, _ = reference_attention(qv, kv, vv, p, layout="thd", compute_dtype=q.dtype)
        err, allowed = fa_rule_error(out.reshape(qv.shape), ref, same)
        print("ok" if err <= allowed else "FAIL", label, backend, f"err={err:.2e}")

    for backend in (None, "triton_decode", "reference", "torch_sdpa"):
        bt = i32(0, 1, 2, 3, 4, 5).view(2, 3)
        expect_error("short seqlens_k", backend, bt, i32(9))
        expect_error("negative length", backend, bt, i32(5, -3))
        expect_error("past capacity", backend, bt, i32(5, 13))
        expect_error("page out of range", backend, i32(0, 1, 2, 3, 99, 5).view(2, 3), i32(5, 9))
        # an edit through .data does not bump _version: the memo must not be fooled
        bt, sl = i32(0, 1, 2, 3, 4, 5).view(2, 3), i32(5, 9)
        expect_answer("valid table", backend, bt, sl)
        bt.data[1, 1] = 1000
        expect_error("table edited through .data", backend, bt, sl)
        bt.data[1, 1] = 2  # a valid edit, also invisible to _version: must be seen
        expect_answer("valid edit through .data", backend, bt, sl)
        sl.data[0] = 50
        expect_error("length edited through .data", backend, bt, sl)
""")


def test_crash_prone_paged_cases_in_a_child_process():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=600)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, f"child died ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    failed = [line for line in lines if not line.startswith("ok")]
    assert not failed and len(lines) == 4 * 8, proc.stdout + proc.stderr
