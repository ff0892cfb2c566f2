"""Second pass over 8ea0758 (explain/bhsd/lint/fastest opt-in) and 2115623 (a registered
variant's callable is that variant):

- ``Hub.decide`` of a ``bhsd`` spec missed the binding its call settled: the resolver decides
  a bhsd spec as the bshd call the hub makes, but the hub's decision cache was keyed by the
  bhsd spec, so after the first call timed a pack's near-tie, ``decide`` (and ``explain``
  through that hub) still reported the pack's order for the bhsd spec.
- lint's bucketed-range warning fired a second time for a range that admits no whole number
  (``batch: {gt: 1, lt: 2}``), which ``_no_whole_number`` already reports.
- lint raised StopIteration (a traceback out of ``attnhub policy check``) for a listed
  bucketed value past 2**62 that is not a power of two (``seqlen: [4096, 5.0e+18]``).
- lint said of a listed fraction ``a call of 1.5 is seen as 2``: no call has 1.5.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import attnhub
from attnhub.core.registry import Registry
from attnhub.hookspecs import hookimpl
from attnhub.policy import ProfileStore, load_policy
from attnhub.policy.lint import lint_policy
from tests.test_settle_ties import _Counted


# -- Hub.decide of a bhsd spec after its call settled a near-tie --------------------------

_Timed = _Counted  # the reference kernel on the virtual clock


class _Slow(_Timed):
    name = "rv11b_slow"
    cost = 1.0e-3


class _Fast(_Timed):
    name = "rv11b_fast"
    cost = 0.9e-3


def test_decide_of_a_bhsd_spec_reports_the_binding_its_call_settled(
        tmp_path: Path, virtual_clock: Any) -> None:
    slow, fast = _Slow(virtual_clock), _Fast(virtual_clock)

    @hookimpl
    def attnhub_register_backends(register):  # type: ignore[no-untyped-def]
        register(slow)
        register(fast)

    reg = Registry.of()
    reg.add_plugin(types.SimpleNamespace(attnhub_register_backends=attnhub_register_backends),
                   "rv11b")
    (tmp_path / "p.yaml").write_text(
        "name: ties\nrules:\n  - {name: tied, use: {fastest: [rv11b_slow, rv11b_fast]}}\n")
    hub = attnhub.Hub(load_policy(tmp_path / "p.yaml"), hardware="cpu", registry=reg)
    q, k, v = (torch.randn(1, 2, n, 16) for n in (5, 40, 40))  # bhsd
    spec = attnhub.AttentionSpec(dtype="fp32", head_dim=16, num_q_heads=2, num_kv_heads=2,
                                 layout="bhsd", max_seqlen_q=5, max_seqlen_k=40).bucketed()
    src = ProfileStore(tmp_path / "src.json", packs="off")
    for name, sec in (("rv11b_slow", 1.00e-4), ("rv11b_fast", 1.01e-4)):  # a pack near-tie
        src.record_speed(hub.device, dataclasses.replace(spec, layout="bshd"), name, sec)
    data = src.data()
    data["pack"] = {"measured": "2026-12-02", "command": "test"}
    (tmp_path / "packs").mkdir()
    (tmp_path / "packs" / "pack.json").write_text(json.dumps(data))
    hub.resolver.profile = ProfileStore(tmp_path / "user.json", packs=tmp_path / "packs")
    assert hub.decide(spec).tied == ("rv11b_slow", "rv11b_fast")  # before the call: the pack
    hub.attention(q, k, v, layout="bhsd")
    ran = hub.bound()[-1].decision
    assert ran.backend == "rv11b_fast" and ran.tied == ()
    assert hub.decide(spec) is hub.decide(ran.spec) is ran  # as the call settled it


# -- lint of bucketed conditions ------------------------------------------------------------

def _rule_findings(tmp_path: Path, cond: str) -> list[str]:
    p = tmp_path / "p.yaml"
    p.write_text(f"name: t\nrules:\n  - name: r\n    when: {{{cond}}}\n    use: [reference]\n"
                 "  - {name: rest, use: [reference]}\n")
    return [f.message for f in lint_policy(load_policy(p), Registry.of(), ("cpu",))
            if f.path.startswith("rules[0]")]


@pytest.mark.parametrize("cond", ["batch: {gt: 1, lt: 2}", "seqlen: {gt: 1, lt: 1.5}",
                                  "seqlen_q: {gt: 2, le: 2.5}"])
def test_a_range_with_no_whole_number_is_reported_once(tmp_path: Path, cond: str) -> None:
    found = _rule_findings(tmp_path, cond)
    assert len(found) == 1 and "is a whole number" in found[0] and "admits none" in found[0]


@pytest.mark.parametrize("cond", ["seqlen: [4096, 5.0e+18]", "batch: [2, 6000000000000000000]",
                                  "seqlen_k: [1.0e+30, 8]"])
def test_a_huge_listed_bucketed_value_is_a_warning_not_a_crash(tmp_path: Path,
                                                                  cond: str) -> None:
    found = _rule_findings(tmp_path, cond)
    assert len(found) == 1 and "never holds" in found[0] and "is seen as" in found[0]


def test_a_listed_fraction_is_said_to_be_no_whole_number(tmp_path: Path) -> None:
    found = _rule_findings(tmp_path, "seqlen: [1.5, 4096]")
    assert len(found) == 1 and "value 1.5 never holds: seqlen is a whole number" in found[0]
    assert "a call of 1.5" not in found[0]
    # a whole value that is not a bucket is named before a fraction
    found = _rule_findings(tmp_path, "seqlen: [1.5, 3000, 4096]")
    assert len(found) == 1 and "a call of 3000 is seen as 4096" in found[0]


@pytest.mark.parametrize("cond", ["seqlen: {ge: 4096, le: 4096}", "seqlen: {gt: 4096, le: 8192}",
                                  "batch: {lt: 1}", "batch: {le: 0}", "batch: [0]",
                                  "batch: [1]", "batch: {gt: 0}", "seqlen_q: {le: 1}",
                                  "seqlen: {ge: 4096.0}", "head_dim: [96]",
                                  "num_q_heads: [24]", "gqa_ratio: {gt: 4, lt: 8}",
                                  "world_size: {gt: 4, lt: 8}"])
def test_bucketed_lint_stays_quiet_on_powers_of_two_and_unbucketed_keys(
        tmp_path: Path, cond: str) -> None:
    assert _rule_findings(tmp_path, cond) == []


# -- a callable registered under two names --------------------------------------------------

def test_a_callable_registered_under_two_names_is_the_first_one(tmp_path: Path) -> None:
    """docs/plugins.md: an alias is matched by name only; the callable is the first name."""
    def halve(s, b, h, q, kv):  # type: ignore[no-untyped-def]
        return s * 0.5

    class Variants:
        @hookimpl
        def attnhub_register_variants(self, register: Any) -> None:
            register("halved", score_mod=halve)
            register("halved_alias", score_mod=halve)

    reg = Registry.of()
    reg.add_plugin(Variants(), "rv11b_alias")
    assert set(reg.variants) >= {"halved", "halved_alias"} and reg.variant_of[id(halve)] == \
        "halved"
    p = tmp_path / "p.yaml"
    p.write_text("name: t\nrules:\n"
                 "  - {name: alias, when: {variant: [halved_alias]}, use: [reference]}\n"
                 "  - {name: first, when: {variant: [halved]}, use: [reference]}\n"
                 "  - {name: rest, use: [reference]}\n")
    hub = attnhub.Hub(policy=p, hardware="cpu", registry=reg)
    q = torch.randn(1, 4, 2, 8)
    for mod, rule in ((halve, "first"), ("halved_alias", "alias"), ("halved", "first")):
        hub.attention(q, q, q, score_mod=mod)
        assert hub.bound()[-1].decision.rule == rule
