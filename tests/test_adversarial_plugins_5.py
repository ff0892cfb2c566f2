"""Broken and hostile plugins, fifth round, and the stores and policies they meet: an output
in an input's memory under a storage object of its own, an unhashable backend, a
capabilities property that fails after registration, a ``forward()`` that changes torch's
settings or writes past the version counter, process state beyond the earlier rounds
(logging, torch's generator, torch's own functions). Each crashed the host or went unseen."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch
import torch.nn.functional as F

import attnhub
from attnhub.core.outputs import shared_memory
from attnhub.core.registry import Registry
from attnhub.core.spec import AttentionSpec
from attnhub.errors import NoBackendError, OutputContractError
from attnhub.plugin import AttentionOutput, Backend, Capabilities
from tests.test_adversarial_plugins_3 import _module, site  # noqa: F401 (fixture)

CPU32 = Capabilities(vendors=frozenset({"cpu"}), dtypes=frozenset({"fp32"}), gqa=True)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2)).transpose(1, 2).contiguous()


class Exact(Backend):
    name, plugin = "exact", "adv5"
    capabilities = CPU32

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        return AttentionOutput(_sdpa(q, k, v))


def _hub(*backends: Backend) -> attnhub.Hub:
    hub = attnhub.Hub(hardware="cpu")
    hub.registry = Registry.of(*backends, plugin="adv5")
    return hub


@pytest.mark.parametrize("which", [0, 1, 2])
def test_an_output_in_a_fused_qkv_buffer_is_refused(which: int) -> None:
    """q, k, v as views of one projection: an output handed back through DLPack in one of
    their memories has a storage object of its own, which the storage comparison missed;
    the caller's input was overwritten and the next ``out.zero_()`` zeroed it again."""

    class Alias(Exact):
        name = "alias"

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
            out = torch.from_dlpack((q, k, v)[which].detach())
            out.copy_(_sdpa(q, k, v))
            return AttentionOutput(out)

    q, k, v = torch.randn(2, 8, 3, 2, 16).unbind(2)
    with pytest.raises(OutputContractError, match=f"wrote into its input {'qkv'[which]}"):
        _hub(Alias()).attention(q, k, v, backend="alias")  # the write itself, by bit sums
    view = torch.from_dlpack((q, k, v)[which].detach())  # and a view returned unwritten
    err = shared_memory("alias", view, None, {"q": q, "k": k, "v": v})
    assert err is not None and "in the memory of its input q / k / v" in str(err)
    fresh = [torch.randn(2, 8, 2, 16) for _ in range(3)]  # separate tensors: served
    torch.testing.assert_close(_hub(Exact()).attention(*fresh, backend="exact"),
                               _sdpa(*fresh))


def test_an_unhashable_backend_serves() -> None:
    """A backend written as a ``@dataclass`` (eq=True makes it unhashable): every hub call
    raised TypeError from the runner's set of distrusted backends."""

    @dataclasses.dataclass(eq=True)
    class DataBackend(Exact):
        name: str = "data_backend"

        def __post_init__(self) -> None:
            Backend.__init__(self)

    hub = _hub(DataBackend())
    q = torch.randn(1, 8, 2, 16)
    for _ in range(3):
        torch.testing.assert_close(hub.attention(q, q, q, backend="data_backend"),
                                   _sdpa(q, q, q))


@pytest.mark.parametrize("broken", ["raises", "dict"])
def test_capabilities_that_break_after_registration_reject_the_backend(
        broken: str, tmp_path) -> None:
    """A capabilities property that raised after registration (a driver probe that fails
    later), or one that returns a dict, crashed resolution with a traceback; now the
    backend is rejected with the reason and the next candidate serves."""
    calls = {"n": 0}

    class Flaky(Exact):
        name = "flaky"

        @property  # type: ignore[override]
        def capabilities(self):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] > 1:
                if broken == "raises":
                    raise RuntimeError("driver probe failed")
                return {"exact": True}
            return CPU32

    policy = tmp_path / "p.yaml"
    policy.write_text("name: p\nrules:\n  - name: r\n    use: [flaky, torch_sdpa]\n")
    hub = attnhub.Hub(policy=str(policy), hardware="cpu")
    hub.registry = Registry.of(Flaky(), plugin="adv5")
    q = torch.randn(1, 8, 2, 16)
    torch.testing.assert_close(hub.attention(q, q, q), _sdpa(q, q, q))
    d = hub.decide(AttentionSpec(dtype="fp32", head_dim=16, num_q_heads=2, num_kv_heads=2))
    assert d.backend == "torch_sdpa"
    (why,) = [r.reasons for r in d.rejected if r.backend == "flaky"]
    assert "capabilities() of backend 'flaky'" in why[0], why
    assert ("driver probe failed" if broken == "raises" else "returned a dict") in why[0]


