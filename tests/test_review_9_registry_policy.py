"""Review 9: a registry changed under a hub (``add_plugin``) rebinds it; policy ``targets``
and ``version`` are taken as written and bounded; lint names the accuracy metrics it knows;
``explain`` bounds the sizes it is given."""

from __future__ import annotations

import gc
import textwrap
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import attnhub
from attnhub import AttentionOutput, Backend, Capabilities
from attnhub.cli import build_parser, main
from attnhub.core.capabilities import ALL_MASKS
from attnhub.core.registry import Registry
from attnhub.errors import PolicyError
from attnhub.policy import load_policy
from attnhub.policy.lint import lint_policy
from attnhub.testing import plugin_of


class Spy(Backend):
    """Serves any fp32 call on the CPU and counts its calls."""

    tier = "portable"
    capabilities = Capabilities(dtypes=frozenset({"fp32"}), max_head_dim=1024, gqa=True,
                                masks=ALL_MASKS, different_v_dim=True)

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.calls = 0

    def forward(self, q: Any, k: Any, v: Any, spec: Any, params: Any) -> AttentionOutput:
        self.calls += 1
        return AttentionOutput(torch.zeros_like(q), None)




def _write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def late_policy(tmp_path: Path) -> Path:
    return _write(tmp_path, """
        name: late
        rules:
          - {name: any, use: [late, torch_sdpa]}
        """)


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(1, 4, 2, 8)
    return q, q.clone(), q.clone()


# -- 1. a registry changed under a hub ------------------------------------------------------
def test_a_backend_added_after_first_calls_binds_on_the_hot_path(late_policy: Path) -> None:
    reg = Registry.load(entry_points=False, modules=[])
    hub = attnhub.Hub(policy=str(late_policy), hardware="cpu", registry=reg)
    q, k, v = _qkv()
    for _ in range(2):  # the second call takes the exact-key table
        hub.attention(q, k, v)
    assert hub.bound()[-1].decision.backend == "torch_sdpa"
    spec = hub.bound()[-1].decision.spec
    assert hub.decide(spec).backend == "torch_sdpa"
    before = reg.generation
    late = Spy("late")
    reg.add_plugin(plugin_of(late), "lateplugin")
    out = hub.attention(q, k, v)  # same key: used to stay on torch_sdpa for good
    assert late.calls == 1 and not out.any()
    assert hub.decide(spec).backend == "late"  # and explain/decide say so
    assert reg.generation > before


def test_a_plugin_the_deployment_picks_replaces_the_bound_backend() -> None:
    reg = Registry.load(entry_points=False, modules=[])
    hub = attnhub.Hub(policy="portable", hardware="cpu", registry=reg)
    q, k, v = _qkv()
    hub.attention(q, k, v)
    hub.attention(q, k, v)
    assert hub.bound()[-1].decision.backend == "torch_sdpa"
    reg.providers["torch_sdpa"] = "mine"  # the deployment picks a replacement provider
    mine = Spy("torch_sdpa")
    assert reg.add_plugin(plugin_of(mine), "mine").ok
    assert reg.get("torch_sdpa") is mine
    hub.attention(q, k, v)
    assert mine.calls == 1  # not the core's torch_sdpa, bound before


def test_a_name_taken_from_its_plugin_by_a_conflict_stops_serving(late_policy: Path) -> None:
    reg = Registry.load(entry_points=False, modules=[])
    first = Spy("late")
    reg.add_plugin(plugin_of(first), "one")
    hub = attnhub.Hub(policy=str(late_policy), hardware="cpu", registry=reg)
    q, k, v = _qkv()
    hub.attention(q, k, v)
    hub.attention(q, k, v)
    assert first.calls == 2
    reg.add_plugin(plugin_of(Spy("late")), "two")  # neither serves 'late' now
    assert "late" not in reg.backends
    hub.attention(q, k, v)
    assert first.calls == 2
    d = hub.decide(hub.bound()[-1].decision.spec)
    assert d.backend == "torch_sdpa" and "late" in d.missing


