"""The ring under attack: ranks that disagree, refuse or stay away, and sharding helpers given
wrong arguments. Every failure must be a clear RingError on *every* rank (never a gloo abort,
a hang, or a silently wrong answer), and the group must stay usable after it.

This file is also the rank-side module: ``run_on_ranks`` loads it by path in each gloo
process and calls :func:`adversarial_ranks` (one launch per world size runs every scenario).
"""

from __future__ import annotations

import datetime
import importlib.util
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from attnhub_ring import (
    RingError,
    ring_attention,
    zigzag_shard,
    zigzag_shard_varlen,
    zigzag_unshard,
    zigzag_unshard_varlen,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from attnhub import InputError

HERE = Path(__file__)
LOCAL = "torch_flash_cpu"


# -- sharding helpers, one process --------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(world=st.integers(1, 5), shape=st.lists(st.integers(0, 6), min_size=1, max_size=4),
       dim=st.integers(-4, 3), data=st.data())
def test_zigzag_shards_of_any_tensor_round_trip(world: int, shape: list[int], dim: int,
                                                data: Any) -> None:
    if not -len(shape) <= dim < len(shape):
        dim = dim % len(shape)
    x = torch.randn(*shape).to(data.draw(st.sampled_from([torch.float32, torch.bfloat16])))
    if data.draw(st.booleans()) and x.dim() > 1:
        x = x.transpose(0, -1)  # not contiguous
    shards = [zigzag_shard(x, r, world, dim) for r in range(world)]
    assert torch.equal(zigzag_unshard(shards, dim), x)
    docs = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    y = torch.randn(sum(docs), 2)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    parts = [zigzag_shard_varlen(y, cu, r, world) for r in range(world)]
    assert torch.equal(zigzag_unshard_varlen([p for p, _ in parts], cu), y)


@pytest.mark.parametrize(("call", "words"), [
    (lambda x: zigzag_shard(x, 2, 2), "rank=2 is not a rank of a ring of 2"),
    (lambda x: zigzag_shard(x, -1, 2), "rank=-1"),
    (lambda x: zigzag_shard(x, 0, 0), "world_size=0"),
    (lambda x: zigzag_shard(x, 0, 2, dim=3), "dim=3 is not an axis"),
    # lengths that sum right but are not a zigzag sharding were silently scrambled
    (lambda x: zigzag_unshard([x[:, :4], x[:, 4:]]), "not a zigzag sharding"),
    (lambda x: zigzag_unshard([x[:, :3], x[:, 3:].double()]), "must differ only"),
    (lambda x: zigzag_unshard([]), "non-empty list"),
    # documents that do not start at 0 or do not cover the tokens were silently misplaced
    (lambda x: zigzag_shard_varlen(x[0], torch.tensor([1, 3, 7]), 0, 2), "start at 0"),
    (lambda x: zigzag_shard_varlen(x[0], torch.tensor([0, 3, 6]), 0, 2), "end at the 7"),
    (lambda x: zigzag_shard_varlen(x[0], torch.tensor([0.0, 7.0]), 0, 2), "integer tensor"),
    (lambda x: zigzag_unshard_varlen([x[0, :2], x[0, 2:]], torch.tensor([0, 3, 7])),
     "not a zigzag sharding"),
])
def test_sharding_helpers_refuse_what_would_be_silently_wrong(call: Callable[..., Any],
                                                              words: str) -> None:
    x = torch.arange(2 * 7 * 3, dtype=torch.float32).view(2, 7, 3)
    with pytest.raises(InputError, match=words):
        call(x)


