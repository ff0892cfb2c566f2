"""``attnhub`` command line. Each subcommand is a module here with ``register(subparsers)``;
modules are discovered, so a new command is a new file."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time
from typing import Sequence

import torch

from ..core.process_state import STRAY
from ..errors import AttnhubError
from ._common import json_printed, print_error_json


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnhub",
        description="Attention bound by policy to the best backend for this machine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    json_printed[0] = 0
    try:
        return int(args.func(args) or 0)
    except AttnhubError as exc:
        return _failed(args, exc, str(exc))
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:  # Ctrl-C: what was written is whole (atomic writers)
        print(f"attnhub {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except MemoryError as exc:  # a size the machine cannot hold (--vocab 10**12)
        return _failed(args, exc, f"out of memory ({exc or 'MemoryError'}); pass smaller sizes")
    except RuntimeError as exc:
        if not _out_of_memory(exc):
            raise
        return _failed(args, exc, f"out of memory ({str(exc).splitlines()[0][:160]}); pass "
                                  "smaller sizes")
    except SystemExit as exc:  # ``SystemExit("attnhub bench: ...")``: exit 1, said on stderr
        if isinstance(exc.code, str) and getattr(args, "json", False):
            print_error_json("CommandError", exc.code.removeprefix(f"attnhub {args.command}: "))
        raise


def _failed(args: argparse.Namespace, exc: BaseException, message: str) -> int:
    """Exit 1 with ``message`` on stderr; with ``--json`` also the error object on stdout."""
    print(f"attnhub {args.command}: error: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print_error_json(type(exc).__name__, message, getattr(exc, "problems", None))
    return 1


#: Exit status after Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130


def _out_of_memory(exc: RuntimeError) -> bool:
    text = str(exc)
    oom = getattr(torch, "OutOfMemoryError", ())
    return isinstance(exc, oom) or "can't allocate memory" in text or (
        "not enough memory" in text)


def run() -> None:
    """The ``attnhub`` process: :func:`main`, then exit without waiting on threads a plugin
    left running (they are reported when it loads; the interpreter would wait for them at
    exit forever). Given 2 s to end, then the process exits with main's status."""
    rc = main()
    if rc == INTERRUPTED:  # a worker thread (a kit case) may still run: no teardown with it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    stray = [t for t in list(STRAY) if t.is_alive()]
    deadline = time.monotonic() + 2.0
    for t in stray:
        t.join(max(0.0, deadline - time.monotonic()))
    stray = [t.name for t in stray if t.is_alive()]
    if stray:
        print(f"attnhub: exiting without waiting for thread(s) {', '.join(map(repr, stray))} "
              "still running (started by a plugin: see `attnhub plugins`)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":  # pragma: no cover
    run()