def test_the_policy_cache_keys_on_the_generation_not_the_count() -> None:
    """A replacement keeps the number of backends: the policy's own cache served the old
    decision (keyed by ``len(registry.backends)``)."""
    reg = Registry.load(entry_points=False, modules=[])
    policy = load_policy("portable")
    device = attnhub.simulate("cpu")
    spec = attnhub.AttentionSpec(dtype="bf16", num_q_heads=8, num_kv_heads=8)
    assert policy.resolve(spec, device, reg).backend == "torch_sdpa"
    reg.providers["torch_sdpa"] = "fp32only"
    n = len(reg.backends)
    reg.add_plugin(plugin_of(Spy("torch_sdpa")), "fp32only")  # serves no bf16
    assert len(reg.backends) == n
    d = policy.resolve(spec, device, reg)
    assert d.backend != "torch_sdpa"
    assert any(r.backend == "torch_sdpa" for r in d.rejected)


def test_a_hub_checks_the_generation_at_bind_time(late_policy: Path) -> None:
    """A change its listener did not report (another path) is still seen when binding."""
    reg = Registry.load(entry_points=False, modules=[])
    hub = attnhub.Hub(policy=str(late_policy), hardware="cpu", registry=reg)
    spec = attnhub.AttentionSpec(dtype="fp32", num_q_heads=2, num_kv_heads=2, head_dim=8)
    assert hub.decide(spec).backend == "torch_sdpa"
    reg.backends["late"] = Spy("late")  # behind the listeners' back ...
    reg.generation += 1  # ... but a new generation
    assert hub.decide(spec).backend == "late"


def test_a_registry_holds_its_hubs_weakly_and_only_its_own_rebind() -> None:
    reg, other = (Registry.load(entry_points=False, modules=[]) for _ in range(2))
    hub = attnhub.Hub(policy="portable", hardware="cpu", registry=reg)
    hub.registry = other  # the hub left ``reg``: a change there keeps its bindings
    q, k, v = _qkv()
    hub.attention(q, k, v)
    bound = hub.bound()
    reg.add_plugin(plugin_of(Spy("late")), "late")
    assert hub.bound() == bound
    ref = weakref.ref(hub)
    del hub, bound
    gc.collect()
    assert ref() is None
    other.add_plugin(plugin_of(Spy("late")), "late")  # a dead listener is skipped


# -- 2. targets exactly as written ----------------------------------------------------------
@pytest.mark.parametrize("target,fix", [('"cpu\\n"', "'cpu'"), ('" sm90 "', "'sm90'"),
                                        ('"\\th100"', "'h100'"), ('"gfx942\\r\\n"', "'gfx942'")])
def test_a_target_not_written_exactly_is_a_located_error(tmp_path: Path, target: str,
                                                         fix: str) -> None:
    path = _write(tmp_path, f"name: x\ntargets: [sm80, {target}]\nrules: []\n")
    with pytest.raises(PolicyError) as exc:
        load_policy(str(path))
    text = str(exc.value)
    assert f"{path}:2:" in text and "targets[1]:" in text
    assert f"expected a target name exactly: write {fix}" in text


def test_exact_targets_still_load(tmp_path: Path) -> None:
    path = _write(tmp_path, "name: x\ntargets: [cpu, sm90, h100, gfx942, H200]\nrules: []\n")
    assert load_policy(str(path)).targets == ("cpu", "sm90", "h100", "gfx942", "H200")


# -- 3. version bounded ---------------------------------------------------------------------
@pytest.mark.parametrize("version", ["-1", "12345678901234567", "2147483648"])
def test_a_negative_or_absurd_version_is_a_located_error(tmp_path: Path, version: str) -> None:
    path = _write(tmp_path, f"name: x\nversion: {version}\nrules: []\n")
    with pytest.raises(PolicyError) as exc:
        load_policy(str(path))
    assert f"{path}:2:10 version: got {version}, expected a version from 0 to 2147483647" \
        in str(exc.value)


