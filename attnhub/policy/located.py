"""YAML read with a position for every node, and errors that point at them.

PyYAML's ``safe_load`` silently keeps the last of two equal keys and forgets positions, so a
typo could change which kernel runs without a word. Here the document is composed into nodes,
built into plain data by hand (duplicate keys become problems) and every path remembers its
``line:col``; pydantic's errors are then turned into ``file:line:col path: what is wrong,
what is expected`` lines, all of them at once.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import BaseModel

Path_ = tuple[str | int, ...]


@dataclass
class Located:
    """Plain data from one YAML file plus the position of each value and each key."""

    file: str
    data: Any = None
    values: dict[Path_, tuple[int, int]] = field(default_factory=dict)
    keys: dict[Path_, tuple[int, int]] = field(default_factory=dict)

    def where(self, path: Path_, key: bool = False) -> str:
        """``file:line:col`` of the deepest node on ``path`` (the key's position if asked)."""
        p = tuple(path)
        while p and p not in self.values:
            p = p[:-1]
        line, col = (self.keys.get(p) if key else None) or self.values.get(p, (1, 1))
        return f"{self.file}:{line}:{col}"

    def line(self, path: Path_) -> int:
        return int(self.where(path).rsplit(":", 2)[1])


def dotted(path: Path_) -> str:
    """``("rules", 2, "when", "arch")`` -> ``rules[2].when.arch``."""
    out = ""
    for seg in path:
        out += f"[{seg}]" if isinstance(seg, int) else (f".{seg}" if out else str(seg))
    return out or "(document)"


#: Limits no real policy comes near; a file past them is refused, located, never expanded.
MAX_DEPTH = 64
MAX_VALUES = 500_000
_STD = "tag:yaml.org,2002:"
_SCALAR_TAGS = frozenset(_STD + t for t in ("null", "bool", "int", "float", "str"))
_MERGE = _STD + "merge"
_STR = _STD + "str"
_NUMBER_TAGS = frozenset({_STD + "int", _STD + "float"})
_AWAIT, _SKIP = object(), object()
#: A plain decimal integer (YAML 1.1 reads a leading 0 as octal, so none here).
#: the largest integer a policy file may hold (bits; sign apart): hex and binary integers are
#: read with no digit limit, and a bigger one is a typo or generated garbage
MAX_INT_BITS = 64
_DECIMAL = re.compile(r"[-+]?(?:0|[1-9][0-9]{0,17})\Z")
#: YAML 1.1 numbers few readers expect: a leading 0 is octal (``0100`` is 64) and colons are
#: base 60 (``1:04`` is 64, ``9:0`` is 540). Refused: the value would differ from what it says.
_LEGACY_NUMBER = re.compile(r"[-+]?(?:0[0-7_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)\Z")
#: Only escapes can write these; they would reach terminals and JSON output (a lone surrogate
#: cannot even be printed as UTF-8).
#: Control characters, lone surrogates and the bidirectional overrides that make text read
#: differently from what it is ("Trojan Source": a name shown reversed in every message).
#: U+2028/U+2029 too: refused raw before parsing (``_hidden_breaks``), an escape
#: (``"a\\Lb"``) still put a line break no editor shows into a name and every message.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff"
                          "\u202a-\u202e\u2066-\u2069\u2028\u2029]")


#: Characters YAML reads as a line break that editors do not show as one (often pasted from a
#: web page or a word processor): one in a comment ends the comment, so the rest of that line
#: is parsed as YAML and the error points at a line that looks fine.
_HIDDEN_BREAKS = {"\u2028": "LINE SEPARATOR", "\u2029": "PARAGRAPH SEPARATOR",
                  "\x85": "NEXT LINE (NEL)"}
_HIDDEN_BREAK = re.compile("[\u2028\u2029\x85]")


