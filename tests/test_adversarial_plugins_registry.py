"""Broken plugins the registry must record, by name, with the fix, instead of loading them
"ok" with nothing registered, losing their other backends, or hanging the host."""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import pytest

from attnhub.core.registry import Registry

BACKEND = '''
from attnhub.plugin import AttentionOutput, Backend, Capabilities, hookimpl

class Good(Backend):
    name = "{name}_good"
    capabilities = Capabilities()
    def forward(self, q, k, v, spec, params):
        return AttentionOutput(q)
'''

PLUGINS = {
    "typo": ("@hookimpl\ndef attnhub_register_backend(register):\n    register(Good())\n",
             "hook 'attnhub_register_backend' is not an attnhub hook and is never called; "
             "expected one of: attnhub_register_backends, attnhub_register_variants (did you "
             "mean 'attnhub_register_backends'?)"),
    "undecorated": ("def attnhub_register_backends(register):\n    register(Good())\n",
                    "attnhub_register_backends not decorated with @attnhub.plugin.hookimpl, so "
                    "never called"),
    "nohooks": ("X = 1\n", "implements no attnhub hook, so it registers nothing; expected "
                "@hookimpl def attnhub_register_backends(register) (docs/plugins.md)"),
    "returns": ("@hookimpl\ndef attnhub_register_backends(register):\n    return [Good()]\n",
                "hook attnhub_register_backends returned list, which is ignored: a hook returns "
                "nothing and calls register(...) once per backend or variant"),
    "klass": ("@hookimpl\ndef attnhub_register_backends(register):\n    register(Good)\n",
              "registered the class Good, expected an instance: register(Good())"),
}


def _module(root: Path, name: str, body: str) -> str:
    mod = f"adv_plugin_{name}_{time.time_ns()}"
    (root / f"{mod}.py").write_text(BACKEND.format(name=name) + textwrap.dedent(body))
    return mod


@pytest.fixture
def site(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("case", sorted(PLUGINS))
def test_a_plugin_that_registers_nothing_says_why(site: Path, case: str) -> None:
    body, error = PLUGINS[case]
    mod = _module(site, case, body)
    rec = Registry.load(modules=[mod], entry_points=False).plugins[mod.split(".")[0]]
    assert rec.errors == [error] and rec.backends == []


def test_a_backend_whose_attributes_raise_does_not_cost_the_others(site: Path) -> None:
    mod = _module(site, "props", '''
        class NoName(Good):
            @property
            def name(self):
                raise RuntimeError("no name")

        class NoTier(Good):
            name = "props_notier"
            @property
            def tier(self):
                raise RuntimeError("no tier")

        @hookimpl
        def attnhub_register_backends(register):
            register(NoName())
            register(NoTier())
            register(Good())
        ''')
    reg = Registry.load(modules=[mod], entry_points=False)
    rec = reg.plugins[mod]
    assert rec.backends == ["props_good"] and "props_good" in reg.backends
    assert rec.errors == ["backend NoName: reading its name raised RuntimeError: no name",
                          "backend 'props_notier': reading its tier raised RuntimeError: no tier"]


def test_invalid_variants_are_refused_at_registration(site: Path) -> None:
    mod = _module(site, "variants", '''
        @hookimpl
        def attnhub_register_variants(register):
            register(123, score_mod=lambda s, b, h, q, k: s)
            register("not a name", score_mod=lambda s, b, h, q, k: s)
            register("text", score_mod="s * 2")
            register("fine", mask_mod=lambda b, h, q, k: q >= k)
        ''')
    reg = Registry.load(modules=[mod], entry_points=False)
    assert sorted(reg.variants) == ["fine"]
    assert reg.plugins[mod].errors == [
        "variant name 123 is not an identifier (a rule names it in `when.variant`, a call in "
        "score_mod=/mask_mod=)",
        "variant name 'not a name' is not an identifier (a rule names it in `when.variant`, a "
        "call in score_mod=/mask_mod=)",
        "variant 'text': score_mod is a str, expected a callable (FlexAttention style) or None"]


#: plugins that hang: at import, in their hook, and in an attribute pluggy reads while it
#: looks for hooks (a module ``__getattr__`` here; a property alike), then what is recorded
HANGS = {
    "import": ("import time\ntime.sleep(3600)\n", "its import"),
    "hook": ("import time\n@hookimpl\ndef attnhub_register_backends(register):\n"
             "    register(Good())\n    time.sleep(3600)\n", "hook attnhub_register_backends"),
    "read": ("import time\n@hookimpl\ndef attnhub_register_backends(register):\n"
             "    register(Good())\ndef __dir__():\n    return ['attnhub_register_backends', "
             "'Good', 'slow']\ndef __getattr__(name):\n    if name == 'slow':\n"
             "        time.sleep(3600)\n    raise AttributeError(name)\n",
             "reading its hooks (an attribute that hangs)"),
}


@pytest.mark.parametrize("where", sorted(HANGS))
def test_a_plugin_that_hangs_is_skipped_after_the_timeout(site: Path, monkeypatch,
                                                          where: str) -> None:
    """Registry.load waited forever on a plugin sleeping at import, in its hook, or in an
    attribute pluggy's register() read on the host's thread."""
    monkeypatch.setenv("ATTNHUB_PLUGIN_TIMEOUT", "0.5")
    body, what = HANGS[where]
    mod = _module(site, f"hang_{where}", body)
    got: list[Registry] = []
    loader = threading.Thread(target=lambda: got.append(Registry.load(modules=[mod],
                                                                      entry_points=False)),
                              daemon=True)  # a loader that still hangs fails the test, not CI
    loader.start()
    loader.join(10)
    assert got, "Registry.load is still waiting on the plugin"
    reg = got[0]
    assert reg.plugins[mod].errors == [
        f"{what} did not finish within 0.5 s (ATTNHUB_PLUGIN_TIMEOUT); the plugin is skipped "
        "(fix the hang, or raise the limit with ATTNHUB_PLUGIN_TIMEOUT=SECONDS)"]
    assert f"hang_{where}_good" not in reg.backends  # what it registered before is taken back
    assert reg.get("torch_sdpa").plugin == "core"
    if where == "import":  # a second load does not wait on the hung import's module lock
        t0 = time.perf_counter()
        again = Registry.load(modules=[mod], entry_points=False)
        assert time.perf_counter() - t0 < 5 and "still running" in again.plugins[mod].errors[0]
