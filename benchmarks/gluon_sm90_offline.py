"""Compile the Hopper Gluon forwards for sm90 on a machine without a GPU, and report what
the build says: registers per partition (``setmaxnreg``), shared memory, spills, and the
wgmma / barrier instructions of the SASS. No launch happens.

    PYTHONPATH=<triton 3.6 site>:.:plugins/triton_portable \
        python3 benchmarks/gluon_sm90_offline.py [--ws-only] [--dump DIR]

(``pip install --target /tmp/t36 triton==3.6.0`` gives the machine's Triton without touching
the local one.)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import torch
import triton
from triton.runtime.driver import driver

from attnhub_triton_portable.launch_stub import StubDriver


class _Sm90(StubDriver):
    """The launch stub's sm90 driver, with the torch device a compile asks for."""

    def get_active_torch_device(self):
        return torch.device("cpu")


def _compile(kernel, call):
    """Run ``call`` (which launches ``kernel[grid](...)``) with the launch turned into a
    compile-only warmup; return the compiled kernel."""
    got = {}
    orig = kernel.run

    def run(*a, grid, warmup, **kw):
        got["k"] = orig(*a, grid=grid, warmup=True, **kw)
        return got["k"]

    kernel.run = run
    try:
        call()
    except Exception:  # the launch after the compile: the stub driver has no launcher
        if "k" not in got:
            raise
    finally:
        kernel.run = orig
    return got["k"]


def _cuobjdump(flag: str, path: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        return subprocess.run([tool, flag, path], capture_output=True, text=True,
                              check=False).stdout
    except OSError:
        return ""


def _sass(cubin: bytes, path: str) -> str:
    with open(path, "wb") as f:
        f.write(cubin)
    return _cuobjdump("--dump-sass", path)


def _resources(cubin: str) -> str:
    """``regs=R stack=S local=L`` of the cubin at path ``cubin`` (cuobjdump; the compile-only
    warmup sets no ``n_regs``/``n_spills``, the driver does at load). Spills show in STACK."""
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)",
                  _cuobjdump("--dump-resource-usage", cubin))
    return f"regs={m[1]} stack={m[2]} local={m[4]}" if m else "regs=? stack=? local=?"


