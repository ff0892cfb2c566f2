"""The documentation runs: what README.md and docs/*.md show is what the code does.

Conventions, for whoever edits the docs:

- Every fenced ```python block of README.md and docs/*.md (not docs/benchmarks/) is run on
  the CPU with fresh globals (all blocks in one new interpreter, in document order), from
  the repository root, with ``ATTNHUB_PROFILE`` pointing at a temporary file and no
  ``ATTNHUB_POLICY``/``ATTNHUB_BACKEND``/``ATTNHUB_HARDWARE``. A runnable block is therefore
  self-contained: it imports and defines what it uses.
- A block that cannot run here says so in an HTML comment on the line just above its fence,
  which Markdown does not render::

      <!-- snippet: skip needs a GPU -->

  The text after ``skip`` is the reason pytest reports; it must not be empty (GPU only,
  several processes, a model download, or a fragment of a larger program).
- Every ``ATTNHUB_*`` environment variable named in README.md, docs/*.md or a plugin's
  README.md must be read somewhere in the code, and every ``attnhub <command> --flag`` (in
  code spans and code blocks, or ``<command> --flag`` with a known command) must be an
  option of that command's parser, so a renamed flag or variable fails here.
- Every ``attnhub <command> [<action>]`` they show must be a command of the CLI, every
  relative Markdown link must reach a file, every backend they name where a backend is meant
  (a ``backend`` table column, ``use:`` lists, ``backend=``, ``--backend(s)``/``--exclude``,
  ``check-plugin NAME``, ``ATTNHUB_BACKEND``) must be registered, and every YAML block with
  ``rules:`` must load as a policy (a fragment as an overlay of the default).
- Every dotted name ``attnhub.x.y`` / ``attnhub_plugin.x`` and every repository path
  (``attnhub/...``, ``plugins/...``, ``tests/...::test_name``, ...) they name must exist; the
  few that name something else (a schema, a file a command writes) are listed below.
- Every link's ``#anchor`` must be a heading of its file, every ``benchmarks/x.py --flag``
  (or ``examples/``) an option that script declares, and every keyword argument shown in a
  call of attnhub's (``Hub(settle_ties=False)``, python blocks too) a parameter of it.
- Lists that mirror the code must stay complete: README.md's command table (every
  command), the set-up commands (the Makefile's targets, ``.ci/run``), docs/contract.md's
  argument table (``Hub.attention``'s options) and error tree (``attnhub/errors.py``), and
  docs/policy.md's approximate backends and schema keys.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnhub.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ALL_DOCS = [*DOCS, ROOT / "docs" / "benchmarks" / "README.md",
            *sorted((ROOT / "plugins").glob("*/README.md")),
            *sorted((ROOT / "examples").glob("*/README.md"))]
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"<!--\s*snippet:\s*skip\b(.*?)-->")
_RUNNER = """\
import json, sys, traceback
failed = {}
for where, src in json.load(sys.stdin):
    try:
        exec(compile(src, where, "exec"), {"__name__": "__main__"})
    except BaseException:
        failed[where] = traceback.format_exc()
print(json.dumps(failed))
"""


def _blocks(path: Path) -> list[tuple[str, str, str, str | None]]:
    """``(language, location, source, skip reason or None)`` for each fenced block."""
    text = path.read_text()
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        above = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(above)
        where = f"{path.relative_to(ROOT)}:{line}"
        out.append((m.group(1), where, m.group(2), skip.group(1).strip() if skip else None))
    return out


_PYTHON = [b for p in DOCS for b in _blocks(p) if b[0] == "python"]


@pytest.fixture(scope="module")
def block_failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Runs every runnable block in one fresh interpreter (one import of torch, not one per
    block): ``{location: traceback}`` of those that raised."""
    todo = [[where, src] for _, where, src, skip in _PYTHON if skip is None]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "ATTNHUB_PROFILE": str(tmp_path_factory.mktemp("docs") / "profile.json")}
    for var in ("ATTNHUB_POLICY", "ATTNHUB_BACKEND", "ATTNHUB_HARDWARE"):
        env.pop(var, None)  # the snippets see the defaults the docs describe
    r = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(todo), cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"the snippet runner died:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block", _PYTHON, ids=[b[1] for b in _PYTHON])
