"""YAML read with a position for every node, and errors that point at them.

PyYAML's ``safe_load`` silently keeps the last of two equal keys and forgets positions, so a
typo could change which kernel runs without a word. Here the document is composed into nodes,
built into plain data by hand (duplicate keys become problems) and every path remembers its
``line:col``; pydantic's errors are then turned into ``file:line:col path: what is wrong,
what is expected`` lines, all of them at once.
"""

from __future__ import annotations

import difflib
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


def read_yaml(text: str, file: str) -> tuple[Located, list[str]]:
    """Compose ``text``; return located plain data and problems (syntax, duplicate keys)."""
    doc = Located(file)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        what = " ".join(x for x in (exc.context, exc.problem) if x)
        return doc, [f"{file}:{line}:{col} (yaml syntax): {what}, expected valid YAML"]
    except yaml.YAMLError as exc:
        return doc, [f"{file}:1:1 (yaml): {exc}, expected one valid YAML document"]
    problems: list[str] = []
    if root is not None:
        doc.data = _build(root, (), doc, problems, yaml.SafeLoader(""))
    return doc, problems


def _build(node: yaml.Node, path: Path_, doc: Located, problems: list[str],
           loader: yaml.SafeLoader) -> Any:
    doc.values[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.SequenceNode):
        return [_build(n, path + (i,), doc, problems, loader) for i, n in enumerate(node.value)]
    if not isinstance(node, yaml.MappingNode):
        return loader.construct_object(node, deep=True)
    out: dict[Any, Any] = {}
    for knode, vnode in node.value:
        pos = (knode.start_mark.line + 1, knode.start_mark.column + 1)
        scalar = isinstance(knode, yaml.ScalarNode)
        key = loader.construct_object(knode, deep=True) if scalar else None
        if not isinstance(key, (str, int, float, bool)) or key is None:
            problems.append(f"{doc.file}:{pos[0]}:{pos[1]} {dotted(path)}: got a "
                            f"{type(key).__name__} as a key, expected a plain name")
            continue
        if key in out:
            first = doc.keys[path + (key,)][0]
            problems.append(f"{doc.file}:{pos[0]}:{pos[1]} {dotted(path + (key,))}: duplicate "
                            f"key {key!r} (first at line {first}), expected each key once")
            continue
        doc.keys[path + (key,)] = pos
        out[key] = _build(vnode, path + (key,), doc, problems, loader)
    return out


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
        msg = f"got {_show(err.get('input'))}, expected{msg[len('Input should be'):]}"
    elif not msg.startswith("got "):
        msg = f"got {_show(err.get('input'))}, {msg[0].lower()}{msg[1:]}"
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


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
