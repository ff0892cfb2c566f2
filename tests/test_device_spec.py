"""Device probe, simulation, spec hashing and capability reasons."""

from __future__ import annotations

import pytest
import torch

import attnhub
import attnhub.plugin
from attnhub.core.capabilities import Capabilities
from attnhub.core.device import probe, simulate
from attnhub.core.spec import AttentionSpec, MaskSpec, bucket


def test_probe_cpu_and_versions():
    dev = probe()
    if not torch.cuda.is_available():
        assert dev.vendor == "cpu" and dev.arch == "cpu" and not dev.simulated
    assert dev.version("torch") == torch.__version__


@pytest.mark.parametrize("hw,vendor,cap", [("sm90", "cuda", (9, 0)), ("h100", "cuda", (9, 0)),
                                           ("sm80", "cuda", (8, 0)), ("gfx942", "rocm", None)])
def test_simulate(hw, vendor, cap):
    dev = simulate(hw)
    assert dev.vendor == vendor and dev.capability == cap and dev.simulated and dev.sm_count > 0


def test_a_model_alias_is_that_model_for_device_name_rules(tmp_path):
    """``h200`` shares sm90's arch but is not an H100: a rule on ``device_name: "*H200*"``
    must match the simulated H200 (it was labelled "NVIDIA H100 80GB HBM3") and not sm90."""
    from attnhub.policy import load_policy

    path = tmp_path / "p.yaml"
    path.write_text("version: 2\nname: t\nrules:\n"
                    "  - {name: h200, when: {device_name: '*H200*'}, use: [reference]}\n"
                    "  - {name: rest, use: [torch_sdpa]}\n")
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_q_heads=2, num_kv_heads=2)
    assert simulate("h200").arch == "sm90" and simulate("h200").memory_gb == 141
    for hw, rule in (("h200", "h200"), ("H200", "h200"), ("sm90", "rest"), ("h100", "rest")):
        d = attnhub.Hub(policy=load_policy(path), hardware=hw).decide(spec)
        assert d.rule == rule, (hw, d.rule)


def test_simulate_unknown_names_the_choices():
    with pytest.raises(ValueError, match="sm90"):
        simulate("tpu-v5")


def test_env_hardware(monkeypatch):
    monkeypatch.setenv("ATTNHUB_HARDWARE", "sm80")
    assert probe().arch == "sm80"


def test_spec_is_hashable_and_bucketed():
    a = AttentionSpec(max_seqlen_q=100, max_seqlen_k=3000, batch=3).bucketed()
    b = AttentionSpec(max_seqlen_q=128, max_seqlen_k=4096, batch=4).bucketed()
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert [bucket(n) for n in (0, 1, 2, 3, 1023, 1024, 1025)] == [0, 1, 2, 4, 1024, 1024, 2048]
    with pytest.raises(Exception):
        a.phase = "decode"  # frozen


def test_mask_kinds():
    assert MaskSpec().kinds == {"none"}
    m = MaskSpec(causal=True, window=(5, 0), softcap=True, score_mod="f")
    assert m.kinds == {"causal", "sliding_window", "softcap", "score_mod"}


def test_capability_reasons_are_readable():
    caps = Capabilities(vendors=frozenset({"cuda"}), min_capability=(9, 0),
                        dtypes=frozenset({"bf16"}), max_head_dim=128,
                        masks=frozenset({"causal"}), phases=frozenset({"prefill"}))
    spec = AttentionSpec(phase="decode", dtype="fp32", head_dim=192,
                         mask=MaskSpec(causal=True, softcap=True), needs_grad=True)
    assert caps.check(spec, simulate("sm80")) == [
        "needs compute capability >= 9.0, this device has 8.0"] + caps.check(
            spec, simulate("sm90"))
    reasons = " | ".join(caps.check(spec, simulate("sm90")))
    for text in ("dtype fp32", "head dim 192", "softcap", "phase decode", "no backward"):
        assert text in reasons
    assert caps.check(spec, simulate("cpu"))[0].startswith("runs on cuda")
    ok = AttentionSpec(phase="prefill", dtype="bf16", head_dim=128, mask=MaskSpec(causal=True))
    assert caps.check(ok, simulate("sm90")) == []


def test_approximate_needs_budget():
    with pytest.raises(ValueError, match="error_budget"):
        Capabilities(exact=False)


def test_forced_backend_raises_with_its_reasons(hub):
    from attnhub.core.backend import AttentionOutput, Backend

    class Tiny(Backend):
        name = "tiny"
        capabilities = Capabilities(max_head_dim=128)

        def forward(self, q, k, v, spec, params):
            return AttentionOutput(q)

    hub.registry.add_plugin(_Plugin(Tiny()), "tiny_plugin")
    q = torch.randn(1, 3, 2, 300)
    with pytest.raises(attnhub.BackendUnavailableError, match="head dim 300 not supported"):
        hub.attention(q, q, q, backend="tiny")


class _Plugin:
    def __init__(self, backend):
        self.backend = backend

    @attnhub.plugin.hookimpl
    def attnhub_register_backends(self, register):
        register(self.backend)


def test_env_forced_backend(monkeypatch):
    monkeypatch.setenv("ATTNHUB_BACKEND", "reference")
    hub = attnhub.Hub(hardware="cpu")
    q = torch.randn(1, 4, 2, 16)
    hub.attention(q, q, q)
    (runner,) = hub.bound()
    assert runner.decision.backend == "reference" and runner.decision.rule == "forced"


def test_forced_backend_set_after_calls_rebinds():
    """Setting ``hub.forced_backend`` after calls: the next call (same shapes, so the
    exact-shape table would match) runs the forced backend, and unsetting it goes back."""
    hub = attnhub.Hub(hardware="cpu")
    q = torch.randn(1, 4, 2, 16)
    hub.attention(q, q, q)
    (first,) = hub.bound()
    assert first.decision.rule != "forced"
    hub.forced_backend = "reference"
    hub.attention(q, q, q)
    (runner,) = hub.bound()
    assert runner.decision.backend == "reference" and runner.decision.rule == "forced"
    hub.forced_backend = None
    hub.attention(q, q, q)
    (runner,) = hub.bound()
    assert runner.decision.rule == first.decision.rule


def test_device_or_registry_set_after_calls_rebinds():
    """Siblings of ``forced_backend``: a hub given another device or registry after calls
    binds the next call (same shapes) anew, under the new one."""
    from attnhub.core.backend import AttentionOutput, Backend
    from attnhub.core.device import DeviceInfo, library_versions
    from attnhub.core.registry import Registry

    hub = attnhub.Hub(hardware="cpu")
    q = torch.randn(1, 4, 2, 16)
    hub.attention(q, q, q)
    other = DeviceInfo(vendor="cpu", arch="cpu", name="Another CPU",
                       versions=library_versions())
    hub.device = other
    hub.attention(q, q, q)
    (runner,) = hub.bound()
    assert runner.decision.device == other.describe()

    class Filler(Backend):  # one name, two plugins: each fills its output with its value
        name = "filler"
        capabilities = Capabilities()

        def __init__(self, value: float):
            super().__init__()
            self.value = value

        def forward(self, q, k, v, spec, params):
            return AttentionOutput(torch.full_like(q, self.value))

    hub.registry = Registry.of(Filler(1.0), plugin="ones")
    assert float(hub.attention(q, q, q, backend="filler").mean()) == 1.0
    hub.registry = Registry.of(Filler(2.0), plugin="twos")
    assert float(hub.attention(q, q, q, backend="filler").mean()) == 2.0