def test_python_block_runs(block: tuple[str, str, str, str | None],
                           block_failures: dict[str, str]) -> None:
    _, where, _, skip = block
    if skip is not None:
        assert skip, f"{where}: '<!-- snippet: skip -->' needs a reason after 'skip'"
        pytest.skip(skip)
    assert where not in block_failures, f"{where} failed:\n{block_failures[where][-3000:]}"


def test_skip_markers_sit_on_python_blocks() -> None:
    """A marker above anything but a python fence would silently skip nothing."""
    for path in DOCS:
        text = path.read_text()
        for m in _SKIP.finditer(text):
            after = text[m.end():].lstrip(" ")
            assert after.startswith("\n```python"), (
                f"{path.name}: snippet marker at offset {m.start()} is not right above a "
                "```python fence")


# ---------------------------------------------------------------- env variables and flags


def _code_text(path: Path) -> list[str]:
    """Code spans and code-block lines of a doc (where commands and variables are named)."""
    text = path.read_text()
    lines = [ln for m in _FENCE.finditer(text) for ln in _join_continuations(m.group(2))]
    prose = _FENCE.sub("", text)
    return lines + re.findall(r"`([^`\n]+)`", prose)


def _join_continuations(block: str) -> list[str]:
    return block.replace("\\\n", " ").splitlines()


def _source_text() -> str:
    files = [*(ROOT / "attnhub").rglob("*.py"), *(ROOT / "plugins").glob("*/attnhub_*/**/*.py")]
    return "\n".join(f.read_text() for f in files)


def test_every_documented_env_variable_is_read_by_the_code() -> None:
    code = _source_text()
    named = {(v, p.relative_to(ROOT)) for p in ALL_DOCS
             for v in re.findall(r"\bATTNHUB_[A-Z0-9_]*[A-Z0-9]", p.read_text())}
    assert named, "no ATTNHUB_* variable found in the docs: the scan is broken"
    missing = sorted(f"{v} ({where})" for v, where in named if f'"{v}"' not in code)
    assert not missing, f"documented but never read by the code: {missing}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


_WORD = re.compile(r"^[a-z][a-z0-9-]*$")


def _uses(line: str, commands: dict[str, argparse.ArgumentParser]) -> list[tuple[str, str]]:
    """``(command, --flag)`` for each ``[attnhub] <command> [<action>] ... --flag``."""
    found = []
    for part in re.split(r"&&|\|\||[;|#]", line):
        words = part.split()
        while words and "=" in words[0]:  # VAR=value attnhub ...
            words = words[1:]
        if words[:1] == ["attnhub"]:
            words = words[1:]
        elif len(words) < 2 or not words[1].startswith("--"):
            continue  # a bare word is a command only when a flag follows it
        if not words or words[0] not in commands:
            continue
        name, parser = words[0], commands[words[0]]
        actions = _subparsers(parser)
        if len(words) > 1 and words[1] in actions:
            name, parser = f"{name} {words[1]}", actions[words[1]]
        for w in words[1:]:
            flag = w.strip("[]").split("=", 1)[0]
            if flag.startswith("--") and _WORD.match(flag[2:]):
                found.append((name, flag) if flag in _options(parser) else (name, "!" + flag))
    return found


def test_every_documented_cli_flag_exists() -> None:
    commands = _subparsers(build_parser())
    seen, missing = 0, []
    for path in ALL_DOCS:
        for line in _code_text(path):
            for name, flag in _uses(line, commands):
                seen += 1
                if flag.startswith("!"):
                    missing.append(f"attnhub {name} {flag[1:]} ({path.relative_to(ROOT)})")
    assert seen > 20, f"only {seen} documented flags found: the scan is broken"
    assert not missing, f"documented flags the CLI does not have: {sorted(set(missing))}"


