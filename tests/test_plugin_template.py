"""examples/plugin_template is a working third-party plugin: its entry point names a module
with the hook, its backend registers through the public API only, and it passes the kit."""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import pytest

from attnhub.conformance import run_kit
from attnhub.core.device import probe
from attnhub.core.registry import Registry

TEMPLATE = Path(__file__).resolve().parents[1] / "examples" / "plugin_template"


@pytest.fixture
def template_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TEMPLATE))
    yield
    for name in [m for m in sys.modules if m.startswith("attnhub_example")]:
        del sys.modules[name]


def test_template_registers_through_its_entry_point_and_passes_the_kit(template_on_path):
    meta = tomllib.loads((TEMPLATE / "pyproject.toml").read_text())
    (name, module), = meta["project"]["entry-points"]["attnhub.backends"].items()
    source = (TEMPLATE / "attnhub_example" / "backend.py").read_text()
    assert "from attnhub.plugin import" in source and "attnhub.core" not in source
    reg = Registry.load(allow=[])
    rec = reg.add_plugin(importlib.import_module(module), name)
    assert rec.ok and rec.backends == ["example"]
    report = run_kit(reg.get("example"), probe("cpu"), quick=True)
    assert report.ok, report.to_json()
    assert {"mask softcap", "backward", "lse"} <= {f["feature"] for f in report.features()}
