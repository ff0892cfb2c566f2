"""The decode host path: direct launches only reuse a binary for arguments it was specialized
for, Triton's own dispatch is kept where it must be (first launch, launch hooks, switch off),
and reused scratch never leaks into what a call returns.

The launch tests run the compiled (not interpreted) kernels against a stub driver
(``launch_stub``): no GPU, nothing is computed, every launch is checked against the
specialization Triton itself would give its arguments. The scratch tests compute, through
the interpreter on a CPU.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # Triton reads this when a kernel is decorated (import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnhub_triton_portable import decode, fastlaunch, scratch
from triton import knobs
from triton.runtime.jit import JITFunction

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture()
def stubbed(stub_decode: tuple[list[Any], Any]) -> dict[str, Any]:
    """decode on the stub sm90 (``stub_decode``), every launch logged; counts Triton's
    dispatch (``JITFunction.run``) per kernel."""
    kernels, stubs = stub_decode
    dispatched = {fn.__name__: 0 for fn in kernels}
    for fn in kernels:
        def counted(*args: Any, _fn: JITFunction = fn, _run: Any = fn.run, **kw: Any) -> Any:
            dispatched[_fn.__name__] += 1
            return _run(*args, **kw)

        fn.run = counted  # type: ignore[method-assign]
    return {"made": stubs.made, "log": stubs.log, "dispatched": dispatched}


def _launches(made: dict[str, list[Any]]) -> int:
    return sum(k.launches for binaries in made.values() for k in binaries)


#: The properties of a call that decide the kernels' arguments and Triton's specialization,
#: each with the values drawn (strides, a pointer off 16-byte alignment, page sizes and
#: block-table widths including 1, lengths, masks and their side tensors, splits, configs).
ASPECTS: dict[str, list[Any]] = {
    "q": ["plain", "strided", "misaligned"],
    "paged": [False, True],
    "page": [1, 5, 16],
    "width": [1, 3, 16],
    "max_seqlen": [None, "cap", "third"],
    "sk": [1, 17, 300],
    "k": ["plain", "sliced", "every_other"],
    "v": ["plain", "sliced"],
    "seqlens": [False, True],
    "causal": [False, True],
    "alignment": ["bottom_right", "top_left"],
    "window": [None, (3, 0), (16, -1), (-1, 2)],
    "softcap": [None, 5.0, 30],
    "alibi": [None, "h", "bh"],
    "num_splits": [None, 1, 2, 7],
    "fused": [False, True],
}


def _make_call(dims: tuple[Any, ...], a: dict[str, Any]) -> tuple[tuple[torch.Tensor, ...],
                                                                   dict[str, Any]]:
    """The decode call of sizes ``dims`` with properties ``a`` (see ``ASPECTS``)."""
    dtype, b, sq, hkv, group, d = dims
    hq = hkv * group
    mk = lambda *s: torch.randn(*s).to(dtype)
    q = {"plain": lambda: mk(b, sq, hq, d), "strided": lambda: mk(b, sq, hq, d + 3)[..., :d],
         "misaligned": lambda: mk(b * sq * hq * d + 1)[1:].view(b, sq, hq, d)}[a["q"]]()
    kw: dict[str, Any] = {"scale": 0.3, "causal": a["causal"], "alignment": a["alignment"],
                          "window": a["window"], "softcap": a["softcap"],
                          "num_splits": a["num_splits"]}
    if a["paged"]:
        page, width = a["page"], a["width"]
        k, v = mk(b * width + 2, page, hkv, d), mk(b * width + 2, page, hkv, d)
        cap = width * page
        kw.update(block_table=torch.randperm(b * width + 2)[: b * width].view(b, width)
                  .to(torch.int32),
                  seqlens_k=torch.randint(0, cap + 1, (b,), dtype=torch.int32),
                  max_seqlen_k={None: None, "cap": cap, "third": max(1, cap // 3)}[
                      a["max_seqlen"]])
    else:
        sk = a["sk"]
        k = {"plain": lambda: mk(b, sk, hkv, d), "sliced": lambda: mk(b, sk + 5, hkv, d)[:, :sk],
             "every_other": lambda: mk(b, sk, hkv, 2 * d)[..., ::2]}[a["k"]]()
        v = mk(b, sk, hkv, d) if a["v"] == "plain" else mk(b, sk + 3, hkv, d)[:, :sk]
        if a["seqlens"]:
            kw["seqlens_k"] = torch.randint(0, sk + 1, (b,), dtype=torch.int32)
    if a["alibi"] is not None:
        kw["alibi_slopes"] = torch.rand(hq) if a["alibi"] == "h" else torch.rand(b, hq)
    if a["fused"]:
        kw["config"] = decode.decode_config("sm90").with_(fused_merge=True)
    return (q, k, v), kw


def _tokens(log: list[Any], out: torch.Tensor, lse: torch.Tensor) -> list[Any]:
    """Launches as comparable values: the call's outputs by role, other tensors by dtype,
    shape, strides and contents (so a stale tensor from an earlier call shows), the rest
    by type and value."""
    def token(x: Any) -> Any:
        if x is out or x is lse:
            return "out" if x is out else "lse"
        if isinstance(x, torch.Tensor):
            return (x.dtype, tuple(x.shape), x.stride(), x.data_ptr() % 16 == 0,
                    hash(x.contiguous().view(torch.uint8).numpy().tobytes()))
        return (type(x), x)

    return [(name, grid, [token(a) for a in args]) for name, grid, args in log]


def test_cached_launches_equal_fresh_ones(stubbed: dict[str, Any]) -> None:
    """Random calls, each followed by one variant per property (``ASPECTS``) that differs
    from it in that property alone: every call launches what a cold cache would launch
    (grids, arguments, tensors), its repeat launches the same without Triton's dispatch, and
    every launch gets arguments that Triton specializes exactly as the binary launched (the
    stub raises otherwise). A cache key that missed a property would let a variant reuse
    its base's launches and differ from the cold ones."""
    rng = random.Random(0)
    torch.manual_seed(0)
    log, dispatched = stubbed["log"], stubbed["dispatched"]

    def launched(args: tuple[torch.Tensor, ...], kw: dict[str, Any]) -> list[Any]:
        log.clear()
        return _tokens(log, *decode.decode_attention(*args, **kw))

    for _ in range(20):
        dims = (rng.choice([torch.float16, torch.bfloat16, torch.float32]), rng.choice([1, 3]),
                rng.choice([1, 5]), rng.choice([1, 2]), rng.choice([1, 6]), rng.choice([16, 40]))
        base = {name: rng.choice(values) for name, values in ASPECTS.items()}
        variants = [base] + [{**base, name: rng.choice([x for x in values if x != base[name]])}
                             for name, values in ASPECTS.items()]
        for aspects in variants:
            args, kw = _make_call(dims, aspects)
            cached = launched(args, kw)
            before = sum(dispatched.values())
            again = launched(args, kw)
            assert sum(dispatched.values()) == before, aspects  # the repeat went direct
            kept, families = dict(decode._shapes), dict(decode._families)
            decode._shapes.clear()
            decode._families.clear()
            fresh = launched(args, kw)
            decode._shapes.update(kept)
            decode._families.update(families)
            assert cached == fresh == again, aspects


