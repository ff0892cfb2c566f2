"""The ring, fourth round: world sizes 2-4 on lengths 2W does not divide, MQA, softcap, LSE
gradients, documents across shards and gradients on some of q/k/v only, held to the fp64
single-device reference by the FlashAttention rule; and the misuses that must raise on every
rank (cross-attention, windows, flags that differ per rank), a rank whose kernel raises
mid-ring (every rank raises, at once), repeated calls of changing shapes, bit-for-bit
repeats and a subgroup that is not the default group.

Like the other adversarial files this one is also the rank-side module that ``run_on_ranks``
loads in each gloo process (one launch per world size: process start-up dominates).
"""

from __future__ import annotations

import datetime
import importlib.util
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from attnhub_ring import RingError, ring_attention

import attnhub
from attnhub.plugin import AttnParams, reference_attention
from attnhub.testing import assert_fa_rule

HERE = Path(__file__)
LOCAL = "torch_flash_cpu"


def _sibling(name: str) -> Any:
    """Another test module of this folder, loaded by path (as the ranks load this one)."""
    full = f"_ring4_{name}"
    if full not in sys.modules:
        spec = importlib.util.spec_from_file_location(full, HERE.parent / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[full]


def _calls(world: int) -> list[Any]:
    """Hand-picked calls the random sweep can miss, per world size."""
    call = _sibling("test_ring_adversarial_3").Call
    base = dict(thd=False, causal=True, dtype="fp32", heads=(4, 1), dims=(8, 8), batch=1,
                softcap=None, lse_grad=False, noncontig=False, block_backward="auto",
                sharding="zigzag", path="direct", scale=1.0, spread=1.0, grads="qkv",
                bhsd=False)
    s = 2 * world + 1  # 2W never divides it
    picks = [
        dict(lens=(s,), grads="k"), dict(lens=(s + 2,), grads="v", sharding="contiguous"),
        dict(lens=(s,), softcap=2.0, heads=(2, 2), lse_grad=True, grads="qv"),
        dict(lens=(3, 0, s), thd=True, heads=(2, 1), lse_grad=True),
        dict(lens=(1, s + 1), thd=True, causal=False, sharding="contiguous", grads="q"),
        dict(lens=(world - 1,), grads="kv", dtype="bf16"),
    ]
    return [call(seed=1000 * world + i, **{**base, **p}) for i, p in enumerate(picks)]


def exact_ranks(rank: int, world: int) -> list[str]:
    """Every hand-picked call against the fp64 reference (check_call of round 3)."""
    sweep = _sibling("test_ring_adversarial_3").sweep_ranks
    return sweep(rank, world, [asdict(c) for c in _calls(world)])


# -- scenarios: every rank runs each, in order -----------------------------------------------
def _qkv(rank: int, s: int, seed: int = 0, hq: int = 2, hkv: int = 1,
         grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 31 + rank)
    return [torch.randn(1, s, h, 8, generator=g, requires_grad=grad) for h in (hq, hkv, hkv)]


def _cross_attention(rank: int, world: int) -> None:
    """Sq != Sk on every rank: refused on every rank (no single-rank raise, no hang)."""
    q = _qkv(rank, 3)[0]
    _, k, v = _qkv(rank, 5)
    ring_attention(q, k, v, local_backend=LOCAL, causal=True)


def _window_via_hub(rank: int, world: int) -> None:
    """A sliding window on sharded inputs: the ring cannot mask it across shards, and a
    single-device kernel would attend within the shard only (silently wrong)."""
    q, k, v = _qkv(rank, 6)
    attnhub.Hub(hardware="cpu").attention(q, k, v, causal=True, window=(3, 0),
                                          context=attnhub.BindContext(world_size=world))


def _softcap_differs(rank: int, world: int) -> None:
    q, k, v = _qkv(rank, 6)
    ring_attention(q, k, v, local_backend="reference", causal=True,
                   softcap=None if rank == 1 else 3.0)


def _scale_differs(rank: int, world: int) -> None:
    q, k, v = _qkv(rank, 6)
    ring_attention(q, k, v, local_backend=LOCAL, causal=True, scale=0.5 if rank == 1 else 0.25)


def _kv_heads_differ(rank: int, world: int) -> None:
    q, k, v = _qkv(rank, 6, hq=2, hkv=2 if rank == 1 else 1)
    ring_attention(q, k, v, local_backend=LOCAL, causal=True)


def _fresh_group(world: int, seconds: float = 20.0) -> Any:
    import torch.distributed as dist

    return dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=seconds))


class _FailingKernel(attnhub.plugin.Backend):
    """torch_flash_cpu that raises ``error`` at its ``fail_at``-th block (None: never)."""

    name = "failing_on_one_rank"
    tier = "portable"

    def __init__(self, fail_at: int | None, error: BaseException | None = None):
        super().__init__()
        self.inner = attnhub.default_hub().registry.get(LOCAL)
        self.capabilities = self.inner.capabilities
        self.fail_at, self.calls = fail_at, 0
        self.error = error or RuntimeError("injected kernel failure")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Any,
                params: Any) -> Any:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise self.error
        return self.inner.forward(q, k, v, spec, params)