def test_flag_scan_catches_an_unknown_flag() -> None:
    """The scan itself: a misspelt flag and a misspelt subcommand action are reported."""
    commands = _subparsers(build_parser())
    assert ("explain", "!--hardwre") in _uses("attnhub explain --hardwre sm90", commands)
    assert ("policy check", "!--jsn") in _uses("attnhub policy check x.yaml --jsn", commands)
    assert ("lock", "--check") in _uses("ATTNHUB_X=1 attnhub lock --check a.lock", commands)


# ---------------------------------------------------------------- dotted names and paths

#: Dotted names that are not Python objects: entry-point group, lock file, example plugins.
NOT_OBJECTS = ("attnhub.backends", "attnhub.lock", "attnhub_example.", "attnhub_myattn.")
#: Paths the docs name as what a command writes, or as an example of an error message.
NOT_FILES = ("policies/x.yaml", "docs/benchmarks/ring_scaling.json",
             "docs/benchmarks/ring_scaling.md")
_DOTTED = re.compile(r"\b((?:attnhub|attnhub_[a-z0-9_]+)(?:\.[A-Za-z_]\w*)+)(?![\w/-])")
_PATH = re.compile(r"(?<![\w./$-])((?:attnhub|plugins|policies|examples|benchmarks|tests|docs"
                   r"|requirements|\.ci)/[\w./-]*\w)(?:::(\w+))?")


def _longest_module(parts: list[str]) -> tuple[object, list[str]] | None:
    """The longest importable prefix of a dotted name, and the attribute names after it."""
    for i in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:i])), parts[i:]
        except ImportError:
            continue
    return None


def _resolves(name: str) -> bool:
    found = _longest_module(name.split("."))
    if found is None:
        return False
    obj, rest = found
    for part in rest:
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def test_every_documented_module_and_object_exists() -> None:
    missing = sorted({f"{m.group(1)} ({p.relative_to(ROOT)})" for p in ALL_DOCS
                      for m in _DOTTED.finditer(p.read_text())
                      if not (m.group(1) + ".").startswith(NOT_OBJECTS)
                      and not _resolves(m.group(1))})
    assert not missing, f"documented names that do not import: {missing}"


def test_every_documented_path_and_test_exists() -> None:
    missing = []
    for doc in ALL_DOCS:
        for m in _PATH.finditer(doc.read_text()):
            path, test = m.group(1), m.group(2)
            found = [b / path for b in (ROOT, doc.parent) if (b / path).exists()]
            if not found and path not in NOT_FILES:
                missing.append(f"{path} ({doc.relative_to(ROOT)})")
            elif test and found and f"def {test}(" not in found[0].read_text():
                missing.append(f"{path}::{test} ({doc.relative_to(ROOT)})")
    assert not missing, f"documented paths that do not exist: {missing}"


def test_capabilities_table_lists_every_field() -> None:
    """docs/plugins.md's table of ``Capabilities`` fields is the plugin author's reference."""
    from dataclasses import fields

    from attnhub.plugin import Capabilities

    text = (ROOT / "docs" / "plugins.md").read_text()
    table = text.split("## `Capabilities`", 1)[1].split("\n## ", 1)[0]
    documented = {name for row in re.findall(r"^\| (`[^|]+`) \|", table, re.M)
                  for name in re.findall(r"`(\w+)`", row)}
    assert documented == {f.name for f in fields(Capabilities)}


@pytest.mark.parametrize("heading,model", [("## Top-level keys", "PolicyFile"),
                                           ("## Rule keys", "Rule"),
                                           ("### `when:` keys", "When")])
