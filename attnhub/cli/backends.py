"""``attnhub backends``: every backend, its plugin and tier, and whether it can run here."""

from __future__ import annotations

import argparse

from ..core.backend import safe_available
from ..core.device import probe
from ..core.registry import Registry, plugin_timeout
from ._common import add_hardware, add_json, print_json, table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("backends", help="list backends and whether each can run on this device")
    add_hardware(p)
    add_json(p)
    p.set_defaults(func=run)


def backend_rows(reg: Registry, hardware: str | None) -> list[dict]:
    dev = probe(hardware)
    out = []
    for name, b in reg.backends.items():
        reasons = safe_available(b, dev, plugin_timeout())
        c = b.capabilities
        out.append({"name": name, "plugin": b.plugin, "tier": b.tier, "available": not reasons,
                    "reasons": reasons, "exact": c.exact, "backward": c.backward,
                    "dropout": c.dropout,
                    "phases": sorted(c.phases), "dtypes": sorted(c.dtypes),
                    "masks": sorted(c.masks), "description": b.description})
    return out


def run(args: argparse.Namespace) -> int:
    rows = backend_rows(Registry.load(), args.hardware)
    if args.json:
        print_json(rows)
        return 0
    print(table([(r["name"], r["plugin"], r["tier"], "yes" if r["available"] else "no",
                  "; ".join(r["reasons"]) or r["description"]) for r in rows],
                ("backend", "plugin", "tier", "available", "why / what")))
    return 0
