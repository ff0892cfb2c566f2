"""Golden located error messages: every kind of bad policy, all problems at once."""

from __future__ import annotations

import pytest

from attnhub.core.registry import Registry
from attnhub.errors import PolicyError
from attnhub.policy import load_policy
from attnhub.policy.lint import lint_policy


def problems(path) -> list[str]:
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert str(info.value) == "\n".join(info.value.problems)
    return [p.replace(f"{path}", "F") for p in info.value.problems]


def test_unknown_key(write):
    p = write("p.yaml", """
        name: bad
        rules:
          - name: r1
            when: {hardwre: sm90}
            use: [torch_sdpa]
        """)
    assert problems(p) == [
        "F:4:12 rules[0].when.hardwre: unknown key 'hardwre', expected one of: batch, "
        "capability, deterministic, device_name, dropout, dtype, gqa_ratio, hardware, head_dim, "
        "head_dim_v, kv_dtype, layer, layout, mask, mask_any, model, needs_grad, num_kv_heads, "
        "num_q_heads, phase, profile, return_lse, seqlen, seqlen_k, seqlen_q, variant, "
        "world_size (did you mean 'hardware'?)"]


def test_wrong_types_and_bad_enums_all_at_once(write):
    p = write("p.yaml", """
        name: bad
        rules:
          - name: r1
            when:
              head_dim: [64, big]
              needs_grad: sometimes
              hardware: h100
            use: torch_sdpa
            on_failure: retry
          - name: r2
            when: {phase: trian, seqlen: {ge: 1024, over: 3}}
            use: {fastest: []}
        """)
    assert problems(p) == [
        "F:5:22 rules[0].when.head_dim[1]: got 'big', expected a valid number, unable to parse "
        "string as a number",
        "F:6:19 rules[0].when.needs_grad: got 'sometimes', expected a valid boolean, unable to "
        "interpret input",
        "F:7:17 rules[0].when.hardware: got 'h100', expected an arch (cpu, gfx1100, gfx1201, "
        "gfx90a, gfx942, gfx950, sm100, sm120, sm75, sm80, sm86, sm89, sm90, any smNN or gfxNNN) "
        "or a vendor (cpu, cuda, rocm); 'h100' is a device model: write 'sm90' (every sm90 "
        "device), or match the model with device_name: '*H100*'",
        "F:9:17 rules[0].on_failure: got 'retry', expected 'next' or 'error'",
        "F:11:19 rules[1].when.phase: got 'trian', expected 'train', 'prefill' or 'decode'",
        "F:11:45 rules[1].when.seqlen.over: unknown key 'over', expected one of: ge, gt, in, le, "
        "lt",
        "F:12:20 rules[1].use.fastest: got an empty list, expected at least 1 item(s)"]


def test_duplicate_keys_and_rule_names(write):
    p = write("p.yaml", """
        name: bad
        rules:
          - name: r1
            when:
              phase: train
              dtype: bf16
              phase: decode
            use: [torch_sdpa]
          - name: r1
            use: [reference]
        """)
    assert problems(p) == [
        "F:7:7 rules[0].when.phase: duplicate key 'phase' (first at line 5), expected each key "
        "once",
        "F:9:11 rules[1].name: duplicate rule name 'r1' (first at rules[0]), expected unique "
        "names"]


def test_missing_keys(write):
    p = write("p.yaml", """
        rules:
          - when: {phase: train}
        """)
    assert problems(p) == [
        "F:1:1 name: required key is missing, expected `name: ...` here",
        "F:2:5 rules[0].name: required key is missing, expected `name: ...` here",
        "F:2:5 rules[0].use: required key is missing, expected `use: ...` here"]


def test_yaml_syntax(write):
    p = write("p.yaml", """
        name: bad
        rules:
          - name: r1
            when: {phase: [train, prefill}
        """)
    assert problems(p) == [
        "F:4:34 (yaml syntax): while parsing a flow sequence expected ',' or ']', but got '}', "
        "expected valid YAML"]


def test_not_a_mapping_and_unreadable(write, tmp_path):
    assert problems(write("p.yaml", "- a\n- b\n")) == [
        "F:1:1 (document): got list, expected a mapping with name, rules and optional extends, "
        "defaults, targets"]
    missing = tmp_path / "nope.yaml"
    with pytest.raises(PolicyError, match=r"cannot read policy .*nope.yaml \(No such file"):
        load_policy(missing)


def test_semantic_range_and_layer_errors(write):
    p = write("p.yaml", """
        name: bad
        rules:
          - name: r1
            when: {batch: {}, layer: {offset: 1}, world_size: true}
            use: [torch_sdpa]
        """)
    assert problems(p) == [
        "F:4:19 rules[0].when.batch: got an empty range, expected at least one of in, ge, gt, "
        "le, lt",
        "F:4:30 rules[0].when.layer: got offset without every, expected `every: N` with `offset`",
        "F:4:55 rules[0].when.world_size: got True, expected a number, a list of numbers or a "
        "mapping of ge/gt/le/lt bounds"]


def test_placement_outside_overlay(write):
    p = write("p.yaml", """
        name: bad
        remove: [x]
        rules:
          - {name: r1, use: [torch_sdpa], before: r0}
        """)
    assert problems(p) == [
        "F:2:9 remove: got rules to remove in a file without `extends`, expected it only in an "
        "overlay",
        "F:4:43 rules[0].before: got a placement in a file without `extends`, expected it only "
        "in an overlay"]


def test_lint_unknown_backend_name(write):
    p = write("p.yaml", """
        name: typo
        targets: [cpu]
        rules:
          - name: r1
            use: [torch_sdpaa, reference]
        """)
    findings = lint_policy(load_policy(p), Registry.load(allow=[]))
    assert [str(f).replace(str(p), "F") for f in findings] == [
        "F:5:11 rules[0].use[0] (r1): error: unknown backend 'torch_sdpaa', expected one of: "
        "ck_fa, cudnn, fa2, fa2_torch, fa3, fa3_fp8, flashinfer_decode, flashinfer_prefill, "
        "flex, gla, linear, longformer, lsh, reference, retention, ring, sliding_window, "
        "torch_flash_cpu, torch_sdpa, triton, triton_decode, triton_decode_fp8, triton_rocm "
        "(did you mean 'torch_sdpa'?)"]
