"""``attnhub lock``: freeze the resolved bindings; ``--check`` lists drift (exit 1), or says
why nothing could be checked (exit 3): a malformed lockfile, located, or a policy or plugin
setting that does not load."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from ..core.decision import BindContext
from ..core.registry import Registry
from ..errors import AttnhubError, PolicyError
from ..policy import Policy, load_policy
from ..policy.cells import cells
from ..policy.loader import PolicyData, _exists, policies_dir
from ..policy.located import clip
from ..policy.profile import default_profile_path
from ..policy.lock import (EXIT_BAD_LOCK, LockfileError, build_lock, check_lock,
                           hardware_name, read_lock, write_lock)
from ._common import add_json, hardware_names, nonblank, print_error_json, print_json, progress
from ._policy_common import add_policy, devices, load


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lock", help="freeze resolved bindings with library versions; "
                                    "--check reports drift")
    add_policy(p)
    p.add_argument("--hardware", metavar="A,B", type=hardware_names,
                   help="lock simulated hardware (default: this machine)")
    p.add_argument("--model", type=nonblank("model", "llama-3-8b", "no model"),
                   help="model name of the bind context (rules may match on it)")
    p.add_argument("-o", "--output", metavar="FILE", help="lockfile to write")
    p.add_argument("--check", metavar="FILE", help="resolve a lockfile's bindings again and "
                                                   "print what changed (exit 1 on drift, 3 "
                                                   "when it cannot be checked: a malformed "
                                                   "lockfile, a policy that does not load)")
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if bool(args.output) == bool(args.check):
        raise AttnhubError("give exactly one of -o FILE (write a lock) or --check FILE")
    if args.check:
        return _check(args)
    policy, registry = load(args)
    _not_a_policy_file(Path(args.output), policy.data.paths)
    ctx = BindContext(model=args.model)
    grid = [(dev, c) for dev in devices(args.hardware) for c in cells()]
    bar = progress(args, "lock", len(grid), unit="binding")  # seconds for many hardware
    pairs = []
    for dev, c in grid:
        pairs.append((dev, policy.resolve(c.spec(), dev, registry, ctx)))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    lock = build_lock(policy, registry, pairs)
    lock["policy"]["files"] = _recorded_files(Path(args.output), policy.data)
    write_lock(args.output, lock)
    unserved = sum(d.backend is None for _, d in pairs)
    summary = {"lockfile": args.output, "bindings": len(pairs), "unserved": unserved,
               "hardware": sorted({hardware_name(dev) for dev, _ in pairs})}
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {args.output}: {len(pairs)} bindings on {', '.join(summary['hardware'])}"
              f" ({unserved} unserved) for policy {policy.name}")
    return 0


def _not_a_policy_file(out: Path, policy_files: tuple[Path, ...]) -> None:
    """``-o`` naming the policy (or a file it extends) replaced that YAML with the lock's
    JSON: the policy was lost and the next ``lock --check`` could not load it."""
    real = Path(os.path.realpath(out))
    if real in {Path(os.path.realpath(f)) for f in policy_files}:
        raise AttnhubError(f"-o {out} is a file of the policy being locked; expected a new "
                           "path for the lockfile (e.g. attnhub.lock.json), the policy is "
                           "unchanged")
    if real == Path(os.path.realpath(default_profile_path())):  # every measurement lost
        raise AttnhubError(f"-o {out} is the profile store (ATTNHUB_PROFILE or the default); "
                           "expected a new path for the lockfile (e.g. attnhub.lock.json), "
                           "the store is unchanged")


def _check(args: argparse.Namespace) -> int:
    try:
        lock = read_lock(args.check)
        policy, registry = _policy_to_check(args, lock), Registry.load()
        drift = check_lock(lock, policy, registry)
    except AttnhubError as exc:  # nothing was checked: not drift (1), which a CI job acts on
        # always EXIT_BAD_LOCK, whatever printing meets: stderr first, then the object (a
        # closed stdout once made this check of a malformed lock exit 0)
        problems = getattr(exc, "problems", None) or [str(exc)]
        for line in problems:
            print(f"attnhub lock: error: {line}", file=sys.stderr)
        if args.json:
            with contextlib.suppress(BrokenPipeError):
                print_error_json("bad-lockfile" if isinstance(exc, LockfileError)
                                 else type(exc).__name__, str(exc), problems)
        return EXIT_BAD_LOCK
    if args.json:
        print_json(drift.to_json())
        return int(drift.drifted)
    for line in drift.policy + drift.versions:
        print(f"note: {line}")
    for line in drift.changed:
        print(f"DRIFT {line}")
    n = len(lock.get("bindings", []))
    print(f"{args.check}: {len(drift.changed)} of {n} binding(s) changed"
          if drift.drifted else f"{args.check}: all {n} binding(s) unchanged")
    if drift.drifted:
        print(f"to accept the new bindings: attnhub lock -o {args.check} (with the same "
              "policy and hardware); to keep the locked ones: restore the policy and plugin "
              "versions the lock names (attnhub plugins lists what is installed)")
    return int(drift.drifted)


def _recorded_files(lock_path: Path, data: PolicyData) -> list[str]:
    """The policy's files as a lock records them: a packaged policy by its name, any other
    file relative to the lockfile's folder, so ``lock --check`` finds it from any working
    directory (and after the project moves, lock and policies together)."""
    if len(data.paths) != len(data.files):
        return list(data.files)
    packaged = Path(os.path.realpath(policies_dir()))
    base = os.path.realpath(lock_path.parent)  # ``..`` from it is resolved physically
    out = []
    for shown, path in zip(data.files, data.paths):
        real = Path(os.path.realpath(path))
        # the path as read, not its realpath: a symlinked policy's relative ``extends`` is
        # resolved from the link's folder, so --check must load it through the link too
        out.append(real.stem if real.parent == packaged and real.suffix == ".yaml"
                   else os.path.relpath(os.path.abspath(shown), base))
    return out


def _policy_to_check(args: argparse.Namespace, lock: dict) -> Policy:
    """``--policy``, else the policy the lock records; one that does not load is said to
    come from the lock (``cannot read policy x.yaml`` alone named no flag and no key)."""
    if args.policy:
        return load_policy(args.policy)
    ref = _locked_policy(lock, Path(args.check))
    try:
        return load_policy(ref)
    except PolicyError as exc:
        raise PolicyError([*exc.problems, (
            f"{args.check}: policy.files[-1] names {clip(ref, 200, middle=True)!r}, the policy "
            "the lock was written with; expected it readable there: restore it, or pass "
            "--policy FILE")]) from None


def _locked_policy(lock: dict, lock_path: Path) -> str:
    """The top policy file recorded in the lock: beside the lockfile (relative paths are
    written so), else as written (a packaged name, or a lock from before that, relative to
    the working directory it was written in)."""
    files = lock.get("policy", {}).get("files") or []
    if not files:
        raise AttnhubError(f"{lock_path} records no policy file; pass --policy")
    top = Path(files[-1])
    beside = lock_path.parent / top
    return str(beside if not top.is_absolute() and _exists(beside, file=True) else top)