def test_policy_key_tables_match_the_schema(heading: str, model: str) -> None:
    """docs/policy.md's key tables name exactly the keys the YAML schema accepts."""
    from attnhub.policy import schema

    text = (ROOT / "docs" / "policy.md").read_text()
    table = text.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]
    documented = {name.split(".")[0] for row in re.findall(r"^\| (`[^|]+`) \|", table, re.M)
                  for name in re.findall(r"`([\w.]+)`", row)}
    fields = getattr(schema, model).model_fields
    assert documented == {f.alias or n for n, f in fields.items()}


# ---------------------------------------------------------------- commands, links, backends


def _command_words(line: str) -> list[list[str]]:
    """The words after each ``attnhub`` that starts a command in ``line``."""
    out = []
    for part in re.split(r"&&|\|\||[;|#(]", line):
        words = part.split()
        while words and "=" in words[0]:  # VAR=value attnhub ...
            words = words[1:]
        if words[:1] == ["attnhub"] and len(words) > 1 and _WORD.match(words[1]):
            out.append(words[1:])
    return out


def _unknown_commands(line: str, commands: dict[str, argparse.ArgumentParser]) -> list[str]:
    bad = []
    for words in _command_words(line):
        if words[0] not in commands:
            bad.append(words[0])
            continue
        actions = _subparsers(commands[words[0]])
        if actions and len(words) > 1 and _WORD.match(words[1]) and words[1] not in actions:
            bad.append(f"{words[0]} {words[1]}")
    return bad


def test_every_documented_command_exists() -> None:
    commands = _subparsers(build_parser())
    seen = 0
    missing = []
    for path in ALL_DOCS:
        for line in _code_text(path):
            seen += len(_command_words(line))
            missing += [f"attnhub {c} ({path.relative_to(ROOT)})"
                        for c in _unknown_commands(line, commands)]
    assert seen > 20, f"only {seen} documented commands found: the scan is broken"
    assert not missing, f"documented commands the CLI does not have: {sorted(set(missing))}"


def test_command_scan_catches_an_unknown_command() -> None:
    commands = _subparsers(build_parser())
    assert _unknown_commands("attnhub fp8check --kv", commands) == ["fp8check"]
    assert _unknown_commands("X=1 attnhub policy chek a.yaml", commands) == ["policy chek"]
    assert _unknown_commands("attnhub policy check a.yaml && attnhub run", commands) == []


def test_every_command_takes_json() -> None:
    """README: "Every command takes `--json`" (each leaf command, actions included)."""
    def leaves(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, set[str]]]:
        subs = _subparsers(parser)
        if not subs:
            return [(name, _options(parser))]
        return [leaf for n, p in subs.items() for leaf in leaves(p, f"{name} {n}".strip())]

    found = leaves(build_parser(), "")
    assert len(found) > 10
    assert not [n for n, opts in found if "--json" not in opts]


_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def test_every_relative_link_reaches_a_file() -> None:
    missing = []
    for doc in ALL_DOCS:
        for target in _LINK.findall(_FENCE.sub("", doc.read_text())):
            path = target.split("#", 1)[0]
            if not path or re.match(r"^[a-z]+:", target):
                continue  # an anchor in the same file, or a URL
            if not (doc.parent / path).exists():
                missing.append(f"{target} ({doc.relative_to(ROOT)})")
    assert not missing, f"links to files that do not exist: {missing}"


#: Backend names the docs use for a third-party plugin not installed here, and placeholders.
EXAMPLE_BACKENDS = {"example", "myattn", "NAME", "name"}
_NAMED = [re.compile(p) for p in (
    r"""\b(?:local_)?backend\s*=\s*["']([\w.-]+)["']""",  # backend="x" in Python
    r"--(?:backend|backends|exclude)[ =]([\w,.-]+)",  # CLI flags
    r"\bcheck-plugin (\w[\w.-]*)",
    r"\bATTNHUB_BACKEND=([\w.-]+)",
    r"\bATTNHUB_PROVIDERS=([\w.-]+)=",
)]