def test_context_length_picks_its_split_count(stubbed: dict[str, Any]) -> None:
    """One paged layout, longest context 256 then 64 then 256 keys (sm90: 4 key tiles, then
    1): the cached launches follow the length, as cold ones do."""
    q, kc = torch.randn(1, 1, 8, 32), torch.randn(20, 16, 2, 32)
    table = torch.randperm(20)[:16].view(1, 16).to(torch.int32)
    lens = torch.tensor([200], dtype=torch.int32)
    grids = []
    for longest in (256, 64, 256):
        stubbed["log"].clear()
        decode.decode_attention(q, kc, kc, scale=0.2, block_table=table, seqlens_k=lens,
                                max_seqlen_k=longest)
        grids.append(stubbed["log"][0][1])
    assert grids[0] == grids[2] != grids[1]
    assert grids[0][0] > 1 and grids[1][0] == 1  # splits


@pytest.mark.parametrize("layout", ["bshd", "bhsd view"])
def test_growing_cache_is_rebased_and_launches_as_cold(stubbed: dict[str, Any],
                                                       layout: str) -> None:
    """A contiguous cache one key longer every call (a DynamicCache decode loop; HF's bhsd
    cache reaches the kernel as a transposed view): each new length reuses the launchers of
    an earlier one (the capacity and strides change, their Triton specialization does not),
    launches exactly what a cold cache launches (the stub checks every argument's
    specialization against the binary), and Triton's dispatch runs once per binary only."""
    log, dispatched = stubbed["log"], stubbed["dispatched"]
    big = torch.randn(2, 90, 2, 32), torch.randn(2, 90, 2, 32)
    q = torch.randn(2, 1, 8, 32)
    for n in range(30, 75):
        k, v = (x[:, :n].contiguous() if layout == "bshd"
                else x[:, :n].transpose(1, 2).contiguous().transpose(1, 2) for x in big)
        log.clear()
        got = _tokens(log, *decode.decode_attention(q, k, v, scale=0.2))
        kept, families = dict(decode._shapes), dict(decode._families)
        decode._shapes.clear()
        decode._families.clear()
        log.clear()
        cold = _tokens(log, *decode.decode_attention(q, k, v, scale=0.2))
        decode._shapes.update(kept)
        decode._families.update(families)
        assert got == cold, n
    binaries = sum(len(m) for m in stubbed["made"].values())
    # the cold calls above dispatch every time; the rebased ones at most once per binary
    assert dispatched["_split_kernel"] <= 45 + len(stubbed["made"]["_split_kernel"]), binaries


