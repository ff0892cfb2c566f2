"""``attnhub doctor``: the device, library versions, usable backends and how to unlock more."""

from __future__ import annotations

import argparse

from ..core.device import probe
from ..core.registry import Registry
from ._common import add_hardware, add_json, print_json
from .backends import backend_rows


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="device, versions, usable backends, what to install")
    add_hardware(p)
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    dev = probe(args.hardware)
    reg = Registry.load()
    rows = backend_rows(reg, args.hardware)
    report = {
        "device": {"vendor": dev.vendor, "arch": dev.arch, "name": dev.name,
                   "capability": dev.capability, "units": dev.sm_count,
                   "simulated": dev.simulated},
        "versions": dict(dev.versions),
        "usable": [r["name"] for r in rows if r["available"]],
        "unusable": {r["name"]: r["reasons"] for r in rows if not r["available"]},
        "plugin_errors": [f"{p}: {e}" for p, e in reg.errors()],
    }
    if args.json:
        print_json(report)
        return 0
    print(f"device:   {dev.describe()}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in dev.versions))
    print(f"usable:   {', '.join(report['usable']) or 'none'}")
    for name, reasons in report["unusable"].items():
        print(f"  {name}: {'; '.join(reasons)}")
    for e in report["plugin_errors"]:
        print(f"  plugin error: {e}")
    return 0
