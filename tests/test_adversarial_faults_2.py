"""Fault injection at the hub boundary, second round: a backend whose result is no
AttentionOutput, whose output is cut from (or wrongly kept in) the autograd graph, is a
Tensor subclass, shares memory with its inputs or with itself, or which writes into its
inputs; a plugin exception whose message cannot be read; KeyboardInterrupt; settle's timed
candidates; CLI numbers and hardware names; the profile store with paths in the way.

Each is detected at the boundary, named with the backend (or file, or flag), falls back only
where the rule says, and never hands the caller wrong data, on the first call (slow lane)
and on later calls (hot path)."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import attnhub
from attnhub.cli import main as cli_main
from attnhub.core.backend import AttentionOutput
from attnhub.core.builtin import ReferenceBackend
from attnhub.core.capabilities import ALL_MASKS, Capabilities
from attnhub.core.device import simulate
from attnhub.core.registry import Registry
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttentionSpec, AttnParams
from attnhub.errors import NoBackendError, OutputContractError, PolicyError
from attnhub.policy.profile import ProfileStore
from tests.test_settle_ties import _hub as _tie_hub, _qkv, registry  # noqa: F401 (fixture)

CAPS = Capabilities(dtypes=frozenset({"fp32", "fp16", "bf16"}), masks=ALL_MASKS, gqa=True,
                    returns_lse=True, max_head_dim=256, backward=True,
                    layouts=frozenset({"bshd", "thd", "paged"}))


class Faulty(ReferenceBackend):
    """The reference's answer (every layout) through ``spoil(self, out, lse, q, k, v,
    params)``."""

    name = "faulty"
    tier = "portable"
    capabilities = CAPS

    def __init__(self, spoil: Callable[..., Any]):
        super().__init__()
        self.spoil = spoil
        self.calls = 0

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        self.calls += 1
        out, lse = super().forward(q, k, v, spec, params)
        return self.spoil(self, out, lse, q, k, v, params)


def _hub(tmp_path: Path, spoil: Callable[..., Any], on_failure: str = "next",
         chain: str = "faulty, torch_sdpa") -> attnhub.Hub:
    path = tmp_path / f"p_{on_failure}.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: faults
        rules:
          - name: only
            use: [{chain}]
            on_failure: {on_failure}
        """), encoding="utf-8")
    reg = Registry.of(Faulty(spoil), plugin="faultplug")
    return attnhub.Hub(policy=str(path), hardware="cpu", registry=reg)


