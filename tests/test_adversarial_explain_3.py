"""Every decision the default policy makes has a reason a user can read, on every simulated
hardware: a sampled grid of cells binds a backend that declares the cell or refuses with
specific reasons; explain's JSON and trace are stable; decisions are the same in two
processes; CPU-runnable cells match the reference; explain refuses what the API refuses, and
says when the bind context asked for something no rule gives."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import re
import subprocess
import sys

import pytest
import torch

from attnhub.cli import main
from attnhub.core.decision import BindContext, Decision
from attnhub.core.device import simulate
from attnhub.core.reference import reference_attention
from attnhub.core.registry import Registry
from attnhub.core.spec import AttentionSpec, AttnParams
from attnhub.hub import Hub
from attnhub.policy import load_policy
from attnhub.policy.cells import mask_from_kinds
from attnhub.policy.profile import ProfileStore

HARDWARE = ("sm80", "sm90", "h100", "h200", "a100", "gfx942", "cpu")
MASKS = (("none",), ("causal",), ("causal", "top_left"), ("sliding_window",),
         ("sliding_window", "causal"), ("alibi",), ("softcap",), ("prefix_lm", "causal"),
         ("column_sparse",), ("document",), ("document", "causal"))
#: What a reason must never look like: empty, None, a Python repr, a traceback, a bare set.
BAD = re.compile(r"^\s*$|\bNone\b|<\w[\w.]* object at|Traceback|File \"|frozenset\(|^\[\]$")


def _cell(rng: random.Random) -> tuple[str, AttentionSpec, BindContext]:
    """One random cell of the grid (phase, dtypes, head dim, GQA, mask, length, batch,
    layout and page size, flags, world size, layer kind)."""
    phase = rng.choice(("prefill", "decode", "train"))
    dtype = rng.choice(("fp32", "bf16", "fp16"))
    kv = "fp8_e4m3" if dtype == "bf16" and phase != "train" and rng.random() < 0.2 else dtype
    kinds = rng.choice(MASKS)
    mask = mask_from_kinds([k for k in kinds if k != "top_left"], rng.choice((16, 1024)))
    if "top_left" in kinds:
        mask = dataclasses.replace(mask, alignment="top_left")
    layout = "thd" if mask.document else rng.choice(("bshd", "bshd", "paged"))
    length = rng.choice((1, 7, 4096, 131072))
    hq, hkv = rng.choice(((32, 32), (32, 8), (8, 1), (6, 2)))
    spec = AttentionSpec(
        phase=phase, dtype=dtype, kv_dtype=kv, head_dim=rng.choice((64, 128, 256, 72, 80)),
        num_q_heads=hq, num_kv_heads=hkv, layout=layout, mask=mask,
        max_seqlen_q=1 if phase == "decode" else length, max_seqlen_k=length,
        batch=rng.choice((1, 3, 64)), needs_grad=phase == "train",
        deterministic=rng.random() < 0.3, return_lse=rng.random() < 0.3,
        page_size=rng.choice((1, 16, 256)) if layout == "paged" else 0).bucketed()
    ctx = BindContext(world_size=rng.choice((1, 1, 2, 8)),
                      layer_kind=rng.choice(("softmax", "softmax", "sliding", "linear")))
    return rng.choice(HARDWARE), spec, ctx


def _assert_readable(d: Decision, where: str, registry: Registry) -> None:
    if d.backend is None:
        assert d.rejected, f"{where}: unbound with no rejection: {d.explain()}"
    else:
        assert d.backend in d.candidates, where
    for r in d.rejected:
        assert r.reasons, f"{where}: {r.backend} rejected without a reason"
        for reason in r.reasons:
            assert isinstance(reason, str) and not BAD.search(reason), \
                f"{where}: unreadable reason for {r.backend}: {reason!r}"
    for n in d.notes:
        assert isinstance(n, str) and not BAD.search(n), f"{where}: unreadable note {n!r}"
    if d.backend is not None:
        device = next(simulate(h) for h in HARDWARE if simulate(h).describe() == d.device)
        bound = registry.backends[d.backend]
        assert bound.check(d.spec, device) == [], \
            f"{where}: bound {d.backend} does not declare {d.spec.describe()}"
        for fb in d.fallbacks:
            assert registry.backends[fb].check(d.spec, device) == [], (where, fb)
    if d.inner is not None:
        _assert_readable(d.inner, where + " (local kernel)", registry)


def test_sampled_grid_binds_or_refuses_with_readable_reasons():
    policy, registry = load_policy(None), Registry.load()
    rng = random.Random(20261204)
    for _ in range(1500):
        hw, spec, ctx = _cell(rng)
        d = policy.resolve(spec, simulate(hw), registry, ctx)
        where = f"{hw} {spec.describe()} ws={ctx.world_size} {ctx.layer_kind}"
        _assert_readable(d, where, registry)
        json.dumps(d.to_json())  # plain JSON: no object reaches explain's str() fallback
        trace = policy.trace(spec, simulate(hw), ctx)
        assert trace[-1][0].rule.name == d.rule and trace[-1][1] is None, where


@pytest.mark.parametrize("hw,dtype,phase,want", [
    ("sm90", "bf16", "train", "fa3"), ("h100", "fp16", "prefill", "fa3"),
    ("h200", "bf16", "prefill", "fa3"), ("sm80", "bf16", "train", "fa2"),
    ("a100", "fp16", "prefill", "fa2"), ("sm90", "fp32", "prefill", "triton"),
    ("sm80", "fp32", "train", "triton"), ("sm100", "bf16", "train", "triton"),
    ("gfx942", "bf16", "train", "ck_fa"), ("gfx942", "fp32", "prefill", "triton_rocm")])
def test_dense_cells_bind_the_documented_backend(hw, dtype, phase, want):
    policy, registry = load_policy(None), Registry.load()
    rng = random.Random(hash((hw, dtype, phase)) & 0xFFFF)
    for mask in (("none",), ("causal",)):
        spec = AttentionSpec(phase=phase, dtype=dtype, head_dim=rng.choice((64, 128)),
                             num_q_heads=32, num_kv_heads=rng.choice((8, 32)),
                             mask=mask_from_kinds(list(mask)), max_seqlen_q=4096,
                             max_seqlen_k=4096, needs_grad=phase == "train").bucketed()
        d = policy.resolve(spec, simulate(hw), registry)
        assert d.backend == want, d.explain()
        assert "fa3_fp8" not in (d.backend, *d.fallbacks), d.explain()


def test_fp8_binds_only_behind_a_passing_accuracy_record(tmp_path):
    registry, dev = Registry.load(), simulate("sm90")
    spec = AttentionSpec(phase="decode", dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128,
                         num_q_heads=32, num_kv_heads=8, max_seqlen_q=1, max_seqlen_k=8192)
    store = ProfileStore(tmp_path / "p.json", packs="off")
    policy = load_policy(None, profile=store)
    d = policy.resolve(spec, dev, registry)
    assert d.backend is None and all("accuracy record" in " ".join(r.reasons)
                                     for r in d.rejected), d.explain()
    store.record_accuracy(dev, spec.bucketed(), "fa3_fp8", False, {"rel_error": 0.2})
    policy.profile = store
    d = policy.resolve(spec, dev, registry)
    assert d.backend is None and "failed: rel_error=0.2" in d.explain(), d.explain()
    store.record_accuracy(dev, spec.bucketed(), "fa3_fp8", True, {"rel_error": 0.004})
    policy.profile = store
    assert policy.resolve(spec, dev, registry).backend == "fa3_fp8"


def _explain_json(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["explain", *argv, "--json", "--trace"])
    return rc, json.loads(capsys.readouterr().out)


def test_explain_json_schema_is_the_same_bound_unbound_and_distributed(capsys):
    docs = [_explain_json(capsys, "--hardware", hw, *extra) for hw, *extra in (
        ("sm90", "--mask", "causal"), ("cpu", "--world-size", "2", "--heads", "8:2"),
        ("gfx942", "--phase", "decode", "--layout", "paged", "--page-size", "1"),
        ("sm80", "--layer-kind", "linear", "--mask", "prefix_lm"))]
    assert [rc for rc, _ in docs] == [0, 0, 0, 1]
    keys = {tuple(sorted(doc)) for _, doc in docs}
    dkeys = {tuple(sorted(doc["decision"])) for _, doc in docs}
    assert len(keys) == 1 and len(dkeys) == 1, (keys, dkeys)
    inner = docs[1][1]["decision"]["inner"]
    assert inner["backend"] == "torch_flash_cpu" and tuple(sorted(inner)) in dkeys
    for _, doc in docs:
        trace = doc["trace"]
        assert trace[-1]["rule"] == doc["decision"]["rule"] and trace[-1]["failed"] is None
        assert all(isinstance(t["failed"], str) and t["failed"] for t in trace[:-1]), trace
        assert len({t["rule"] for t in trace}) == len(trace)


def test_decisions_are_the_same_in_another_process():
    rng = random.Random(7)
    cells = [_cell(rng) for _ in range(60)]
    policy, registry = load_policy(None), Registry.load()
    here = [policy.resolve(s, simulate(hw), registry, c).to_json() for hw, s, c in cells]
    code = ("import json,pickle,sys\nfrom attnhub.policy import load_policy\n"
            "from attnhub.core.registry import Registry\nfrom attnhub.core.device import "
            "simulate\ncells=pickle.loads(sys.stdin.buffer.read())\np,r=load_policy(None),"
            "Registry.load()\nprint(json.dumps([p.resolve(s,simulate(h),r,c).to_json() "
            "for h,s,c in cells]))")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(cells),
                         capture_output=True, check=True, timeout=120).stdout
    assert json.loads(out) == json.loads(json.dumps(here))


@pytest.mark.parametrize("seed", range(12))
def test_cpu_cells_run_and_match_the_reference(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    phase = rng.choice(("prefill", "decode", "train"))
    dtype = rng.choice((torch.float32, torch.bfloat16))
    hq, hkv = rng.choice(((4, 4), (4, 2), (6, 1)))
    d, sk = rng.choice((16, 72, 64)), rng.randint(5, 70)
    sq = rng.randint(1, 4) if phase == "decode" else rng.choice((sk, max(1, sk // 3)))
    causal = rng.random() < 0.6
    kw = dict(causal=causal, causal_alignment=rng.choice(("bottom_right", "top_left")),
              window=(rng.randint(0, 9), 0) if rng.random() < 0.4 else None,
              softcap=20.0 if rng.random() < 0.3 else None,
              alibi_slopes=torch.rand(hq) if rng.random() < 0.3 else None)
    q = torch.randn(2, sq, hq, d, dtype=dtype, requires_grad=phase == "train")
    k, v = (torch.randn(2, sk, hkv, d, dtype=dtype) for _ in range(2))
    hub = Hub()
    out = hub.attention(q, k, v, phase=phase, **kw)
    assert sum(hub.fallback_counts.values()) == 0, hub.fallback_counts
    params = AttnParams(scale=d ** -0.5, causal=causal, alignment=kw["causal_alignment"],
                        window=kw["window"], softcap=kw["softcap"],
                        alibi_slopes=kw["alibi_slopes"])
    ref, _ = reference_attention(q.detach(), k, v, params)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (out.detach().double() - ref.double()).abs().max() <= tol, \
        hub.bound()[-1].decision.explain()


@pytest.mark.parametrize("argv,needle", [
    (["--dtype", "fp8_e4m3"], "for an FP8 KV cache pass --dtype bf16 --kv-dtype fp8_e4m3"),
    (["--dtype", "fp8_e5m2", "--run"], "attention takes fp32, fp16, bf16 queries"),
    (["--kv-dtype", "fp32"], "only an FP8 KV cache may differ"),
    (["--dtype", "fp16", "--kv-dtype", "bf16", "--hardware", "sm90"], "k/v must have"),
    (["--phase", "decode", "--kv-dtype", "fp8_e4m3", "--run"], "no backend can serve"),
    (["--page-size", "256", "--hardware", "sm90"], "read only with --layout paged"),
    (["--mask", "alibi", "--top-left"], "--top-left aligns a causal or sliding-window")])
def test_explain_refuses_calls_the_api_refuses_without_a_traceback(argv, needle, capsys):
    rc = main(["explain", "--seqlen", "24", "--heads", "2:2", "--head-dim", "16", *argv])
    err = capsys.readouterr().err
    assert rc != 0 and needle in err and "Traceback" not in err, err


def test_context_no_rule_reads_is_said_not_ignored():
    policy, registry = load_policy(None), Registry.load()
    spec = AttentionSpec(phase="decode", max_seqlen_q=1, max_seqlen_k=2048, num_kv_heads=8)
    d = policy.resolve(spec, simulate("sm90"), registry,
                       BindContext(layer_kind="slidng", world_size=4))
    text = d.explain()
    assert d.backend == "torch_sdpa", text
    assert "layer kind 'slidng' is selected by no rule" in text and "gla" in text, text
    assert "world_size=4, but torch_sdpa is a single-device kernel" in text, text
    plain = policy.resolve(spec, simulate("sm90"), registry, BindContext())
    assert not any("layer kind" in n or "world_size" in n for n in plain.notes)
    ring = policy.resolve(dataclasses.replace(spec, phase="prefill", max_seqlen_q=2048),
                          simulate("cpu"), registry, BindContext(world_size=2))
    assert ring.backend == "ring" and not any("world_size" in n for n in ring.notes)
