"""Policies, stores, locks and the call boundary, fifth round: what a hostile or careless
file or argument did. Each was accepted silently (a rule that can never match, a key that
is not the language's, a duplicate key where the last one won) or crashed with a raw
traceback (a profile pack's device entry, a lockfile string, a numpy window, a list
layout); and two accuracy misses the FA rule found on the CPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import attnhub
from attnhub.core.reference import reference_attention
from attnhub.core.registry import Registry
from attnhub.core.spec import AttentionSpec, AttnParams
from attnhub.errors import ArgumentError, LayoutError, PolicyError
from attnhub.policy import load_policy
from attnhub.policy.lint import lint_policy
from attnhub.policy.lock import LockfileError, read_lock
from attnhub.policy.profile import ProfileStore
from attnhub.testing import fa_rule_error

REPO = Path(__file__).resolve().parents[1]


def _policy(tmp_path: Path, when: str) -> Path:
    p = tmp_path / "p.yaml"
    p.write_text(textwrap.dedent(f"""\
        name: p
        rules:
          - name: r
            when: {when}
            use: [torch_sdpa]
          - name: rest
            use: [torch_sdpa]
        """))
    return p


@pytest.mark.parametrize("when, error", [
    ("{layer: {}}", "empty layer selector"), ("{profile: {}}", "empty profile condition"),
    ("{head_dim: {in_: [64]}}", "unknown key 'in_'")])
def test_empty_selectors_and_python_names_are_refused(tmp_path: Path, when: str,
                                                       error: str) -> None:
    """``layer: {}`` matched every layer and let an approximate backend bind on all;
    ``in_`` (the model's Python name) passed as ``in``."""
    with pytest.raises(PolicyError, match=error):
        load_policy(_policy(tmp_path, when))


NEVER = {
    "{head_dim: {lt: 1}}": "whole number >= 1",
    "{head_dim: {gt: 64, lt: 65}}": "admits none",
    "{world_size: {lt: 1}}": "whole number >= 1",
    "{hardware: sm90, capability: {ge: 90}}": "compute capability 9.0",
    "{hardware: sm80, capability: {ge: 9.0}}": "compute capability 8.0",
    "{capability: {ge: 90}}": "major.minor",
    "{seqlen_q: {ge: 4096}, seqlen: {le: 1024}}": "the longer of seqlen_q and seqlen_k",
    "{layer: {index: 5, every: 4, offset: [0]}}": "none of the layers",
}
FINE = ["{hardware: sm90, capability: {ge: 9.0}}", "{layer: {index: [4, 5], every: 4}}",
        "{head_dim: {gt: 63, lt: 65}}", "{seqlen_q: {ge: 512}, seqlen: {le: 1024}}"]


@pytest.mark.parametrize("when", [*NEVER, *FINE])
def test_lint_names_rules_no_call_can_match(tmp_path: Path, when: str) -> None:
    """These passed ``attnhub policy check`` with no warning."""
    got = [f.message for f in lint_policy(load_policy(_policy(tmp_path, when)),
                                          Registry.load(allow=[]), ("cpu",))
           if "can never match" in f.message]
    if when in NEVER:
        assert len(got) == 1 and NEVER[when] in got[0], got
    else:
        assert not got, got


def test_a_profile_packs_device_entry_of_the_wrong_type_is_located(tmp_path: Path) -> None:
    packs = tmp_path / "packs"
    packs.mkdir()
    store = ProfileStore(tmp_path / "store.json", packs=str(packs))
    dev = attnhub.Hub(hardware="h100").device
    spec = AttentionSpec(phase="decode")
    for device, where in (('"NVIDIA H100"', "devices['x'].device"),
                          ('{"name": "a", "versions": ["torch"]}', ".device.versions"),
                          ('{"name": 5}', ".device.name")):
        (packs / "p.json").write_text(
            f'{{"schema": "attnhub.profile/1", "devices": {{"x": {{"device": {device}}}}}}}')
        with pytest.raises(PolicyError, match=rf"p.json: .*{re.escape(where)}"):
            store.ranking(dev, spec, ["a", "b"])
        (packs / "p.json").unlink()


def test_a_duplicate_key_in_a_profile_store_is_refused(tmp_path: Path) -> None:
    """``"passed": false, ..., "passed": true`` read as a passing accuracy record."""
    path = tmp_path / "store.json"
    path.write_text('{"schema": "attnhub.profile/1", "devices": {}, "devices": {}}')
    with pytest.raises(PolicyError, match="duplicate key 'devices'"):
        ProfileStore(path, packs="off").accuracy(attnhub.Hub(hardware="cpu").device, "*", "x")


@pytest.mark.parametrize("field, text", [("versions.torch", "2.0\ud800"),
                                         ("policy.name", "x\x1b[31mred"),
                                         ("versions.torch", "2.0\u202eevil")])
def test_lockfile_strings_a_terminal_would_print_raw_are_refused(
        tmp_path: Path, field: str, text: str) -> None:
    """A lone surrogate made ``attnhub lock --check`` die with UnicodeEncodeError; escape
    sequences and bidi overrides were printed raw."""
    lock = tmp_path / "a.lock"
    subprocess.run([sys.executable, "-m", "attnhub", "lock", "--hardware", "cpu", "-o",
                    str(lock)], check=True, capture_output=True, cwd=tmp_path)
    data = json.loads(lock.read_text())
    section, key = field.split(".")
    data[section][key] = text
    lock.write_text(json.dumps(data))
    with pytest.raises(LockfileError, match=rf"\$\.{section}\.{key}: holds"):
        read_lock(lock)
    run = subprocess.run([sys.executable, "-m", "attnhub", "lock", "--check", str(lock)],
                         capture_output=True, cwd=tmp_path)
    assert run.returncode == 3 and b"Traceback" not in run.stderr, run.stderr[-800:]
    assert b"\x1b" not in run.stderr and "\u202e".encode() not in run.stderr


def test_a_numpy_window_leaves_the_hot_path_usable() -> None:
    """``window=np.int64(2)`` put a key in the table that compared with a tuple window as a
    numpy array: every later tuple-window call raised numpy's ValueError."""
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    hub = attnhub.Hub(hardware="cpu")
    first = hub.attention(q, k, v, window=np.int64(2))
    for window in ((2, 2), np.int64(2), 2, (np.int64(2), 2)):
        torch.testing.assert_close(hub.attention(q, k, v, window=window), first)


@pytest.mark.parametrize("kw, error", [({"layout": ["bshd"]}, LayoutError),
                                       ({"context": "decoder"}, ArgumentError),
                                       ({"context": {"model": "m"}}, ArgumentError)])
def test_layout_and_context_of_another_type_are_named(kw: dict, error: type) -> None:
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(error, match=next(iter(kw))):
        attnhub.Hub(hardware="cpu").attention(q, q, q, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", [None, "torch_sdpa", "torch_flash_cpu"])
def test_half_precision_cpu_gradients_meet_the_rule_on_peaked_softmax(
        backend: str | None, dtype: torch.dtype) -> None:
    """Scale 1, D=64, five keys: the softmax is nearly one-hot. torch's CPU flash backward
    in fp16/bf16 gave dq/dk up to 9.7x the FlashAttention bound (6 of 40 seeds in bf16);
    the policy's CPU default and ``torch_flash_cpu`` now stay within it."""
    hub = attnhub.Hub(hardware="cpu")
    p = AttnParams(scale=1.0)
    worst = 0.0
    for seed in range(24):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, n, 1, 64, generator=g).to(dtype).requires_grad_()
                   for n in (1, 5, 5))
        out = hub.attention(q, k, v, scale=1.0, backend=backend)
        dout = torch.randn(out.shape, generator=g).to(dtype)
        ref64 = reference_attention(q, k, v, p)[0]
        same = reference_attention(q, k, v, p, compute_dtype=dtype)[0]
        grads = [torch.autograd.grad(o, (q, k, v), d) for o, d in
                 ((out, dout), (ref64, dout.double()), (same, dout))]
        worst = max(worst, *(e / a for e, a in (fa_rule_error(x, y, z, mult=3.0)
                                                for x, y, z in zip(*grads))))
    assert worst <= 1.0, worst