def _qkv4(grad: bool = False) -> tuple[torch.Tensor, ...]:
    q = torch.randn(2, 5, 4, 8, requires_grad=grad)
    k, v = (torch.randn(2, 7, 2, 8, requires_grad=grad) for _ in range(2))
    return q, k, v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
    kt, vt = (t.repeat_interleave(qt.shape[1] // t.shape[1], 1) for t in (kt, vt))
    mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril(k.shape[1] - q.shape[1])
    return torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=mask).transpose(1, 2)


def _faulty(hub: attnhub.Hub) -> Faulty:
    return hub.registry.get("faulty")  # type: ignore[return-value]


# -- results that are no AttentionOutput ----------------------------------------------------
NOT_OUTPUTS = {
    "bare tensor": lambda s, out, lse, *a: out,
    "None": lambda s, out, lse, *a: None,
    "tuple of 3": lambda s, out, lse, *a: (out, lse, None),
    "dict": lambda s, out, lse, *a: {"out": out, "lse": lse},
    "iterator": lambda s, out, lse, *a: iter([out, lse]),
}


@pytest.mark.parametrize("how", list(NOT_OUTPUTS))
def test_a_result_that_is_no_attention_output_falls_back_with_a_reason(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str) -> None:
    """Before: an iterator of (out, lse) passed the first call's unpacking and failed the
    hot path's indexing; the others fell back as "TypeError: cannot unpack ..." or
    "KeyError: 0", naming nothing of the contract."""
    hub = _hub(tmp_path, NOT_OUTPUTS[how])
    q, k, v = _qkv4()
    with caplog.at_level(logging.WARNING, logger="attnhub"):
        for _ in range(3):  # the slow lane, then the hot path
            torch.testing.assert_close(hub.attention(q, k, v, causal=True), _sdpa(q, k, v))
    assert hub.fallback_counts == {("faulty", "torch_sdpa"): 3}
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "OutputContractError: backend 'faulty' returned" in said, said
    assert "the contract is AttentionOutput(out, lse)" in said, said


def test_a_result_that_is_no_attention_output_under_on_failure_error(tmp_path: Path) -> None:
    hub = _hub(tmp_path, NOT_OUTPUTS["None"], on_failure="error")
    q, k, v = _qkv4()
    for _ in range(2):
        with pytest.raises(NoBackendError, match=r"returned NoneType; the contract is "
                                                 r"AttentionOutput"):
            hub.attention(q, k, v, causal=True)


# -- the autograd graph and the output's class -----------------------------------------------
class _Marked(torch.Tensor):
    """A Tensor subclass a backend might leak."""


GRAPH = {
    # a call that needs gradients, answered by an output cut from the graph: training went on
    # with no gradient through attention, silently
    "detached": (True, lambda s, out, lse, *a: AttentionOutput(out.detach(), lse)),
    "subclass": (False, lambda s, out, lse, *a: AttentionOutput(out.as_subclass(_Marked), lse)),
}


@pytest.mark.parametrize("how", list(GRAPH))
def test_an_output_outside_the_calls_graph_or_of_another_class_is_refused(
        tmp_path: Path, how: str) -> None:
    grad, spoil = GRAPH[how]
    hub = _hub(tmp_path, spoil)
    for _ in range(2):
        q, k, v = _qkv4(grad)
        out = hub.attention(q, k, v, causal=True)
        assert type(out) is torch.Tensor and out.requires_grad is grad
        torch.testing.assert_close(out.detach(), _sdpa(q, k, v))
        if grad:
            out.sum().backward()
            assert all(t.grad is not None and bool(t.grad.abs().sum() > 0) for t in (q, k, v))
    assert hub.fallback_counts == {("faulty", "torch_sdpa"): 2}


def test_a_detached_output_under_on_failure_error_names_the_graph(tmp_path: Path) -> None:
    hub = _hub(tmp_path, GRAPH["detached"][1], on_failure="error")
    q, k, v = _qkv4(grad=True)
    with pytest.raises(NoBackendError, match="cut from the autograd graph"):
        hub.attention(q, k, v, causal=True)


# -- memory shared with the inputs, or with itself ------------------------------------------
SHARED = {
    "q itself": lambda s, out, lse, q, k, v, p: AttentionOutput(q, lse),
    "a view of q": lambda s, out, lse, q, k, v, p: AttentionOutput(q.view(q.shape), lse),
    "expanded": lambda s, out, lse, q, k, v, p: AttentionOutput(
        out[:1].expand(out.shape), lse),
}


@pytest.mark.parametrize("how", list(SHARED))
def test_an_output_sharing_memory_is_moved_behind_and_never_served(
        tmp_path: Path, how: str) -> None:
    """Before: the first call's fallback was counted, then the exact-shape hot path
    (metadata checks only) returned the aliased or expanded tensor on every later call."""
    hub = _hub(tmp_path, SHARED[how])
    q, k, v = _qkv4()
    for _ in range(3):
        out = hub.attention(q, k, v, causal=True)
        torch.testing.assert_close(out, _sdpa(q, k, v))
        assert out.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
        assert 0 not in out.stride()
    assert _faulty(hub).calls == 1  # found on the slow lane, never called again
    d = hub.bound()[-1].decision
    assert d.backend == "torch_sdpa"
    assert any("faulty moved behind torch_sdpa after breaking the output contract" in n
               for n in d.notes), d.notes


def test_an_output_sharing_memory_under_on_failure_error_is_refused_every_call(
        tmp_path: Path) -> None:
    hub = _hub(tmp_path, SHARED["q itself"], on_failure="error")
    q, k, v = _qkv4()
    for _ in range(3):
        with pytest.raises(NoBackendError, match="in the memory of its input q"):
            hub.attention(q, k, v, causal=True)
    assert _faulty(hub).calls == 3
    assert any("runs with every result checked in full" in n
               for n in hub.bound()[-1].decision.notes)


# -- a backend that writes into its inputs --------------------------------------------------
def _scale_q(s, out, lse, q, k, v, p):  # type: ignore[no-untyped-def]
    q.mul_(2.0)
    return AttentionOutput(out, lse)


def test_a_backend_writing_into_q_raises_and_is_never_run_unchecked(tmp_path: Path) -> None:
    """Before: the caller's q was doubled in place on every call, and the (right) output
    returned as if nothing happened. Now the call that wrote raises (no fallback answers for
    inputs that changed) and later calls of the binding are served by the next candidate."""
    hub = _hub(tmp_path, _scale_q)
    q, k, v = _qkv4()
    kept = q.clone()
    with pytest.raises(OutputContractError, match=r"backend 'faulty' \(plugin "
                                                  r"'faultplug'\) wrote into its input q"):
        hub.attention(q, k, v, causal=True)
    assert not hub.fallback_counts
    q.copy_(kept)  # the caller repairs its tensor; no later call may spoil it again
    for _ in range(2):
        torch.testing.assert_close(hub.attention(q, k, v, causal=True), _sdpa(kept, k, v))
        assert torch.equal(q, kept)
    assert _faulty(hub).calls == 1
    assert any("faulty moved behind torch_sdpa" in n for n in hub.bound()[-1].decision.notes)


def test_a_backend_writing_into_q_under_on_failure_error_raises_every_call(
        tmp_path: Path) -> None:
    hub = _hub(tmp_path, _scale_q, on_failure="error")
    q, k, v = _qkv4()
    for _ in range(3):  # every call in the checked lane: never the unchecked hot path
        with pytest.raises(OutputContractError, match="wrote into its input q"):
            hub.attention(q, k, v, causal=True)
    assert _faulty(hub).calls == 3


def _zero_cache(s, out, lse, q, k, v, p):  # type: ignore[no-untyped-def]
    k.zero_()
    return AttentionOutput(out, lse)


def _spoil_table(s, out, lse, q, k, v, p):  # type: ignore[no-untyped-def]
    p.block_table.fill_(0)
    return AttentionOutput(out, lse)


@pytest.mark.parametrize("spoil,name", [(_zero_cache, "k"), (_spoil_table, "block_table")])
def test_a_backend_writing_into_the_kv_cache_or_the_checked_tables_raises(
        tmp_path: Path, spoil: Callable[..., Any], name: str) -> None:
    hub = _hub(tmp_path, spoil)
    kc, vc = torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)
    bt = torch.tensor([[3, 1, 5], [0, 4, 2]], dtype=torch.int32)
    sl = torch.tensor([9, 12], dtype=torch.int32)
    q = torch.randn(2, 1, 4, 8)
    kw = dict(layout="paged", block_table=bt, seqlens_k=sl)
    with pytest.raises(OutputContractError, match=f"wrote into its input {name}"):
        hub.attention(q, kc.clone(), vc.clone(), **kw)
    # the hub's checked copy of the tables is not handed to the next call
    ref = hub.attention(q, kc, vc, backend="reference", **kw)
    want = hub.attention(q, kc, vc, backend="torch_sdpa", **kw)
    torch.testing.assert_close(ref, want)