@pytest.mark.parametrize("change", ["default dtype", "grad mode", "matmul precision"])
def test_forward_that_changes_torch_settings_is_put_back_and_fails(change: str) -> None:
    """A backend's forward() that set the default dtype, turned grad mode off or changed
    matmul precision left the host changed for every later call, unnoticed."""
    setters = {"default dtype": lambda: torch.set_default_dtype(torch.float64),
               "grad mode": lambda: torch.set_grad_enabled(False),
               "matmul precision": lambda: torch.set_float32_matmul_precision("medium")}

    class Rude(Exact):
        name = "rude"

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
            out = _sdpa(q, k, v)
            setters[change]()
            return AttentionOutput(out)

    before = (torch.get_default_dtype(), torch.is_grad_enabled(),
              torch.get_float32_matmul_precision())
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(NoBackendError, match=r"changed process-wide settings in forward\(\): "
                                             rf"torch (float32 )?{change}"):
        _hub(Rude()).attention(q, q, q, backend="rude")
    assert (torch.get_default_dtype(), torch.is_grad_enabled(),
            torch.get_float32_matmul_precision()) == before


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_a_write_past_the_version_counter_is_found(how: str) -> None:
    """``q.data.mul_(0)`` or a write through numpy moves no version counter: the caller's q
    was zeroed and the call reported nothing."""

    class Writer(Exact):
        name = "writer"

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
            out = _sdpa(q, k, v)
            if how == "data":
                q.data.mul_(0)
            else:
                q.detach().numpy()[..., 0] += 1.0
            return AttentionOutput(out)

    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    with pytest.raises(OutputContractError, match="wrote into its input q"):
        _hub(Writer()).attention(q, k, v, backend="writer")


def test_logging_generator_and_torch_functions_a_plugin_changes_are_put_back(site) -> None:
    """At import: ``logging.basicConfig`` (every host record printed twice, at DEBUG), a
    ``torch.manual_seed`` (a seeded run's draws moved by installing a plugin), and a
    replaced ``F.scaled_dot_product_attention`` / ``Tensor.softmax`` (``torch_sdpa``
    returned zeros). All loaded "ok" and stayed."""
    seed = random.randrange(10**6)
    code = ("import logging, torch.nn.functional as F\n"
            "logging.basicConfig(level=logging.DEBUG, force=True)\n"
            f"torch.manual_seed({seed})\n"
            "F.scaled_dot_product_attention = lambda *a, **k: torch.zeros(1)\n"
            "torch.Tensor.softmax = lambda self, *a, **k: self\n"
            "@hookimpl\ndef attnhub_register_backends(register):\n    register(Good())\n")
    sdpa, softmax = F.scaled_dot_product_attention, torch.Tensor.softmax
    level, handlers = logging.root.level, list(logging.root.handlers)
    torch.manual_seed(1)
    want = torch.rand(4)
    torch.manual_seed(1)
    mod = _module(site, "state5", code)
    reg = Registry.load(modules=[mod], entry_points=False)
    (err,) = reg.plugins[mod].errors
    for what in ("root logger level", "root logger handlers", "random generator state",
                 "torch.nn.functional.scaled_dot_product_attention", "torch.Tensor.softmax"):
        assert what in err, err
    assert torch.equal(torch.rand(4), want)
    assert F.scaled_dot_product_attention is sdpa and torch.Tensor.softmax is softmax
    assert logging.root.level == level and logging.root.handlers == handlers
    assert any(n.endswith("_good") for n in reg.backends)
