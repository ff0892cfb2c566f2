"""Broken and hostile plugins, sixth round: a failed candidate's edits to the call's
parameters, an output outside the graph, one buffer returned for every call, writes into
the FP8 descales, a name that changes, SystemExit from a kernel library, state a plugin
leaves (loggers, autocast, torch modes, Python's generators), overlays that move their own
targets, and a lockfile written over the profile store. Each gave a wrong answer, went
unseen, or lost data."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import attnhub
import attnhub.core.process_state as process_state
from attnhub.cli import main
from attnhub.core.registry import Registry
from attnhub.errors import PolicyError
from attnhub.plugin import AttentionOutput, Backend, BackendUnavailableError, Capabilities
from attnhub.policy import load_policy

CPU32 = Capabilities(vendors=frozenset({"cpu"}), dtypes=frozenset({"fp32"}), gqa=True,
                     backward=True)


def _sdpa(q, k, v, scale=None):  # type: ignore[no-untyped-def]
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), scale=scale,
                                          enable_gqa=True).transpose(1, 2).contiguous()


class Exact(Backend):
    name, plugin = "exact6", "adv6"
    capabilities = CPU32

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        return AttentionOutput(_sdpa(q, k, v, params.scale))


def _hub(first: Backend, tmp_path: Path) -> attnhub.Hub:
    """``first``, then torch_sdpa, falling back at run time."""
    policy = tmp_path / "p.yaml"
    policy.write_text(f"name: t\nrules:\n  - {{name: only, use: [{first.name}, torch_sdpa], "
                      "on_failure: next}\n")
    return attnhub.Hub(policy=policy, hardware="cpu", registry=Registry.of(first, plugin="adv6"))


def _qkv(seed: int = 0, grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 5, h, 8, generator=g).requires_grad_(grad) for h in (4, 2, 2))


@pytest.mark.parametrize("edit", [{"scale": 1.0}, {"causal": False}, {"window": (0, 0)}])
@pytest.mark.parametrize("fails_on", [0, 1])
def test_a_failed_candidates_edits_to_params_do_not_reach_the_fallback(
        edit: dict, fails_on: int, tmp_path: Path) -> None:
    """One params object went to every candidate: a backend that changed a field and then
    failed (on the slow lane or the hot path) left the fallback computing another attention
    (1.32 off with scale 1.0)."""

    class Edits(Exact):
        name, calls = "edits", 0

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
            type(self).calls += 1
            for key, value in edit.items():
                setattr(params, key, value)
            if type(self).calls > fails_on:
                raise BackendUnavailableError(self.name, ["not this shape after all"])
            return AttentionOutput(_sdpa(q, k, v))

    hub = _hub(Edits(), tmp_path)
    q, k, v = _qkv()
    want = attnhub.Hub(hardware="cpu").attention(q, k, v, causal=True, scale=0.3)
    for _ in range(3):
        got = hub.attention(q, k, v, causal=True, scale=0.3)
        if Edits.calls > fails_on:
            torch.testing.assert_close(got, want)


def test_a_leaf_output_with_requires_grad_is_out_of_the_graph(tmp_path: Path) -> None:
    """``requires_grad_()`` on a detached result passed the graph check: backward left
    q, k and v without gradients, with no error."""

    class Leafy(Exact):
        name = "leafy"

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
            with torch.no_grad():
                out = _sdpa(q, k, v, params.scale)
            return AttentionOutput(out.requires_grad_(q.requires_grad))

    hub = _hub(Leafy(), tmp_path)
    for _ in range(3):
        q, k, v = _qkv(grad=True)
        hub.attention(q, k, v).sum().backward()
        assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q, k, v))
    assert hub.fallback_counts[("leafy", "torch_sdpa")] == 3


def test_one_buffer_returned_for_every_call_is_caught(tmp_path: Path) -> None:
    """A static output buffer (CUDA-graph style) rewrote every result the caller held;
    the second call now finds it in the first's memory and the binding moves on."""

    class Static(Exact):
        name, buf = "static", None

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
            out = _sdpa(q, k, v, params.scale)
            if Static.buf is None:
                Static.buf = torch.empty_like(out)
            return AttentionOutput(Static.buf.copy_(out))

    hub, ref = _hub(Static(), tmp_path), attnhub.Hub(hardware="cpu")
    held = []
    for seed in range(4):
        q, k, v = _qkv(seed)
        held.append((hub.attention(q, k, v), ref.attention(q, k, v)))
    for got, want in held[1:]:
        torch.testing.assert_close(got, want)
    assert hub.fallback_counts[("static", "torch_sdpa")] >= 1


def test_writes_into_the_fp8_descales_are_caught(tmp_path: Path) -> None:
    class Scales(Exact):
        name = "scales"
        capabilities = Capabilities(vendors=frozenset({"cpu"}), dtypes=frozenset({"fp32"}),
                                    kv_dtypes=frozenset({"fp8_e4m3"}), gqa=True)

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
            params.extra["k_descale"].mul_(2)
            return AttentionOutput(_sdpa(q, k.float(), v.float()))

    hub = _hub(Scales(), tmp_path)
    q, k, v = _qkv()
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    kd, vd = torch.ones(1), torch.ones(1)
    with pytest.raises(attnhub.errors.OutputContractError, match="extra\\['k_descale'\\]"):
        hub.attention(q, k8, v8, extra={"k_descale": kd, "v_descale": vd})