# -- scenarios run on every rank ----------------------------------------------------------------
def _qkv(rank: int, world: int, s: int = 10, b: int = 1, hq: int = 2, hkv: int = 2,
         d: int = 8, dtype: torch.dtype = torch.float32,
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    return zigzag_shard(q, rank, world), zigzag_shard(k, rank, world), \
        zigzag_shard(v, rank, world)


def _ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    out = ring_attention(q, k, v, local_backend=LOCAL, causal=kw.pop("causal", True), **kw)
    if out.requires_grad:
        out.sum().backward()
    return out


def _batch(rank: int, world: int) -> None:
    _ring(*_qkv(rank, world, b=2 if rank == 1 else 1))


def _same_size_dtype(rank: int, world: int) -> None:  # fp16 bits read as bf16: no size error
    _ring(*_qkv(rank, world, dtype=torch.bfloat16 if rank == 1 else torch.float16))


def _query_heads(rank: int, world: int) -> None:
    _ring(*_qkv(rank, world, hq=4 if rank == 1 else 2))


def _grad_on_some_ranks(rank: int, world: int) -> None:  # rank 0's backward waited on rank 1
    q, k, v = _qkv(rank, world)
    _ring(q.requires_grad_(rank == 0), k, v)


def _documents(rank: int, world: int) -> None:
    lens = [3, 4] if rank == 0 else [7]
    q, k, v = (torch.randn(sum(lens), 2, 8) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    _ring(q, k, v, cu_seqlens=cu)


def _global_seqlens(rank: int, world: int) -> None:
    # rank 1's shard of 4W tokens is also its shard of 4W+1 (the extra token is rank 0's):
    # each rank alone is consistent, the ranks are not (rank 1 reads a block too short)
    s = 4 * world
    _ring(*_qkv(rank, world, s=s), global_seqlens=[s + 1 if rank == 1 else s])


def _short_key_shard(rank: int, world: int) -> None:  # refused on rank 1 alone
    q, k, v = _qkv(rank, world)
    if rank == 1:
        k, v = k[:, 1:], v[:, 1:]
    _ring(q, k, v)


def _bad_input(rank: int, world: int) -> None:  # the hub's contract, on rank 1 alone
    q, k, v = _qkv(rank, world)
    _ring(q, k.double() if rank == 1 else k, v)


def _hub_dtypes(rank: int, world: int) -> None:
    import attnhub

    q, k, v = _qkv(rank, world, dtype=torch.bfloat16 if rank == 1 else torch.float16)
    attnhub.Hub(hardware="cpu").attention(q, k, v, causal=True,
                                          context=attnhub.BindContext(world_size=world))


def _mixed_grad_inputs(rank: int, world: int) -> None:
    """Every rank needs gradients, of different inputs: exact out and grads (FA rule)."""
    from attnhub.plugin import AttnParams, reference_attention
    from attnhub.testing import assert_fa_rule

    g = torch.Generator().manual_seed(3)
    s = 4 * world + 3
    full = [torch.randn(2, s, h, 16, generator=g).bfloat16() for h in (4, 1, 1, 4)]
    q, k, v, dout = full
    params = AttnParams(scale=0.25, causal=True)
    refs = {}
    for dt in (torch.float64, torch.bfloat16):
        leaves = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        out, _ = reference_attention(*leaves, params, compute_dtype=dt)
        (out * dout.to(dt)).sum().backward()
        refs[dt] = [out.detach(), *(x.grad for x in leaves)]
    ql, kl, vl = (zigzag_shard(x, rank, world) for x in (q, k, v))
    want = (ql, kl, vl)[rank % 3]  # rank 0: q, rank 1: k, rank 2: v
    want.requires_grad_()
    out = ring_attention(ql, kl, vl, local_backend=LOCAL, causal=True, scale=0.25)
    (out * zigzag_shard(dout, rank, world)).sum().backward()
    mine = [zigzag_shard(t, rank, world) for t in refs[torch.float64]]
    same = [zigzag_shard(t, rank, world) for t in refs[torch.bfloat16]]
    assert_fa_rule(out, mine[0], same[0], mult=2, what=f"rank {rank} out")
    i = 1 + rank % 3
    assert want.grad is not None
    assert_fa_rule(want.grad, mine[i], same[i], mult=3, what=f"rank {rank} d{'qkv'[i - 1]}")


def _global_seqlens_once(rank: int, world: int) -> None:
    """With global_seqlens the handshake runs once per geometry (no host sync after)."""
    from attnhub_ring import ring as ring_mod

    calls = []
    agree = ring_mod.agree

    def counting(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return agree(*a, **kw)

    ring_mod.agree = counting
    try:
        q, k, v = _qkv(rank, world, s=9, hq=2, hkv=1, d=5)  # a geometry no other case has
        outs = [_ring(q, k, v, global_seqlens=[9]) for _ in range(3)]
    finally:
        ring_mod.agree = agree
    assert len(calls) == 1, f"{len(calls)} handshakes for 3 calls of one geometry"
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def _world3_cases(rank: int, world: int) -> None:
    """ring_cases.py's uneven, empty-shard and varlen cases on a world size that the suite's
    2- and 4-rank runs miss (shard lengths that 2W does not divide, 3-way zigzag)."""
    spec = importlib.util.spec_from_file_location("_ring_cases", HERE.parent / "ring_cases.py")
    assert spec is not None and spec.loader is not None
    cases = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = cases
    spec.loader.exec_module(cases)
    res = cases.check_cases(rank, world, ["causal_uneven_fp32", "causal_empty_shard",
                                          "full_uneven_lse_grad", "varlen_causal"])
    bad = [m for m in res.values() if m is not None]
    assert not bad, "\n".join(bad)


def _group_of_one(rank: int, world: int) -> None:
    """A process group of one rank: the ring is plain attention over the whole sequence."""
    import torch.distributed as dist
    from attnhub.plugin import AttnParams, reference_attention
    from attnhub.testing import assert_fa_rule

    groups = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 9, h, 8, generator=g, requires_grad=True) for h in (2, 1, 1))
    out, lse = ring_attention(q, k, v, local_backend=LOCAL, causal=True, return_lse=True,
                              group=groups[rank])
    grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    params = AttnParams(scale=8 ** -0.5, causal=True)
    refs = {}
    for dt in (torch.float64, torch.float32):
        leaves = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        o, l = reference_attention(*leaves, params, compute_dtype=dt)
        refs[dt] = [o, *torch.autograd.grad(o.sum() + l.sum(), leaves)]
    for i, (got, what) in enumerate(zip((out, *grads), ("out", "dq", "dk", "dv"))):
        assert_fa_rule(got, refs[torch.float64][i], refs[torch.float32][i], mult=3, what=what)


def _not_a_member(rank: int, world: int) -> None:
    """Rank 1 passes a group it is not in (it got new_group's placeholder)."""
    import torch.distributed as dist

    only_0 = dist.new_group([0])
    q, k, v = _qkv(0, 1)
    _ring(q, k, v, group=only_0)


def _absent_rank(rank: int, world: int) -> None:
    """Rank 1 skips the call (it raised earlier, say): the others must not wait forever."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=4))
    dist.barrier(group)
    if rank != 1:
        _ring(*_qkv(rank, world), group=group)


#: (name, function) in the order every rank runs them; the last one leaves its own group
#: broken on purpose
SCENARIOS: list[tuple[str, Callable[[int, int], None]]] = [
    ("batch", _batch), ("same_size_dtype", _same_size_dtype), ("query_heads", _query_heads),
    ("grad_on_some_ranks", _grad_on_some_ranks), ("documents", _documents),
    ("global_seqlens", _global_seqlens), ("short_key_shard", _short_key_shard),
    ("bad_input", _bad_input), ("hub_dtypes", _hub_dtypes),
    ("mixed_grad_inputs", _mixed_grad_inputs), ("global_seqlens_once", _global_seqlens_once),
    ("world3_cases", _world3_cases), ("group_of_one", _group_of_one),
    ("not_a_member", _not_a_member),
    ("absent_rank", _absent_rank),
]


def adversarial_ranks(rank: int, world: int, names: list[str]) -> dict[str, str]:
    """Per scenario: ``ok``, or the exception's type and message on this rank."""
    torch.manual_seed(zlib.crc32(b"ring") + rank)
    out = {}
    for name, fn in SCENARIOS:
        if name not in names:
            continue
        try:
            fn(rank, world)
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported to the test, which judges it
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


#: What every rank must say, per scenario: (words on rank 1, words on the others)
DISAGREE = "ring: the {w} ranks disagree on "
EXPECT = {
    "batch": (DISAGREE + "batch: rank 0: 1, rank 1: 2",) * 2,
    "same_size_dtype": (DISAGREE + "q dtype: rank 0: float16, rank 1: bfloat16",) * 2,
    "query_heads": (DISAGREE + "query heads",) * 2,
    "grad_on_some_ranks": (DISAGREE + "gradients: rank 0: yes, rank 1: no",) * 2,
    "documents": (DISAGREE + "sequences (documents): rank 0: 2, rank 1: 1",) * 2,
    "global_seqlens": (DISAGREE + "global_seqlens",) * 2,
    "short_key_shard": ("ring: shards self-attention",
                        "rank 1 of {w} cannot run this call (ring: shards self-attention"),
    "bad_input": ("ring_attention: ", "rank 1 of {w} cannot run this call (ring_attention: "),
    "hub_dtypes": (DISAGREE + "q dtype",) * 2,
    "mixed_grad_inputs": ("ok",) * 2,
    "global_seqlens_once": ("ok",) * 2,
    "world3_cases": ("ok",) * 2,
    "group_of_one": ("ok",) * 2,
}
#: rank 1's words (a RingError) and rank 0's ("ok"); other ranks take no part
MEMBER = ("is not a member of the process group", "ok")


def _check(results: list[dict[str, str]], world: int, names: list[str]) -> None:
    problems = []
    for name in names:
        if name == "absent_rank":
            continue
        for rank, res in enumerate(results):
            if name == "not_a_member" and rank > 1:
                continue
            want = MEMBER if name == "not_a_member" else EXPECT[name]
            words = want[0 if rank == 1 else 1].format(w=world)
            got = res[name]
            ok = got == "ok" if words == "ok" else (got.startswith("RingError: ")
                                                    and words in got)
            if not ok:
                problems.append(f"{name} rank {rank}/{world}: want {words!r}, got {got!r}")
    if "absent_rank" in names:
        for rank, res in enumerate(results):
            want = "ok" if rank == 1 else "RingError: ring: rank"
            if not res["absent_rank"].startswith(want) or (
                    rank != 1 and "got no answer" not in res["absent_rank"]):
                problems.append(f"absent_rank rank {rank}: got {res['absent_rank']!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_fail_alike_on_every_rank_and_the_group_lives_on(
        run_on_ranks: Callable[..., list[Any]], world: int) -> None:
    """Before, these aborted a gloo process (sizes differ), hung (a rank without backward or
    without a ring call), or answered silently wrong (fp16 vs bf16, other global_seqlens).
    The exact cases after the refusals show the group still works."""
    names = [n for n, _ in SCENARIOS
             if not (world == 2 and n == "world3_cases") and not (world == 3 and n in (
                 "hub_dtypes", "absent_rank", "global_seqlens_once", "group_of_one",
                 "not_a_member"))]
    results = run_on_ranks(HERE, "adversarial_ranks", world, names, timeout=150)
    _check(results, world, names)


def test_a_rank_that_cannot_run_the_call_without_a_group_raises_its_own_reason() -> None:
    """No process group: the call's own fault is named, not only the missing group."""
    q, k, v = _qkv(0, 1)
    with pytest.raises(RingError, match="ring_attention: .*float64"):
        ring_attention(q, k.double(), v, local_backend=LOCAL)