def _hidden_breaks(text: str, file: str) -> list[str]:
    """A problem for the first character of ``_HIDDEN_BREAKS`` in ``text`` (with how many
    more there are), at the line and column an editor shows; empty when there is none."""
    first = _HIDDEN_BREAK.search(text)
    if first is None:
        return []
    pos = first.start()
    # lines end at \n, \r\n or a lone \r (as editors and YAML count them); a BOM is no column
    line = text.count("\n", 0, pos) + text.count("\r", 0, pos) - text.count("\r\n", 0, pos) + 1
    start = max(text.rfind("\n", 0, pos), text.rfind("\r", 0, pos)) + 1
    col = pos - (start or int(text.startswith("\ufeff"))) + 1
    char = first.group()
    more = len(_HIDDEN_BREAK.findall(text, pos + 1))
    tail = f" ({more} more in this file: replace each)" if more else ""
    return [f"{file}:{line}:{col} (yaml): character U+{ord(char):04X} {_HIDDEN_BREAKS[char]} "
            "is a line break to YAML but not to an editor (the rest of the line would be read "
            f"as YAML, and errors would point elsewhere), expected a space or a newline "
            f"(replace it){tail}"]


class _Refused(Exception):
    """A construct policy files do not allow (alias, tag, merge key, depth): stop reading."""


class _Frame:
    """An open list or mapping while events stream in; ``skip`` frames build nothing."""

    __slots__ = ("data", "path", "key", "skip", "is_key")

    def __init__(self, data: Any, path: Path_, skip: bool = False, is_key: bool = False):
        self.data, self.path, self.key, self.skip, self.is_key = data, path, _AWAIT, skip, is_key