def test_flex_returns_an_fp32_lse_within_the_rule_with_a_score_mod() -> None:
    """With softcap (or ALiBi) in bf16, flex returned its LSE in bf16 (the hub refused the
    result), at twice the same-precision reference's error."""
    q, k, v = (2 * torch.randn(2, 48, 4, 32, dtype=torch.bfloat16) for _ in range(3))
    out, lse = attnhub.Hub(hardware="cpu").attention(q, k, v, backend="flex",
                                                     return_lse=True, softcap=5.0)
    p = AttnParams(scale=32 ** -0.5, softcap=5.0)
    _, l64 = reference_attention(q, k, v, p)
    _, same = reference_attention(q, k, v, p, compute_dtype=torch.bfloat16)
    assert lse.dtype == torch.float32
    err = float((lse - l64).abs().max())
    assert err <= 2 * float((same.float() - l64).abs().max()) + 1e-3, err


def test_a_write_sweeps_temporary_files_a_killed_writer_left(tmp_path: Path) -> None:
    """Each SIGKILL between a store write's create and rename left a truncated
    ``.store.json.*.tmp`` behind, forever; the next write removes those older than a live
    write could be, and leaves a fresh one (another process's write in progress) alone."""
    import os
    import time

    from attnhub.policy.profile import STALE_TMP_S, write_json_atomic

    store = tmp_path / "store.json"
    dead, live = tmp_path / ".store.json.dead1.tmp", tmp_path / ".store.json.live1.tmp"
    other = tmp_path / ".other.json.dead2.tmp"
    for p in (dead, live, other):
        p.write_text('{"schema": "attnh')
    old = time.time() - 2 * STALE_TMP_S
    os.utime(dead, (old, old))
    os.utime(other, (old, old))
    write_json_atomic(store, {"ok": True})
    assert json.loads(store.read_text()) == {"ok": True}
    assert not dead.exists() and live.exists() and other.exists()