def test_a_walk_keeps_only_its_last_lengths(stubbed: dict[str, Any]) -> None:
    """A growing cache's shapes are kept for its last ``_RECENT_LIMIT`` lengths only (each
    length is called for one step, by every layer, then never again): the shape cache stays
    small over a long walk, and a length met again after it was dropped launches what a cold
    cache launches."""
    log = stubbed["log"]
    big = torch.randn(2, 200, 2, 32)
    q = torch.randn(2, 1, 8, 32)
    view = lambda n: big[:, :n].transpose(1, 2).contiguous().transpose(1, 2)
    for n in range(30, 190):
        decode.decode_attention(q, view(n), view(n), scale=0.2)
        assert len(decode._shapes) <= decode._RECENT_LIMIT + 2, n  # + the built ones
        assert len(decode._recent) <= decode._RECENT_LIMIT
    for n in (31, 100, 188):  # dropped (31, 100) and still kept (188)
        log.clear()
        again = _tokens(log, *decode.decode_attention(q, view(n), view(n), scale=0.2))
        kept, families = dict(decode._shapes), dict(decode._families)
        decode._shapes.clear()
        decode._families.clear()
        log.clear()
        cold = _tokens(log, *decode.decode_attention(q, view(n), view(n), scale=0.2))
        decode._shapes.update(kept)
        decode._families.update(families)
        assert again == cold, n


@pytest.mark.parametrize("layers", [1, 3])
def test_a_new_length_is_served_from_its_family_then_stored(stubbed: dict[str, Any],
                                                            layers: int) -> None:
    """A decode step of ``layers`` layers at a new length (each layer its own cache
    tensors): the first call launches from the family's shape without storing one for the
    length, the next layer's call stores it, the rest hit it; every call launches what a
    cold cache launches. A one-layer walk stores no shape but its families' first ones."""
    log = stubbed["log"]
    caches = [torch.randn(2, 120, 2, 32) for _ in range(layers)]
    q = torch.randn(2, 1, 8, 32)
    view = lambda x, n: x[:, :n].transpose(1, 2).contiguous().transpose(1, 2)
    decode.decode_attention(q, view(caches[0], 30), view(caches[0], 30), scale=0.2)
    for n in range(31, 100):
        for i, x in enumerate(caches):
            log.clear()
            families_before, recent = len(decode._families), list(decode._recent)
            got = _tokens(log, *decode.decode_attention(q, view(x, n), view(x, n), scale=0.2))
            if i == 0:  # the length founded a family (divisible by 16): stored as built
                founded = len(decode._families) > families_before
            # a shape stored for the length: rebased on the second call (the recent ones)
            assert (list(decode._recent) != recent) == (i == 1 and not founded), (n, i)
            kept, families = dict(decode._shapes), dict(decode._families)
            decode._shapes.clear()
            decode._families.clear()
            log.clear()
            cold = _tokens(log, *decode.decode_attention(q, view(x, n), view(x, n), scale=0.2))
            decode._shapes.clear()
            decode._shapes.update(kept)
            decode._families.clear()
            decode._families.update(families)
            assert got == cold, (n, i)
    if layers == 1:  # each family's first shape only
        assert len(decode._shapes) == len(decode._families) == 2 and not decode._recent