def _table_backends(text: str) -> list[str]:
    """First-column code spans of Markdown tables whose first header cell is ``backend``."""
    names = []
    for table in re.findall(r"(?:^\|.*\n)+", _FENCE.sub("", text), re.M):
        rows = table.splitlines()
        if rows[0].split("|")[1].strip().lower() == "backend":
            names += [n for row in rows[2:] for n in re.findall(r"`([\w.-]+)`",
                                                                 row.split("|")[1])]
    return names


def _documented_backends(path: Path) -> list[str]:
    names = _table_backends(path.read_text())
    for line in _code_text(path):
        for pattern in _NAMED:
            names += [n for m in pattern.findall(line) for n in m.split(",") if n]
    return names


def test_every_documented_backend_is_registered() -> None:
    from attnhub.core.registry import Registry

    known = set(Registry.load().backends) | EXAMPLE_BACKENDS
    named = {(n, p.relative_to(ROOT)) for p in ALL_DOCS for n in _documented_backends(p)}
    assert len(named) > 20, f"only {len(named)} documented backend names: the scan is broken"
    missing = sorted(f"{n} ({where})" for n, where in named if n not in known)
    assert not missing, f"documented backends no plugin registers: {missing}"


def test_backend_scan_catches_an_unknown_backend(tmp_path: Path) -> None:
    doc = tmp_path / "README.md"
    doc.write_text("| backend | what |\n|---|---|\n| `fa3x` | typo |\n\n"
                   "`attnhub bench --backends torch_sdpa,trition`\n\n"
                   "```python\nattnhub.attention(q, k, v, backend='sdpa')\n```\n")
    assert sorted(_documented_backends(doc)) == ["fa3x", "sdpa", "torch_sdpa", "trition"]


def _policy_blocks() -> list[tuple[str, str]]:
    return [(where, src) for p in ALL_DOCS for lang, where, src, _ in _blocks(p)
            if lang == "yaml" and re.search(r"^rules:", src, re.M)]


@pytest.mark.parametrize("where,src", _policy_blocks(), ids=[b[0] for b in _policy_blocks()])
def test_documented_policy_loads(where: str, src: str, tmp_path: Path) -> None:
    """A YAML policy in the docs loads (keys, ``before:`` targets, conditions) and names only
    registered backends; a fragment (no ``name``) is read as an overlay of the default."""
    from attnhub.core.registry import Registry
    from attnhub.policy import load_policy
    from attnhub.policy.lint import lint_policy

    if not re.search(r"^name:", src, re.M):
        src = "name: doc-fragment\nversion: 1\nextends: default\n" + src
    path = tmp_path / "doc.yaml"
    path.write_text(src)
    policy = load_policy(str(path))
    unknown = [f for f in lint_policy(policy, Registry.load())
               if f.level == "error" and str(path) in f.where
               and f.message.startswith("unknown backend")
               and not any(f"'{n}'" in f.message for n in EXAMPLE_BACKENDS)]
    assert not unknown, f"{where}: " + "; ".join(map(str, unknown))


# ---------------------------------------------------------------- anchors, scripts, calls


