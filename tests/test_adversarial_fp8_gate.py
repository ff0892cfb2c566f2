"""Adversarial: the FP8 accuracy gate (a passing record must vouch for the kernel that binds).

Before: the resolver trusted ``passed`` alone, so a record measured by emulation
(``fp8-check --emulate``: the kernel never ran), one for another recipe than the backend
runs, or one whose recorded error is over the backend's error budget (written with a loose
``--budget`` or hand-edited) bound fa3_fp8, as did ``passed=True`` with no error measured at
all, for one bucket or device-wide (``*``); and a bind through the gate left no note saying
which record opted FP8 in.
"""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import pytest

from attnhub.core.registry import Registry
from attnhub.core.spec import AttentionSpec, MaskSpec
from attnhub.hub import Hub
from attnhub.policy.profile import ProfileStore

RNG = random.Random()
RECIPES = ("plain", "smooth_k")


def _hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe: str) -> tuple[Hub, Path]:
    store = tmp_path / "profile.json"
    monkeypatch.setenv("ATTNHUB_PROFILE", str(store))
    monkeypatch.setenv("ATTNHUB_FP8_RECIPE", recipe)
    return Hub(hardware="sm90", registry=Registry.load()), store


def _spec() -> AttentionSpec:
    h = RNG.choice([1, 2, 4, 8])
    s = RNG.randint(16, 8192)
    return AttentionSpec(phase="prefill", dtype="bf16", head_dim=RNG.choice([64, 128]),
                         num_q_heads=h * RNG.choice([1, 2]), num_kv_heads=h,
                         mask=MaskSpec(causal=RNG.random() < 0.5), max_seqlen_q=s,
                         max_seqlen_k=s, batch=RNG.randint(1, 8))


def _provider(hub: Hub) -> str:
    return hub.registry.provider_text(hub.registry.get("fa3_fp8").plugin)


def _record(hub: Hub, store: Path, spec: AttentionSpec | str, rel: float | None,
            reference: str) -> None:
    ProfileStore(store).record_accuracy(
        hub.device, spec, "fa3_fp8", True,
        None if rel is None else {"rel_error": rel, "budget": 10.0}, reference=reference)


@pytest.mark.parametrize("flaw", ["emulated", "other_recipe", "over_budget", "other_version",
                                  "no_error", "no_error_device_wide"])
