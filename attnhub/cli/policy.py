"""``attnhub policy check FILE...`` (lint) and ``attnhub policy show FILE`` (merged rules)."""

from __future__ import annotations

import argparse
import sys

from ..core.registry import Registry
from ..errors import AttnhubError, PolicyError
from ..policy import load_policy
from ..policy.lint import lint_policy
from ._common import add_json, hardware_names, print_json, table
from ._policy_common import env_hardware, hardware_list


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policy", help="check or show policy files")
    psub = p.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    c = psub.add_parser("check", help="lint policies: unknown backends, shadowed rules, "
                                      "contradictions, unserved cells (exit 1 on errors)")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("--hardware", metavar="A,B", type=hardware_names,
                   help="hardware whose cells must be served (default: ATTNHUB_HARDWARE, else "
                        "the policy's targets)")
    add_json(c)
    c.set_defaults(func=run_check)
    s = psub.add_parser("show", help="the merged rules of a policy (after extends), in order")
    s.add_argument("file", metavar="FILE")
    add_json(s)
    s.set_defaults(func=run_show)


def run_check(args: argparse.Namespace) -> int:
    registry = Registry.load()
    hardware = tuple(hardware_list(args.hardware)
                     or env_hardware("check each policy's targets")) or None
    report, failed = [], False
    for f in args.files:
        try:
            findings = [x.to_json() for x in lint_policy(load_policy(f), registry, hardware)]
        except PolicyError as exc:
            findings = [{"level": "error", "location": "", "path": "", "message": m}
                        for m in exc.problems]
        except AttnhubError as exc:  # one file's failure: the others are still checked
            findings = [{"level": "error", "location": "", "path": "", "message": f"{f}: {exc}"}]
        errors = sum(x["level"] == "error" for x in findings)
        failed |= errors > 0
        report.append({"file": f, "ok": errors == 0, "errors": errors,
                       "warnings": len(findings) - errors, "findings": findings})
    if args.json:
        print_json(report)
        return int(failed)
    for r in report:
        for x in r["findings"]:
            line = (f"{x['location']} {x['path']}: {x['level']}: {x['message']}"
                    if x["location"] else x["message"])
            print(line, file=sys.stderr if x["level"] == "error" else sys.stdout)
        print(f"{r['file']}: {'ok' if r['ok'] else 'FAILED'} ({r['errors']} error(s), "
              f"{r['warnings']} warning(s))")
    return int(failed)


def run_show(args: argparse.Namespace) -> int:
    policy = load_policy(args.file)
    rows = [{"name": lr.rule.name, "location": lr.location,
             "when": lr.rule.when.model_dump(exclude_none=True, by_alias=True),
             "use": lr.rule.use.model_dump(exclude_none=True),
             "on_failure": lr.rule.on_failure or policy.data.defaults.on_failure}
            for lr in policy.rules]
    if args.json:
        print_json({"name": policy.name, "files": list(policy.data.files),
                    "targets": list(policy.targets), "rules": rows})
        return 0
    print(f"policy {policy.name} v{policy.data.version} from {' <- '.join(policy.data.files)}")
    print(table([(i, r["name"], r["location"], _short(r["when"]), _short(r["use"]))
                 for i, r in enumerate(rows)], ("#", "rule", "where", "when", "use")))
    return 0


def _short(d: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items()) or "(always)"
