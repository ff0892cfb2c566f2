"""Rules that can never match, and variant names nothing registers: ``policy check`` warns,
located, with what to change, instead of staying silent."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnhub.core.registry import Registry
from attnhub.plugin import hookimpl
from attnhub.policy import load_policy
from attnhub.policy.lint import lint_policy


class _Variants:
    @hookimpl
    def attnhub_register_variants(self, register):  # type: ignore[no-untyped-def]
        register("softcap30", score_mod=lambda s, b, h, q, k: s)


@pytest.fixture(scope="module")
def registry() -> Registry:
    reg = Registry.load(entry_points=False, modules=[])
    reg.add_plugin(_Variants(), "variants")
    return reg


def _findings(tmp_path: Path, registry: Registry, rule: str) -> list[str]:
    path = tmp_path / "p.yaml"
    path.write_text(f"name: p\nrules:\n  - {rule}\n  - {{name: rest, use: [torch_sdpa]}}\n")
    return [f"{f.level} {f.path}: {f.message}" for f in lint_policy(load_policy(path), registry,
                                                                     ("cpu",))]


@pytest.mark.parametrize("when, path, message", [
    ("{mask: [none], mask_any: [causal]}", "rules[0].when.mask_any (a)",
     "mask_any ['causal'] needs a kind outside `mask` ['none'], so this rule can never match"),
    ("{mask: [causal], variant: [softcap30]}", "rules[0].when.variant (a)",
     "a variant is a score_mod or mask_mod, which `mask` ['causal'] leaves out, so this rule "
     "can never match"),
    ("{hardware: [cpu, gfx942], capability: {ge: 8.0}}", "rules[0].when.capability (a)",
     "compute capability exists only on CUDA, and `hardware` is cpu, gfx942, so this rule can "
     "never match"),
])
def test_contradicting_conditions_are_warned(tmp_path: Path, registry: Registry, when: str,
                                             path: str, message: str) -> None:
    found = _findings(tmp_path, registry, f"{{name: a, when: {when}, use: [torch_sdpa]}}")
    assert any(f.startswith(f"warning {path}: {message}; expected conditions") for f in found), \
        found


def test_conditions_that_can_hold_together_are_not_warned(tmp_path: Path,
                                                          registry: Registry) -> None:
    found = _findings(tmp_path, registry, "{name: a, when: {mask: [causal, score_mod], "
                      "mask_any: [causal], variant: [softcap30], hardware: [cuda, cpu], "
                      "capability: {ge: 8.0}}, use: [torch_sdpa]}")
    assert not any("can never match" in f or "variant" in f for f in found), found


def test_an_unregistered_variant_name_is_warned_with_a_suggestion(tmp_path: Path,
                                                                   registry: Registry) -> None:
    found = _findings(tmp_path, registry, "{name: a, when: {variant: [sofcap30]}, "
                      "use: [torch_sdpa]}")
    assert ("warning rules[0].when.variant[0] (a): no installed plugin registers variant "
            "'sofcap30', so the rule matches only calls whose score_mod/mask_mod callable is "
            "named 'sofcap30'; expected one of: softcap30 (did you mean 'softcap30'?)") in found
