"""Broken and hostile plugins, fourth round: an exception whose text raises, process-wide
state beyond torch's switches (working directory, standard streams, exception hooks,
recursion limit, warning filters, ``sys.modules``, attnhub's own functions and classes) and
threads that keep the host from exiting. Each crashed the host or changed it silently."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Callable

import pytest

import attnhub.core.builtin as builtin
from attnhub.core.registry import Registry
from tests.test_adversarial_plugins_3 import HEAD, _module, site  # noqa: F401 (fixture)

REG = "\n@hookimpl\ndef attnhub_register_backends(register):\n    register(Good())\n"


def _load(*mods: str) -> Registry:
    return Registry.load(modules=list(mods), entry_points=False)


@pytest.mark.parametrize("where", ["import", "hook"])
@pytest.mark.parametrize("inner", ["RuntimeError", "SystemExit", "KeyboardInterrupt"])
def test_an_exception_whose_text_raises_is_recorded(site: Path, where: str, inner: str) -> None:
    """``str(exc)`` of the plugin's exception raised inside the host's own error handling:
    ``attnhub plugins`` died with a traceback, every other plugin unlisted."""
    raising = (f"class E(Exception):\n    def __str__(self):\n        raise {inner}('x')\n")
    body = raising + ("raise E()\n" if where == "import" else
                      "@hookimpl\ndef attnhub_register_backends(register):\n    raise E()\n")
    bad, good = _module(site, "weird", body), _module(site, "fine", REG)
    reg = _load(bad, good)
    (err,) = reg.plugins[bad].errors
    assert err.endswith(f"E: <E: str() raised {inner}>"), err
    assert reg.plugins[good].ok and "fine_good" in reg.backends


def _swap(attr: str) -> Callable[[pytest.MonkeyPatch, str], str]:
    """A change of ``sys.<attr>`` (kept for the monkeypatch to undo, should the fix not)."""
    def change(mp: pytest.MonkeyPatch, _: str) -> str:
        mp.setattr(sys, attr, getattr(sys, attr))
        return f"import io, sys\nsys.{attr} = io.StringIO()\n"
    return change


def _chdir(mp: pytest.MonkeyPatch, tag: str) -> str:
    mp.chdir(os.getcwd())
    return "import tempfile\nos.chdir(tempfile.gettempdir())\n"


def _recursion(mp: pytest.MonkeyPatch, tag: str) -> str:  # the test puts the limit back
    return f"import sys\nsys.setrecursionlimit({random.Random(tag).randrange(60, 400)})\n"


def _warnings(mp: pytest.MonkeyPatch, _: str) -> str:
    mp.setattr(warnings, "filters", list(warnings.filters))
    return "import warnings\nwarnings.simplefilter('error')\n"


def _modules(mp: pytest.MonkeyPatch, tag: str) -> str:
    name = random.Random(tag).choice(["json", "difflib", "textwrap", "fractions"])
    __import__(name)
    mp.setitem(sys.modules, name, sys.modules[name])
    return f"import sys\nsys.modules[{name!r}] = None\n"


def _patch_registry(mp: pytest.MonkeyPatch, _: str) -> str:
    mp.setattr(Registry, "get", Registry.get)
    return "import attnhub.core.registry as r\nr.Registry.get = lambda self, name: None\n"


def _patch_builtin(mp: pytest.MonkeyPatch, _: str) -> str:
    mp.setattr(builtin.TorchSDPABackend, "tier", builtin.TorchSDPABackend.tier)
    return "import attnhub.core.builtin as b\nb.TorchSDPABackend.tier = 'approximate'\n"


CHANGES = {  # what -> (set up an undo and give the plugin's code, what the error names)
    "stdout": (_swap("stdout"), "sys.stdout"), "stderr": (_swap("stderr"), "sys.stderr"),
    "excepthook": (_swap("excepthook"), "sys.excepthook"),
    "cwd": (_chdir, "working directory"), "recursion": (_recursion, "recursion limit"),
    "warnings": (_warnings, "warnings filter for every warning"),
    "sys.modules": (_modules, "removed from sys.modules"),
    "monkeypatch": (_patch_registry, "attnhub.core.registry.Registry.get"),
    "class attribute": (_patch_builtin, "attnhub.core.builtin.TorchSDPABackend.tier"),
}


def _state() -> tuple:
    return (sys.stdout, sys.stderr, sys.excepthook, os.getcwd(), sys.getrecursionlimit(),
            list(warnings.filters), Registry.get, builtin.TorchSDPABackend.tier)


@pytest.mark.parametrize("when", ["import", "hook"])
@pytest.mark.parametrize("what", list(CHANGES))
def test_process_wide_state_a_plugin_changes_is_put_back(site: Path, monkeypatch, what: str,
                                                         when: str) -> None:
    """A plugin that chdir'ed moved every relative policy and lockfile path; one that replaced
    sys.stdout silenced ``attnhub plugins``; one that replaced sys.excepthook hid the next
    crash; ``simplefilter("error")`` turned the host's warnings into exceptions; a module set
    to None in sys.modules broke every later import of it; a monkeypatched Registry.get or a
    built-in backend's tier changed attnhub itself. All loaded "ok", nothing put back."""
    tag = f"t{random.randrange(10**6)}"
    limit = sys.getrecursionlimit()
    code = CHANGES[what][0](monkeypatch, tag)
    if when == "hook":
        code = ("@hookimpl\ndef attnhub_register_backends(register):\n"
                + "".join(f"    {line}\n" for line in code.splitlines()) + "    register(Good())\n")
    else:
        code += REG
    before, modules = _state(), dict(sys.modules)
    try:
        mod = _module(site, f"state_{when}", code)
        reg = _load(mod)
        after = _state()
    finally:
        sys.setrecursionlimit(limit)
    assert after == before
    assert not [n for n, m in modules.items() if sys.modules.get(n) is not m]
    (err,) = reg.plugins[mod].errors
    assert err.startswith("changed process-wide state while loading: ") and \
        CHANGES[what][1] in err, err
    assert f"state_{when}_good" in reg.backends  # recorded, not refused: it did register


