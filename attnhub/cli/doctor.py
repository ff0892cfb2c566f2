"""``attnhub doctor``: the device, library versions, usable backends and how to unlock more,
plugin errors, policy rules that name a backend no installed plugin registers, and
``ATTNHUB_*`` settings that change or break every attention call. Exit 1 when the policy
(``--policy`` or ``ATTNHUB_POLICY``) does not load or such a setting is invalid, else 0."""

from __future__ import annotations

import argparse
import os

from ..core.device import probe
from ..core.env import env_flag
from ..core.registry import Registry, did_you_mean
from ..errors import ArgumentError, PolicyError
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


#: Read by every ``Hub``: the backend every call is forced onto (unset or empty: the policy).
FORCE_ENV = "ATTNHUB_BACKEND"
#: On/off switches every ``Hub`` reads (``env_flag``), with their defaults: a value it
#: cannot read fails each call.
SWITCHES = {"ATTNHUB_DEBUG": False, "ATTNHUB_SETTLE_TIES": True}


def forced_backend() -> str | None:
    """``ATTNHUB_BACKEND`` as a ``Hub`` reads it."""
    return os.environ.get(FORCE_ENV) or None


def forced_problem(reg: Registry, usable: list[str] | None = None,
                   reasons: list[str] | None = None) -> str | None:
    """Why ``ATTNHUB_BACKEND`` makes every attention call raise, or None: it names no
    registered backend, or (``usable`` given) one that cannot run on this device (why:
    ``reasons``, else see doctor's list)."""
    name = forced_backend()
    if name is None:
        return None
    if name not in reg.backends:
        return (f"{FORCE_ENV}={name!r} names no registered backend"
                f"{did_you_mean(name, list(reg.backends))}, so every attention call raises; "
                f"set a known one ({', '.join(sorted(reg.backends))}) or unset it to follow "
                "the policy")
    if usable is not None and name not in usable:
        why = f"({'; '.join(reasons)})" if reasons else "(see `usable` above)"
        return (f"{FORCE_ENV}={name!r} names a backend that cannot run on this device, so every "
                f"attention call raises {why}; unset it to follow the policy")
    return None


def settings(reg: Registry, usable: list[str]) -> dict[str, list[str]]:
    """``ATTNHUB_*`` settings every ``Hub`` reads: ``errors``, values that make each call
    raise (doctor said nothing of them and exited 0), and ``notes``, values that change
    which backend runs."""
    forced = forced_problem(reg, usable)
    errors = [forced] if forced else []
    for name, default in SWITCHES.items():
        try:
            env_flag(name, default)
        except ArgumentError as exc:
            errors.append(f"{exc}; no Hub can be made, so every attention call raises this")
    notes = [f"{FORCE_ENV}={forced_backend()} forces every attention call onto it; the "
             "policy is not consulted"] if forced_backend() and not forced else []
    return {"errors": errors, "notes": notes}


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
    report["settings"] = settings(reg, report["usable"])
    # a policy that does not load, or a setting every call fails on, fails the run: every
    # later command with it fails too (plugin errors are shown, the plugins that load still
    # serve)
    status = int(any(e.startswith(NO_POLICY) for e in report["policy_missing_backends"])
                 or bool(report["settings"]["errors"]))
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
    for level in ("errors", "notes"):
        for e in report["settings"][level]:
            print(f"  setting{' error' if level == 'errors' else ''}: {e}")
    return status
