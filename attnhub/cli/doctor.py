"""``attnhub doctor``: the device, library versions, usable backends and how to unlock more,
plugin errors, and policy rules that name a backend no installed plugin registers. Exit 1 when
the policy (``--policy`` or ``ATTNHUB_POLICY``) does not load, else 0."""

from __future__ import annotations

import argparse

from ..core.device import probe
from ..core.registry import Registry
from ..errors import PolicyError
from ._common import add_hardware, add_json, print_json
from ._policy_common import add_policy
from .backends import backend_rows


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="device, versions, usable backends, what to install")
    add_hardware(p)
    add_policy(p)
    add_json(p)
    p.set_defaults(func=run)


#: The first line of :func:`policy_gaps` when the policy itself does not load.
NO_POLICY = "policy does not load: "


def policy_gaps(reg: Registry, policy_ref: str | None) -> list[str]:
    """Each (rule, backend) of the policy whose backend is not registered here: at run time
    the next candidate serves those calls (warned once, counted in ``Hub.fallback_counts``)."""
    from ..policy import load_policy

    try:
        policy = load_policy(policy_ref)
    except PolicyError as exc:
        return [NO_POLICY + exc.problems[0]]
    return [f"rule {lr.rule.name} ({lr.location}) names {name}: {reg.missing_reason(name)}"
            for lr in policy.rules for name in lr.rule.use.names if name not in reg.backends]


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
        "policy_missing_backends": policy_gaps(reg, args.policy),
    }
    # a policy that does not load is the one finding that fails the run: every later command
    # with it fails too (plugin errors are shown, the plugins that load still serve)
    status = int(any(e.startswith(NO_POLICY) for e in report["policy_missing_backends"]))
    if args.json:
        print_json(report)
        return status
    print(f"device:   {dev.describe()}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in dev.versions))
    print(f"usable:   {', '.join(report['usable']) or 'none'}")
    for name, reasons in report["unusable"].items():
        print(f"  {name}: {'; '.join(reasons)}")
    for e in report["plugin_errors"]:
        print(f"  plugin error: {e}")
    for e in report["policy_missing_backends"]:
        print(f"  policy: {e}")
    return status