def _deep(n: int, fn: Callable[[], Registry]) -> Registry:
    return fn() if n == 0 else _deep(n - 1, fn)


@pytest.mark.parametrize("limit", [25, 60, 130, 200])
@pytest.mark.parametrize("when", ["import", "hook"])
def test_a_lowered_recursion_limit_is_put_back_before_the_host_runs_on(
        site: Path, limit: int, when: str) -> None:
    """A host deep in its stack (a test runner, a server's request) loads a plugin that lowers
    the recursion limit below that depth: the host's own next call failed (a second,
    misleading error) or Python aborted ("Cannot recover from stack overflow")."""
    code = f"import sys\nsys.setrecursionlimit({limit})\n"
    if when == "hook":
        code = ("@hookimpl\ndef attnhub_register_backends(register):\n"
                + "".join(f"    {line}\n" for line in code.splitlines()) + "    register(Good())\n")
    else:
        code += REG
    old = sys.getrecursionlimit()
    mod = _module(site, f"low_{when}", code)
    try:
        reg = _deep(250, lambda: _load(mod))
    finally:
        now = sys.getrecursionlimit()
        sys.setrecursionlimit(old)
    assert now == old
    (err,) = reg.plugins[mod].errors
    assert f"recursion limit {old} -> {limit}" in err, err
    assert f"low_{when}_good" in reg.backends


def test_a_non_daemon_thread_started_while_loading_is_named(site: Path) -> None:
    """A plugin that starts a non-daemon thread at import loaded "ok", and the host (``attnhub
    plugins``, a server's start-up check) then never exited: Python waits for such threads."""
    name = f"worker-{random.randrange(10**6)}"
    flag = site / "release"  # the thread ends once it exists (or after 60 s at most)
    code = ("import threading, time\n"
            f"def _wait():\n    for _ in range(1200):\n        if os.path.exists({str(flag)!r}):"
            "\n            return\n        time.sleep(0.05)\n"
            f"threading.Thread(target=_wait, name={name!r}, daemon=False).start()\n" + REG)
    mod = _module(site, "thread", code)
    daemon = _module(site, "daemon", code.replace("daemon=False", "daemon=True"))
    try:
        reg = _load(mod, daemon)
    finally:
        flag.touch()
    (err,) = reg.plugins[mod].errors
    assert f"started non-daemon thread(s) '{name}' while loading" in err, err
    assert reg.plugins[daemon].ok  # a daemon thread does not hold the process


def test_attnhub_plugins_names_each_broken_plugin_and_goes_on(site: Path) -> None:
    """``attnhub plugins`` with a plugin whose exception text raises, one that swaps stdout
    and one that swaps sys.excepthook: it crashed, or printed nothing (stdout gone), or hid
    its own crash (the hook swallowed the traceback)."""
    bodies = {"weirdexc": "class E(Exception):\n    def __str__(self):\n        raise "
                          "ValueError\nraise E()\n",
              "mute": "import io, sys\nsys.stdout = io.StringIO()\n" + REG,
              "hook": "import sys\nsys.excepthook = lambda *a: None\n" + REG,
              "okay": REG}
    for name, body in bodies.items():
        (site / f"{name}.py").write_text(HEAD.format(name=name) + body)
        info = site / f"{name}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[attnhub.backends]\n{name} = {name}\n")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(repo)]),
           "ATTNHUB_PLUGINS": ",".join(bodies)}
    run = subprocess.run([sys.executable, "-m", "attnhub", "plugins"], capture_output=True,
                         text=True, env=env, timeout=120, cwd=site)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    for name in bodies:
        assert any(line.startswith(f"| {name} ") for line in lines), run.stdout
    assert "weirdexc: import failed: E: <E: str() raised ValueError>" in run.stdout
    assert "mute: changed process-wide state while loading: sys.stdout" in run.stdout
    assert "hook: changed process-wide state while loading: sys.excepthook" in run.stdout
    (okay,) = [line for line in lines if line.startswith("| okay ")]
    assert "okay_good" in okay and okay.rstrip(" |").endswith("ok"), okay


