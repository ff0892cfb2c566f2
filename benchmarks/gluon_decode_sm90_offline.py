"""Build the Gluon paged FP8 decode kernel (``decode_gluon``) for sm90 on a machine
without a GPU and report the build: registers, spills, shared memory, and the SASS
instructions that say whether the design held (local memory, shared-memory traffic,
MMAs, e4m3 conversions, byte permutes, global load widths). No launch happens.

    PYTHONPATH=<triton 3.6 site>:.:plugins/triton_portable \
        python3 benchmarks/gluon_decode_sm90_offline.py [--block-n 16 32] [--page 16] [--maxnreg N]
        [--variants base ahead pre preahead] [--dump DIR]

Each build prints ``regs=`` (per thread), ``stack=`` (bytes of stack per thread: register
spills show here; ``local=`` is the cubin's declared local memory), and ``resident=``: the
one-warp programs an SM holds at that register count, 4 sub-partitions x floor(16384 /
(32 x registers rounded up to 8)) as in cuda_occupancy.h (not 65536 / (32 x registers):
registers are allocated per sub-partition).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch
from triton.runtime.driver import driver

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_sm90_offline import _resources, _sass, _Sm90  # noqa: E402

#: SASS opcodes counted in the report (whole kernel and inside the key loop)
OPS = ("LDL", "STL", "LDS", "STS", "LDSM", "BAR", "HMMA", "F2FP", "F2FP.F16.E4M3", "PRMT",
       "LDG.E.128", "LDG.E.64", "LDG.E.U8", "LDG.E ", "MUFU.EX2", "SHFL")


def split_args(block_n: int, splits: int, ahead: bool, page: int = 16,
               prefetch: bool = False, ring: int = 0) -> tuple:
    """``_split_kernel``'s argument tuple for 32/8 heads, d128, ``page``-key pages, as
    decode builds it."""
    hq, hkv, d, pages, batch = 32, 8, 128, 4096, 64
    q = torch.empty(batch, 1, hq, d, dtype=torch.bfloat16)
    k = torch.empty(pages, page, hkv, d, dtype=torch.float8_e4m3fn)
    out = torch.empty_like(q)
    f32 = torch.empty(16, dtype=torch.float32)
    table = torch.empty(batch, 2048, dtype=torch.int32)
    lens = torch.empty(batch, dtype=torch.int32)
    sc = torch.empty(pages, hkv, dtype=torch.float32)
    return (q, k, k, out, f32, f32, f32, f32, table, lens, f32, sc, sc,
            q.stride(0), q.stride(1), q.stride(2), *k.stride()[:3], *k.stride()[:3],
            hq * d, hq * d, d, table.stride(0), 0, *sc.stride(), *sc.stride(),
            128 ** -0.5, 1.0, -1, -1, 1, 2048 * page, batch, batch, pages, hq, hkv, hq // hkv,
            1, splits,
            d, page, True, True, True, True, False, False, False, False, True, splits == 1,
            False, prefetch, True, ahead, 0, False, 16, block_n, d, max(2, splits), "tf32", False,
            ring, False)


#: (splits, V_AHEAD, PREFETCH) built per block_n: the shipped kernel at one split and at
#: several, V a tile ahead, the software-pipelined loop (``prefetch_pages``: the next tile's
#: K and V in flight) and with V_AHEAD too (the next two tiles)
VARIANTS = ((1, False, False), (8, False, False), (8, True, False), (1, False, True),
            (8, False, True), (1, True, True), (8, True, True))


def _loop(sass: str) -> str:
    """The SASS of the key loop: from the target of the last backward branch to it."""
    lines = sass.splitlines()
    addr = [re.match(r"\s*/\*([0-9a-f]{4,})\*/", ln) for ln in lines]
    best = ""
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if not m or not addr[i] or int(m[1], 16) >= int(addr[i][1], 16):
            continue
        start = next(j for j in range(i) if addr[j] and int(addr[j][1], 16) == int(m[1], 16))
        if i - start > len(best.splitlines()):
            best = "\n".join(lines[start:i + 1])
    return best


def resident(regs: int) -> int:
    """One-warp programs per SM at ``regs`` registers per thread (cuda_occupancy.h: warps
    are given registers in units of 256 within one of 4 sub-partitions of 16384)."""
    return 4 * (16384 // (32 * (-(-regs // 8) * 8)))


def _count(text: str) -> dict[str, int]:
    """OPS counts, and ``insts``: all instructions."""
    got = {op.strip(): len(re.findall(re.escape(op) + (r"" if op.endswith(" ") else r"\b"),
                                      text)) for op in OPS}
    got["insts"] = len(re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s+\S", text, re.M))
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default="/tmp/gluon_decode_sm90")
    ap.add_argument("--block-n", type=int, nargs="*", default=[16, 32])
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--maxnreg", type=int, default=0, help="register cap (0: none)")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="only these: base, ahead, pre, preahead (default: all)")
    ap.add_argument("--ring", type=int, nargs="*", default=[0],
                    help="fp8_ring slots (0: none; 2 or 4: the cp.async ring, which "
                         "replaces the register pipeline)")
    a = ap.parse_args()
    os.makedirs(a.dump, exist_ok=True)
    driver.set_active(_Sm90())
    from attnhub_triton_portable import decode_gluon

    bad = 0
    builds = [(bn, v, ring) for bn in a.block_n for ring in a.ring for v in VARIANTS
              if not ring or v[1:] == (False, False)]  # the ring: its own loop only
    for bn, (splits, ahead, pre), ring in builds:
            name = ("pre" if pre else "") + ("ahead" if ahead else "") or "base"
            if a.variants and name not in a.variants and not ring:
                continue
            tag = (f"fp8_decode_p{a.page}_bn{bn}_s{splits}{'_pre' if pre else ''}"
                   f"{'_ahead' if ahead else ''}{f'_ring{ring}' if ring else ''}"
                   f"{f'_r{a.maxnreg}' if a.maxnreg else ''}")
            cap = {"maxnreg": a.maxnreg} if a.maxnreg else {}
            try:
                ck = decode_gluon._fp8_paged_split_kernel.run(
                    *split_args(bn, splits, ahead, a.page, pre, ring), grid=(splits, 512, 1),
                    warmup=True, num_warps=1, **cap)
            except Exception as exc:  # noqa: BLE001 - report and go on
                bad += 1
                print(f"FAIL {tag}: {type(exc).__name__}: {str(exc)[-4000:]}")
                continue
            for ext in ("ptx", "ttgir", "llir"):
                with open(f"{a.dump}/{tag}.{ext}", "w") as f:
                    f.write(ck.asm[ext])
            sass = _sass(ck.asm["cubin"], f"{a.dump}/{tag}.cubin")
            with open(f"{a.dump}/{tag}.sass", "w") as f:
                f.write(sass)
            res = _resources(f"{a.dump}/{tag}.cubin")
            m = re.match(r"regs=(\d+)", res)
            fit = f" resident={resident(int(m[1]))}" if m else ""
            print(f"OK {tag}: {res} smem={ck.metadata.shared}{fit}")
            print(f"   kernel: {_count(sass)}")
            print(f"   loop:   {_count(_loop(sass))}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