@pytest.mark.parametrize("kinds", ["[softmax]", "[softmax, gla]"])
def test_a_softmax_kind_selector_does_not_open_approximate_backends(
        tmp_path: Path, kinds: str) -> None:
    """Every call made without a layer context has kind softmax: a rule selecting that kind
    bound ``lsh`` (relative error 0.92) to plain ``attnhub.attention`` calls."""
    p = tmp_path / "p.yaml"
    p.write_text(f"name: p\nextends: default\nrules:\n  - name: by-kind\n"
                 f"    when: {{layer: {{kind: {kinds}}}}}\n    use: [lsh, torch_sdpa]\n")
    hub = attnhub.Hub(policy=str(p), hardware="cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 32, generator=g) for _ in range(3))
    out = hub.attention(q, k, v, causal=True)
    ref, _ = reference_attention(q, k, v, AttnParams(scale=32 ** -0.5, causal=True))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    d = hub.decide(AttentionSpec(dtype="fp32", head_dim=32, num_q_heads=2, num_kv_heads=2,
                                 mask=attnhub.MaskSpec(causal=True), max_seqlen_q=64,
                                 max_seqlen_k=64))
    (why,) = [r.reasons for r in d.rejected if r.backend == "lsh"]
    assert "kinds other than softmax" in " ".join(why)
    errors = [f for f in lint_policy(load_policy(p), Registry.load(), ("cpu",))
              if f.level == "error" and "lsh is approximate" in f.message]
    assert errors, "lint must flag the rule"
