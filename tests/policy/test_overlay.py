"""``extends:`` overlay semantics and the packaged-policy lookup."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnhub.errors import PolicyError
from attnhub.policy import load_policy, policies_dir

BASE = """
    name: base
    version: 3
    targets: [cpu, sm90]
    defaults: {on_failure: error}
    rules:
      - {name: a, when: {phase: decode}, use: [torch_sdpa]}
      - {name: b, when: {hardware: cpu}, use: [reference]}
      - {name: c, use: [torch_sdpa, reference]}
    """


def names(policy) -> list[str]:
    return [lr.rule.name for lr in policy.rules]


def test_overlay_replaces_inserts_removes(write):
    base = write("base.yaml", BASE)
    top = write("top.yaml", """
        name: deploy
        extends: base.yaml
        remove: [b]
        rules:
          - {name: new1, when: {phase: train}, use: [reference]}
          - {name: c, use: [reference]}
          - {name: after-a, after: a, use: [torch_sdpa]}
          - {name: new2, use: [torch_sdpa]}
          - {name: before-c, before: c, use: [reference]}
        """)
    p = load_policy(top)
    assert p.name == "deploy" and p.data.version == 1
    # new rules without placement go first (file order), a replaced rule keeps its place,
    # before/after put rules next to the named one, removed rules are gone
    assert names(p) == ["new1", "new2", "a", "after-a", "before-c", "c"]
    where = {lr.rule.name: lr.location for lr in p.rules}
    assert where["a"] == f"{base}:6" and where["c"] == f"{top}:6"
    assert p.rules[-1].rule.use.order == ["reference"]
    assert p.targets == ("cpu", "sm90")  # inherited
    assert p.data.defaults.on_failure == "error"  # inherited key by key
    assert p.data.files == (str(base), str(top))


def test_overlay_overrides_header_and_defaults(write):
    write("base.yaml", BASE)
    top = write("top.yaml", """
        name: deploy
        extends: base.yaml
        targets: [sm80]
        defaults: {on_failure: next}
        """)
    p = load_policy(top)
    assert p.targets == ("sm80",) and p.data.defaults.on_failure == "next"
    assert names(p) == ["a", "b", "c"]


def test_overlay_reference_errors_are_located(write):
    write("base.yaml", BASE)
    top = write("top.yaml", """
        name: deploy
        extends: base.yaml
        remove: [zz]
        rules:
          - {name: x, before: nope, use: [reference]}
        """)
    with pytest.raises(PolicyError) as info:
        load_policy(top)
    assert info.value.problems == [
        f"{top}:3:10 remove[0]: no rule named 'zz' in the policy it extends, expected one of: "
        "a, b, c",
        f"{top}:5:23 rules[0].before: no rule named 'nope' in the policy it extends, expected "
        "one of: a, b, c"]


def test_errors_of_every_file_in_the_chain(write):
    base = write("base.yaml", "name: base\nrules:\n  - {name: a, use: [x], on_failure: maybe}\n")
    top = write("top.yaml", "name: top\nextends: base.yaml\nrules:\n  - {name: b, use: 3}\n")
    with pytest.raises(PolicyError) as info:
        load_policy(top)
    assert [p.split(" ", 1)[0] for p in info.value.problems] == [f"{top}:4:20", f"{base}:3:37"]


def test_cycle_is_reported(write):
    a = write("a.yaml", "name: a\nextends: b.yaml\n")
    write("b.yaml", "name: b\nextends: a.yaml\n")
    with pytest.raises(PolicyError, match=r"b.yaml:2:10 extends: extends forms a cycle"):
        load_policy(a)


def test_packaged_default_and_names(write, monkeypatch):
    d = policies_dir()
    assert (d / "default.yaml").is_file()
    assert load_policy(None).name == "default"
    assert load_policy("portable").name == "portable"
    top = write("top.yaml", "name: mine\nextends: default\nrules:\n"
                            "  - {name: cpu, use: [reference]}\n")
    p = load_policy(top)
    assert p.data.files[0].endswith("default.yaml") and "cpu" in names(p)
    monkeypatch.setenv("ATTNHUB_POLICY", str(top))
    assert load_policy(None).name == "mine"


def test_wheel_layout_lookup(tmp_path, monkeypatch):
    """In a wheel install the policies live in <prefix>/share/attnhub/policies."""
    import attnhub.policy.loader as loader

    share = tmp_path / "share" / "attnhub" / "policies"
    share.mkdir(parents=True)
    (share / "default.yaml").write_text("name: from-wheel\nrules: []\n")
    monkeypatch.setattr(loader, "__file__", str(tmp_path / "site" / "attnhub" / "policy" / "x.py"))
    monkeypatch.setattr(loader.sys, "prefix", str(tmp_path))
    assert loader.policies_dir() == share
    assert load_policy(None).name == "from-wheel"


def test_every_shipped_policy_loads():
    shipped = sorted(Path(policies_dir()).glob("*.yaml"))
    assert {p.stem for p in shipped} >= {"default", "h100-training", "a100-training",
                                         "serving-decode", "portable", "hybrid-model"}
    for p in shipped:
        assert load_policy(p).rules
