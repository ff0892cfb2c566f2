"""Broken plugins are recorded and shown, never fatal: fake distributions on sys.path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from attnhub.core.registry import Registry

BROKEN = "raise RuntimeError('kernel library exploded at import')\n"
DUPLICATE = textwrap.dedent('''
    from attnhub.plugin import Backend, AttentionOutput, hookimpl

    class Impostor(Backend):
        name = "torch_sdpa"
        def forward(self, q, k, v, spec, params):
            return AttentionOutput(q)

    class NotABackend:
        name = "bogus"

    @hookimpl
    def attnhub_register_backends(register):
        register(Impostor())
        register(NotABackend())
''')


def _fake_dist(root: Path, dist: str, module: str, source: str) -> None:
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[attnhub.backends]\n{module} = {module}\n")


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch) -> Path:
    _fake_dist(tmp_path, "attnhub_fake_broken", "fake_broken", BROKEN)
    _fake_dist(tmp_path, "attnhub_fake_dup", "fake_dup", DUPLICATE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_broken_plugins_are_recorded(fake_site):
    reg = Registry.load()
    broken, dup = reg.plugins["fake_broken"], reg.plugins["fake_dup"]
    assert broken.distribution == "attnhub_fake_broken" and broken.version == "0.1"
    assert "exploded at import" in broken.errors[0]
    assert any("already registered by 'core'" in e for e in dup.errors)
    assert any("not an attnhub Backend" in e for e in dup.errors)
    # The real torch_sdpa is untouched and still works.
    assert reg.get("torch_sdpa").plugin == "core"
    q = torch.randn(1, 4, 2, 8)
    from attnhub import Hub

    out = Hub(hardware="cpu", registry=reg).attention(q, q, q, backend="torch_sdpa")
    assert out.shape == q.shape and out.abs().sum() > 0


def test_allow_list(fake_site, monkeypatch):
    monkeypatch.setenv("ATTNHUB_PLUGINS", "")
    assert list(Registry.load().plugins) == ["core"]
    monkeypatch.setenv("ATTNHUB_PLUGINS", "fake_dup")
    assert set(Registry.load().plugins) == {"core", "fake_dup"}


def test_cli_shows_both_errors(fake_site):
    env = {**os.environ, "PYTHONPATH": f"{fake_site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "attnhub.cli", *a],  # noqa: E731
                                    capture_output=True, text=True, env=env, check=True).stdout
    text = run("plugins")
    assert "exploded at import" in text and "already registered" in text
    rows = json.loads(run("plugins", "--json"))
    assert {r["name"]: bool(r["errors"]) for r in rows}["fake_broken"]
    backends = {r["name"]: r for r in json.loads(run("backends", "--json"))}
    assert backends["torch_sdpa"]["available"] and backends["torch_sdpa"]["plugin"] == "core"
