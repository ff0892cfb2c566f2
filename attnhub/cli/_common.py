"""Shared CLI plumbing: common flags, JSON output and plain tables."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Callable, Sequence


def at_least(low: float, kind: type = int, *, strict: bool = False) -> Callable[[str], Any]:
    """An argparse ``type``: an int (or, with ``kind=float``, a finite number) >= ``low``
    (``strict``: > ``low``); anything else is a usage error naming the flag and the bound
    (exit 2, no traceback)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and (value > low if strict else value >= low)):
            raise argparse.ArgumentTypeError(
                f"{text!r}: must be a number {'>' if strict else '>='} {low:g}")
        return value

    parse.__name__ = kind.__name__
    return parse


def list_of(item: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse ``type``: a comma list, each entry parsed by ``item`` (an ``at_least``)."""

    def parse(text: str) -> list[Any]:
        return [item(x.strip()) for x in text.split(",")]

    parse.__name__ = "list"
    return parse


STORE_FAILED = 3  # exit status: measured and printed, but the profile store was not written


def recorded(command: str, path: Any, record: Callable[[], None]) -> bool:
    """Run ``record`` (writes to the profile store at ``path``) after the results were
    printed; False, said on stderr, if the store cannot be read or written (the results are
    not lost with it; the store on disk is as it was)."""
    from ..errors import PolicyError

    try:
        record()
    except (OSError, PolicyError, ValueError) as exc:
        print(f"\nattnhub {command}: the profile store {path} could not be written ({exc}); "
              "the results above were not recorded: fix it, or pass --store PATH (or "
              "--no-store)", file=sys.stderr)
        return False
    return True


def seed(text: str) -> int:
    """An argparse ``type``: a seed in 0..2**32-1 (torch refuses larger ones with a traceback,
    after the model was built)."""
    value = at_least(0)(text)
    if value >= 2 ** 32:
        raise argparse.ArgumentTypeError(f"{text!r}: a seed must be in 0..{2 ** 32 - 1}")
    return value


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
