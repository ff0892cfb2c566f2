"""Shared CLI plumbing: common flags, JSON output and plain tables."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Callable, Sequence


def at_least(low: float, kind: type = int) -> Callable[[str], Any]:
    """An argparse ``type``: an int (or, with ``kind=float``, a finite number) >= ``low``;
    anything else is a usage error naming the flag and the bound (exit 2, no traceback)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(f"{text!r}: must be a number >= {low:g}")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_hardware(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", metavar="ARCH",
                   help="simulate a device for offline planning (cpu, sm80, sm90, gfx942, ...)")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A plain aligned text table (markdown-compatible pipes)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(cells[0]), sep] + [fmt(r) for r in cells[1:]])