def _exact(rank: int, world: int, got: dict[int, torch.Tensor], full: list[torch.Tensor],
           what: str) -> None:
    """This rank's zigzag shard of out (0), dq (1), dk (2), dv (3), those given, against the
    fp64/fp32 single-device references."""
    idx = _sibling("test_ring_adversarial_3").shard_indices(world, (full[0].shape[1],),
                                                            "zigzag", rank)[0]
    refs = {}
    for dt in (torch.float64, torch.float32):
        leaves = [x.to(dt).requires_grad_() for x in full[:3]]
        o, _ = reference_attention(*leaves, AttnParams(scale=8 ** -0.5, causal=True),
                                   compute_dtype=dt)
        refs[dt] = [o, *torch.autograd.grad((o * full[3].to(dt)).sum(), leaves)]
    for i, x in got.items():
        want = [refs[dt][i].index_select(1, idx) for dt in (torch.float64, torch.float32)]
        assert_fa_rule(x, *want, mult=3, what=f"{what}: rank {rank} output {i}")


def _raises_mid_ring(rank: int, world: int) -> None:
    """Rank 1's kernel raises at its first, then at its last block, and the process lives
    on: it drains the ring, then every rank raises the same RingError naming rank 1, the
    step and the injected error, and the next call of every rank runs in step. The group's
    timeout is 20 s: waiting for it (or 30 min on the default group) would fail here."""
    group = _fresh_group(world)
    q, k, v, dout, *full = _sibling("test_ring_adversarial_3")._shards(
        rank, world, 4 * world + 1, "zigzag", seed=4)
    for fail_at in (0, world - 1, None):
        t0 = time.monotonic()
        local = _FailingKernel(fail_at if rank == 1 else None)
        lq, lk, lv = (x.detach().requires_grad_() for x in (q, k, v))
        try:
            out = ring_attention(lq, lk, lv, local_backend=local, causal=True, group=group)
        except RingError as exc:
            want = f"rank 1 of {world} failed in the ring's forward at step {fail_at}"
            assert want in str(exc) and "injected" in str(exc), exc
        else:
            assert fail_at is None, f"rank 1's failure at block {fail_at} was swallowed"
            grads = torch.autograd.grad((out * dout).sum(), (lq, lk, lv))
            _exact(rank, world, dict(enumerate((out, *grads))), full, "after the failures")
        took = time.monotonic() - t0
        assert took < 10, f"rank {rank} took {took:.1f} s (failure at {fail_at})"


def _raises_mid_backward(rank: int, world: int) -> None:
    """Rank 1's block backward raises at its second block: every rank raises the same
    RingError naming it (no NaN dK/dV on the others), at once."""
    import attnhub_ring.ring as ring_mod

    group = _fresh_group(world)
    q, k, v, dout, *_ = _sibling("test_ring_adversarial_3")._shards(
        rank, world, 4 * world + 1, "zigzag", seed=6)
    real, calls = ring_mod._fused_block_grads, [0]

    def failing(*a: Any) -> None:
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            raise RuntimeError("injected backward failure")
        real(*a)

    lq, lk, lv = (x.detach().requires_grad_() for x in (q, k, v))
    out = ring_attention(lq, lk, lv, local_backend=LOCAL, causal=True, group=group,
                         block_backward="flash")
    ring_mod._fused_block_grads = failing
    t0 = time.monotonic()
    try:
        torch.autograd.grad((out * dout).sum(), (lq, lk, lv))
    except RingError as exc:
        assert f"rank 1 of {world} failed in the ring's backward at step 1" in str(exc) \
            and "injected" in str(exc), exc
        return
    finally:
        ring_mod._fused_block_grads = real
        assert time.monotonic() - t0 < 10, f"rank {rank} waited for rank 1"
    raise AssertionError(f"rank {rank} returned gradients beside rank 1's failure")


def _repeated_shapes(rank: int, world: int) -> None:
    """One process, calls of changing lengths, dtypes and flags (with and without
    global_seqlens): each exact, nothing carried over from the call before."""
    check = _sibling("test_ring_adversarial_3").check_call
    for i, (s, dt, gs) in enumerate([(7, "fp32", 1), (2 * world + 3, "bf16", 0), (7, "fp32", 1),
                                     (3, "fp32", 0), (7, "fp16", 1)]):
        for c in _calls(world)[:2]:
            check(rank, world, type(c)(**{**asdict(c), "lens": (s,), "dtype": dt,
                                          "seed": 2 * i + gs + 1}))