def read_yaml(text: str, file: str) -> tuple[Located, list[str]]:
    """Parse ``text``; return located plain data and problems (syntax, duplicate keys, and
    what policy files refuse: aliases, tags, merge keys, nesting deeper than ``MAX_DEPTH``).

    Built from the parser's event stream with an explicit stack, so no document can recurse
    the reader, expand an alias, or construct an object: every value is plain data."""
    return read_yaml_with(text, file, getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def read_yaml_with(text: str, file: str, parser: Any) -> tuple[Located, list[str]]:
    """:func:`read_yaml` with the given PyYAML loader class as the event source."""
    doc = Located(file)
    problems = _hidden_breaks(text, file)
    if problems:
        return doc, problems
    loader = yaml.SafeLoader("")
    try:
        doc.data = _Builder(doc, problems, loader).run(yaml.parse(text, Loader=parser))
    except _Refused as exc:
        doc.data = None
        return doc, [str(exc)]
    except yaml.MarkedYAMLError as exc:
        if parser is not yaml.SafeLoader:  # libyaml's wording is terser: ask the pure parser
            return read_yaml_with(text, file, yaml.SafeLoader)
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        what = " ".join(x for x in (exc.context, exc.problem) if x)
        doc.data = None
        return doc, [f"{file}:{line}:{col} (yaml syntax): {what}, expected valid YAML"]
    except yaml.reader.ReaderError as exc:  # a character YAML forbids (NUL, other controls)
        line = text.count("\n", 0, exc.position) + 1
        col = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        doc.data = None
        return doc, [f"{file}:{line}:{col} (yaml): character U+{exc.character:04X} is not "
                     "allowed in YAML, expected printable text (remove it)"]
    except yaml.YAMLError as exc:
        doc.data = None
        return doc, [f"{file}:1:1 (yaml): {exc}, expected one valid YAML document"]
    return doc, problems


class _Builder:
    """Plain data from parser events, positions recorded as it goes."""

    def __init__(self, doc: Located, problems: list[str], loader: yaml.SafeLoader):
        self.doc, self.problems, self.loader = doc, problems, loader
        self.stack: list[_Frame] = []
        self.count = 0
        #: Scalars already built: rules repeat names and values, and resolving a tag tries
        #: several regular expressions.
        self.scalars: dict[tuple[str, str | None, tuple[bool, bool]], Any] = {}

    def _at(self, mark: Any) -> str:
        return f"{self.doc.file}:{mark.line + 1}:{mark.column + 1}"

    def run(self, events: Any) -> Any:
        root: Any = None
        docs = 0
        for ev in events:
            if isinstance(ev, yaml.DocumentStartEvent):
                docs += 1
                if docs > 1:
                    raise _Refused(f"{self._at(ev.start_mark)} (document): a second YAML "
                                   "document, expected one document per policy file (remove "
                                   "the `---` separator)")
            elif isinstance(ev, yaml.AliasEvent):
                raise _Refused(f"{self._at(ev.start_mark)} {dotted(self._path_here())}: YAML "
                               f"alias *{ev.anchor} is not allowed in policy files (aliases can "
                               "expand without bound), expected the value written out; share "
                               "rules between files with `extends:`")
            elif isinstance(ev, (yaml.ScalarEvent, yaml.SequenceStartEvent,
                                 yaml.MappingStartEvent)):
                at_root = not self.stack
                value = self._node(ev)
                if at_root:
                    root = value
            elif isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                done = self.stack.pop()
                if self.stack and not done.is_key:
                    self._value_done(self.stack[-1])
        return root

    def _path_here(self) -> Path_:
        if not self.stack:
            return ()
        f = self.stack[-1]
        if isinstance(f.data, list):
            return f.path + (len(f.data),)
        return f.path + ((f.key,) if f.key not in (_AWAIT, _SKIP) else ())

    def _value_done(self, f: _Frame) -> None:
        if isinstance(f.data, dict) and f.key is not _AWAIT:
            f.key = _AWAIT

    def _node(self, ev: Any) -> Any:
        """Handle a scalar or a container start; returns the new value (root only)."""
        self.count += 1
        if self.count > MAX_VALUES:
            raise _Refused(f"{self._at(ev.start_mark)} (document): more than {MAX_VALUES} "
                           "values, expected a policy of reasonable size")
        self._check_tag(ev)
        parent = self.stack[-1] if self.stack else None
        is_key = parent is not None and isinstance(parent.data, dict) and parent.key is _AWAIT
        if is_key:
            return self._key(parent, ev)
        skip = parent is not None and (parent.skip or parent.key is _SKIP)
        path = () if parent is None else self._path_here()
        pos = (ev.start_mark.line + 1, ev.start_mark.column + 1)
        if isinstance(ev, yaml.ScalarEvent):
            value = None if skip else self._scalar(ev, path)
        else:
            value = [] if isinstance(ev, yaml.SequenceStartEvent) else {}
            if len(self.stack) >= MAX_DEPTH:
                raise _Refused(f"{self._at(ev.start_mark)} {dotted(path)}: nesting deeper than "
                               f"{MAX_DEPTH} levels, expected a flat policy (rules, when, use)")
        if not skip:
            self.doc.values[path] = pos
            if parent is not None:
                if isinstance(parent.data, list):
                    parent.data.append(value)
                else:
                    parent.data[parent.key] = value
        if isinstance(ev, yaml.ScalarEvent):
            if parent is not None:
                self._value_done(parent)
        else:
            self.stack.append(_Frame(value, path, skip))
        return value

    def _key(self, parent: _Frame, ev: Any) -> Any:
        pos = (ev.start_mark.line + 1, ev.start_mark.column + 1)
        where = f"{self.doc.file}:{pos[0]}:{pos[1]} {dotted(parent.path)}" \
            if not isinstance(ev, yaml.ScalarEvent) or parent.skip or not isinstance(
                ev.value, str) or ev.value == "<<" or ev.tag else ""
        if not isinstance(ev, yaml.ScalarEvent):
            if not parent.skip:
                kind = "list" if isinstance(ev, yaml.SequenceStartEvent) else "mapping"
                self.problems.append(f"{where}: got a {kind} as a key, expected a plain name")
            parent.key = _SKIP
            value: Any = [] if isinstance(ev, yaml.SequenceStartEvent) else {}
            self.stack.append(_Frame(value, parent.path, skip=True, is_key=True))
            return value
        if parent.skip:
            parent.key = _SKIP
            return None
        tag = self._tag(ev)
        if tag == _MERGE:
            raise _Refused(f"{where}: merge key `<<` is not allowed in policy files, expected "
                           "the keys written out (or `extends:` to build on another file)")
        key = self._construct(ev, tag, parent.path)
        if not isinstance(key, str):
            where = f"{self.doc.file}:{pos[0]}:{pos[1]} {dotted(parent.path)}"
            self.problems.append(f"{where}: got the key {show(ev.value)}, which YAML reads as "
                                 f"{_reading(key)}, expected a plain name (quote it)")
            parent.key = _SKIP
        elif key in parent.data:
            first = self.doc.keys[parent.path + (key,)][0]
            self.problems.append(f"{self.doc.file}:{pos[0]}:{pos[1]} "
                                 f"{dotted(parent.path + (key,))}: duplicate key {key!r} (first "
                                 f"at line {first}), expected each key once")
            parent.key = _SKIP
        else:
            self.doc.keys[parent.path + (key,)] = pos
            parent.key = key
        return key

    def _check_tag(self, ev: Any) -> None:
        tag = getattr(ev, "tag", None)
        if tag is None or tag == "!":
            return
        allowed = (_SCALAR_TAGS if isinstance(ev, yaml.ScalarEvent) else
                   {_STD + "seq"} if isinstance(ev, yaml.SequenceStartEvent) else {_STD + "map"})
        if tag not in allowed:
            shown = "!!" + tag[len(_STD):] if tag.startswith(_STD) else tag
            raise _Refused(f"{self._at(ev.start_mark)} {dotted(self._path_here())}: YAML tag "
                           f"{shown} is not allowed in policy files, expected a plain value "
                           "without a tag (quote it if it must be a string)")

    def _tag(self, ev: Any) -> str:
        if ev.tag is not None and ev.tag != "!":
            return ev.tag
        if not ev.implicit[0]:  # quoted: always a string
            return _STR
        return self.loader.resolve(yaml.ScalarNode, ev.value, ev.implicit)

    def _scalar(self, ev: Any, path: Path_) -> Any:
        key = (ev.value, ev.tag, ev.implicit)  # decides the tag, so the (immutable) value
        hit = self.scalars.get(key, _AWAIT)
        if hit is _AWAIT:
            if ev.tag is None and ev.implicit[0] and _DECIMAL.match(ev.value):
                hit = self.scalars[key] = int(ev.value)  # what the int resolver would build
            else:
                hit = self.scalars[key] = self._construct(ev, self._tag(ev), path)
        return hit

    def _construct(self, ev: Any, tag: str, path: Path_) -> Any:
        if tag == _STR:
            bad = _UNPRINTABLE.search(ev.value)
            if bad:
                raise _Refused(f"{self._at(ev.start_mark)} {dotted(path)}: character "
                               f"U+{ord(bad.group()):04X} ({_char_kind(bad.group())}) is not "
                               "allowed in policy files, expected printable text (remove the "
                               "escape)")
            return ev.value
        if tag in _NUMBER_TAGS and _LEGACY_NUMBER.match(ev.value.strip()):
            kind = "a base-60" if ":" in ev.value else "an octal"
            raise _Refused(f"{self._at(ev.start_mark)} {dotted(path)}: {show(ev.value)} is "
                           f"{kind} number in YAML 1.1 (it reads as "
                           f"{self.loader.construct_object(_node(tag, ev))}), expected a decimal "
                           "number without a leading 0 or colons (quote it for a string)")
        node = _node(tag, ev)
        try:
            value = self.loader.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, OverflowError):  # ValueError: an int of 5,000 digits
            raise _Refused(f"{self._at(ev.start_mark)} {dotted(path)}: cannot read "
                           f"{show(ev.value)} as a plain value, expected a string, number, "
                           "true/false or null (quote it to make it a string)") from None
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            # hex and binary have no digit limit: 0xfff... of 4,000 digits is an int whose
            # decimal form (past 4,300 digits) every message and dump failed to print
            raise _Refused(f"{self._at(ev.start_mark)} {dotted(path)}: the number "
                           f"{show(ev.value.strip())} is too large ({value.bit_length()} bits), "
                           f"expected an integer of at most {MAX_INT_BITS} bits")
        return value


