"""Broken and hostile plugins, third round: what a plugin returns from its checks, what it
declares, what it changes in the host's process while it loads, callbacks it keeps, and the
environment variables that pick plugins. Each was accepted silently or crashed the host."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from attnhub import Hub
from attnhub.core.registry import Registry
from attnhub.errors import BackendUnavailableError, PluginError
from attnhub.plugin import Capabilities

HEAD = '''
import logging, os
import torch
from attnhub.plugin import AttentionOutput, Backend, Capabilities, hookimpl

class Good(Backend):
    name = "{name}_good"
    capabilities = Capabilities()
    def forward(self, q, k, v, spec, params):
        return AttentionOutput(q.clone())
'''


def _module(root: Path, name: str, body: str) -> str:
    mod = f"adv3_{name}_{time.time_ns()}"
    (root / f"{mod}.py").write_text(HEAD.format(name=name) + textwrap.dedent(body))
    return mod


def _dist(root: Path, name: str) -> None:
    """An installed distribution with entry point ``name`` (module of the same name)."""
    (root / f"{name}.py").write_text(HEAD.format(name=name) + textwrap.dedent('''
        @hookimpl
        def attnhub_register_backends(register):
            register(Good())
        '''))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[attnhub.backends]\n{name} = {name}\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    for var in ("ATTNHUB_PLUGINS", "ATTNHUB_PROVIDERS", "ATTNHUB_PLUGIN_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def _load(mod: str) -> Registry:
    return Registry.load(modules=[mod], entry_points=False)


CHECKS = {  # case -> what extra_checks / check / available returns, and its type
    "text": ("'needs a GPU'", "str"), "empty_text": ("''", "str"), "none": ("None", "NoneType"),
    "items": ("[None, 3]", "list"), "mapping": ("{'a': 1}", "dict"), "false": ("False", "bool"),
}


@pytest.mark.parametrize("method", ["extra_checks", "check", "available"])
def test_garbage_from_a_check_rejects_the_backend_with_the_bug(site: Path, method: str) -> None:
    """A str became one "reason" per character (`- n`, `- e`, ...); an empty str or a dict
    read as "serves it" and the backend ran; ``[None, 3]`` became the reasons "None", "3"."""
    from attnhub.core.backend import safe_available

    args = "self, device" if method == "available" else "self, spec, device"
    classes = "".join(f'''
        class B_{case}(Good):
            name = "g_{case}"
            def {method}({args}):
                return {value}
        ''' for case, (value, _) in CHECKS.items())
    mod = _module(site, "checks", classes + '''
        @hookimpl
        def attnhub_register_backends(register):
            for c in list(globals().values()):
                if isinstance(c, type) and c.__name__.startswith("B_"):
                    register(c())
        ''')
    reg = _load(mod)
    hub = Hub(hardware="cpu", registry=reg)
    q = torch.randn(1, 4, 2, 8)
    for case, (value, kind) in CHECKS.items():
        name = f"g_{case}"
        if method == "available":
            got = safe_available(reg.get(name), hub.device)
        else:
            with pytest.raises(BackendUnavailableError) as exc:
                hub.attention(q, q, q, backend=name)
            got = exc.value.reasons
        assert got == [f"{method}() of backend {name!r} returned {kind} {value}, expected a list "
                       f"of reason sentences (empty: it can) (a bug in plugin {mod!r}; report it "
                       "to its authors)"], got


def test_a_backend_that_skips_super_init_still_loads_and_runs(site: Path) -> None:
    """``load()`` read ``self._loaded`` set only by ``Backend.__init__``: the first call
    failed with AttributeError, reported as the backend raising."""
    mod = _module(site, "noinit", '''
        class NoInit(Good):
            name = "noinit"
            def __init__(self):
                self.ready = True
            def _load(self):
                self.loaded_once = True

        @hookimpl
        def attnhub_register_backends(register):
            register(NoInit())
        ''')
    reg = _load(mod)
    q = torch.randn(1, 4, 2, 8)
    out = Hub(hardware="cpu", registry=reg).attention(q, q, q, backend="noinit")
    assert torch.equal(out, q) and reg.get("noinit").loaded_once


BAD_CAPS = [  # declarations that serve nothing, or compare wrongly
    ({"exact": False, "error_budget": math.nan}, "error_budget must be a non-negative number"),
    ({"exact": False, "error_budget": -0.1}, "error_budget must be a non-negative number"),
    ({"exact": False, "error_budget": "0.1"}, "error_budget must be a non-negative number"),
    ({"max_query_len_decode": "4"}, "max_query_len_decode must be a positive int"),
    ({"max_query_len_decode": 0}, "max_query_len_decode must be a positive int"),
    ({"max_query_len_decode": True}, "max_query_len_decode must be a positive int"),
    ({"vendors": {"cudaa"}}, "vendors must be among cpu, cuda, rocm (got cudaa)"),
    ({"archs": {"SM90"}}, "archs must be device archs such as sm90"),
    ({"archs": {"hopper"}}, "archs must be device archs such as sm90"),
    ({"head_dims": {0, 64}}, "head_dims must be a non-empty set of positive ints"),
    ({"head_dims": {True}}, "head_dims must be a non-empty set of positive ints"),
    ({"head_dims": set()}, "head_dims must be a non-empty set of positive ints"),
    ({"min_capability": (9, False)}, "min_capability must be a (major, minor) tuple of non-neg"),
    ({"max_capability": (9, -1)}, "max_capability must be a (major, minor) tuple of non-neg"),
    ({"dtypes": frozenset()}, "dtypes is empty: the backend would serve nothing"),
    ({"phases": set()}, "phases is empty: the backend would serve nothing"),
    ({"vendors": []}, "vendors is empty: the backend would serve nothing"),
    ({"layouts": ()}, "layouts is empty: the backend would serve nothing"),
]


@pytest.mark.parametrize("kwargs, error", BAD_CAPS, ids=[str(k) for k, _ in BAD_CAPS])
def test_capabilities_that_serve_nothing_or_compare_wrongly_are_refused(kwargs, error) -> None:
    """Each was accepted: a NaN budget compares False with everything, ``"4"`` raised
    TypeError inside every check, a vendor typo left the backend unavailable everywhere."""
    with pytest.raises(TypeError, match=r"^invalid Capabilities: " + re.escape(error)):
        Capabilities(**kwargs)
    ok = Capabilities(exact=False, error_budget=math.inf, archs={"sm90", "gfx942"},
                      head_dims={64, 128}, min_capability=(8, 0), max_query_len_decode=1)
    assert ok.error_budget == math.inf  # what the in-repo linear backends declare


def test_a_register_callback_kept_past_its_hook_is_refused(site: Path) -> None:
    """A plugin that kept ``register`` and called it later (a thread, first use) added a
    backend or variant after the host had planned, explained or locked with the registry."""
    mod = _module(site, "late", '''
        KEPT = []

        class Late(Good):
            name = "late_backend"

        @hookimpl
        def attnhub_register_backends(register):
            register(Good())
            KEPT.append(register)

        @hookimpl
        def attnhub_register_variants(register):
            KEPT.append(register)
        ''')
    reg = _load(mod)
    kept = importlib.import_module(mod).KEPT
    kept[0](importlib.import_module(mod).Late())
    kept[1]("late_variant", score_mod=lambda s, b, h, q, k: s)
    assert "late_backend" not in reg.backends and "late_variant" not in reg.variants
    assert reg.plugins[mod].backends == ["late_good"]
    assert reg.plugins[mod].errors == [
        f"register({what}) was called after hook {hook} returned (the callback was kept and "
        "called later); ignored: call register(...) inside the hook"
        for what, hook in (("Late", "attnhub_register_backends"),
                           ("variant 'late_variant'", "attnhub_register_variants"))]


@pytest.mark.parametrize("where", ["import", "hook"])
def test_process_wide_state_a_plugin_changes_is_put_back_and_recorded(site: Path, monkeypatch,
                                                                      where: str) -> None:
    """A plugin that set torch's default dtype, deterministic algorithms, an SDPA switch,
    silenced logging or set ATTNHUB_BACKEND at import changed every later call of the host,
    silently (ATTNHUB_BACKEND forces one backend onto every call)."""
    monkeypatch.delenv("ATTNHUB_BACKEND", raising=False)
    changes = textwrap.dedent('''
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.enable_math_sdp(False)
        logging.disable(logging.CRITICAL)
        os.environ["ATTNHUB_BACKEND"] = "reference"
        ''')
    hook = "@hookimpl\ndef attnhub_register_backends(register):\n    register(Good())\n"
    body = (changes + hook if where == "import" else
            hook + textwrap.indent(changes, "    "))
    mod = _module(site, f"mutate_{where}", body)
    before = (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
              torch.backends.cuda.math_sdp_enabled(), logging.root.manager.disable)
    try:
        reg = _load(mod)
        after = (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                 torch.backends.cuda.math_sdp_enabled(), logging.root.manager.disable)
        assert after == before and "ATTNHUB_BACKEND" not in os.environ
    finally:  # without the guard the plugin's settings would leak into later tests
        torch.set_default_dtype(before[0])
        torch.use_deterministic_algorithms(before[1])
        torch.backends.cuda.enable_math_sdp(before[2])
        logging.disable(before[3])
        os.environ.pop("ATTNHUB_BACKEND", None)
    (error,) = reg.plugins[mod].errors
    assert error.startswith("changed process-wide state while loading: torch default dtype "
                            "torch.float32 -> torch.float64; torch deterministic algorithms "
                            "(False, False) -> (True, False); SDPA math kernel switch True -> "
                            "False; logging.disable level 0 -> 50; environment variable(s) "
                            "ATTNHUB_BACKEND; put back"), error
    assert reg.plugins[mod].backends == [f"mutate_{where}_good"]  # the plugin still serves


@pytest.mark.parametrize("value", ["inf", "1e400", "1e12"])
def test_plugin_timeout_values_that_mean_no_limit_do_not_break_plugins(site: Path, monkeypatch,
                                                                       value: str) -> None:
    """``inf`` (or any value past threading.TIMEOUT_MAX) made every wait raise OverflowError:
    each healthy plugin was recorded as "import failed"."""
    from attnhub.core.registry import plugin_timeout

    monkeypatch.setenv("ATTNHUB_PLUGIN_TIMEOUT", value)
    assert plugin_timeout() is None
    mod = _module(site, "timeout", "@hookimpl\ndef attnhub_register_backends(register):\n"
                                   "    register(Good())\n")
    rec = _load(mod).plugins[mod]
    assert rec.errors == [] and rec.backends == ["timeout_good"]


@pytest.mark.parametrize("value", ["nan", "-1", "-inf", "ten"])
def test_a_plugin_timeout_that_is_no_duration_is_an_error(monkeypatch, value: str) -> None:
    """``nan`` and negative values silently meant "no limit": a hanging plugin hung the host."""
    monkeypatch.setenv("ATTNHUB_PLUGIN_TIMEOUT", value)
    with pytest.raises(PluginError, match=rf"^ATTNHUB_PLUGIN_TIMEOUT='{value}' is not a number "
                                          r"of seconds, expected one >= 0 \(0 or inf: no limit"):
        Registry.load(modules=[], entry_points=False)


def test_misspelt_plugin_names_in_the_environment_are_recorded(site: Path,
                                                               monkeypatch) -> None:
    """A misspelt allow entry loaded nothing of the plugin, a misspelt deny entry loaded it
    anyway, and a provider pick of a plugin that is not loaded took the backend from
    everyone; each without a word (``missing_reason`` said "unknown backend")."""
    _dist(site, "adv3_alpha")
    monkeypatch.setenv("ATTNHUB_PLUGINS", "adv3_alpha,adv3_alhpa,-adv3_alpah")
    monkeypatch.setenv("ATTNHUB_PROVIDERS", "adv3_alpha_good=adv3_alhpa,nosuch=adv3_alpha")
    reg = Registry.load(modules=[])
    installed = sorted({"core", *(ep.name for ep in importlib.metadata.entry_points(
        group="attnhub.backends"))})
    assert reg.plugins["core"].errors == [
        f"ATTNHUB_PLUGINS names plugin 'adv3_alhpa', which is not installed (installed: "
        f"{', '.join(installed)}) (did you mean 'adv3_alpha'?)",
        f"ATTNHUB_PLUGINS names plugin 'adv3_alpah', which is not installed (installed: "
        f"{', '.join(installed)}) (did you mean 'adv3_alpha'?)",
        "ATTNHUB_PROVIDERS picks plugin 'adv3_alhpa' for backend 'adv3_alpha_good', but no "
        "plugin of that name is loaded (loaded: core, adv3_alpha) (did you mean 'adv3_alpha'?); "
        "no plugin serves 'adv3_alpha_good'",
        "ATTNHUB_PROVIDERS picks plugin 'adv3_alpha' for backend 'nosuch', which that plugin "
        "does not register (it registers: nothing)"]
    assert reg.missing_reason("adv3_alpha_good") == reg.plugins["core"].errors[-2]


@pytest.mark.parametrize("value", ["x=a,x=b", "torch_sdpa=core,torch_sdpa=other"])
def test_a_backend_given_two_providers_is_an_error(monkeypatch, value: str) -> None:
    """The last pick won silently (or took a core backend from the core)."""
    monkeypatch.setenv("ATTNHUB_PROVIDERS", value)
    with pytest.raises(PluginError, match="is given two providers"):
        Registry.load(modules=[], entry_points=False)


def test_a_keyboard_interrupt_a_plugin_raises_itself_is_recorded(site: Path) -> None:
    """A plugin raising KeyboardInterrupt at import or in its hook stopped the host (the CLI,
    a server starting up): it ran in a worker thread, which Ctrl-C never reaches, so it can
    only be the plugin's own raise. Run in a subprocess: before the fix it ends the session."""
    mods = [_module(site, f"kbd_{where}", body) for where, body in (
        ("import", "raise KeyboardInterrupt('stop')\n"),
        ("hook", "@hookimpl\ndef attnhub_register_backends(register):\n"
                 "    register(Good())\n    raise KeyboardInterrupt\n"))]
    code = ("from attnhub.core.registry import Registry\n"
            f"reg = Registry.load(modules={mods!r}, entry_points=False)\n"
            f"print([reg.plugins[m].errors for m in {mods!r}], 'torch_sdpa' in reg.backends)\n")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(site)])}
    env.pop("ATTNHUB_PLUGIN_TIMEOUT", None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, cwd=site)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str([
        ["import failed: KeyboardInterrupt: raised by the plugin's own code, not by Ctrl-C: "
         "stop"],
        ["registration raised KeyboardInterrupt: raised by the plugin's own code, not by "
         "Ctrl-C"]]) + " True"