def _copy(root: Path, dist: str, version: str, ep: str) -> None:
    """Distribution ``dist`` at ``version`` in folder ``root``, entry point ``ep``."""
    root.mkdir()
    (root / f"{ep}.py").write_text(HEAD.format(name=ep) + REG)
    info = root / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[attnhub.backends]\n{ep} = {ep}\n")


@pytest.mark.parametrize("differ", ["version", "entry point", "nothing"])
def test_a_distribution_installed_twice_is_named(tmp_path: Path, monkeypatch,
                                                 differ: str) -> None:
    """Two copies of one plugin distribution on sys.path (an upgrade into another folder, a
    stale copy beside an editable install): importlib.metadata serves only the first, so the
    other never loaded and ``attnhub plugins`` showed no sign of it."""
    for var in ("ATTNHUB_PLUGINS", "ATTNHUB_PROVIDERS", "ATTNHUB_PLUGIN_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    dist = f"twice{random.randrange(10**6)}"
    first, second = f"0.{random.randrange(1, 50)}", f"1.{random.randrange(1, 50)}"
    ep2 = f"{dist}_b" if differ == "entry point" else f"{dist}_a"
    _copy(tmp_path / "one", dist, first, f"{dist}_a")
    _copy(tmp_path / "two", dist, second if differ == "version" else first, ep2)
    monkeypatch.syspath_prepend(str(tmp_path / "two"))
    monkeypatch.syspath_prepend(str(tmp_path / "one"))
    reg = Registry.load(allow=[f"{dist}_a"])
    assert reg.plugins[f"{dist}_a"].ok and reg.plugins[f"{dist}_a"].version == first
    found = [e for e in reg.plugins["core"].errors if dist in e]
    if differ == "nothing":  # the same files twice: harmless
        assert found == []
        return
    (err,) = found
    assert err.startswith(f"plugin distribution {dist!r} is installed 2 times: {first} "
                          f"({dist}_a={dist}_a) in {tmp_path / 'one'}; "), err
    assert err.endswith("only the first on sys.path is loaded, expected one copy (uninstall "
                        "or remove the others from the path)"), err


def test_check_plugin_on_a_plugin_that_failed_to_load_says_why(site: Path, monkeypatch,
                                                                capsys) -> None:
    """``attnhub check-plugin NAME`` for a plugin whose import raised said "unknown backend
    'NAME'", as if nothing of that name were installed, and not why it serves nothing."""
    from attnhub.cli import main

    code = random.choice(["raise SystemExit(3)\n", "raise ImportError('no libfoo.so')\n",
                          "import sys\nsys.exit('bye')\n"])
    mod = _module(site, "failing", code)
    monkeypatch.setenv("ATTNHUB_PLUGIN_MODULES", mod)
    monkeypatch.setenv("ATTNHUB_PLUGINS", mod)
    assert main(["check-plugin", mod]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"attnhub check-plugin: error: plugin {mod!r} has no backend to "
                          "check: import failed: "), err


@pytest.mark.parametrize("kind", ["backend", "variant"])
def test_names_a_policy_cannot_write_are_refused_at_registration(site: Path, kind: str) -> None:
    """A backend named "tritоn" (Cyrillic 'о') passed ``isidentifier()``, listed exactly like
    the real one and no policy could name it; a name of a million characters filled every
    listing. Policies allow ASCII names of at most 128 characters: so does the registry."""
    rng = random.Random(kind)
    names = ["trit\u043en", "fl\u0435x", "x" * rng.randrange(129, 10**6)]
    ok = "y" * 128
    if kind == "backend":
        classes = "".join(f"class B{i}(Good):\n    name = {n!r}\n"
                          for i, n in enumerate([*names, ok]))
        body = classes + ("@hookimpl\ndef attnhub_register_backends(register):\n"
                          + "".join(f"    register(B{i}())\n" for i in range(len(names) + 1)))
    else:
        body = ("@hookimpl\ndef attnhub_register_variants(register):\n"
                + "".join(f"    register({n!r}, mask_mod=lambda b, h, q, k: q >= k)\n"
                          for n in [*names, ok]))
    mod = _module(site, "names", body)
    reg = _load(mod)
    errors = reg.plugins[mod].errors
    assert len(errors) == len(names) and all(
        "ASCII identifier of at most 128 characters" in e and len(e) < 300 for e in errors), errors
    assert ok in (reg.backends if kind == "backend" else reg.variants)
    assert not set(names) & (set(reg.backends) | set(reg.variants))
