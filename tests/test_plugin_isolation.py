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


EXITS = "import sys\nsys.exit('plugin gave up')\n"
BAD_CHECKS = textwrap.dedent('''
    from attnhub.plugin import Backend, AttentionOutput, Capabilities, hookimpl

    class Raises(Backend):
        name = "raises_in_check"
        capabilities = Capabilities(masks=frozenset({"causal"}))
        def extra_checks(self, spec, device):
            return {}["no such key"]
        def forward(self, q, k, v, spec, params):
            return AttentionOutput(q)

    class DictCaps(Backend):
        name = "dict_caps"
        capabilities = {"masks": ["causal"]}
        def forward(self, q, k, v, spec, params):
            return AttentionOutput(q)

    @hookimpl
    def attnhub_register_backends(register):
        register(Raises())
        register(DictCaps())
''')


def _takeover(name: str) -> str:
    return textwrap.dedent(f'''
        from attnhub.plugin import Backend, AttentionOutput, Capabilities, hookimpl

        class Kernel(Backend):
            name = "shared_name"
            description = "{name}"
            capabilities = Capabilities()
            def forward(self, q, k, v, spec, params):
                return AttentionOutput(q)

        @hookimpl
        def attnhub_register_backends(register):
            register(Kernel())
    ''')


@pytest.fixture
def hostile_site(tmp_path: Path, monkeypatch) -> Path:
    _fake_dist(tmp_path, "attnhub_fake_exit", "fake_exit", EXITS)
    _fake_dist(tmp_path, "attnhub_fake_checks", "fake_checks", BAD_CHECKS)
    _fake_dist(tmp_path, "attnhub_fake_first", "fake_first", _takeover("first"))
    _fake_dist(tmp_path, "attnhub_fake_second", "fake_second", _takeover("second"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("ATTNHUB_PLUGINS", raising=False)
    monkeypatch.delenv("ATTNHUB_PROVIDERS", raising=False)
    return tmp_path


def test_system_exit_at_import_is_recorded_with_the_plugin(hostile_site):
    reg = Registry.load()
    rec = reg.plugins["fake_exit"]
    assert rec.errors == ["import failed: SystemExit: plugin gave up"]
    assert rec.distribution == "attnhub_fake_exit"
    assert "torch_sdpa" in reg.backends  # the host goes on


def test_raising_extra_checks_is_a_rejection_reason(hostile_site):
    from attnhub import Hub
    from attnhub.core.spec import AttentionSpec, MaskSpec
    from attnhub.errors import BackendUnavailableError

    reg = Registry.load()
    hub = Hub(hardware="cpu", registry=reg)
    spec = AttentionSpec(dtype="fp32", head_dim=8, num_q_heads=2, num_kv_heads=2,
                         mask=MaskSpec(causal=True), max_seqlen_q=4, max_seqlen_k=4)
    reasons = reg.get("raises_in_check").check(spec, hub.device)
    assert len(reasons) == 1 and "KeyError" in reasons[0] and "'fake_checks'" in reasons[0]
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(BackendUnavailableError, match="a bug in plugin 'fake_checks'"):
        hub.attention(q, q, q, causal=True, backend="raises_in_check")


def test_capabilities_of_the_wrong_type_are_rejected_at_registration(hostile_site):
    reg = Registry.load()
    assert "dict_caps" not in reg.backends
    assert any("declares capabilities as dict" in e for e in reg.plugins["fake_checks"].errors)
    with pytest.raises(TypeError, match="masks must be a set of str"):
        from attnhub.plugin import Capabilities

        Capabilities(masks=frozenset({1}))


def test_name_takeover_is_refused_for_both_unless_a_provider_is_picked(hostile_site,
                                                                       monkeypatch):
    reg = Registry.load()
    assert "shared_name" not in reg.backends
    for p in ("fake_first", "fake_second"):
        assert any("registered by more than one plugin" in e and "ATTNHUB_PROVIDERS" in e
                   for e in reg.plugins[p].errors), reg.plugins[p].errors
    assert "registered by more than one plugin" in reg.missing_reason("shared_name")
    monkeypatch.setenv("ATTNHUB_PROVIDERS", "shared_name=fake_second")
    reg = Registry.load()
    assert reg.get("shared_name").description == "second"
    assert reg.provider("shared_name") == {"plugin": "fake_second",
                                           "distribution": "attnhub_fake_second",
                                           "version": "0.1"}
    assert any("picks plugin 'fake_second'" in e for e in reg.plugins["fake_first"].errors)


def test_deny_one_plugin(hostile_site, monkeypatch):
    monkeypatch.setenv("ATTNHUB_PLUGINS", "-fake_exit,-fake_first")
    reg = Registry.load()
    assert "fake_exit" not in reg.plugins and "fake_first" not in reg.plugins
    assert reg.get("shared_name").plugin == "fake_second"  # no collision left
    monkeypatch.setenv("ATTNHUB_PLUGINS", "fake_second,-fake_second")
    assert set(Registry.load().plugins) == {"core"}


def test_policy_naming_an_uninstalled_backend_warns_once_and_counts(tmp_path, caplog):
    from attnhub import Hub
    from attnhub.policy import load_policy

    p = tmp_path / "p.yaml"
    p.write_text("name: p\nrules:\n  - {name: all, use: [not_installed, torch_sdpa]}\n")
    hub = Hub(load_policy(p), hardware="cpu", registry=Registry.load(allow=[]))
    with caplog.at_level("WARNING", logger="attnhub"):
        for s in (4, 4, 9):  # two bindings (9 is another bucket), one warning
            q = torch.randn(1, s, 2, 8)
            hub.attention(q, q, q)
    warns = [r for r in caplog.records if "not_installed" in r.getMessage()]
    assert len(warns) == 1 and "rule all" in warns[0].getMessage()
    assert hub.fallback_counts[("not_installed", "torch_sdpa")] == 2
    d = hub.bound()[0].decision
    assert d.missing == ("not_installed",) and "not installed" in d.explain()


def test_doctor_shows_policy_backends_that_are_not_installed(tmp_path, capsys):
    from attnhub.cli import main

    p = tmp_path / "p.yaml"
    p.write_text("name: p\nrules:\n  - {name: all, use: [not_installed, torch_sdpa]}\n")
    assert main(["doctor", "--json", "--policy", str(p)]) == 0
    gaps = json.loads(capsys.readouterr().out)["policy_missing_backends"]
    assert len(gaps) == 1 and "rule all" in gaps[0] and "names not_installed" in gaps[0]


def test_cli_survives_a_plugin_that_exits(hostile_site, capsys):
    from attnhub.cli import main

    for cmd in (["backends"], ["doctor"], ["plugins"]):
        assert main(cmd) == 0
    assert "fake_exit: import failed: SystemExit: plugin gave up" in capsys.readouterr().out
