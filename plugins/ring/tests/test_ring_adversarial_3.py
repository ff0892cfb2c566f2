"""The ring on random calls, and the failures that used to be silent or hang: contiguous
shards, second-order gradients, a rank that changes its call alone under ``global_seqlens``,
a forced block backward that only some ranks cannot run.

The sweep draws random calls (world sizes 1-4, bshd and thd with documents across shards and
empty ones, GQA, causal or not, softcap, LSE gradients, fp16/bf16/fp32, non-contiguous
shards, every block backward, zigzag or contiguous shards, direct or through the hub) and
checks each rank's out, LSE and dQ/dK/dV against the single-device fp64 and same-precision
references by the FlashAttention rule. Like test_ring_adversarial.py, this file is also the
rank-side module that ``run_on_ranks`` loads in each gloo process.
"""

from __future__ import annotations

import datetime
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from attnhub_ring import ZigzagLayout, ring_attention

import attnhub
from attnhub import InputError
from attnhub.plugin import AttnParams, reference_attention
from attnhub.testing import assert_fa_rule, assert_lse

HERE = Path(__file__)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Call:
    """One random ring call; every rank builds the same full tensors from ``seed``."""

    seed: int
    lens: tuple[int, ...]  # bshd: (S,); thd: the documents' lengths (0 allowed)
    thd: bool
    causal: bool
    dtype: str
    heads: tuple[int, int]  # (Hq, Hkv)
    dims: tuple[int, int]  # (D, Dv)
    batch: int
    softcap: float | None
    lse_grad: bool
    noncontig: bool
    block_backward: str
    sharding: str
    path: str  # "direct", "hub" (default policy, params.extra) or "hub_gs" (+global_seqlens)
    scale: float
    spread: float  # q's magnitude: large values make the softmax peaky
    grads: str  # which of q, k, v need gradients ("" under no_grad: prefill)
    bhsd: bool  # through the hub as (B, H, S, D) views


def random_calls(world: int, n: int, seed: int) -> list[Call]:
    """``n`` random valid calls for ``world`` ranks (the local kernel follows the call:
    ``reference`` by hand for softcap or Dv != D, else ``torch_flash_cpu``). The sharding
    and the path alternate, so that a few draws cover both."""
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        thd = rng.random() < 0.4
        lens = (tuple(rng.choice([0, 1, rng.randint(1, 3 * world + 2)])
                      for _ in range(rng.randint(1, 3))) if thd
                else (rng.randint(max(1, world - 1), 4 * world + 3),))
        softcap = rng.choice([None, None, None, 1.5]) if world > 1 else None
        dims = (8, 8) if softcap or rng.random() < 0.8 else (8, 4)
        lse_grad = rng.random() < 0.3
        plain = softcap is None and dims[0] == dims[1]
        fused_ok = plain and not lse_grad
        path = ("direct", "hub", "hub_gs")[i % 3] if plain and world > 1 else "direct"
        hkv = rng.choice([1, 2])
        calls.append(Call(
            seed=rng.randrange(1 << 30), lens=lens, thd=thd, causal=rng.random() < 0.7,
            dtype=rng.choice(list(DTYPES)), heads=(hkv * rng.choice([1, 2]), hkv), dims=dims,
            batch=1 if thd else rng.choice([1, 2]), softcap=softcap, lse_grad=lse_grad,
            noncontig=rng.random() < 0.5,
            block_backward=rng.choice(["auto", "flash", "math"] if fused_ok else ["auto", "math"]),
            sharding=("contiguous", "zigzag")[i % 2], path=path,
            scale=round(rng.uniform(0.05, 1.5), 3), spread=rng.choice([1.0, 1.0, 6.0]),
            grads=rng.choice(["qkv", "qkv", "q", "kv", ""]),
            bhsd=path != "direct" and not thd and rng.random() < 0.5))
    return calls


def _cu(lens: tuple[int, ...] | list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()],
                        dtype=torch.int32)


