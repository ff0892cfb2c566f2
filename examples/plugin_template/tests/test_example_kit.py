"""The plugin's own tests: the attnhub conformance kit on every feature it declares."""

from __future__ import annotations

from attnhub.conformance import format_report, run_kit
from attnhub.core.device import probe
from attnhub.core.registry import Registry


def test_entry_point_registers_the_backend() -> None:
    reg = Registry.load()
    assert reg.plugins["example"].ok, reg.plugins["example"].errors
    assert reg.get("example").plugin == "example"


def test_conformance_kit_passes() -> None:
    report = run_kit(Registry.load().get("example"), probe())
    assert report.ok, format_report(report)
    assert {f["feature"] for f in report.features()} >= {"mask causal", "mask softcap", "lse",
                                                         "backward", "gqa 4:1 (MQA)"}