def _slugs(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (``## Exit status and `--json` errors``
    is ``#exit-status-and---json-errors``; a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", _FENCE.sub("", path.read_text()),
                              re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_link_anchor_reaches_a_heading() -> None:
    """``[x](policy.md#exit-status-and---json-errors)``: a renamed heading breaks the link."""
    missing, seen = [], 0
    for doc in ALL_DOCS:
        for target in _LINK.findall(_FENCE.sub("", doc.read_text())):
            if "#" not in target or re.match(r"^[a-z]+:", target):
                continue
            path, anchor = target.split("#", 1)
            dest = doc.parent / path if path else doc
            seen += 1
            if dest.suffix == ".md" and dest.is_file() and anchor not in _slugs(dest):
                missing.append(f"{target} ({doc.relative_to(ROOT)})")
    assert seen, "no link with an anchor found: the scan is broken"
    assert not missing, f"links to headings that do not exist: {missing}"


def test_anchor_slugs_follow_github(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("# A\n## Exit status and `--json` errors\n## `use:` and `fastest`\n## A\n")
    assert _slugs(doc) == {"a", "exit-status-and---json-errors", "use-and-fastest", "a-1"}


_SCRIPT = re.compile(r"\b((?:benchmarks|examples)/[\w/]+\.py)\b(.*)")


def _script_flags(line: str) -> list[tuple[str, str]]:
    """``(script, --flag)`` for each ``benchmarks/x.py ... --flag`` (or ``examples/``)."""
    found = []
    for part in re.split(r"&&|\|\||[;|#]", line):
        m = _SCRIPT.search(part)
        if m:
            found += [(m.group(1), f) for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)",
                                                          m.group(2))]
    return found


def test_every_documented_script_flag_exists() -> None:
    """``python benchmarks/ring_scaling.py --simulate 2``: each flag is an option the script
    declares (its ``add_argument`` string), so a renamed option fails here."""
    seen, missing = 0, []
    for doc in ALL_DOCS:
        for line in _code_text(doc):
            for script, flag in _script_flags(line):
                seen += 1
                src = (ROOT / script).read_text() if (ROOT / script).is_file() else ""
                if f'"{flag}"' not in src and f"'{flag}'" not in src:
                    missing.append(f"{script} {flag} ({doc.relative_to(ROOT)})")
    assert seen > 5, f"only {seen} documented script flags found: the scan is broken"
    assert not missing, f"documented script flags the script does not declare: {missing}"


def test_script_flag_scan_reads_each_command() -> None:
    line = "torchrun --nproc-per-node 2 examples/ring_torchrun.py --check && x --y  # --z"
    assert _script_flags(line) == [("examples/ring_torchrun.py", "--check")]


#: Modules searched, in order, for a bare name the docs call (``Hub(...)``, ``run_kit(...)``).
_CALL_MODULES = ("attnhub", "attnhub.plugin", "attnhub.policy", "attnhub.core.kvcache",
                 "attnhub.conformance", "attnhub.integrations.transformers", "attnhub_ring",
                 "attnhub_hybrid_linear", "attnhub.nn")
#: Variable names the docs use for an instance of a class.
_INSTANCES = {"hub": "Hub", "store": "ProfileStore", "cache": "PagedKVCache",
              "kv_cache": "PagedKVCache", "states": "RecurrentStateCache",
              "registry": "Registry"}


def _forwarded(obj: object) -> object:
    """The function whose signature a ``**kwargs`` wrapper forwards to."""
    import attnhub

    bind = importlib.import_module("attnhub.bind").bind  # attnhub.bind is that function too
    forwards = {attnhub.attention: attnhub.Hub.attention, attnhub.Hub.bind: bind}
    return forwards.get(obj, obj)  # type: ignore[call-overload]


def _callee(func: object) -> object | None:
    import ast

    parts: list[str] = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    parts = [func.id, *reversed(parts)]
    obj: object | None = None
    if parts[0] == "attnhub" or parts[0].startswith("attnhub_"):
        found = _longest_module(parts)
        if found is None:
            return None
        obj, rest = found
    else:
        name = _INSTANCES.get(parts[0], parts[0])
        mods = [importlib.import_module(m) for m in _CALL_MODULES]
        if parts[0] == "Registry":
            mods.insert(0, importlib.import_module("attnhub.core.registry"))
        obj = next((getattr(m, name) for m in mods if hasattr(m, name)), None)
        rest = parts[1:]
    for part in rest:
        obj = getattr(obj, part, None)
    return obj


def _documented_calls(path: Path) -> list[tuple[str, str, list[str]]]:
    """``(source, callee, [keyword, ...])`` of every call in a code span or python block."""
    import ast

    text = path.read_text()
    sources = [m.group(2) for m in _FENCE.finditer(text) if m.group(1) == "python"]
    sources += [s for s in re.findall(r"`([^`\n]+)`", _FENCE.sub("", text)) if "=" in s]
    calls = []
    for src in sources:
        try:
            tree = ast.parse(src.replace("...", "None"))
        except SyntaxError:
            continue
        local = {a.arg for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
                 for a in fn.args.args}  # a hook's ``register`` callback is not ours
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and any(k.arg for k in node.keywords) and not (
                    isinstance(node.func, ast.Name) and node.func.id in local):
                calls.append((ast.unparse(node)[:80], node.func,
                              [k.arg for k in node.keywords if k.arg]))
    return calls


def test_every_documented_keyword_argument_exists() -> None:
    """``Hub(settle_ties=False)``, ``run_kit(..., case_timeout_s=S)``: the keywords the docs
    pass to attnhub's functions and classes (code spans and python blocks, skipped blocks
    too) are parameters of what they call."""
    import inspect

    seen, missing = 0, []
    for doc in ALL_DOCS:
        for src, func, keywords in _documented_calls(doc):
            obj = _forwarded(_callee(func))
            if not callable(obj) or not getattr(obj, "__module__", "").startswith("attnhub"):
                continue  # not ours (torch.autograd.grad, ...), or not resolved
            try:
                params = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                continue
            seen += 1
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            missing += [f"{src}: {k} ({doc.relative_to(ROOT)})" for k in keywords
                        if k not in params]
    assert seen > 20, f"only {seen} documented calls resolved: the scan is broken"
    assert not missing, f"documented keyword arguments the callee does not take: {missing}"


# ---------------------------------------------------------------- lists that mirror the code


def _section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]


