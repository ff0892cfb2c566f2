"""``attnhub plugins``: installed plugins, their versions, backends and load errors."""

from __future__ import annotations

import argparse

from ..core.registry import Registry
from ._common import add_json, print_json, table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plugins", help="list plugins, versions and load errors")
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    reg = Registry.load()
    recs = list(reg.plugins.values())
    if args.json:
        print_json([r.to_json() for r in recs])
        return 0
    rows = [(r.name, r.distribution or "-", r.version or "-", ", ".join(r.backends) or "-",
             "ok" if r.ok else "ERROR") for r in recs]
    print(table(rows, ("plugin", "distribution", "version", "backends", "status")))
    for r in recs:
        for e in r.errors:
            print(f"  {r.name}: {e}")
    return 0