def test_a_name_that_changes_between_reads_is_refused() -> None:
    class Shifty(Exact):
        _names = itertools.chain(["shifty", "shifty"], itertools.repeat("torch_sdpa"))
        name = property(lambda self: next(self._names))  # type: ignore[assignment]

    reg = Registry.of(Shifty(), plugin="adv6")
    assert reg.get("torch_sdpa").plugin == "core"
    assert any("computes its name" in e for _, e in reg.errors())


def test_system_exit_from_a_kernel_library_falls_back(tmp_path: Path) -> None:
    class Fatal(Exact):
        name, calls = "fatal", 0

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
            type(self).calls += 1
            if type(self).calls > 1:
                raise SystemExit("kernel library aborted")
            return AttentionOutput(_sdpa(q, k, v, params.scale))

    hub = _hub(Fatal(), tmp_path)
    q, k, v = _qkv()
    for _ in range(4):
        torch.testing.assert_close(hub.attention(q, k, v), _sdpa(q, k, v))
    assert hub.fallback_counts[("fatal", "torch_sdpa")] >= 1


@pytest.mark.parametrize("change", ["filter", "propagate", "autocast", "mode"])
def test_process_state_a_plugin_leaves_is_put_back(change: str) -> None:
    log = logging.getLogger("attnhub")
    before = process_state.snapshot()
    mode = _PassThrough()
    if change == "filter":
        log.addFilter(lambda record: False)
    elif change == "propagate":
        log.propagate = False
    elif change == "autocast":
        torch.set_autocast_enabled("cpu", True)
    else:
        mode.__enter__()
    changed = process_state.restore(before)
    assert changed, change
    assert not log.filters and log.propagate and not torch.is_autocast_enabled("cpu")
    assert torch._C._len_torch_function_stack() == 0
    assert process_state.snapshot()[0] == before[0]


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _overlay(tmp_path: Path, rules: str) -> list[str]:
    (tmp_path / "base.yaml").write_text(
        "name: b\nrules:\n  - {name: x, when: {phase: decode}, use: [reference]}\n"
        "  - {name: y, when: {phase: prefill}, use: [reference]}\n"
        "  - {name: z, use: [torch_sdpa]}\n")
    (tmp_path / "o.yaml").write_text("name: o\nextends: base.yaml\nrules:\n" + rules)
    return [r.rule.name for r in load_policy(tmp_path / "o.yaml").rules]


@pytest.mark.parametrize("rules", [
    "  - {name: A, before: y, use: [torch_sdpa]}\n  - {name: y, before: x, use: [reference]}\n",
    "  - {name: y, before: x, use: [reference]}\n  - {name: A, before: y, use: [torch_sdpa]}\n",
])
def test_a_placement_follows_a_rule_the_same_overlay_moves(tmp_path: Path, rules: str) -> None:
    """A ``before: y`` stayed at y's old place when the overlay moved y (A ended after y,
    so y decided), or was refused with "no rule named 'y'" when y was listed first."""
    assert _overlay(tmp_path, rules) == ["A", "y", "x", "z"]


@pytest.mark.parametrize("rules, needle", [
    ("  - {name: r, before: r, use: [torch_sdpa]}\n", "relative to itself"),
    ("  - {name: P, before: Q, use: [torch_sdpa]}\n  - {name: Q, before: P, use: [reference]}\n",
     "(a cycle)"),
])
def test_placements_that_cannot_be_kept_are_named(tmp_path: Path, rules: str,
                                                  needle: str) -> None:
    with pytest.raises(PolicyError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        _overlay(tmp_path, rules)


def test_a_folder_named_like_a_packaged_policy_does_not_hide_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()
    (tmp_path / "mine.yaml").write_text("name: m\nextends: default\nrules: []\n")
    assert load_policy("mine.yaml").name == "m"
    assert load_policy("default").name == "default"


def test_lock_does_not_write_over_the_profile_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "profile.json"
    store.write_text('{"kept": true}')
    monkeypatch.setenv("ATTNHUB_PROFILE", str(store))
    assert main(["lock", "--hardware", "cpu", "-o", str(store)]) == 1
    assert "is the profile store" in capsys.readouterr().err
    assert store.read_text() == '{"kept": true}'


@pytest.mark.parametrize("kw, needle", [
    (dict(min_capability=(9, 0), max_capability=(8, 0)), "no device has both"),
    (dict(head_dim_multiple=512, max_head_dim=256), "no head dim is both"),
    (dict(vendors=frozenset({"cpu"}), archs=frozenset({"sm90"})), "of no vendor"),
    (dict(phases=frozenset({"train"})), "a training call needs gradients"),
])
def test_declarations_that_serve_nothing_are_refused(kw: dict, needle: str) -> None:
    with pytest.raises(TypeError, match=needle):
        Capabilities(**kw)


@pytest.mark.parametrize("host", ["autocast", "inference_mode"])
def test_plugins_loaded_inside_a_host_context_are_not_blamed(host: str) -> None:
    """Plugins import in a worker thread, whose autocast, inference mode and torch mode
    stacks are its own: compared with the host's, every plugin was blamed for them."""
    q = torch.randn(1, 4, 2, 8)
    ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if host == "autocast"
           else torch.inference_mode())
    with ctx:
        registry = Registry.load()
        hub = attnhub.Hub(hardware="cpu", registry=registry)
        hub.attention(q, q, q)
    assert not [e for _, e in registry.errors() if "process-wide" in e], registry.errors()