def test_a_growing_e4m3_cache_launches_as_cold(stubbed: dict[str, Any]) -> None:
    """The family path with an e4m3 contiguous cache and per-(sequence, KV head) descales
    (their strides sit after k's and v's in the launch): each new length, first call and
    the next layer's, launches what a cold cache launches."""
    log = stubbed["log"]
    cache = torch.randn(2, 120, 2, 32).to(torch.float8_e4m3fn)
    kd, vd = torch.rand(2, 2) + 0.5, torch.rand(2, 2) + 0.5
    q = torch.randn(2, 1, 8, 32).to(torch.bfloat16)
    view = lambda n: cache[:, :n].transpose(1, 2).contiguous().transpose(1, 2)
    for n in range(30, 60):
        for _ in range(2):  # two layers: the family path, then the stored shape
            kv = view(n)
            log.clear()
            got = _tokens(log, *decode.decode_attention(q, kv, kv, scale=0.2, k_descale=kd,
                                                        v_descale=vd))
            kept, families = dict(decode._shapes), dict(decode._families)
            decode._shapes.clear()
            decode._families.clear()
            log.clear()
            cold = _tokens(log, *decode.decode_attention(q, kv, kv, scale=0.2, k_descale=kd,
                                                         v_descale=vd))
            decode._shapes.clear()
            decode._shapes.update(kept)
            decode._families.clear()
            decode._families.update(families)
            assert got == cold, n


@pytest.mark.parametrize("known", [False, True])
def test_a_growing_cache_whose_v_lags_is_refused(stubbed: dict[str, Any], known: bool) -> None:
    """k one key longer than v: refused before any launch, whether the length is new to a
    known family (``rebased``, which reads the shapes from the call's key) or the first."""
    log = stubbed["log"]
    q, big = torch.randn(2, 1, 8, 32), torch.randn(2, 80, 2, 32)
    if known:
        decode.decode_attention(q, big[:, :40].contiguous(), big[:, :40].contiguous(),
                                scale=0.2)
    log.clear()
    with pytest.raises(ValueError, match="k .* and v .* must .* agree"):
        decode.decode_attention(q, big[:, :51].contiguous(), big[:, :50].contiguous(),
                                scale=0.2)
    assert not log


