"""Shared CLI plumbing: common flags, JSON output and plain tables."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import stat
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..errors import InputError


#: Upper bounds of the flags that size a call (``explain``; ``--heads`` everywhere): past them
#: a value is a typo, and ``--heads 99999999999999999999:1`` was explained, and put into the
#: ``fp8-check`` command a record would need, as if a call could have it.
MAX_HEADS = 4096  # query or KV heads: published models use at most a few hundred
MAX_HEAD_DIM = 4096  # no attention kernel takes over 1024
MAX_LENGTH = 2**31 - 1  # lengths, windows, pages, layer indices: int32, as cu_seqlens hold
MAX_BATCH = 2**20  # sequences in one call
MAX_WORLD_SIZE = 2**16  # context-parallel ranks


def at_least(low: float, kind: type = int, *, strict: bool = False,
             high: float | None = None, why: str = "") -> Callable[[str], Any]:
    """An argparse ``type``: an int (or, with ``kind=float``, a finite number) >= ``low``
    (``strict``: > ``low``) and at most ``high`` if given (``why``: what that bound is);
    anything else is a usage error naming the flag and the bound (exit 2, no traceback)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and (value > low if strict else value >= low)):
            raise argparse.ArgumentTypeError(
                f"{text!r}: must be a number {'>' if strict else '>='} {low:g}")
        if high is not None and value > high:
            most = high if isinstance(high, int) else f"{high:g}"  # 2147483647, not 2.1e+09
            raise argparse.ArgumentTypeError(f"{text!r}: must be at most {most}"
                                             + (f" ({why})" if why else ""))
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


def recorded(command: str, path: Any, record: Callable[[], None],
             skip_flag: str = "--no-store") -> bool:
    """Run ``record`` (writes to the profile store at ``path``) after the results were
    printed; False, said on stderr, if the store cannot be read or written (the results are
    not lost with it; the store on disk is as it was). ``skip_flag``: the command's own flag
    for not recording, named in the fix."""
    from ..errors import PolicyError

    try:
        record()
    except (OSError, PolicyError, ValueError) as exc:
        print(f"\nattnhub {command}: the profile store {path} could not be written ({exc}); "
              f"the results above were not recorded: fix it, or pass --store PATH (or "
              f"{skip_flag})", file=sys.stderr)
        return False
    return True


def seed(text: str) -> int:
    """An argparse ``type``: a seed in 0..2**32-1 (torch refuses larger ones with a traceback,
    after the model was built)."""
    value = at_least(0)(text)
    if value >= 2 ** 32:
        raise argparse.ArgumentTypeError(f"{text!r}: a seed must be in 0..{2 ** 32 - 1}")
    return value


def wants_progress(args: argparse.Namespace) -> bool:
    """A progress bar only on a terminal: not with --json or --no-progress, nor when stderr is
    piped or in a file (a bar's carriage returns would fill the log)."""
    return not (getattr(args, "json", False) or getattr(args, "no_progress", False)
                or not sys.stderr.isatty())


def progress(args: argparse.Namespace, desc: str, total: int, unit: str = "it") -> Any:
    """A tqdm bar on stderr for long work, or None (see ``wants_progress``)."""
    if not wants_progress(args):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)