def _bitwise_repeat(rank: int, world: int) -> None:
    """Same inputs twice: the same bits, forward and gradients."""
    runs = []
    for _ in range(2):
        q, k, v = _qkv(rank, 2 * world + 1, seed=3, grad=True)
        out, lse = ring_attention(q, k, v, local_backend=LOCAL, causal=True, return_lse=True,
                                  deterministic=True)
        grads = torch.autograd.grad((out * out.detach().flip(-1)).sum() + lse.sum(), (q, k, v))
        runs.append([out, lse, *grads])
    for a, b, what in zip(*runs, ("out", "lse", "dq", "dk", "dv")):
        assert torch.equal(a, b), f"rank {rank}: {what} differs between two identical calls"


def _subgroup(rank: int, world: int) -> None:
    """A ring over ranks {0, W-1} only (not the default group, not contiguous global ranks):
    exact; the ranks outside it make no call."""
    import torch.distributed as dist

    members = [0, world - 1]
    group = dist.new_group(members)
    if rank not in members:
        return
    me = members.index(rank)
    zz = _sibling("test_ring_adversarial_3")
    s = 7
    g = torch.Generator().manual_seed(77)
    full = [torch.randn(1, s, h, 8, generator=g, dtype=torch.float64) for h in (2, 1, 1, 2)]
    idx = zz.shard_indices(2, (s,), "zigzag", me)[0]
    lq, lk, lv = (x.index_select(1, idx).float().requires_grad_() for x in full[:3])
    out = ring_attention(lq, lk, lv, local_backend=LOCAL, causal=True, group=group)
    grads = torch.autograd.grad((out * full[3].index_select(1, idx).float()).sum(), (lq, lk, lv))
    _exact(me, 2, dict(enumerate((out, *grads))), full, f"subgroup (global rank {rank})")


SCENARIOS: dict[str, Callable[[int, int], None]] = {
    "cross_attention": _cross_attention, "window_via_hub": _window_via_hub,
    "softcap_differs": _softcap_differs, "scale_differs": _scale_differs,
    "kv_heads_differ": _kv_heads_differ, "repeated_shapes": _repeated_shapes,
    "bitwise_repeat": _bitwise_repeat, "subgroup": _subgroup,
    "raises_mid_ring": _raises_mid_ring, "raises_mid_backward": _raises_mid_backward,
}


def launch_ranks(rank: int, world: int, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The exact calls, then the scenarios."""
    return exact_ranks(rank, world), _scenarios(rank, world, names)


def _scenarios(rank: int, world: int, names: list[str]) -> dict[str, str]:
    return _sibling("test_ring_adversarial_3").run_scenarios(SCENARIOS, rank, world, names)


#: world size -> scenarios run there (round 3's sweep covers world 4)
LAUNCHES = {2: [n for n in SCENARIOS if not n.startswith("raises_mid")],
            3: ["subgroup", "raises_mid_ring", "raises_mid_backward"]}
_LAUNCHED: dict[int, list[tuple[list[str], dict[str, str]]]] = {}


def _launched(run_on_ranks: Callable[..., list[Any]], world: int
              ) -> list[tuple[list[str], dict[str, str]]]:
    if world not in _LAUNCHED:
        _LAUNCHED[world] = run_on_ranks(HERE, "launch_ranks", world, LAUNCHES[world],
                                        timeout=120)
    return _LAUNCHED[world]


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_hand_picked_calls_match_fp64_by_the_flash_attention_rule(
        run_on_ranks: Callable[..., list[Any]], world: int) -> None:
    bad = [m for sweep, _ in _launched(run_on_ranks, world) for m in sweep]
    assert not bad, "\n".join(bad)


DISAGREE = "RingError: ring: the {w} ranks disagree on "
#: per scenario: (rank 1's words, the other ranks' words); "ok" means exactly ok
EXPECT = {
    "cross_attention": ("RingError: ring: shards self-attention",) * 2,
    "window_via_hub": ("window",) * 2,
    "softcap_differs": (DISAGREE + "softcap",) * 2,
    "scale_differs": (DISAGREE + "scale",) * 2,
    "kv_heads_differ": (DISAGREE + "key/value heads",) * 2,
    "repeated_shapes": ("ok",) * 2,
    "bitwise_repeat": ("ok",) * 2,
    "subgroup": ("ok",) * 2,
    "raises_mid_ring": ("ok",) * 2,  # each rank asserts the RingError itself
    "raises_mid_backward": ("ok",) * 2,
}


@pytest.mark.parametrize("world", [w for w, names in LAUNCHES.items() if names])
def test_misuse_and_failures_raise_alike_on_every_rank_and_repeats_stay_exact(
        run_on_ranks: Callable[..., list[Any]], world: int) -> None:
    results = [res for _, res in _launched(run_on_ranks, world)]
    problems = []
    for name in LAUNCHES[world]:
        for rank, res in enumerate(results):
            words = EXPECT[name][0 if rank == 1 else 1].format(w=world)
            got = res[name]
            ok = got == "ok" if words == "ok" else (words in got and got != "ok")
            if not ok:
                problems.append(f"{name} rank {rank}/{world}: want {words!r}, got {got!r}")
    assert not problems, "\n".join(problems)