@pytest.mark.parametrize("version", [0, 1, 20250131, 2147483647])
def test_sane_versions_load(tmp_path: Path, version: int) -> None:
    path = _write(tmp_path, f"name: x\nversion: {version}\nrules: []\n")
    assert load_policy(str(path)).data.version == version


# -- 4. lint names the accuracy metrics -----------------------------------------------------
def test_lint_warns_of_an_accuracy_metric_no_record_holds(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        name: x
        rules:
          - name: r
            use: [torch_sdpa]
            requires:
              accuracy:
                max: {rel_eror: 0.1, rel_error: 0.1, max_error_q_channel_x20: 1, budget: 1}
        """)
    found = [f for f in lint_policy(load_policy(str(path)),
                                    Registry.load(entry_points=False, modules=[]), ("cpu",))
             if "metric" in f.message]
    assert len(found) == 1, found
    f = found[0]
    assert f.level == "warning" and f.path == "rules[0].requires.accuracy.max.rel_eror (r)"
    assert f.where == f"{path}:8:15"  # at the key
    assert "unknown metric 'rel_eror'" in f.message and "did you mean 'rel_error'?" in f.message
    for known in ("rel_error", "max_error", "bf16_rel_error", "budget", "q_channel", "k_bias"):
        assert known in f.message


def test_the_metrics_lint_knows_are_the_ones_fp8_check_writes() -> None:
    from attnhub.cli import fp8_check
    from attnhub.policy.fp8_gate import OUTLIER_KINDS, known_metric

    assert fp8_check.OUTLIER_KINDS is OUTLIER_KINDS
    for name in ("rel_error", "max_error", "bf16_rel_error", "budget",
                 "rel_error_q_channel_x5", "max_error_k_bias_x0.5", "rel_error_k_bias_x1e+06"):
        assert known_metric(name), name
    for name in ("rel_eror", "rel_error_q_channel", "rel_error_other_x5", "rel_error\n"):
        assert not known_metric(name), name


# -- 5. explain's sizes bounded --------------------------------------------------------------
@pytest.mark.parametrize("flag,value,says", [
    ("--heads", "99999999999999999999:1", "at most 4096 heads"),
    ("--heads", "8192:8", "at most 4096 heads"),
    ("--head-dim", "99999999999999999999", "must be at most 4096"),
    ("--head-dim-v", "4097", "must be at most 4096"),
    ("--seqlen", "2147483648", "must be at most 2147483647"),
    ("--seqlen-q", "99999999999999999999", "must be at most 2147483647"),
    ("--batch", "1048577", "must be at most 1048576"),
    ("--window", "99999999999999999999", "must be at most 2147483647"),
    ("--page-size", "99999999999999999999", "must be at most 2147483647"),
    ("--layer", "99999999999999999999", "must be at most 2147483647"),
    ("--world-size", "65537", "must be at most 65536"),
])
def test_explain_refuses_sizes_past_any_call(flag: str, value: str, says: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["explain", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and says in err and "Traceback" not in err


def test_explain_takes_sizes_at_the_bounds() -> None:
    args = build_parser().parse_args([
        "explain", "--heads", "4096:8", "--head-dim", "4096", "--seqlen", "2147483647",
        "--batch", "1048576", "--world-size", "65536", "--layer", "2147483647"])
    assert args.heads == (4096, 8) and args.seqlen == 2147483647 and args.batch == 1048576


def test_explain_runs_within_the_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--hardware", "cpu", "--policy", "portable", "--dtype", "fp32",
                 "--heads", "4096:4096", "--seqlen", "2147483647", "--json"]) == 0
    assert '"backend": "torch_sdpa"' in capsys.readouterr().out