def test_a_passing_record_that_does_not_vouch_for_the_kernel_does_not_bind_fp8(
        flaw: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = RNG.choice(RECIPES)
    hub, store = _hub(tmp_path, monkeypatch, recipe)
    budget = hub.registry.get("fa3_fp8").capabilities.error_budget
    spec = _spec()
    rel = budget * (1 + RNG.random() * 3) if flaw == "over_budget" else budget * RNG.random()
    checked = [r for r in RECIPES if r != recipe][0] if flaw == "other_recipe" else recipe
    emulated = " (FP8 emulated)" if flaw == "emulated" else ""
    by = _provider(hub)
    if flaw == "other_version":
        by = by.rsplit(" ", 1)[0] + f" 0.{RNG.randint(0, 99)}.{RNG.randint(0, 9)}.dev-old"
    if flaw.startswith("no_error"):  # passed=True from the API, nothing measured
        rel = None
    _record(hub, store, "*" if flaw.endswith("device_wide") else spec, rel,
            f"fp32{emulated}, recipe {checked}, by {by}")
    d = hub.decide(spec)
    assert d.backend != "fa3_fp8", (flaw, d)
    why = " ".join(r for x in d.rejected if x.backend == "fa3_fp8" for r in x.reasons)
    expect = {"emulated": "--emulate", "other_recipe": f"runs recipe {recipe}",
              "over_budget": "over fa3_fp8's error budget",
              "other_version": "is now served by", "no_error": "records no rel_error",
              "no_error_device_wide": "(*) says passed but records no rel_error"}[flaw]
    assert expect in why, why


def test_an_honest_record_binds_fp8_and_says_which_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same gate opens for a kernel-measured record within budget, and the
    decision names the record (explain never binds FP8 silently)."""
    recipe = RNG.choice(RECIPES)
    hub, store = _hub(tmp_path, monkeypatch, recipe)
    budget = hub.registry.get("fa3_fp8").capabilities.error_budget
    spec = _spec()
    rel = budget * RNG.uniform(0.01, 0.99)
    _record(hub, store, spec, rel, f"fp32, recipe {recipe}, by {_provider(hub)}")
    d = hub.decide(spec)
    assert d.backend == "fa3_fp8", d
    note = [n for n in d.notes if "opted in by a passing accuracy record" in n]
    assert note and f"{rel:g}" in note[0], d.notes
    from attnhub.cli.plan import entry  # `plan --json` carries the same note

    assert entry(d)["notes"] == list(d.notes)


def test_fp8_check_emulated_writes_what_the_gate_reads(tmp_path: Path) -> None:
    """The record ``fp8-check --emulate`` writes (on this CPU) is one the gate refuses."""
    from attnhub.cli import main
    from attnhub.core.device import probe
    from attnhub.policy.fp8_gate import record_problems

    store = tmp_path / "s.json"
    d = RNG.choice([8, 16])
    rc = main(["fp8-check", "--emulate", "--shape", f"1,{RNG.randint(8, 24)},2,1,{d}",
               "--magnitudes", "5", "--store", str(store), "--no-progress"])
    assert rc in (0, 1)
    [entry] = json.loads(store.read_text())["devices"].values()
    [bucket] = entry["accuracy"]
    rec = ProfileStore(store).accuracy(probe(), bucket, "fa3_fp8")
    reg = Registry.load()
    backend = reg.get("fa3_fp8")
    assert rec is not None
    problems = record_problems(rec, backend, reg.provider_text(backend.plugin))
    assert any("--emulate" in p for p in problems), problems
    assert not any("served by" in p or "runs recipe" in p for p in problems), problems


@pytest.mark.parametrize("kv", [False, True], ids=["prefill", "kv_cache_decode"])
def test_a_missing_record_names_the_command_that_writes_it(
        kv: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the reason said ``attnhub bench``, which writes no accuracy record. The hint
    must be an ``fp8-check`` command whose record lands in the very bucket that was refused."""
    import re

    import torch

    from attnhub.cli import fp8_check
    from attnhub.policy.profile import bucket_key

    hub, _ = _hub(tmp_path, monkeypatch, RNG.choice(RECIPES))
    spec = _spec()
    if kv:
        spec = AttentionSpec(phase="decode", dtype="bf16", kv_dtype="fp8_e4m3",
                             head_dim=spec.head_dim, num_q_heads=spec.num_q_heads,
                             num_kv_heads=spec.num_kv_heads, layout="paged",
                             mask=MaskSpec(causal=spec.mask.causal), max_seqlen_q=1,
                             max_seqlen_k=spec.max_seqlen_k, batch=spec.batch,
                             page_size=RNG.choice([8, 16, 32, 64]))
    d = hub.decide(spec)
    name = "triton_decode_fp8" if kv else "fa3_fp8"
    [why] = [r for x in d.rejected if x.backend == name for r in x.reasons
             if "requires a passing accuracy record" in r]
    cmd = re.search(r"`attnhub (fp8-check[^`]*)`", why)
    assert cmd is not None and "attnhub bench" not in why, why
    argv = cmd.group(1).split()
    assert argv[argv.index("--backend") + 1] == name and ("--kv" in argv) == kv, argv
    b, s, hq, hkv, hd = fp8_check.parse_shape(argv[argv.index("--shape") + 1])
    x = torch.empty(1).expand
    page = int(argv[argv.index("--page-size") + 1]) if kv else 0
    case = fp8_check.Case("c", "random", 1.0, x(b, s, hq, hd), x(b, s, hkv, hd),
                          x(b, s, hkv, hd), "--causal" in argv, kv=kv, page=page)
    assert bucket_key(fp8_check._spec(case)) == bucket_key(spec)


def test_fp8_check_emulated_on_the_cpu_reports_real_error_figures(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--emulate --no-record`` runs here and its FP8 column is really quantized: finite,
    and above BF16's error on random inputs (an emulation that skipped the cast reads 0)."""
    from attnhub.cli import main

    d = RNG.choice([16, 32])
    m = RNG.uniform(20, 60)
    rc = main(["fp8-check", "--emulate", "--no-record", "--json", "--no-progress",
               "--shape", f"1,{RNG.randint(8, 32)},2,1,{d}", "--magnitudes", f"{m:.1f}",
               "--seed", str(RNG.randrange(1000))])
    out = json.loads(capsys.readouterr().out)
    assert rc in (0, 1) and out["emulated"] is True
    for case in out["cases"]:
        fp8 = [v["rel"] for k, v in case["errors"].items() if k.startswith("fp8 ")]
        assert fp8 and all(0 < e < 1 for e in fp8), case
        if case["kind"] == "random":
            assert min(fp8) > case["errors"]["bf16"]["rel"] > 0, case


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf"), "int"])
def test_descales_that_cannot_scale_are_refused_at_the_hub(bad: object) -> None:
    """A negative, zero, NaN or inf descale (or an integer tensor) beside an e4m3 cache gave
    wrong or NaN scores without a word on triton_decode_fp8; the hub refuses it for every
    backend, naming the key. The cache's own descales pass and answer."""
    import torch

    from attnhub import Hub
    from attnhub.core.kvcache import PagedKVCache
    from attnhub.errors import ArgumentError

    g = torch.Generator().manual_seed(zlib.crc32(repr(bad).encode()))
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8,
                         dtype=torch.float8_e4m3fn)
    s = cache.allocate()
    cache.append(s, [torch.randn(6, 2, 8, generator=g)], [torch.randn(6, 2, 8, generator=g)])
    q = torch.randn(1, 1, 4, 8, generator=g).to(torch.bfloat16)
    hub = Hub(hardware="cpu")

    def call(extra: dict) -> object:
        return hub.attention(q, cache.k_cache(0), cache.v_cache(0), layout="paged",
                             block_table=cache.block_table([s]), seqlens_k=cache.seqlens([s]),
                             extra=extra, backend="triton_decode_fp8")

    good = cache.scales.descales(0)
    assert torch.isfinite(call(good)).all()
    name = RNG.choice(["k_descale", "v_descale"])
    worse = dict(good)
    if bad == "int":
        worse[name] = good[name].to(torch.int32)
    else:
        worse[name] = good[name].clone()
        worse[name][RNG.randrange(4), RNG.randrange(2)] = bad
    with pytest.raises(ArgumentError, match=f"extra\\['{name}'\\]"):
        call(worse)


def test_an_exact_backend_gated_by_a_record_with_an_error_is_judged_not_crashed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule may ask an exact backend (no error budget) for an accuracy record; one that
    carries ``rel_error`` raised ``TypeError`` (a float compared with None) in resolution
    instead of binding it."""
    monkeypatch.setenv("ATTNHUB_PROFILE", str(tmp_path / "profile.json"))
    policy = tmp_path / "p.yaml"
    policy.write_text("name: gate\nversion: 1\nrules:\n  - name: gated\n    use: [torch_sdpa]\n"
                      "    requires: {accuracy: true}\n")
    hub = Hub(policy, hardware="cpu", registry=Registry.load())
    assert hub.registry.get("torch_sdpa").capabilities.error_budget is None
    spec = AttentionSpec(phase="prefill", dtype="fp32", head_dim=64, num_q_heads=4,
                         num_kv_heads=4, mask=MaskSpec(causal=True), max_seqlen_q=128,
                         max_seqlen_k=128, batch=2)
    ProfileStore(tmp_path / "profile.json").record_accuracy(
        hub.device, spec, "torch_sdpa", True, {"rel_error": RNG.uniform(1e-4, 1e-2)})
    d = hub.decide(spec)
    assert d.backend == "torch_sdpa", d
    assert any("opted in by a passing accuracy record" in n for n in d.notes), d.notes
