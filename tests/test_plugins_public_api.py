"""The in-repo plugins are written exactly as a third party would write them: their code
imports attnhub only through ``attnhub.plugin`` and the package's top level, never its
internals (``attnhub.core``, ``attnhub.hub``, ...), which may change without notice."""

from __future__ import annotations

import ast
from pathlib import Path

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
ALLOWED = {"attnhub", "attnhub.plugin"}


def test_plugin_code_imports_only_the_public_api() -> None:
    found = []
    files = sorted(PLUGINS.glob("*/attnhub_*/**/*.py"))
    assert len(files) > 20  # the plugins' packages were found
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if (name or "").split(".")[0] == "attnhub" and name not in ALLOWED:
                    found.append(f"{path.relative_to(PLUGINS)}:{node.lineno}: {name}")
    assert not found, "plugins import attnhub internals (use attnhub.plugin):\n" + "\n".join(
        found)