def test_error_tree_lists_every_error_class() -> None:
    """docs/contract.md's tree of errors names every class of ``attnhub.errors``, each under
    its parent and with its builtin base (``InputError (also ValueError)``)."""
    import inspect

    import attnhub.errors as errors

    tree = (ROOT / "docs" / "contract.md").read_text().split("\n## Errors\n", 1)[1]
    tree = tree.split("```", 2)[1]
    parent: dict[str, str] = {}
    also: dict[str, set[str]] = {}
    stack: list[tuple[int, str]] = []
    for line in tree.splitlines()[1:]:
        m = re.match(r"^([│ ]*)[├└]── (.*)$", line)
        if not m:
            continue
        depth = len(m.group(1)) // 4
        head = m.group(2).split(":", 1)[0]
        names = re.findall(r"\b([A-Z]\w*Error)\b", head.split(" (also", 1)[0])
        stack = stack[:depth]
        for name in names:
            parent[name] = stack[-1][1] if stack else "AttnhubError"
            also[name] = set(re.findall(r"also (\w+)", head))
        stack.append((depth, names[0]))
    classes = {n: c for n, c in vars(errors).items() if inspect.isclass(c)
               and issubclass(c, errors.AttnhubError) and c is not errors.AttnhubError}
    assert set(parent) == set(classes), (
        f"only in the tree: {sorted(set(parent) - set(classes))}; "
        f"only in attnhub/errors.py: {sorted(set(classes) - set(parent))}")
    for name, cls in classes.items():
        own = [b.__name__ for b in cls.__bases__ if issubclass(b, errors.AttnhubError)]
        builtin = {b.__name__ for b in cls.__bases__ if not issubclass(b, errors.AttnhubError)}
        assert own == [parent[name]], f"{name}: the tree puts it under {parent[name]}"
        if also[name] or name == own[0]:
            assert also[name] == builtin, f"{name}: documented also {also[name]}, is {builtin}"