def _hot_spills(sass: str) -> int:
    """LDL + STL inside the innermost loops that issue wgmmas (the SASS between a backward
    branch and its target, holding an HGMMA and no other backward branch): spills that cost
    every tile, unlike scalars spilled around a loop."""
    lines = sass.splitlines()
    addr = [int(m[1], 16) if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/", ln)) else -1
            for ln in lines]
    back = [(int(m[1], 16), i) for i, ln in enumerate(lines)
            if (m := re.search(r"@!?U?P\d\s+BRA\s+0x([0-9a-f]+)", ln))
            and 0 <= int(m[1], 16) < addr[i]]  # conditional: the waits' jumps back are not
    hot = set()
    for target, end in back:
        body = [j for j in range(end + 1) if addr[j] >= target]
        inner = any(target <= addr[j] < addr[end] for _, j in back)
        if not inner and any("HGMMA" in lines[j] for j in body):
            hot.update(body)
    return sum(bool(re.search(r"\b(LDL|STL)\b", lines[j])) for j in hot)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default="/tmp/gluon_sm90")
    ap.add_argument("--ws-only", action="store_true")
    ap.add_argument("--bwd", action="store_true", help="the Gluon backward (bwd_gluon) only")
    ap.add_argument("--case", nargs="*", default=[],
                    help="only these mask forms: full causal causal_tl window (default: all)")
    ap.add_argument("--bwd-builds", nargs="*", default=["step", "pipe", "pipe1"],
                    help="with --bwd: the shipped step, the pipelined one, it with 1 dQ buffer "
                         "(default), and hoist: the step before its spill cure (_no_hoist=False)")
    a = ap.parse_args()
    os.makedirs(a.dump, exist_ok=True)
    driver.set_active(_Sm90())
    from attnhub_triton_portable import configs, fwd_gluon, fwd_gluon_ws
    from attnhub_triton_portable.launch import DenseArgs

    from attnhub.plugin import AttnParams

    import attnhub_triton_portable.fwd as fwd_mod
    fwd_mod.device_arch = lambda dev: "sm90"  # the stub has no device to probe
    cases = [("full", {}), ("causal", {"causal": True}),
             ("causal_tl", {"causal": True, "alignment": "top_left"}),
             ("window", {"causal": True, "window": (4096, 0)})]
    cfgs = configs.GLUON_WS_SM90 + ([] if a.ws_only else configs.GLUON_SM90)
    if a.bwd:  # the shipped backward, then its timing variants (bwd_gluon.flash_bwd's _kw)
        from attnhub_triton_portable import bwd_gluon
        builds = {"step": {"BWD": True, "_pipe": False}, "pipe": {"BWD": True, "_pipe": True},
                  "pipe1": {"BWD": True, "_pipe": True, "_dq_bufs": 1},
                  "hoist": {"BWD": True, "_pipe": False, "_no_hoist": False}}
        cfgs = [builds[n] for n in a.bwd_builds]
    bad = 0
    for cfg in cfgs:
        mod = fwd_gluon_ws if cfg.get("WS") else fwd_gluon
        kern = fwd_gluon_ws._fwd_ws_kernel if cfg.get("WS") else fwd_gluon._fwd_kernel
        for name, kw in cases:
            if a.case and name not in a.case:
                continue
            q = torch.randn(1, 1024, 16, 128, dtype=torch.bfloat16)
            k = torch.randn(1, 1024, 8, 128, dtype=torch.bfloat16)
            params = AttnParams(scale=128 ** -0.5, **kw)
            args = DenseArgs.from_params(q, k, k, params, "bshd")
            why = bwd_gluon.supports(args) if a.bwd else fwd_mod.gluon_unsupported(args, cfg)
            if why:
                print(f"{cfg} {name}: unsupported: {why}")
                continue
            tag = re.sub(r"[^A-Za-z0-9]+", "_", f"{cfg}_{name}")[:120]
            if a.bwd:
                lse = torch.zeros(1, 16, 1024)
                kern = bwd_gluon._bwd_kernel
                kw = {n: x for n, x in cfg.items() if n.startswith("_")}
                call = lambda: bwd_gluon.flash_bwd(args, q, lse, q, lse, **kw)  # noqa: E731
            else:
                call = lambda: mod.flash_fwd(args, cfg)  # noqa: E731
            try:
                ck = _compile(kern, call)
            except Exception as exc:  # noqa: BLE001 - report and go on
                bad += 1
                print(f"FAIL {cfg} {name}: {type(exc).__name__}: {str(exc)[-3000:]}")
                continue
            ptx = ck.asm["ptx"]
            with open(f"{a.dump}/{tag}.ptx", "w") as f:
                f.write(ptx)
            with open(f"{a.dump}/{tag}.ttgir", "w") as f:
                f.write(ck.asm["ttgir"])
            sass = _sass(ck.asm["cubin"], f"{a.dump}/{tag}.cubin")
            with open(f"{a.dump}/{tag}.sass", "w") as f:
                f.write(sass)
            md = ck.metadata
            nreg = sorted(set(re.findall(
                r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
            print(f"OK {name:9s} {cfg}: {_resources(f'{a.dump}/{tag}.cubin')} smem={md.shared} "
                  f"setmaxnreg={nreg} HGMMA={sass.count('HGMMA')} "
                  f"DEPBAR={sass.count('WARPGROUP.DEPBAR')} MUFU.EX2={sass.count('MUFU.EX2')} "
                  f"LDL={sass.count('LDL')} STL={sass.count('STL')} "
                  f"loop_spills={_hot_spills(sass)}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
