"""``attnhub plan``: the support matrix of a policy for a fleet you may not have.

Rows are cells (phase x dtype x mask kind, a representative Llama-8B-like shape), columns the
hardware; each entry is the backend the policy binds there (``-`` when none can serve).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..core.decision import Decision
from ..policy.cells import cells
from ..policy.lock import hardware_name
from ._common import add_json, hardware_names, print_json, table
from ._policy_common import add_policy, devices, load


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="support matrix: cells x hardware -> backend (offline)")
    add_policy(p)
    p.add_argument("--hardware", metavar="A,B", type=hardware_names,
                   help="comma-separated hardware to plan for (default: ATTNHUB_HARDWARE, "
                        "else the policy's targets)")
    add_json(p)
    p.set_defaults(func=run)


def entry(d: Decision) -> dict[str, Any]:
    return {"backend": d.backend, "rule": d.rule, "fallbacks": list(d.fallbacks),
            "inner": d.inner.backend if d.inner is not None else None,
            "rejected": {r.backend: list(r.reasons) for r in d.rejected},
            "notes": list(d.notes)}  # e.g. which accuracy record let an FP8 backend in


def run(args: argparse.Namespace) -> int:
    policy, registry = load(args)
    devs = devices(args.hardware, policy)
    names = [hardware_name(d) for d in devs]  # an H20 and an H100 are both sm90
    grid = cells()
    rows = []
    for cell in grid:
        spec = cell.spec()
        rows.append({"phase": cell.phase, "dtype": cell.dtype, "mask": cell.mask,
                     "dropout": cell.dropout, "label": cell.phase_label,
                     "spec": spec.describe(),
                     "bindings": {n: entry(policy.resolve(spec, d, registry))
                                  for n, d in zip(names, devs)}})
    if args.json:
        print_json({"schema": "attnhub.plan/1", "policy": policy.name,
                    "files": list(policy.data.files), "hardware": names,
                    "cells": rows})
        return 0
    print(f"policy {policy.name} ({' <- '.join(policy.data.files)}); shape of each cell: "
          f"{grid[0].spec().describe().split(' mask=')[0].split(' ', 2)[2]}")
    print(table([(r["label"], r["dtype"], r["mask"],
                  *(r["bindings"][n]["backend"] or "-" for n in names)) for r in rows],
                ("phase", "dtype", "mask", *names)))
    unserved = sum(b["backend"] is None for r in rows for b in r["bindings"].values())
    if unserved:
        print(f"{unserved} cell(s) unserved; `attnhub explain` shows why")
    return 0
