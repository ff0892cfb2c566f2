"""``attnhub check-plugin NAME...``: the conformance kit on installed backends.

Exit 0 when every declared feature passes (or is declined by the backend's own checks on this
device, shown as skip), 1 on any failure or crash, 2 when nothing could be checked.
"""

from __future__ import annotations

import argparse
import os
import time

from ..conformance import backend_grid, format_report, run_kit
from ..core.backend import safe_available
from ..core.device import probe
from ..core.registry import Registry, plugin_timeout
from ..errors import AttnhubError
from ._common import add_json, at_least, nonblank, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check-plugin", help="run the conformance kit: does a backend do what "
                                            "its capabilities declare? (exit 1 on failure)")
    p.add_argument("names", nargs="*", metavar="BACKEND",
                   help="backend names (see `attnhub backends`), or a plugin name for all "
                        "of its backends")
    p.add_argument("--all-available", action="store_true",
                   help="every backend that can run on this device")
    p.add_argument("--quick", action="store_true",
                   help="a smaller grid (one case per declared feature where possible; CI)")
    p.add_argument("--budget", type=at_least(0, float), metavar="SECONDS",
                   help="stop starting new cases for a backend after this long (the rest "
                        "are reported as skipped)")
    p.add_argument("--total", type=at_least(0, float), metavar="SECONDS",
                   help="overall limit across backends (each gets at most what is left)")
    p.add_argument("--case-timeout", type=at_least(0, float, strict=True), default=300.0,
                   metavar="SECONDS",
                   help="stop waiting for one call after this long (default 300): the case is "
                        "a crash and the backend's remaining cases are not run")
    p.add_argument("-k", "--feature", metavar="TEXT", action="append",
                   type=nonblank("feature", "causal", "every feature"),
                   help="only features whose name contains TEXT (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true", help="list every case")
    add_json(p)
    p.set_defaults(func=run)


def selected(reg: Registry, names: list[str], all_available: bool) -> list[str]:
    """Backend names from backend or plugin names (or every available backend)."""
    device = probe()
    if all_available:
        return [n for n, b in reg.backends.items()
                if not safe_available(b, device, plugin_timeout())]
    out: list[str] = []
    for n in names:
        if n in reg.backends:
            out.append(n)
        elif n in reg.plugins and reg.plugins[n].backends:
            out += reg.plugins[n].backends
        elif n in reg.plugins:  # the plugin is there but serves nothing: say why, not "unknown"
            why = "; ".join(reg.plugins[n].errors) or "its hook registered no backend"
            raise AttnhubError(f"plugin {n!r} has no backend to check: {why}")
        else:
            reg.get(n)  # raises UnknownBackendError listing what exists
    return out


def run(args: argparse.Namespace) -> int:
    if not args.names and not args.all_available:
        raise AttnhubError("name a backend (or plugin), or pass --all-available")
    reg = Registry.load()
    device = probe()
    names = selected(reg, args.names, args.all_available)
    if not names:
        raise AttnhubError(f"no backend can run on {device.describe()} (see `attnhub backends`)")
    reports = []
    t_end = None if args.total is None else time.monotonic() + args.total
    for n in names:
        budget = args.budget
        if t_end is not None:
            left = max(0.0, t_end - time.monotonic())
            budget = left if budget is None else min(budget, left)
        cases = [c for c in backend_grid(reg.get(n), device, args.quick, args.case_timeout)
                 if not args.feature or any(t in c.feature for t in args.feature)]
        reports.append(run_kit(reg.get(n), device, budget_s=budget, cases=cases,
                               case_timeout_s=args.case_timeout))
        if not args.json:  # each table as soon as it is known: a killed run keeps them
            print(format_report(reports[-1], args.verbose), end="\n\n", flush=True)
    checked = any(r.status != "skip" for rep in reports for r in rep.results)
    if args.json:
        print_json({"schema": "attnhub.check-plugin/1", "device": device.describe(),
                    "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
                    "ok": all(r.ok for r in reports) and checked,
                    "backends": [r.to_json() for r in reports]})
    if not all(r.ok for r in reports):
        return 1
    return 0 if checked else 2