def test_approximate_backend_list_is_complete() -> None:
    """docs/policy.md lists the approximate backends the policy gates."""
    from attnhub.core.registry import Registry

    text = (ROOT / "docs" / "policy.md").read_text()
    m = re.search(r"\*\*Approximate backends\*\* \(`capabilities\.exact == False`: ([^)]*)\)",
                  text)
    assert m, "the approximate backends' list moved: update this test"
    listed = {n.strip() for n in m.group(1).replace("\n", " ").split(",")}
    known = {n for n, b in Registry.load().backends.items() if not b.capabilities.exact}
    assert listed == known, f"listed {sorted(listed)}, registered {sorted(known)}"


def test_every_policy_sub_key_is_documented() -> None:
    """The keys of ranges, layer selectors, profile conditions, ``use``, ``requires`` and
    ``defaults`` (the top-level, rule and ``when`` keys have their tables, above) appear in
    docs/policy.md as a YAML key (``in:``) or a code span."""
    from pydantic import BaseModel

    from attnhub.policy import schema

    text = (ROOT / "docs" / "policy.md").read_text()
    tabled = {"PolicyFile", "Rule", "When"}
    models = [m for n, m in vars(schema).items() if isinstance(m, type)
              and issubclass(m, BaseModel) and m.__module__ == schema.__name__
              and n not in tabled and m.model_fields]
    assert len(models) >= 6, "the schema's models moved: update this test"
    missing = [f"{m.__name__}.{key}" for m in models
               for key in (f.alias or n for n, f in m.model_fields.items())
               if not re.search(rf"(?<![\w.]){key}:|`{key}`", text)]
    assert not missing, f"schema keys docs/policy.md does not mention: {missing}"


def test_readme_commands_table_names_every_command() -> None:
    section = _section((ROOT / "README.md").read_text(), "## Commands")
    text = "\n".join(ln for ln in section.splitlines() if ln.startswith("|"))
    missing = [name for name in _subparsers(build_parser())
               if not re.search(rf"(`|attnhub ){re.escape(name)}\b", text)]
    assert not missing, f"commands missing from README.md's table: {missing}"


def test_contract_argument_table_matches_the_signature() -> None:
    """docs/contract.md's table of side arguments (with ``layout``, which has a table of its
    own) is exactly ``Hub.attention``'s options."""
    import inspect

    import attnhub

    text = (ROOT / "docs" / "contract.md").read_text()
    table = text.split("\n| argument | contract |\n", 1)[1].split("\n\n", 1)[0]
    documented = {"layout"}
    for cell in re.findall(r"^\| ([^|]+) \|", table, re.M):
        for name in re.findall(r"`(\w+)(?:/(\w+))?`", cell):
            documented.add(name[0])
            if name[1]:  # cu_seqlens_q/k
                documented.add(name[0].rsplit("_", 1)[0] + "_" + name[1])
    params = set(inspect.signature(attnhub.Hub.attention).parameters)
    params -= {"self", "q", "k", "v", "_only_keywords"}
    assert documented == params, (f"not in the table: {sorted(params - documented)}; "
                                  f"not options: {sorted(documented - params)}")


def test_readme_setup_is_the_makefile_and_ci() -> None:
    """The README's two set-up commands are Makefile targets that install and then run
    ``attnhub run`` / the test suite, and ``.ci/run`` runs exactly the test command."""
    block = _section((ROOT / "README.md").read_text(), "## Set-up (two commands)")
    commands = [ln.split("#", 1)[0].strip() for ln in _FENCE.search(block).group(2).splitlines()]
    assert commands == ["make run", "make test"]
    make = (ROOT / "Makefile").read_text()
    targets = dict(re.findall(r"^(\w+):[^\n=]*\n((?:\t[^\n]*\n?)*)", make, re.M))
    assert re.search(r"^run: install$", make, re.M) and "-m attnhub run" in targets["run"]
    assert re.search(r"^test: install$", make, re.M) and "-m pytest" in targets["test"]
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.startswith(("#", "set ", "cd "))]
    assert ci == ["make test"]