def path_kind(path: str | os.PathLike[str]) -> str | None:
    """What is at ``path``: "file", "folder", "other" (a device, FIFO or socket) or None
    (nothing). ``Path.is_file()``/``exists()`` let a name too long (ENAMETOOLONG) or an
    unsearchable folder (EACCES) escape as tracebacks; here every such error is an
    ``OSError`` the caller names (see :func:`checked_kind`)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return "file" if stat.S_ISREG(mode) else "folder" if stat.S_ISDIR(mode) else "other"


def checked_kind(flag: str, path: str | os.PathLike[str]) -> str | None:
    """:func:`path_kind` of a user's path, a path that cannot be looked at (a name too long,
    a folder without permission, a symlink loop) an error naming ``flag``, the path and why."""
    try:
        return path_kind(path)
    except OSError as exc:
        from ..policy.located import clip

        raise InputError(f"{flag} {clip(os.fspath(path), 200, middle=True)}: cannot use this "
                         f"path ({exc.strerror or exc}); pass another one") from None


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix, so writers that infer the format from
    it still do) that replaces ``path`` only when the block succeeds: a failed or interrupted
    write leaves the old file, or none, never a truncated one."""
    target = Path(os.path.realpath(path))
    if path_kind(target) == "other":
        raise InputError(f"{path} is not a regular file (a device, FIFO or socket, which the "
                         "write would replace); pass the path of a file to write")
    from ..policy.profile import _UMASK, discard, kept_mode, open_temp

    kept = kept_mode(target)
    made: list[Path] = []
    try:
        os.close(open_temp(target, target.suffix, made))
        yield made[-1]
        with open(made[-1], "rb+") as f:  # on disk before the rename, as the store's JSON
            os.fsync(f.fileno())
        # the writer may have made the file anew: the old file's mode, or a new file's
        os.chmod(made[-1], 0o666 & ~_UMASK if kept is None else kept)
        os.replace(made[-1], target)
    except BaseException:
        discard(made)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """``path`` holds ``text`` afterwards, or is as it was (see ``atomic_path``)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def name_list(what: str, example: str, omitted: str = "") -> Callable[[str], str]:
    """An argparse ``type`` for a comma list that selects or filters: at least one name. An
    empty value (an unset shell variable: ``--cells "$CELLS"``) was read as no filter at all,
    and the whole default ran. ``omitted``: what leaving the flag out does."""

    def parse(text: str) -> str:
        if not [x for x in text.split(",") if x.strip()]:
            raise _nothing(text, what, example, omitted)
        return text

    parse.__name__ = "list"
    return parse


def nonblank(what: str, example: str, omitted: str = "") -> Callable[[str], str]:
    """An argparse ``type`` for one name or filter text: not blank (see :func:`name_list`)."""

    def parse(text: str) -> str:
        if not text.strip():
            raise _nothing(text, what, example, omitted)
        return text

    parse.__name__ = "text"
    return parse


def _nothing(text: str, what: str, example: str, omitted: str) -> argparse.ArgumentTypeError:
    tail = f" ({omitted})" if omitted else ""
    return argparse.ArgumentTypeError(f"{text!r} names no {what}; pass e.g. {example}, or "
                                      f"leave the flag out{tail}")


#: ``--policy FILE``: not blank (an unset shell variable, ``--policy "$P"``, ran ``attnhub run``
#: under the default policy and made ``explain`` read the working directory as the policy).
POLICY_FLAG = nonblank("policy", "policies/portable.yaml or a packaged name such as default",
                       "ATTNHUB_POLICY, else the packaged default")

#: ``--hardware A,B``: at least one name (an empty value planned for this machine, or for
#: ATTNHUB_HARDWARE, as if the flag had not been given).
hardware_names = name_list("hardware", "sm90")


def hardware_name(text: str) -> str:
    """An argparse ``type`` for a one-device ``--hardware``: exactly one name (``explain``
    read the first of ``sm90,sm80`` and dropped the rest without a word)."""
    names = [h.strip() for h in hardware_names(text).split(",") if h.strip()]
    if len(names) > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: one device here; `attnhub plan --hardware "
                                         f"{','.join(names)}` compares several")
    return names[0]


def add_hardware(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--hardware", metavar="ARCH", type=hardware_name,
                   help=help or "simulate a device for offline planning (cpu, sm80, sm90, "
                                "gfx942, ...)")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


#: JSON documents printed by the running command (``main`` resets it): a command that fails
#: after printing its report adds no second document, which would make stdout unparsable.
json_printed = [0]


def print_json(obj: Any) -> None:
    """``obj`` as one strict JSON document on stdout: a float that is not finite (NaN, inf),
    which strict parsers refuse, is written as null. A reader that went away (a closed pipe)
    is not an error of the command: the rest of stdout goes nowhere, and the command keeps
    its status (a failing command exits 1, not 0 or with a traceback)."""
    text = json.dumps(_finite(obj), indent=2, default=str, allow_nan=False)
    json_printed[0] += 1
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()


def _finite(obj: Any) -> Any:
    """``obj`` with each float that is not finite replaced by None (JSON null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _stdout_to_devnull() -> None:
    """After a closed pipe, stdout writes (and the flush at exit) go to the null device."""
    try:
        fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # no file descriptor (a captured stdout)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- stays open for the process


def print_error_json(kind: str, message: str, problems: Sequence[str] | None = None) -> None:
    """With ``--json``, a failed command prints ``{"error": kind (the exception's class),
    "message": ..., "problems": [each located line]}`` on stdout, unless it printed its
    report already: a script parsing the output got nothing to parse."""
    if not json_printed[0]:
        print_json({"error": kind, "message": message, "problems": list(problems or [message])})


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A plain aligned text table (markdown-compatible pipes)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(cells[0]), sep] + [fmt(r) for r in cells[1:]])