def shard_indices(world: int, lens: tuple[int, ...], sharding: str,
                  rank: int) -> tuple[torch.Tensor, list[int]]:
    """The global positions a rank holds, and its tokens per document, written here with
    ``tensor_split`` (not the layout under test): per document, chunks ``rank`` and
    ``2W-1-rank`` of ``2W`` (zigzag) or chunk ``rank`` of ``W`` (contiguous)."""
    parts, per_doc, start = [], [], 0
    for n in lens:
        pos = torch.arange(start, start + n)
        if sharding == "zigzag":
            chunks = torch.tensor_split(pos, 2 * world)
            mine = torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])
        else:
            mine = torch.tensor_split(pos, world)[rank]
        parts.append(mine)
        per_doc.append(mine.numel())
        start += n
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long), per_doc


def _noncontig(x: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous view (heads and tokens swapped in memory)."""
    return x.transpose(-3, -2).contiguous().transpose(-3, -2) if x.shape[-3] > 1 else \
        torch.cat([x, x], -1)[..., :x.shape[-1]]


def check_call(rank: int, world: int, c: Call) -> None:
    """Run ``c`` on this rank and hold its results to the FlashAttention rule."""
    g = torch.Generator().manual_seed(c.seed)
    dt, total = DTYPES[c.dtype], sum(c.lens)
    (hq, hkv), (d, dv) = c.heads, c.dims

    def rand(h: int, e: int) -> torch.Tensor:
        shape = (total, h, e) if c.thd else (c.batch, total, h, e)
        return torch.randn(*shape, generator=g).to(dt)

    q, k, v, dout = (rand(hq, d) * c.spread).to(dt), rand(hkv, d), rand(hkv, dv), rand(hq, dv)
    dlse = torch.randn(*((hq, total) if c.thd else (c.batch, hq, total)), generator=g)
    cu = _cu(c.lens)
    scale = c.scale / d ** 0.5
    params = AttnParams(scale=scale, causal=c.causal, softcap=c.softcap,
                        cu_seqlens_q=cu if c.thd else None, cu_seqlens_k=cu if c.thd else None)
    refs = {}
    for cdt in (torch.float64, dt):
        leaves = [x.detach().to(cdt).requires_grad_() for x in (q, k, v)]
        out, lse = reference_attention(*leaves, params, layout="thd" if c.thd else "bshd",
                                       compute_dtype=cdt)
        loss = (out * dout.to(cdt)).sum() + ((lse * dlse).sum() if c.lse_grad else 0)
        refs[cdt] = [out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves)]
    idx, local_lens = shard_indices(world, c.lens, c.sharding, rank)
    seq = 0 if c.thd else 1

    def mine(x: torch.Tensor, dim: int = seq) -> torch.Tensor:
        return x.index_select(dim, idx)

    ql, kl, vl = (mine(x) for x in (q, k, v))
    if c.noncontig:
        ql, kl, vl = (_noncontig(x) for x in (ql, kl, vl))
    leaves = [x.requires_grad_() for x, n in zip((ql, kl, vl), "qkv") if n in c.grads]
    cu_l = _cu(local_lens)
    with torch.set_grad_enabled(bool(c.grads)):
        out, lse = _run(c, ql, kl, vl, cu_l, scale, world)
    lse_dim = 1 if c.thd else 2
    where = f"rank {rank}/{world} {c}"
    r64, rsame = refs[torch.float64], refs[dt]
    assert_fa_rule(out, mine(r64[0]), mine(rsame[0]), mult=2, what=f"{where} out")
    assert_lse(lse, mine(r64[1], lse_dim))
    assert out.requires_grad == bool(c.grads), f"{where}: requires_grad {out.requires_grad}"
    if not c.grads:
        return
    loss = (out * mine(dout)).sum() + ((lse * mine(dlse, lse_dim)).sum() if c.lse_grad else 0)
    grads = torch.autograd.grad(loss, leaves)
    for grad, n in zip(grads, [n for n in "qkv" if n in c.grads]):
        i = "qkv".index(n)
        assert_fa_rule(grad, mine(r64[2 + i]), mine(rsame[2 + i]), mult=3, what=f"{where} d{n}")


def _run(c: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
         scale: float, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    extra: dict[str, Any] = {"sharding": c.sharding, "block_backward": c.block_backward}
    if c.path != "hub_gs":
        if c.sharding == "zigzag" and c.path == "hub":
            del extra["sharding"]  # the default
    else:
        extra["global_seqlens"] = list(c.lens)
    if c.path == "direct":
        local = "reference" if c.softcap or c.dims[0] != c.dims[1] else "torch_flash_cpu"
        return ring_attention(q, k, v, local_backend=local, causal=c.causal, scale=scale,
                              softcap=c.softcap, cu_seqlens=cu if c.thd else None,
                              return_lse=True, sharding=c.sharding,
                              block_backward=c.block_backward,
                              global_seqlens=list(c.lens) if c.seed % 2 else None)
    kw: dict[str, Any] = ({"layout": "thd", "cu_seqlens_q": cu, "cu_seqlens_k": cu}
                          if c.thd else {})
    if c.bhsd:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        kw["layout"] = "bhsd"
    hub = attnhub.Hub(hardware="cpu")
    out, lse = hub.attention(q, k, v, causal=c.causal, scale=scale, return_lse=True,
                             context=attnhub.BindContext(world_size=world), extra=extra, **kw)
    assert hub.bound()[0].decision.backend == "ring", hub.bound()[0].decision.explain()
    return (out.transpose(1, 2) if c.bhsd else out), lse


def sweep_ranks(rank: int, world: int, calls: list[dict[str, Any]]) -> list[str]:
    """Every call in turn on this rank; the failures (the ranks stay in step: a failed
    assertion is local, after the call's collective work)."""
    bad = []
    for fields in calls:
        c = Call(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
        try:
            check_call(rank, world, c)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, with its call
            bad.append(f"{type(exc).__name__}: {str(exc)[:600]} ({c})")
    return bad


# -- the failures found, one scenario each, run on every rank -----------------------------------
def _shards(rank: int, world: int, s: int, sharding: str, seed: int = 0, d: int = 8,
            dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """This rank's q, k, v and dout of a random (1, s, 2, d) call, and the full tensors."""
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, s, 2, d, generator=g).to(dtype) for _ in range(4)]
    idx = shard_indices(world, (s,), sharding, rank)[0]
    return [x.index_select(1, idx) for x in full] + full


def _contiguous_causal(rank: int, world: int) -> None:
    """Contiguous shards, causal, told so: exact (they were read as zigzag: wrong)."""
    s = 3 * world + 1
    q, k, v, dout, *full = _shards(rank, world, s, "contiguous", seed=5)
    params = AttnParams(scale=0.3, causal=True)
    refs = {}
    for dt in (torch.float64, torch.float32):
        leaves = [x.to(dt).requires_grad_() for x in full[:3]]
        o, _ = reference_attention(*leaves, params, compute_dtype=dt)
        refs[dt] = [o, *torch.autograd.grad((o * full[3].to(dt)).sum(), leaves)]
    lq, lk, lv = (x.requires_grad_() for x in (q, k, v))
    out = ring_attention(lq, lk, lv, local_backend="torch_flash_cpu", causal=True, scale=0.3,
                         sharding="contiguous")
    grads = torch.autograd.grad((out * dout).sum(), (lq, lk, lv))
    for i, got in enumerate((out, *grads)):
        want = [torch.tensor_split(refs[dt][i], world, 1)[rank]
                for dt in (torch.float64, torch.float32)]
        assert_fa_rule(got, *want, mult=3, what=f"contiguous rank {rank} output {i}")


def _hub_alternates_sharding(rank: int, world: int) -> None:
    """One hub (its hot path after the first call), the sharding alternating per call under
    one ``global_seqlens`` geometry, through ``extra``: every answer exact (both shardings
    give every rank 2 chunks' worth of tokens: the lengths cannot tell them apart)."""
    s = 4 * world
    hub, ctx = attnhub.Hub(hardware="cpu"), attnhub.BindContext(world_size=world)
    for i, sharding in enumerate(("zigzag", "contiguous", "zigzag", "contiguous")):
        q, k, v, _, *full = _shards(rank, world, s, sharding, seed=i, dtype=torch.bfloat16)
        out = hub.attention(q, k, v, causal=True, context=ctx,
                            extra={"sharding": sharding, "global_seqlens": [s]})
        idx = shard_indices(world, (s,), sharding, rank)[0]
        want = [reference_attention(*full[:3], AttnParams(scale=8 ** -0.5, causal=True),
                                    compute_dtype=dt)[0].index_select(1, idx)
                for dt in (torch.float64, torch.bfloat16)]
        assert_fa_rule(out, *want, mult=2, what=f"hub call {i} ({sharding}) rank {rank}")


def _sharding_disagrees(rank: int, world: int) -> None:
    q, k, v, *_ = _shards(rank, world, 4 * world, "zigzag")
    ring_attention(q, k, v, local_backend="torch_flash_cpu", causal=True,
                   sharding="contiguous" if rank == 1 else "zigzag")


def _sharding_unknown(rank: int, world: int) -> None:
    q, k, v, *_ = _shards(rank, world, 4 * world, "zigzag")
    ring_attention(q, k, v, local_backend="torch_flash_cpu", causal=True,
                   sharding="striped" if rank == 1 else "zigzag")


def _double_backward(rank: int, world: int) -> None:
    """create_graph=True: exact first-order gradients, then a clear error at the second."""
    q, k, v, dout, *full = _shards(rank, world, 2 * world + 3, "zigzag", seed=9)
    params = AttnParams(scale=0.3, causal=True)
    leaves = [x.double().requires_grad_() for x in full[:3]]
    o, _ = reference_attention(*leaves, params)
    want = torch.autograd.grad((o * full[3].double()).sum(), leaves[0])[0]
    lq, lk, lv = (x.requires_grad_() for x in (q, k, v))
    out = ring_attention(lq, lk, lv, local_backend="torch_flash_cpu", causal=True, scale=0.3)
    (dq,) = torch.autograd.grad((out * dout).sum(), lq, create_graph=True)
    idx = shard_indices(world, (full[0].shape[1],), "zigzag", rank)[0]
    err = float((dq.double() - want.index_select(1, idx)).abs().max())
    assert err < 1e-4, f"first-order dq under create_graph: error {err:.2e}"
    dq.square().sum().backward()  # must raise RingError on every rank


def _reverts_alone(rank: int, world: int) -> None:
    """global_seqlens: causal, then full on every rank, then rank 1 alone goes back to
    causal. Its call was agreed before, so it skipped the handshake and ran causal blocks
    against the others' full ones: a silently wrong answer. Now it must raise everywhere."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=5))
    s = 4 * world
    q, k, v, *_ = _shards(rank, world, s, "zigzag")
    for causal in (True, False, rank == 1):
        ring_attention(q, k, v, local_backend="torch_flash_cpu", causal=causal,
                       global_seqlens=[s], group=group)


def _forced_flash_lse_grad_on_some_ranks(rank: int, world: int) -> None:
    """block_backward="flash" with a loss on the LSE: the ranks holding tokens could not run
    it and raised alone, the empty rank waited in its hops (S = W - 1: the last rank holds
    none). Every rank must refuse alike (each drains the ring, then all raise, naming
    every rank once)."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=5))
    q, k, v, *_ = _shards(rank, world, world - 1, "zigzag")
    lq = q.requires_grad_()
    out, lse = ring_attention(lq, k, v, local_backend="torch_flash_cpu", causal=True,
                              return_lse=True, block_backward="flash", group=group)
    (out.sum() + lse.sum()).backward()


def _block_backward_disagrees(rank: int, world: int) -> None:
    """Rank 1 forces flash, the others pick: with an LSE loss rank 1 alone would raise."""
    q, k, v, *_ = _shards(rank, world, 4 * world + 1, "zigzag")
    ring_attention(q.requires_grad_(), k, v, local_backend="torch_flash_cpu", causal=True,
                   block_backward="flash" if rank == 1 else "auto")


def _block_backward_unknown(rank: int, world: int) -> None:
    """A kernel name that does not exist: refused before the forward, on every rank."""
    q, k, v, *_ = _shards(rank, world, 4 * world + 1, "zigzag")
    with torch.no_grad():  # it used to surface only in a backward, which this call has not
        ring_attention(q, k, v, local_backend="torch_flash_cpu", causal=True,
                       block_backward="fast" if rank == 1 else "auto")


SCENARIOS: dict[str, Callable[[int, int], None]] = {
    "contiguous_causal": _contiguous_causal, "hub_alternates": _hub_alternates_sharding,
    "sharding_disagrees": _sharding_disagrees,
    "sharding_unknown": _sharding_unknown, "double_backward": _double_backward,
    "forced_flash_lse_grad": _forced_flash_lse_grad_on_some_ranks,
    "block_backward_disagrees": _block_backward_disagrees,
    "block_backward_unknown": _block_backward_unknown,
    "reverts_alone": _reverts_alone,
}


def scenario_ranks(rank: int, world: int, names: list[str]) -> dict[str, str]:
    """Per scenario: ``ok`` or the exception's type and message on this rank."""
    return run_scenarios(SCENARIOS, rank, world, names)


def run_scenarios(table: dict[str, Any], rank: int, world: int,
                  names: list[str]) -> dict[str, str]:
    """``table[name](rank, world)`` for each name: ``ok`` or the exception it raised."""
    out = {}
    for name in names:
        try:
            table[name](rank, world)
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported to the test, which judges it
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def launch_ranks(rank: int, world: int, calls: list[dict[str, Any]], names: list[str]
                 ) -> tuple[list[str], dict[str, str]]:
    """One launch per world size (process start-up dominates): the sweep, then the
    scenarios (``reverts_alone`` last: it leaves its own group broken)."""
    return sweep_ranks(rank, world, calls), scenario_ranks(rank, world, names)


#: (world size, random calls, seed, scenarios?): the seed is in every failure message
LAUNCHES = {1: (3, 101, False), 2: (6, 202, True), 3: (3, 303, False), 4: (2, 404, False)}
_LAUNCHED: dict[int, list[tuple[list[str], dict[str, str]]]] = {}


def _launched(run_on_ranks: Callable[..., list[Any]], world: int
              ) -> list[tuple[list[str], dict[str, str]]]:
    if world not in _LAUNCHED:
        n, seed, scenarios = LAUNCHES[world]
        calls = [asdict(c) for c in random_calls(world, n, seed)]
        _LAUNCHED[world] = run_on_ranks(HERE, "launch_ranks", world, calls,
                                        list(SCENARIOS) if scenarios else [], timeout=240)
    return _LAUNCHED[world]


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_random_ring_calls_match_one_device_by_the_flash_attention_rule(
        run_on_ranks: Callable[..., list[Any]], world: int) -> None:
    bad = [m for sweep, _ in _launched(run_on_ranks, world) for m in sweep]
    assert not bad, f"seed {LAUNCHES[world][1]}:\n" + "\n".join(bad)


#: per scenario, what each rank must say: (rank 1's words, the other ranks' words)
EXPECT = {
    "contiguous_causal": ("ok", "ok"),
    "hub_alternates": ("ok", "ok"),
    "sharding_disagrees": ("RingError: ring: the {w} ranks disagree on sharding: rank 0: "
                           "zigzag, rank 1: contiguous",) * 2,
    "sharding_unknown": ("RingError: ring: sharding='striped'",
                         "RingError: ring: rank 1 of {w} cannot run this call (ring: "
                         "sharding='striped'"),
    "double_backward": ("RingError: ring: second-order gradients",) * 2,
    "forced_flash_lse_grad": ("RingError: ring: ranks 0, 1 of {w} failed in the ring's "
                              "backward before its first block: InputError: ring: "
                              "block_backward='flash' cannot serve",) * 2,
    "block_backward_disagrees": ("RingError: ring: the {w} ranks disagree on block backward: "
                                 "rank 0: auto, rank 1: flash",) * 2,
    "block_backward_unknown": ("RingError: ring: block_backward='fast'",
                               "RingError: ring: rank 1 of {w} cannot run this call (ring: "
                               "block_backward='fast'"),
    "reverts_alone": ("RingError: ring: rank 1 of {w} got no answer",
                      "RingError: ring: a K/V hop"),
}


@pytest.mark.parametrize("world", [w for w, (_, _, scen) in LAUNCHES.items() if scen])
def test_failures_that_were_silent_or_hung_raise_alike_on_every_rank(
        run_on_ranks: Callable[..., list[Any]], world: int) -> None:
    names = list(SCENARIOS)
    results = [res for _, res in _launched(run_on_ranks, world)]
    problems = []
    for name in names:
        for rank, res in enumerate(results):
            words = EXPECT[name][0 if rank == 1 else 1].format(w=world)
            got = res[name]
            if not (got == "ok" if words == "ok" else got.startswith(words)):
                problems.append(f"{name} rank {rank}/{world}: want {words!r}, got {got!r}")
    rank1 = results[1]["reverts_alone"]
    if "causal: no -> yes" not in rank1:  # the changed rank names what it changed
        problems.append(f"reverts_alone rank 1 does not name the change: {rank1!r}")
    assert not problems, "\n".join(problems)


def test_contiguous_shards_round_trip_and_name_their_helper() -> None:
    """contiguous_shard is torch.tensor_split, the layout indexes the same tokens, and shard
    lengths of the other kind are refused naming the helper and the argument."""
    from attnhub_ring import contiguous_shard, zigzag_shard_varlen, zigzag_unshard_varlen

    rng = random.Random(11)
    for _ in range(20):
        world, s = rng.randint(1, 5), rng.randint(0, 13)
        x = torch.randn(2, s, 3)
        parts = [contiguous_shard(x, r, world) for r in range(world)]
        assert torch.equal(torch.cat(parts, 1), x)
        for r in range(world):
            idx = ZigzagLayout(world, (s,), "contiguous").global_indices(r)
            assert torch.equal(idx, shard_indices(world, (s,), "contiguous", r)[0])
            assert torch.equal(x.index_select(1, idx), parts[r])
        docs = [rng.randint(0, 6) for _ in range(rng.randint(1, 3))]
        y = torch.randn(sum(docs), 2)
        cu = _cu(tuple(docs))
        got = [zigzag_shard_varlen(y, cu, r, world, sharding="contiguous")[0]
               for r in range(world)]
        assert torch.equal(zigzag_unshard_varlen(got, cu, sharding="contiguous"), y)
    with pytest.raises(ValueError, match="sharding"):
        ZigzagLayout(2, (4,), "striped")
    s = rng.randint(1, 9) * 4 + 3  # tensor_split over 2: [s//2 + 1, s//2]; zigzag: reversed
    contiguous = [[len(t)] for t in torch.tensor_split(torch.arange(s), 2)]
    with pytest.raises(InputError, match="sharding='contiguous'"):
        ZigzagLayout.from_local_lens(contiguous)
    with pytest.raises(InputError, match="contiguous_shard"):
        ZigzagLayout.from_local_lens(contiguous[::-1], "contiguous")