def _char_kind(c: str) -> str:
    """What an unprintable character is, for the message that refuses it."""
    if c in "\u2028\u2029":
        return "a line break no editor shows"
    return "a control character or lone surrogate"


def _reading(key: Any) -> str:
    """What YAML made of a key that is not text (keys are names, and pydantic placed such a
    key as a list index, ``[1]``, at its value's column, or at 1:1 for NaN)."""
    if isinstance(key, bool):
        return (f"the flag {key} (YAML 1.1 reads unquoted yes/no/on/off/true/false as a "
                "flag)")
    if key is None:
        return "null (an empty key, ~ or null)"
    if isinstance(key, (int, float)):
        return f"the number {show(key)}"
    return f"a {type(key).__name__} ({clip(str(key))})"


def _node(tag: str, ev: Any) -> yaml.ScalarNode:
    return yaml.ScalarNode(tag, ev.value, ev.start_mark, ev.end_mark, ev.style)


def pydantic_problems(errors: list[dict[str, Any]], doc: Located, model: type[BaseModel],
                      prefix: Path_ = ()) -> list[str]:
    """Turn pydantic error dicts into located lines (``prefix`` is where ``model`` starts)."""
    return [_one(err, doc, model, prefix) for err in errors]


def _one(err: dict[str, Any], doc: Located, model: type[BaseModel], prefix: Path_) -> str:
    loc = tuple(err["loc"])
    path, missing = _data_path(doc.data, prefix, loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        key = path[-1]
        allowed = _fields_at(model, loc[:-1])
        hint = difflib.get_close_matches(str(key), allowed, n=1)
        tail = f" (did you mean {hint[0]!r}?)" if hint else ""
        return (f"{doc.where(path, key=True)} {dotted(path)}: unknown key {key!r}, expected one "
                f"of: {', '.join(allowed)}{tail}")
    if kind == "missing":
        return (f"{doc.where(path)} {dotted(path + missing)}: required key is missing, "
                f"expected `{missing[-1]}: ...` here")
    if kind == "too_short":
        n = err.get("ctx", {}).get("min_length", 1)
        return f"{doc.where(path)} {dotted(path)}: got an empty list, expected at least {n} item(s)"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if msg.startswith("Input should be"):
        msg = f"got {show(err.get('input'))}, expected{msg[len('Input should be'):]}"
    elif not msg.startswith("got "):
        msg = f"got {show(err.get('input'))}, {msg[0].lower()}{msg[1:]}"
    return f"{doc.where(path)} {dotted(path)}: {msg}"


def _data_path(data: Any, prefix: Path_, loc: Path_) -> tuple[Path_, Path_]:
    """Follow ``loc`` through the data; segments pydantic adds (shorthand keys such as
    ``in``/``order``, or a missing key) do not exist there and are returned separately."""
    path, skipped = list(prefix), []
    node = data
    for seg in prefix:
        node = node[seg]
    for seg in loc:
        if isinstance(node, dict) and seg in node:
            node = node[seg]
            path.append(seg)
        elif isinstance(node, list) and isinstance(seg, int) and 0 <= seg < len(node):
            node = node[seg]
            path.append(seg)
        else:
            skipped.append(seg)
    return tuple(path), tuple(s for s in skipped[-1:] if isinstance(s, str))


def _fields_at(model: type[BaseModel], loc: Path_) -> list[str]:
    """The keys the schema allows at ``loc`` (for 'expected one of')."""
    t: Any = model
    for seg in loc:
        t = _unwrap(t)
        if isinstance(t, type) and issubclass(t, BaseModel):
            by_key = {f.alias or n: f.annotation for n, f in t.model_fields.items()}
            t = by_key.get(str(seg), t) if isinstance(seg, str) else t
        elif typing.get_origin(t) is list and isinstance(seg, int):
            t = typing.get_args(t)[0]
        elif typing.get_origin(t) is dict:
            t = typing.get_args(t)[1]
    t = _unwrap(t)
    if isinstance(t, type) and issubclass(t, BaseModel):
        return sorted(f.alias or n for n, f in t.model_fields.items())
    return []


def _unwrap(t: Any) -> Any:
    """Strip ``Annotated`` and ``X | None`` down to the one real type."""
    while True:
        origin = typing.get_origin(t)
        if origin is typing.Annotated:
            t = typing.get_args(t)[0]
        elif origin in (typing.Union, types.UnionType):
            real = [a for a in typing.get_args(t) if a is not type(None)]
            if len(real) != 1:
                return t
            t = real[0]
        else:
            return t


def clip(text: str, limit: int = 60, middle: bool = False) -> str:
    """``text`` cut to ``limit`` characters with ``...`` (``middle``: the start and the end
    kept, for paths whose file name is at the end): a value of megabytes is a typo or
    generated garbage, and echoed whole it made one error line of megabytes."""
    if len(text) <= limit:
        return text
    if not middle:
        return text[:limit - 3] + "..."
    head = (limit - 3) // 2
    return text[:head] + "..." + text[len(text) - (limit - 3 - head):]


def show(v: Any) -> str:
    """``repr(v)`` for a message, cut to one short line (see :func:`clip`); an integer too long
    to print in decimal (Python refuses past 4,300 digits) is named by its size."""
    try:
        return clip(repr(v))
    except ValueError:
        if isinstance(v, int):
            return f"an integer of {v.bit_length()} bits"
        raise
