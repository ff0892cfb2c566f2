"""The conformance kit: broken backends fail it on the feature they break, honest in-repo CPU
backends pass it, and the CLI / pytest entry points report and exit accordingly."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from attnhub.cli import main
from attnhub.conformance import grid, run_kit
from attnhub.core.builtin import ReferenceBackend
from attnhub.core.device import probe
from attnhub.plugin import AttentionOutput, Capabilities

pytest_plugins = ["pytester"]

CPU = probe("cpu")
HONEST = replace(ReferenceBackend.capabilities, layouts=frozenset({"bshd", "thd", "paged"}))


class Honest(ReferenceBackend):
    name = "honest"
    plugin = "test"
    capabilities = HONEST


class IgnoresSoftcap(Honest):
    """Claims softcap (as every other mask), computes without it."""

    name = "ignores_softcap"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        return super().forward(q, k, v, spec, replace(params, softcap=None))


class WrongShape(Honest):
    name = "wrong_shape"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        out, lse = super().forward(q, k, v, spec, params)
        return AttentionOutput(out[..., :-1, :], lse)  # one head short


class Transposed(Honest):
    """bshd in, bhsd out, reshaped back to the expected shape: right shape, wrong values."""

    name = "transposed"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        out, lse = super().forward(q, k, v, spec, params)
        if out.dim() == 4:
            out = out.transpose(1, 2).reshape(out.shape)
        return AttentionOutput(out, lse)


class FlattenedFp64(Honest):
    name = "flattened_fp64"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        out, lse = super().forward(q, k, v, spec, params)
        return AttentionOutput(out.double().flatten(-2), lse)


class NaNs(Honest):
    name = "nans"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        out, lse = super().forward(q, k, v, spec, params)
        out = out.contiguous().clone()
        out.view(-1)[0] = float("nan")
        return AttentionOutput(out, lse)


class NoLse(Honest):
    name = "no_lse"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        return AttentionOutput(super().forward(q, k, v, spec, params).out, None)


class Exits(Honest):
    name = "exits"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        raise SystemExit("kernel gave up")


class NoisyForward(Honest):
    """Declares a deterministic forward but adds run-to-run noise below the error bound."""

    name = "noisy"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        out, lse = super().forward(q, k, v, spec, params)
        return AttentionOutput(out + 1e-9 * torch.randn_like(out), lse)


class DenseHeadDim(Honest):
    """Reads every tensor as if its head dim were dense (a raw kernel on a strided view)."""

    name = "dense_head_dim"

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        def dense(t):  # type: ignore[no-untyped-def]
            return t if t.stride(-1) == 1 else torch.as_strided(
                t, t.shape, (*t.stride()[:-1], 1))
        return super().forward(dense(q), dense(k), dense(v), spec, params)


def _features(report) -> dict[str, str]:
    return {f["feature"]: f["status"] for f in report.features()}


def test_honest_backend_passes_every_declared_feature() -> None:
    rep = run_kit(Honest(), CPU, quick=True)
    assert rep.ok, [r.to_json() for r in rep.results if r.status != "pass"]
    feats = _features(rep)
    for f in ("mask softcap", "mask causal top_left (Sq != Sk)", "layout thd", "lse",
              "backward", "deterministic forward", "gqa 4:1 (MQA)", "layout bhsd",
              "head dim stride 2 (bshd views)", "head dim stride 2 (thd views)"):
        assert feats[f] == "pass", f
    assert any(f.startswith("layout paged page=") for f in feats)


@pytest.mark.parametrize("backend, feature, words", [
    (IgnoresSoftcap(), "mask softcap", "max error"),
    (WrongShape(), "basic", "output shape"),
    (Transposed(), "basic", "max error"),
    (FlattenedFp64(), "basic", "output shape"),
    (NaNs(), "basic", "NaN in the output"),
    (NoLse(), "lse", "lse is None"),
    (Exits(), "basic", "SystemExit: kernel gave up"),
    (NoisyForward(), "deterministic forward", "two runs differ"),
    (DenseHeadDim(), "head dim stride 2 (bshd views)", "max error"),
])
def test_broken_backends_fail_on_what_they_break(backend, feature, words) -> None:
    cases = [c for c in grid(backend.capabilities, quick=True) if c.feature == feature]
    rep = run_kit(backend, CPU, cases=cases)
    assert not rep.ok
    row = _features(rep)
    assert row[feature] in ("fail", "crash"), rep.to_json()
    assert any(words in r.detail for r in rep.results), [r.detail for r in rep.results]


def test_softcap_ignorer_is_far_off() -> None:
    cases = [c for c in grid(IgnoresSoftcap.capabilities) if c.feature == "mask softcap"]
    rep = run_kit(IgnoresSoftcap(), CPU, cases=cases)
    worst = max(r.error or 0 for r in rep.results)
    assert worst > 100 * max(r.allowed or 0 for r in rep.results)


def test_grid_follows_the_declaration() -> None:
    """Nothing declared, nothing but the basic contract is tested; each claim adds cases."""
    bare = {c.feature for c in grid(Capabilities(dtypes=frozenset({"fp16"})))}
    assert bare == {"basic", "head_dim 16", "head_dim 64", "head_dim 128", "head_dim 256",
                    "layout bhsd", "head dim stride 2 (bshd views)", "Sq < Sk", "Sq > Sk",
                    "phase decode"}
    full = {c.feature for c in grid(HONEST)}
    assert {"mask alibi", "mask prefix_lm", "mask column_sparse", "mask score_mod",
            "mask mask_mod", "mask document", "deterministic backward"} <= full
    paged = [c for c in grid(replace(HONEST, page_size_multiple=16)) if c.layout == "paged"]
    assert paged and all(c.page_size % 16 == 0 for c in paged)
    assert len({c.page_size for c in paged}) >= 2


def test_declining_is_a_skip_not_a_pass(monkeypatch) -> None:
    class Picky(Honest):
        name = "picky"

        def extra_checks(self, spec, device):  # type: ignore[no-untyped-def, override]
            return ["needs the vendor library"]

    rep = run_kit(Picky(), CPU, quick=True)
    assert rep.ok and {r.status for r in rep.results} == {"skip"}
    assert main(["check-plugin", "torch_sdpa", "--budget", "0"]) == 2  # nothing was checked


@pytest.mark.parametrize("name", ["reference", "torch_sdpa", "sliding_window", "torch_flash_cpu",
                                  "gla", "linear", "retention", "longformer", "lsh"])
def test_in_repo_cpu_backends_pass_the_quick_kit(name: str, capsys) -> None:
    from attnhub.core.registry import Registry

    if name not in Registry.load().backends:
        pytest.skip(f"{name}'s plugin is not installed")
    assert main(["check-plugin", name, "--quick", "--json"]) == 0, capsys.readouterr().out
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["backends"][0]["backend"] == name


@pytest.mark.parametrize("name, features", [
    ("triton", ["basic", "mask softcap", "mask causal bottom_right", "layout thd", "lse"]),
    ("triton_decode", ["basic", "mask softcap", "layout paged", "lse"]),
])
def test_triton_backends_pass_kit_features_in_the_interpreter(name, features) -> None:
    """A few features of the Triton backends (interpreted on a CPU: kept small for CI)."""
    from attnhub.conformance import backend_grid
    from attnhub.core.registry import Registry

    reg = Registry.load()
    if name not in reg.backends:
        pytest.skip(f"{name}'s plugin is not installed")
    backend = reg.get(name)
    if backend.available(CPU):
        pytest.skip("; ".join(backend.available(CPU)))
    cases = [c for c in backend_grid(backend, CPU, quick=True)
             if any(c.feature.startswith(f) for f in features)]
    rep = run_kit(backend, CPU, cases=cases)
    assert rep.ok, [r.to_json() for r in rep.results if r.status != "pass"]
    assert {r.status for r in rep.results} == {"pass"}


def test_cli_exit_code_and_pytest_entry(tmp_path, monkeypatch, pytester, capsys) -> None:
    """A failing plugin fails ``check-plugin`` (exit 1) and the pytest entry point."""
    (tmp_path / "kit_broken_plugin.py").write_text(
        "from attnhub.plugin import hookimpl\n"
        "from test_conformance_kit import IgnoresSoftcap\n"
        "@hookimpl\n"
        "def attnhub_register_backends(register):\n"
        "    register(IgnoresSoftcap())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    monkeypatch.setenv("ATTNHUB_PLUGINS", "kit_broken_plugin")
    monkeypatch.setenv("ATTNHUB_PLUGIN_MODULES", "kit_broken_plugin")
    assert main(["check-plugin", "ignores_softcap", "--quick", "-k", "softcap", "-k",
                 "basic"]) == 1
    out = capsys.readouterr().out
    assert "| mask softcap" in out and "FAIL" in out
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--pyargs",
                                       "attnhub.conformance", "--backend", "ignores_softcap",
                                       "--quick", "-k", "mask_softcap or basic")
    res.assert_outcomes(passed=1, failed=1)
