"""Load a policy: YAML with positions, schema validation, ``extends:`` overlays.

Every problem of every file in the chain is collected and raised together as one
:class:`~attnhub.errors.PolicyError`, each line ``file:line:col path: what is wrong, what is
expected``.

Overlay semantics (a file that ``extends`` another): the top file's name, version and
description win; ``targets`` and each ``defaults`` key are inherited unless set; rules named
in ``remove`` are dropped; a rule whose name exists in the base replaces it in place; a new
rule goes before every base rule, in file order, unless ``before:``/``after:`` names the
rule it should sit next to.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import gc
import os
import re
import stat
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from pydantic import ValidationError

from ..errors import PolicyError
from .located import Located, clip, dotted, pydantic_problems, read_yaml, show
from .schema import Defaults, PolicyFile, Rule

_PACKAGED_NAME = re.compile(r"[A-Za-z0-9_-]+\Z")  # ``$`` took "default\n" as a packaged name
#: Limits no real policy comes near (the packaged ones are under 10 KiB and extend at most
#: once): past them a file is refused, located, before it is parsed or followed.
MAX_BYTES = 16 * 2**20
MAX_CHAIN = 32
#: Problems listed per file; a generated file can have one per value, and a listing of half a
#: million lines helps nobody: the first ones are shown with a count of the rest.
MAX_PROBLEMS = 100
#: Rule names listed in "expected one of" (a base of thousands of rules made one line of
#: hundreds of kilobytes); the rest are counted. Paths in messages are cut to ``MAX_SHOWN``.
MAX_LISTED = 20
MAX_SHOWN = 200


@dataclass(frozen=True)
class LoadedRule:
    """A validated rule and where it was written (for explain, lint and lockfiles)."""

    rule: Rule
    doc: Located
    path: tuple[str | int, ...]  # ("rules", i) inside ``doc``

    @property
    def location(self) -> str:
        """``file:line`` of the rule, as decision records show it."""
        return self.doc.where(self.path).rsplit(":", 1)[0]

    def where(self, *sub: str | int, key: bool = False) -> str:
        return self.doc.where(self.path + sub, key=key)


@dataclass(frozen=True)
class PolicyData:
    """A merged policy: header from the top file, rules after every overlay."""

    name: str
    version: int
    description: str
    targets: tuple[str, ...] | None
    defaults: Defaults
    rules: tuple[LoadedRule, ...]
    files: tuple[str, ...]  # as displayed (relative to the working directory when inside it)
    paths: tuple[Path, ...] = ()  # absolute, base first
    #: where each of ``targets`` is written: ``file:line:col targets[i]``
    target_places: tuple[str, ...] = ()


def policies_dir() -> Path:
    """Where the packaged policies live: the source tree (editable install) or
    ``<prefix>/share/attnhub/policies`` (wheel install, pyproject ``data-files``)."""
    root = Path(__file__).resolve().parents[2]
    candidates = [root / "policies"] if (root / "pyproject.toml").is_file() else []
    for base in {sys.prefix, sysconfig.get_path("data"), sysconfig.get_path("data", "posix_user")}:
        candidates.append(Path(base) / "share" / "attnhub" / "policies")
    for c in candidates:
        if (c / "default.yaml").is_file():
            return c
    raise PolicyError([f"the packaged default policy was not found (looked in "
                       f"{', '.join(str(c) for c in candidates)}); reinstall attnhub or set "
                       "ATTNHUB_POLICY=path/to/policy.yaml"])


def default_policy_path() -> Path:
    """``ATTNHUB_POLICY`` if set, else the packaged ``default.yaml``."""
    env = os.environ.get("ATTNHUB_POLICY")
    return Path(env) if env else policies_dir() / "default.yaml"


def resolve_policy_path(ref: str | os.PathLike[str], base_dir: Path | None = None) -> Path:
    """A file path, or a packaged policy name such as ``default`` or ``portable``."""
    s = os.fspath(ref)
    if _PACKAGED_NAME.match(s) and not _local((base_dir or Path(".")) / s):
        return policies_dir() / f"{s}.yaml"
    try:
        p = Path(s).expanduser()
    except RuntimeError:  # ``~nosuchuser/x.yaml``: read as written, and reported as unreadable
        p = Path(s)
    return p if p.is_absolute() or base_dir is None else base_dir / p


def _local(p: Path) -> bool:
    """``p`` names a local policy rather than a packaged one: a file, or a link that leads
    to no folder (a symlink loop or a dangling link is that file, reported when it is read,
    not a "missing packaged policy")."""
    return _exists(p, file=True) or (os.path.islink(p) and not os.path.isdir(p))


def _exists(p: Path, file: bool = False) -> bool:
    """``p.exists()`` (``file``: ``p.is_file()``: a folder named ``default`` beside a policy
    does not hide the packaged one) that cannot raise: a name too long for the file system
    (ENAMETOOLONG) or a folder without search permission escaped the loader as a traceback;
    the read that follows reports it, located."""
    try:
        return p.is_file() if file else p.exists()
    except OSError:
        return False


def load_data(path: str | os.PathLike[str], origin: str | None = None) -> PolicyData:
    """Read, validate and merge a policy file and the chain it extends. ``origin`` names
    where the path came from (``ATTNHUB_POLICY=...``) in a problem reading it."""
    with paused_gc():
        return _load_data(path, origin)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: reading a policy allocates many small objects
    and no cycles, and its passes made a 4,000-rule file about twice as slow to load."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _load_data(path: str | os.PathLike[str], origin: str | None) -> PolicyData:
    problems: list[str] = []
    chain = _read_chain(Path(path), problems, [], ref=origin)
    if problems:
        raise PolicyError(problems)
    merged = _merge(chain, problems)
    if problems:
        raise PolicyError(problems)
    return merged


def _packaged_hint(path: Path) -> str:
    """`` (did you mean 'default'?)`` when ``path`` is a misspelt packaged policy."""
    try:
        pdir = policies_dir()
    except PolicyError:
        return ""
    if _real(path.parent) != _real(pdir) or path.suffix != ".yaml":
        return ""
    names = sorted(p.stem for p in pdir.glob("*.yaml"))
    hint = difflib.get_close_matches(path.stem, names, n=1)
    return (f"; packaged policies: {', '.join(names)}"
            + (f" (did you mean {hint[0]!r}?)" if hint else ""))


class TooBig(Exception):
    """A file past the size limit, or not a regular file (a FIFO, ``/dev/zero``)."""


class DuplicateKey(ValueError):
    """A JSON object with one key twice (``json`` keeps the last silently)."""


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for hand-editable JSON (locks, profile stores): a key given
    twice is an error, not the last one winning (``"passed": false, ..., "passed": true``
    read as a passing accuracy record)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out


def read_limited(path: Path, limit: int) -> bytes:
    """The bytes of regular file ``path``; :class:`TooBig` past ``limit`` bytes or for
    anything else (reading ``/dev/zero`` or a FIFO would never end)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO: no writer wait
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise TooBig("not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > limit:
        raise TooBig(f"larger than {limit} bytes")
    return raw


def _real(p: Path) -> Path:
    """``p.resolve()`` that cannot raise: a symlink loop is reported when it is read, and so
    is a relative path when the working directory was deleted (``getcwd`` fails)."""
    try:
        return Path(os.path.realpath(p))
    except OSError:
        return p


def _display(p: Path) -> str:
    try:
        return str(_real(p).relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):  # outside it, or the working directory was deleted
        return str(p)


def _utf16(raw: bytes) -> str:
    """What ``raw`` is when it is UTF-16 or UTF-32 (named with how it shows it), or "":
    without a byte-order mark it decodes as UTF-8 with a NUL before or after each character,
    reported as a NUL to remove (the wrong fix)."""
    if raw[:4] in (b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff"):
        return "UTF-32 (it starts with a byte-order mark)"
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return "UTF-16 (it starts with a byte-order mark)"
    if b"\x00" not in raw:
        return ""
    head = raw[:min(len(raw), 256) // 4 * 4]
    if head and (not any(head[1::4] + head[2::4] + head[3::4])
                 or not any(head[0::4] + head[1::4] + head[2::4])):
        return "UTF-32 (three NUL bytes beside each character)"
    # NULs at one parity (the high byte of ASCII: the keys of any policy) in a good share of
    # the characters, and the whole file decodes as that UTF-16 into lines of text: a first
    # line of Cyrillic or CJK has no zero byte, so "every other byte is 0" alone missed it
    even = raw[:len(raw) // 2 * 2]
    for high, encoding in ((1, "utf-16-le"), (0, "utf-16-be")):
        zeros, other = even[high::2].count(0), even[1 - high::2].count(0)
        if zeros >= 2 and zeros * 16 >= len(even) // 2 and zeros >= 3 * other:
            try:
                text = even.decode(encoding)
            except UnicodeDecodeError:
                continue
            if "\n" in text and not _CONTROL.search(text):
                return "UTF-16 (a NUL byte between the characters)"
    return ""


_BREAK = re.compile(r"[\t\n\r]")

#: C0 controls other than tab and the line ends: not in a text decoded right
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _read_chain(path: Path, problems: list[str], seen: list[Path],
                ref: str | None = None) -> list[tuple[PolicyFile, Located]]:
    """Files from the root base to ``path`` (each validated); problems collected."""
    file = _display(path)
    if _real(path) in seen:
        cycle = " -> ".join(_display(p) for p in seen + [_real(path)])
        problems.append(f"{ref}: extends forms a cycle ({cycle}), expected a chain that ends")
        return []
    if len(seen) >= MAX_CHAIN:
        problems.append(f"{ref}: extends chain longer than {MAX_CHAIN} files, expected a short "
                        "chain (merge some of the files)")
        return []
    where = f"{ref}: " if ref else ""
    try:
        raw = read_limited(path, MAX_BYTES)
        if utf16 := _utf16(raw):
            problems.append(f"{file}:1:1 (encoding): the file is {utf16}, "
                            "expected a UTF-8 text file (re-save it as UTF-8)")
            return []
        text = raw.decode("utf-8")
    except OSError as exc:
        shown = clip(file, MAX_SHOWN, middle=True)  # an ``extends:`` of megabytes
        problems.append(f"{where}cannot read policy {shown} ({exc.strerror}), expected a "
                        f"readable YAML file (or a packaged name such as `default`)"
                        f"{_packaged_hint(path)}")
        return []
    except TooBig as exc:
        problems.append(f"{where}policy {clip(file, MAX_SHOWN, middle=True)} is {exc}, "
                        f"expected a regular YAML file of at most {MAX_BYTES // 2**20} MiB "
                        "(split it with `extends:`)")
        return []
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        problems.append(f"{file}:{line}:{col} (encoding): byte 0x{raw[exc.start]:02x} is not "
                        "UTF-8, expected a UTF-8 text file (re-save it as UTF-8)")
        return []
    doc, mine = read_yaml(text, file)
    pf, unlisted = _validate(doc, mine)
    problems += sorted(mine, key=_pos)[:MAX_PROBLEMS]
    unlisted += max(0, len(mine) - MAX_PROBLEMS)
    if unlisted:
        problems.append(f"{file}: {unlisted} more problem(s) not listed, expected the ones "
                        "above fixed first (then check again)")
    extends = pf.extends if pf else (doc.data or {}).get("extends") if isinstance(
        doc.data, dict) else None
    base: list[tuple[PolicyFile, Located]] = []
    # followed even when this file is invalid: every problem of the chain at once
    # (not one the schema refused for a line break: its "cannot read" would split in two)
    if isinstance(extends, str) and extends.strip() and not _BREAK.search(extends):
        base = _read_chain(resolve_policy_path(extends, path.parent), problems,
                           seen + [_real(path)], ref=f"{doc.where(('extends',))} extends")
    return base + [(pf, doc)] if pf else []


def _validate(doc: Located, problems: list[str]) -> tuple[PolicyFile | None, int]:
    """The validated file, or None with the reasons added to ``problems``; and how many
    schema errors were counted but not formatted (past ``MAX_PROBLEMS``)."""
    if doc.data is None and problems:  # a syntax error: nothing to validate
        return None, 0
    if not isinstance(doc.data, dict):
        got = "no value (an empty file, only comments, or null)" if doc.data is None else \
            type(doc.data).__name__
        problems.append(f"{doc.where(())} (document): got {got}, expected a mapping with "
                        "name, rules and optional extends, defaults, targets")
        return None, 0
    try:
        pf = PolicyFile.model_validate(doc.data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        problems += pydantic_problems(errors[:MAX_PROBLEMS], doc, PolicyFile)
        return None, max(0, len(errors) - MAX_PROBLEMS)
    found = _file_checks(pf, doc)
    problems += found
    return (None if found else pf), 0


def _pos(line: str) -> tuple[int, int]:
    m = re.search(r":(\d+):(\d+) ", line)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _file_checks(pf: PolicyFile, doc: Located) -> list[str]:
    """Checks within one file that the schema cannot express."""
    out, seen = [], {}
    for i, r in enumerate(pf.rules):
        if r.name in seen:
            out.append(f"{doc.where(('rules', i, 'name'))} rules[{i}].name: duplicate rule name "
                       f"{r.name!r} (first at rules[{seen[r.name]}]), expected unique names")
        seen.setdefault(r.name, i)
        for key in ("before", "after"):
            if getattr(r, key) is not None and pf.extends is None:
                out.append(f"{doc.where(('rules', i, key))} rules[{i}].{key}: got a placement in "
                           "a file without `extends`, expected it only in an overlay")
    if pf.remove and pf.extends is None:
        out.append(f"{doc.where(('remove',))} remove: got rules to remove in a file without "
                   "`extends`, expected it only in an overlay")
    return sorted(out, key=_pos)


def _merge(chain: list[tuple[PolicyFile, Located]], problems: list[str]) -> PolicyData:
    rules: list[LoadedRule] = []
    defaults: dict[str, object] = {}
    targets, places = None, ()
    for pf, doc in chain:
        defaults.update({k: getattr(pf.defaults, k) for k in pf.defaults.model_fields_set})
        if pf.targets is not None:
            targets = tuple(pf.targets)
            keys = [("targets", i) if ("targets", i) in doc.values else ("targets",)
                    for i in range(len(targets))]
            places = tuple(f"{doc.where(k)} {dotted(k)}" for k in keys)
        rules = _overlay(rules, pf, doc, problems)
    top = chain[-1][0]
    return PolicyData(name=top.name, version=top.version, description=top.description,
                      targets=targets, defaults=Defaults(**defaults), rules=tuple(rules),
                      files=tuple(doc.file for _, doc in chain),
                      paths=tuple(Path(doc.file).resolve() for _, doc in chain),
                      target_places=places)


def _overlay(base: list[LoadedRule], pf: PolicyFile, doc: Located,
             problems: list[str]) -> list[LoadedRule]:
    """Apply one file's ``remove``, replacements, placements and new rules to ``base``.

    Rules sit in a list indexed by name; removals leave holes (None) compacted once at the
    end, so a file of thousands of rules merges in linear time."""
    rules: list[LoadedRule | None] = list(base)
    index = {r.rule.name: i for i, r in enumerate(base)}

    def alive() -> list[str]:
        return [r.rule.name for r in rules if r is not None]

    def drop(name: str) -> None:
        rules[index.pop(name)] = None

    removed: dict[str, int] = {}
    for i, name in enumerate(pf.remove):
        if name in removed:  # not "no rule named": it was there, and is gone already
            problems.append(f"{doc.where(('remove', i))} remove[{i}]: {show(name)} is listed "
                            f"twice (first at remove[{removed[name]}]), expected each name once")
        elif name not in index:
            problems.append(_unknown_ref(doc, ("remove", i), name, alive()))
        else:
            drop(name)
        removed.setdefault(name, i)
    top: list[LoadedRule] = []
    moved: list[tuple[int, LoadedRule, str]] = []
    for i, r in enumerate(pf.rules):
        lr = LoadedRule(r, doc, ("rules", i))
        target = r.before if r.before is not None else r.after
        if target is not None:
            if r.name in index:
                drop(r.name)
            moved.append((i, lr, target))
        elif r.name in index:
            rules[index[r.name]] = lr
        else:
            top.append(lr)
    # a placement follows its target wherever it ends up, a rule this file moves too
    names = set(index) | {lr.rule.name for _, lr, _ in moved}
    before_placing = len(problems)
    attached: dict[str, tuple[list[LoadedRule], list[LoadedRule]]] = {}
    for i, lr, target in moved:
        key = ("rules", i, "before" if lr.rule.before is not None else "after")
        if target == lr.rule.name:
            problems.append(f"{doc.where(key)} {dotted(key)}: rule {target!r} is placed "
                            "relative to itself; expected another rule's name")
        elif target not in names:
            problems.append(_unknown_ref(doc, key, target, alive()))
        else:
            before, after = attached.setdefault(target, ([], []))
            (after if lr.rule.after is not None else before).append(lr)
    out = list(top)
    stack: list[tuple[bool, LoadedRule]] = [(False, r) for r in reversed(rules)
                                            if r is not None]
    while stack:  # iterative: a chain of thousands of placements is no recursion
        done, lr = stack.pop()
        if done:
            out.append(lr)
            continue
        before, after = attached.pop(lr.rule.name, ([], []))
        stack += [(False, x) for x in after] + [(True, lr)] + [
            (False, x) for x in reversed(before)]
    placement_problems = len(problems) - before_placing
    for name, (before, after) in attached.items():  # never reached: placed in a cycle
        if placement_problems:  # or hanging from a placement refused above: said there
            break
        for lr in before + after:
            key = ("rules", lr.path[1], "before" if lr.rule.before is not None else "after")
            problems.append(f"{doc.where(key)} {dotted(key)}: rule {lr.rule.name!r} is "
                            f"placed relative to {name!r}, which is placed relative to it "
                            "(a cycle); expected one of them placed by a rule outside it")
    return out


def _unknown_ref(doc: Located, path: tuple[str | int, ...], name: str, known: list[str]) -> str:
    """``remove:``/``before:``/``after:`` naming no base rule; the name and the list cut to
    one readable line (both were echoed whole: megabytes for a generated value)."""
    shown = ", ".join(known[:MAX_LISTED]) or "(none)"
    if len(known) > MAX_LISTED:
        shown += f" and {len(known) - MAX_LISTED} more (`attnhub policy show` lists them)"
    return (f"{doc.where(path)} {dotted(path)}: no rule named {show(name)} in the policy it "
            f"extends, expected one of: {shown}")