# -- exceptions --------------------------------------------------------------------------------
class _Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("no message")


def _raise(exc: BaseException) -> Callable[..., Any]:
    def spoil(*a: Any) -> Any:
        raise exc
    return spoil


def test_an_exception_whose_message_raises_still_falls_back(tmp_path: Path) -> None:
    """Before: str() of the plugin's exception raised inside the failure handler, and the
    call failed with that ValueError instead of falling back."""
    hub = _hub(tmp_path, _raise(_Unprintable()))
    q, k, v = _qkv4()
    for _ in range(2):
        torch.testing.assert_close(hub.attention(q, k, v, causal=True), _sdpa(q, k, v))
    assert hub.fallback_counts == {("faulty", "torch_sdpa"): 2}


def test_keyboard_interrupt_propagates_and_is_not_counted(tmp_path: Path) -> None:
    hub = _hub(tmp_path, _raise(KeyboardInterrupt()))
    q, k, v = _qkv4()
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            hub.attention(q, k, v, causal=True)
    assert not hub.fallback_counts


# -- settle: timed candidates meet the output contract first --------------------------------
PACK = {"tie_slow": 1.00e-4, "tie_fast": 1.01e-4}


def test_a_tied_candidate_with_an_expanded_output_is_not_timed_nor_bound(
        tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Before: settle called forward without any output check, timed the broken (and
    faster) candidate and bound it; the hot path then served its expanded output."""
    hub = _tie_hub(tmp_path, registry, PACK)
    fast = registry.get("tie_fast")
    real = type(fast).forward

    def expanded(self, *a, **kw):  # type: ignore[no-untyped-def]
        out, lse = real(self, *a, **kw)
        return AttentionOutput(out[:, :1].expand(out.shape), lse)

    monkeypatch.setattr(type(fast), "forward", expanded)
    q, k, v = _qkv()
    for _ in range(2):
        out = hub.attention(q, k, v)
        assert 0 not in out.stride()
    d = hub.bound()[-1].decision
    assert d.backend == "tie_slow"
    assert any("left out: tie_fast raised OutputContractError" in n for n in d.notes), d.notes


def test_a_tied_candidate_writing_into_q_raises(
        tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Before: settle ran the candidate again and again in its timing loop on the caller's q."""
    hub = _tie_hub(tmp_path, registry, PACK)
    fast = registry.get("tie_fast")
    real = type(fast).forward

    def writes(self, q, *a, **kw):  # type: ignore[no-untyped-def]
        q.add_(1.0)
        return real(self, q, *a, **kw)

    monkeypatch.setattr(type(fast), "forward", writes)
    q, k, v = _qkv()
    with pytest.raises(OutputContractError, match="'tie_fast'.*wrote into its input q"):
        hub.attention(q, k, v)
    assert fast.calls == 1


# -- CLI ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["doctor", "--hardware", "zzz"],
                                  ["backends", "--hardware", "zzz"]])