def test_growing_cache_builds_launches_once_per_split_count(stubbed: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A growing cache's lengths share their family's launches per split count (only the
    split kernel's capacity argument is patched): one build per split count and family, not
    one per length (474 builds over 598 lengths before, on the CPU box's growing-cache bench)."""
    built: list[int] = []
    real = decode._Shape._build

    def counting(self, plan):  # type: ignore[no-untyped-def]
        built.append(plan.splits)
        return real(self, plan)

    monkeypatch.setattr(decode._Shape, "_build", counting)
    big = torch.randn(2, 200, 2, 32)
    q = torch.randn(2, 1, 8, 32)
    for n in range(30, 190):
        k = big[:, :n].transpose(1, 2).contiguous().transpose(1, 2)
        decode.decode_attention(q, k, k, scale=0.2)
    # several split counts met, each built once per family (a length divisible by 16 or
    # not: two Triton specializations), never once per length
    assert len(set(built)) >= 2 and all(built.count(n) <= 2 for n in built), built


def test_alignment_and_strides_pick_their_own_binary(stubbed: dict[str, Any]) -> None:
    """The same shapes with q 16-byte aligned and then not: Triton compiles the kernel
    twice, and the misaligned call does not reuse the aligned binary (the stub would raise)."""
    q = torch.randn(1, 1, 8, 32)
    k, v = torch.randn(1, 64, 2, 32), torch.randn(1, 64, 2, 32)
    shifted = torch.randn(8 * 32 + 1)[1:].view(1, 1, 8, 32)
    assert q.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 != 0
    for query in (q, shifted, q, shifted):
        decode.decode_attention(query, k, v, scale=0.2)
    assert len(stubbed["made"]["_split_kernel"]) == 2
    assert stubbed["dispatched"]["_split_kernel"] == 2  # one per binary, then direct


def test_hooks_and_switch_send_launches_through_triton(stubbed: dict[str, Any],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered launch hook (a profiler) or DIRECT = False: every launch is Triton's."""
    q, k, v = torch.randn(1, 1, 8, 32), torch.randn(1, 64, 2, 32), torch.randn(1, 64, 2, 32)
    run = lambda: decode.decode_attention(q, k, v, scale=0.2, num_splits=2)
    run()
    count = lambda: sum(stubbed["dispatched"].values())
    start = count()
    run()
    assert count() == start  # direct
    hook = lambda metadata: None
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        run()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert count() == start + 2
    monkeypatch.setattr(fastlaunch, "DIRECT", False)
    run()
    assert count() == start + 4


def test_scratch_is_reused_per_thread_and_stream_and_aligned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Same sizes on the same stream: the same buffers; another stream or thread: its own;
    views 16-byte aligned and disjoint after the buffer grows; while capturing: fresh ones."""
    dev = torch.device("cpu")
    sizes = (60, 6, 3)
    first = scratch.fp32(dev, 0, sizes, False)
    again = scratch.fp32(dev, 0, sizes, False)
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in first]
    assert scratch.fp32(dev, 7, sizes, False)[0].data_ptr() != first[0].data_ptr()
    big = scratch.fp32(dev, 0, (999 * 33, 999, 5), False)
    assert [t.numel() for t in big] == [999 * 33, 999, 5]
    assert all(t.data_ptr() % 16 == 0 and t.dtype == torch.float32 for t in big)
    spans = sorted((t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in big)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    other: list[int] = []
    t = threading.Thread(target=lambda: other.append(
        scratch.fp32(dev, 0, (999 * 33, 999, 5), False)[0].data_ptr()))
    t.start()
    t.join()
    assert other[0] != big[0].data_ptr()
    monkeypatch.setattr(scratch, "capturing", lambda cuda: True)
    fresh = [scratch.fp32(dev, 0, sizes, False)[0] for _ in range(2)]  # both alive
    ptrs = {big[0].data_ptr(), first[0].data_ptr(), *(f.data_ptr() for f in fresh)}
    assert len(ptrs) == 4
    counters = [scratch.zeroed_counters(dev, 0, 4, False) for _ in range(2)]
    assert counters[0].data_ptr() != counters[1].data_ptr()


def test_outputs_survive_later_calls() -> None:
    """Interpreter: the outputs of a split call are new tensors, untouched by the next call
    (which reuses the partials scratch), and equal to a repeat of the same call."""
    g = torch.Generator().manual_seed(7)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV)
    q, k, v = mk(2, 1, 4, 16), mk(2, 40, 2, 16), mk(2, 40, 2, 16)
    out, lse = decode.decode_attention(q, k, v, scale=0.25, num_splits=3)
    kept = out.clone(), lse.clone()
    decode.decode_attention(mk(2, 1, 4, 16), mk(2, 40, 2, 16), mk(2, 40, 2, 16), scale=0.25,
                            num_splits=3)
    assert torch.equal(out, kept[0]) and torch.equal(lse, kept[1])
    again = decode.decode_attention(q, k, v, scale=0.25, num_splits=3)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    assert out.data_ptr() != again[0].data_ptr()


def test_no_lse_asked_same_out_and_binaries(stubbed: dict[str, Any]) -> None:
    """``return_lse=False`` (the LSE goes to scratch): the same launches, binaries and grids
    as with the LSE returned, and no LSE back."""
    q, kc = torch.randn(2, 3, 8, 32), torch.randn(20, 16, 2, 32)
    kw = {"block_table": torch.randperm(20)[:8].view(2, 4).to(torch.int32),
          "seqlens_k": torch.tensor([50, 9], dtype=torch.int32), "causal": True}
    log = stubbed["log"]
    for splits in (1, 3):
        log.clear()
        decode.decode_attention(q, kc, kc, scale=0.2, num_splits=splits, **kw)
        with_lse = [(name, grid) for name, grid, _ in log]
        made = {name: len(b) for name, b in stubbed["made"].items()}
        log.clear()
        _, lse = decode.decode_attention(q, kc, kc, scale=0.2, num_splits=splits,
                                         return_lse=False, **kw)
        assert lse is None
        assert [(name, grid) for name, grid, _ in log] == with_lse
        assert {name: len(b) for name, b in stubbed["made"].items()} == made


@pytest.mark.parametrize("splits", [1, 3])
def test_no_lse_asked_computes_the_same_out(splits: int) -> None:
    """Interpreter: the output with the LSE kept in scratch is bit for bit the output with
    it returned, a fresh tensor each call."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(*s, generator=g).to(DEV) for s in
               ((2, 1, 4, 16), (2, 40, 2, 16), (2, 40, 2, 16)))
    out, lse = decode.decode_attention(q, k, v, scale=0.25, num_splits=splits)
    first, none = decode.decode_attention(q, k, v, scale=0.25, num_splits=splits,
                                          return_lse=False)
    again, _ = decode.decode_attention(q, k, v, scale=0.25, num_splits=splits,
                                       return_lse=False)
    assert none is None and lse is not None
    assert torch.equal(first, out) and torch.equal(again, out)
    assert len({out.data_ptr(), first.data_ptr(), again.data_ptr()}) == 3


@pytest.mark.parametrize("shape", [(1, 1, 32, 128), (2, 3, 4, 8), (1, 1, 1, 1), (0, 1, 4, 8),
                                   (3, 2, 0), (1,)])
def test_output_allocators_make_fresh_contiguous_tensors(shape: tuple[int, ...]) -> None:
    """What ``_Shape`` allocates outputs with: torch.empty's shape, dtype and strides, a
    new tensor per call (no aliasing of the template or of each other)."""
    make = decode._allocator(shape, torch.bfloat16, torch.device("cpu"))
    a, b = make(), make()
    want = torch.empty(shape, dtype=torch.bfloat16)
    for t in (a, b):
        assert (t.shape, t.stride(), t.dtype, t.device) == (
            want.shape, want.stride(), want.dtype, want.device)
        assert t.is_contiguous() and t._base is None
    if a.numel():
        assert a.data_ptr() != b.data_ptr()
        a.fill_(1.0)
        b.fill_(2.0)
        assert bool((a == 1.0).all())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_another_device_than_the_current_one() -> None:
    """q/k/v on cuda:1 while cuda:0 is current: launched on cuda:1 (under a device guard),
    the same result as on cuda:0, and cuda:0 stays current."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in
               ((2, 1, 8, 64), (2, 500, 2, 64), (2, 500, 2, 64)))
    torch.cuda.set_device(0)
    here = decode.decode_attention(q.cuda(0), k.cuda(0), v.cuda(0), scale=0.125)
    for _ in range(2):  # the second call takes the cached shape
        there = decode.decode_attention(q.cuda(1), k.cuda(1), v.cuda(1), scale=0.125)
        assert torch.cuda.current_device() == 0 and there[0].device == torch.device("cuda", 1)
        assert torch.equal(there[0].cpu(), here[0].cpu())
        assert torch.equal(there[1].cpu(), here[1].cpu())