def test_hosts_that_list_backends_take_a_broken_check_as_a_reason(site: Path) -> None:
    """``attnhub bench``'s candidates, the decoder's decode candidates and ``benchmark.measure``
    called ``available``/``check`` directly: a plugin raising there (or returning a str)
    ended the run with its traceback, or read a str as reasons. Each now names the bug."""
    import argparse

    from attnhub.benchmark import measure
    from attnhub.cli.bench import _backends
    from attnhub.core.spec import AttentionSpec
    from attnhub.models.generate import decode_candidates

    mod = _module(site, "hosts", '''
        class Raises(Good):
            name = "h_raises"
            def available(self, device):
                raise RuntimeError("probe crashed")
        class Text(Good):
            name = "h_text"
            def check(self, spec, device):
                return "needs a GPU"
        @hookimpl
        def attnhub_register_backends(register):
            register(Raises())
            register(Text())
        ''')
    hub = Hub(hardware="cpu", registry=_load(mod))
    names, absent = _backends(argparse.Namespace(backends=None), hub)
    assert "h_raises" not in names and "probe crashed" in absent["h_raises"]
    ok, skipped = decode_candidates(hub, [])  # no decode bindings: availability only
    assert "h_raises" not in ok and "probe crashed" in skipped["h_raises"]
    spec = AttentionSpec(batch=1, num_q_heads=2, num_kv_heads=2, head_dim=8, max_seqlen_q=4,
                         max_seqlen_k=4, dtype="fp32")
    m, = measure(hub, spec, ["h_text"], torch.device("cpu"), warmup=0, repeats=1)
    assert m.skipped and "str" in m.skipped and "n; e" not in m.skipped


def test_a_library_variable_set_while_loading_is_not_the_plugins_bug(site: Path,
                                                                    monkeypatch) -> None:
    """Libraries a plugin imports set their own variables (torch sets CUDA_MODULE_LOADING
    when CUDA starts): only the host's ATTNHUB_* variables are guarded, so the plugin is not
    reported broken on a GPU machine and the library's setting stays."""
    monkeypatch.delenv("ADV3_LIBRARY_SETTING", raising=False)
    mod = _module(site, "libvar", '''
        os.environ["ADV3_LIBRARY_SETTING"] = "LAZY"
        @hookimpl
        def attnhub_register_backends(register):
            register(Good())
        ''')
    try:
        reg = _load(mod)
        assert os.environ.get("ADV3_LIBRARY_SETTING") == "LAZY"
        assert reg.plugins[mod].errors == []
    finally:
        os.environ.pop("ADV3_LIBRARY_SETTING", None)