def test_an_unknown_hardware_flag_is_an_error_not_a_traceback(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ValueError escaped main() with a traceback."""
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert "unknown hardware 'zzz'; use one of cpu" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["explain"], ["doctor"], ["backends"]])
def test_an_unknown_attnhub_hardware_is_named_as_the_variable(
        argv: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ATTNHUB_HARDWARE", "zzz")
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert "ATTNHUB_HARDWARE: unknown hardware 'zzz'" in err and "unset it" in err


@pytest.mark.parametrize("argv,flag", [
    (["explain", "--seqlen", "-5"], "--seqlen"),
    (["explain", "--head-dim", "0"], "--head-dim"),
    (["explain", "--batch", "0"], "--batch"),
    (["check-plugin", "reference", "--budget", "-1"], "--budget"),
    (["run", "--warmup", "-3"], "--warmup"),
    (["run", "--head-dim", "-4"], "--head-dim"),
    (["profile", "--layers", "0"], "--layers"),
])
def test_numbers_out_of_range_are_usage_errors(argv: list[str], flag: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Before: explain planned for head dim 0 or a negative length, check-plugin skipped
    every case, run died in torch with a traceback."""
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and "must be a number >=" in err


def test_a_window_without_a_sliding_window_mask_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: --window was silently ignored unless --mask named sliding_window."""
    assert cli_main(["explain", "--hardware", "cpu", "--window", "7"]) == 1
    assert "--window 7 is read only with --mask sliding_window" in capsys.readouterr().err


# -- the profile store with something in the way ---------------------------------------------
@pytest.mark.parametrize("block", ["lock is a folder", "folder is a file"])
def test_a_store_write_blocked_by_a_path_names_it(tmp_path: Path, block: str) -> None:
    """Before: a raw IsADirectoryError / FileExistsError, no store path, no fix."""
    dev = simulate("sm90")
    spec = AttentionSpec(phase="prefill", dtype="bf16", head_dim=64, num_q_heads=8,
                         num_kv_heads=8, max_seqlen_q=64, max_seqlen_k=64)
    if block == "lock is a folder":
        path = tmp_path / "p.json"
        ProfileStore(path, packs="off").record_speed(dev, spec, "kept", 1e-3)
        (tmp_path / ".p.json.lock").unlink()
        (tmp_path / ".p.json.lock").mkdir()
        blocked = tmp_path / ".p.json.lock"
    else:
        (tmp_path / "sub").write_text("not a folder")
        path = blocked = tmp_path / "sub" / "p.json"
    store = ProfileStore(path, packs="off")
    with pytest.raises(PolicyError, match="cannot write the profile store") as exc:
        store.record_speed(dev, spec, "new", 2e-3)
    assert str(path) in str(exc.value) and "ATTNHUB_PROFILE" in str(exc.value)
    if block == "lock is a folder":
        assert str(blocked) in str(exc.value)
        assert store.speed(dev, spec, "kept") == 1e-3 and store.speed(dev, spec, "new") is None


@pytest.mark.parametrize("backend", ["reference", "torch_sdpa", None])
def test_learned_slopes_with_frozen_qkv_get_their_gradient(backend: str | None) -> None:
    """An output in a graph of its own is the contract too: learned ALiBi slopes with q, k, v
    frozen (the hub refused that output as "a graph the caller did not ask for")."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 7, 2, 8, generator=g) for _ in range(3))
    slopes = torch.rand(2, generator=g).requires_grad_()
    kw = {"backend": backend} if backend else {}
    out = attnhub.attention(q, k, v, causal=True, alibi_slopes=slopes, **kw)
    go = torch.randn(out.shape, generator=g)
    got, = torch.autograd.grad(out, (slopes,), go)
    ref_s = slopes.detach().double().requires_grad_()
    ref, _ = reference_attention(q.double(), k.double(), v.double(),
                                 AttnParams(scale=8 ** -0.5, causal=True, alibi_slopes=ref_s))
    want, = torch.autograd.grad(ref, (ref_s,), go.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
