"""The hot path's memos: ``cu_seqlens`` and paged tables are read once per change (not once
per layer), backends read the hub's private snapshots, a KV cache's own tables come with a
proof (no read-back), the exact-shape table hands backends the same ``AttnParams`` as the
checked path, and devices compare canonically (``"cuda"`` is ``cuda:<current>``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnhub
from attnhub.core import contract, tables
from attnhub.core.backend import AttentionOutput, Backend
from attnhub.core.capabilities import ALL_MASKS, Capabilities
from attnhub.core.contract import canonical_device, same_device
from attnhub.core.kvcache import PagedKVCache
from attnhub.core.paged import paged_to_varlen
from attnhub.core.reference import reference_attention
from attnhub.core.registry import Registry
from attnhub.core.spec import AttnParams
from attnhub.errors import SeqlensError
from attnhub.testing import assert_fa_rule, fa_references


class Spy(Backend):
    """The reference, recording the params every call hands it."""

    name = "spy"
    tier = "portable"
    capabilities = Capabilities(dtypes=frozenset({"fp32"}), max_head_dim=256,
                                layouts=frozenset({"bshd", "thd", "paged"}),
                                different_v_dim=True, gqa=True, masks=ALL_MASKS)

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[AttnParams] = []

    def forward(self, q, k, v, spec, params):  # type: ignore[override]
        self.seen.append(params)
        if spec.layout == "paged":
            qv, kv, vv, cq, ck = paged_to_varlen(q, k, v, params.block_table, params.seqlens_k)
            p = dataclasses.replace(params, cu_seqlens_q=cq, cu_seqlens_k=ck)
            out, lse = reference_attention(qv, kv, vv, p, layout="thd")
            return AttentionOutput(out.to(q.dtype).reshape(*q.shape[:-1], v.shape[-1]), None)
        out, lse = reference_attention(q, k, v, params, layout=spec.layout)
        return AttentionOutput(out.to(q.dtype), lse if params.return_lse else None)


@pytest.fixture()
def spy_hub():
    spy = Spy()
    return attnhub.Hub(registry=Registry.of(spy, plugin="spy"), hardware="cpu"), spy


def _counting(monkeypatch, module, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*a, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def _fields(p: AttnParams) -> dict:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}


@pytest.mark.parametrize("kw", [
    dict(causal=True),
    dict(causal=True, scale=0.3, softcap=20.0, window=(3, 0)),
    dict(alibi_slopes=torch.rand(4), extra={"note": 1}),
])
def test_fast_path_hands_backends_the_checked_params(spy_hub, kw):
    """The first call goes through check_call (keyword AttnParams), the second through the
    exact-shape table (positional): every field the backend sees is the same."""
    hub, spy = spy_hub
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)
    outs = [hub.attention(q, k, v, backend="spy", **kw) for _ in range(2)]
    assert len({id(e) for e in hub._exact.values()}) == 1 and len(spy.seen) == 2
    assert _fields(spy.seen[0]) == _fields(spy.seen[1])
    assert torch.equal(outs[0], outs[1])
    ref64, _, same = fa_references(q, k, v, spy.seen[0])
    assert_fa_rule(outs[1], ref64, same)


@pytest.fixture
def counted_hub(spy_hub, monkeypatch):
    """The spy hub and a list that grows by one per ``check_call`` (the slow path)."""
    checks = _counting(monkeypatch, contract, "check_call")
    monkeypatch.setattr("attnhub.hub.check_call", contract.check_call)
    return (*spy_hub, checks)


def _checked_call(hub, spy, q, kv, layout, ax) -> AttnParams:
    """One causal call (k = v = ``kv``) through the spy: its output shape and the FA rule
    checked; the params the backend saw."""
    out = hub.attention(q, kv, kv, layout=layout, causal=True, backend="spy")
    assert out.shape == q.shape
    ref64, _, same = fa_references(*(t.transpose(1, ax) for t in (q, kv, kv)), spy.seen[-1])
    assert_fa_rule(out.transpose(1, ax), ref64, same)
    return spy.seen[-1]


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_growing_kv_cache_takes_the_fast_path(counted_hub, layout):
    """Decode on a contiguous cache sees a new key length every step: the steps of one
    length bucket are served by the table (no check_call), each with its own length, and a
    v that disagrees with k on the length still gets the slow path's error."""
    hub, spy, checks = counted_hub
    ax = 1 if layout == "bshd" else 2
    q = torch.randn(2, 1, 4, 8).transpose(1, ax)
    kv = torch.randn(2, 40, 2, 8).transpose(1, ax)
    for sk in range(17, 33):  # one bucket (32)
        k = kv.narrow(ax, 0, sk)
        assert _checked_call(hub, spy, q, k, layout, ax).max_seqlen_k == sk
    assert len(checks) == 1
    with pytest.raises(attnhub.InputError, match="keys"):
        hub.attention(q, kv.narrow(ax, 0, 20), kv.narrow(ax, 0, 21), layout=layout,
                      causal=True, backend="spy")


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_prompts_of_a_new_length_take_the_fast_path(counted_hub, layout):
    """Prefill at a new prompt length per call (serving, generate() on new prompts): the
    calls of one (Sq, Sk) bucket pair are served by the table, each with its own lengths
    and output shape; a call with one query (decode, another phase) is bound anew."""
    hub, spy, checks = counted_hub
    ax = 1 if layout == "bshd" else 2
    qb = torch.randn(2, 40, 4, 8).transpose(1, ax)
    kv = torch.randn(2, 40, 2, 8).transpose(1, ax)
    for s in (17, 30, 23, 32):  # one bucket (32) for both
        p = _checked_call(hub, spy, qb.narrow(ax, 0, s), kv.narrow(ax, 0, s), layout, ax)
        assert (p.max_seqlen_q, p.max_seqlen_k) == (s, s)
    assert len(checks) == 1
    q1 = qb.narrow(ax, 0, 1)  # one query on 20 keys: decode, not the prefill binding
    hub.attention(q1, kv.narrow(ax, 0, 20), kv.narrow(ax, 0, 20), layout=layout,
                  causal=True, backend="spy")
    assert len(checks) == 2 and hub.bound()[-1].decision.spec.phase == "decode"
    q2 = qb.narrow(ax, 0, 2)  # two queries: prefill again, bucket 2 (a new binding)
    hub.attention(q2, kv.narrow(ax, 0, 20), kv.narrow(ax, 0, 20), layout=layout,
                  causal=True, backend="spy")
    assert len(checks) == 3 and spy.seen[-1].max_seqlen_q == 2


def _varlen(lens_q, lens_k):
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],  # noqa: E731
                                   dtype=torch.int32)
    return (torch.randn(sum(lens_q), 4, 8), torch.randn(sum(lens_k), 2, 8),
            torch.randn(sum(lens_k), 2, 8), cu(lens_q), cu(lens_k))


def test_thd_offsets_checked_once_per_change(spy_hub, monkeypatch):
    hub, spy = spy_hub
    checks = _counting(monkeypatch, tables, "_check_cu_contents")
    q, k, v, cq, ck = _varlen([3, 5, 2], [4, 6, 2])
    for _ in range(4):  # the layers of one step: one check of each tensor
        out = hub.attention(q, k, v, layout="thd", cu_seqlens_q=cq, cu_seqlens_k=ck,
                            causal=True, backend="spy")
    assert len(checks) == 2
    p = spy.seen[-1]
    assert p.cu_seqlens_q is not cq and torch.equal(p.cu_seqlens_q, cq)  # a private snapshot
    assert (p.max_seqlen_q, p.max_seqlen_k) == (5, 6)
    ref64, _, same = fa_references(q, k, v, p, layout="thd")
    assert_fa_rule(out, ref64, same)
    # new offsets of the same shape (another step): checked again, new longest lengths
    _, _, _, cq2, ck2 = _varlen([1, 1, 8], [1, 1, 10])
    hub.attention(q, k, v, layout="thd", cu_seqlens_q=cq2, cu_seqlens_k=ck2, causal=True,
                  backend="spy")
    assert len(checks) == 4 and spy.seen[-1].max_seqlen_k == 10


@pytest.mark.parametrize("how", ["inplace", "data"])
def test_thd_memo_sees_edits(spy_hub, how):
    """An edit in place (``_version`` bumps) or through ``.data`` (it does not; the CPU
    compares the snapshot) is checked again: a bad offset is an error, never a stale read."""
    hub, spy = spy_hub
    q, k, v, cq, ck = _varlen([3, 5, 2], [4, 6, 2])
    kw = dict(layout="thd", cu_seqlens_q=cq, cu_seqlens_k=ck, backend="spy")
    hub.attention(q, k, v, **kw)
    (ck if how == "inplace" else ck.data)[1] = 11  # not monotonic any more
    with pytest.raises(SeqlensError, match="monotonic"):
        hub.attention(q, k, v, **kw)
    (ck if how == "inplace" else ck.data)[1] = 2  # valid again, other lengths
    out = hub.attention(q, k, v, **kw)
    p = spy.seen[-1]
    assert torch.equal(p.cu_seqlens_k, ck) and p.max_seqlen_k == 8
    ref64, _, same = fa_references(q, k, v, p, layout="thd")
    assert_fa_rule(out, ref64, same)


def test_thd_max_seqlen_below_true_rejected_on_the_fast_path(spy_hub):
    hub, _ = spy_hub
    q, k, v, cq, ck = _varlen([3, 5, 2], [4, 6, 2])
    kw = dict(layout="thd", cu_seqlens_q=cq, max_seqlen_q=5, backend="spy")
    hub.attention(q, k, v, cu_seqlens_k=ck, **kw)
    _, _, _, _, ck2 = _varlen([3, 5, 2], [1, 1, 10])
    hub.attention(q, k, v, cu_seqlens_k=ck2, **kw)  # same key: the fast path
    cq[1:] = torch.tensor([1, 9, 10], dtype=torch.int32)  # longest query now 8 > 5
    with pytest.raises(SeqlensError, match="max_seqlen_q=5"):
        hub.attention(q, k, v, cu_seqlens_k=ck2, **kw)


def _cache_step(b=3, ctx=(5, 9, 2)):
    cache = PagedKVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8)
    seqs = [cache.allocate() for _ in range(b)]
    for s, n in zip(seqs, ctx):
        kv = torch.randn(n, 2, 8)
        cache.write(0, cache.reserve([s], n), kv, torch.randn_like(kv))
    return cache, seqs


def test_kv_cache_tables_need_no_read_back(spy_hub, monkeypatch):
    """Tables the cache built are vouched for: the hub's paged check never reads them back,
    yet backends still read private snapshots and the answer is right."""
    hub, spy = spy_hub
    reads = _counting(monkeypatch, tables, "_check_paged_contents")
    cache, seqs = _cache_step()
    bt, sl = cache.block_table(seqs), cache.seqlens(seqs)
    q = torch.randn(3, 1, 4, 8)
    kw = dict(layout="paged", block_table=bt, seqlens_k=sl, backend="spy")
    outs = [hub.attention(q, cache.k_cache(0), cache.v_cache(0), **kw) for _ in range(3)]
    assert reads == [] and torch.equal(outs[0], outs[2])
    p = spy.seen[-1]
    assert p.block_table is not bt and torch.equal(p.block_table, bt) and p.max_seqlen_k == 9
    for i, s in enumerate(seqs):  # each sequence against its own keys
        k_s, v_s = cache.read(0, s)
        ref, _ = reference_attention(q[i:i + 1], k_s[None], v_s[None],
                                     AttnParams(scale=8 ** -0.5))
        assert torch.allclose(outs[0][i:i + 1].double(), ref, atol=1e-5)


def _break_tables(how: str, bt: torch.Tensor, kc: torch.Tensor,
                  vc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Make ``bt`` name a page the returned k/v caches do not have: a smaller cache, an
    in-place edit (bumps ``_version``) or an edit through ``.data`` (does not)."""
    if how == "smaller_cache":
        return kc[:2], vc[:2]
    if how == "inplace":
        bt[1, 0] = 99
    else:
        bt.data[1, 0] = 99
    return kc, vc


@pytest.mark.parametrize("how", ["inplace", "data", "smaller_cache"])
def test_vouched_tables_still_checked_when_they_stop_holding(spy_hub, monkeypatch, how):
    hub, _ = spy_hub
    reads = _counting(monkeypatch, tables, "_check_paged_contents")
    cache, seqs = _cache_step()
    bt, sl = cache.block_table(seqs), cache.seqlens(seqs)
    q = torch.randn(3, 1, 4, 8)
    kc, vc = cache.k_cache(0), cache.v_cache(0)
    kc, vc = _break_tables(how, bt, kc, vc)
    with pytest.raises(SeqlensError, match="outside"):
        hub.attention(q, kc, vc, layout="paged", block_table=bt, seqlens_k=sl, backend="spy")
    assert reads == [1]


def test_canonical_device_with_a_fake_current_index():
    current = {"cuda": 1}.get
    assert canonical_device("cuda", current) == torch.device("cuda", 1)
    assert canonical_device(torch.device("cuda"), current) == torch.device("cuda", 1)
    assert canonical_device("cuda:0", current) == torch.device("cuda", 0)
    assert canonical_device("cpu", current) == torch.device("cpu")
    assert canonical_device("xpu", lambda kind: None) == torch.device("xpu")  # unknown index
    assert same_device("cuda", "cuda:1", current) and not same_device("cuda", "cuda:0", current)


def test_kv_cache_device_is_canonical(monkeypatch):
    """``PagedKVCache(device=...)`` stores the device as tensors report it; on this CPU the
    fake turns a bare "cpu" into itself, and the cache's helper is the canonical one."""
    seen = []
    real = canonical_device

    def spy(device, current=None):  # type: ignore[no-untyped-def]
        seen.append(device)
        return real(device, current)

    monkeypatch.setattr("attnhub.core.kvcache.canonical_device", spy)
    cache = PagedKVCache(num_layers=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=4,
                         device="cpu")
    assert seen == ["cpu"] and cache.device == torch.empty(0).device


def test_accelerator_memo_uses_the_stamp():
    """Off the CPU a hit is proved by the stamp (no host sync): an in-place edit bumps
    ``_version`` and misses; other geometry misses. (meta tensors stand in for a GPU.)"""
    memo = tables.CuSeqlens()
    a, b = torch.zeros(3, dtype=torch.int32, device="meta"), torch.zeros(3, dtype=torch.int32,
                                                                          device="meta")
    memo._store(a, b, (4, 4, a.device), a.clone(), b.clone(), 2, 2)
    assert memo._hit(a, b, (4, 4, a.device)) is not None
    assert memo._hit(a, b, (4, 5, a.device)) is None and memo._hit(b, a, (4, 4, a.device)) is None
    a.add_(1)
    assert memo._hit(a, b, (4, 4, a.device)) is None


def test_paged_fast_path_rechecks_tables_of_another_batch(spy_hub):
    """The exact-shape key leaves the tables' shapes to the memo: a table checked for a
    batch of 3 is not taken for a batch-2 call that hits the key a batch-2 table made."""
    hub, spy = spy_hub
    cache, seqs = _cache_step()
    kc, vc = cache.k_cache(0), cache.v_cache(0)
    bt2, sl2 = cache.block_table(seqs[:2]), cache.seqlens(seqs[:2])
    bt3, sl3 = cache.block_table(seqs), cache.seqlens(seqs)
    q2, q3 = torch.randn(2, 1, 4, 8), torch.randn(3, 1, 4, 8)
    kw = dict(layout="paged", backend="spy")
    hub.attention(q2, kc, vc, block_table=bt2, seqlens_k=sl2, **kw)  # the batch-2 key
    hub.attention(q3, kc, vc, block_table=bt3, seqlens_k=sl3, **kw)  # memo: batch-3 tables
    with pytest.raises(SeqlensError, match=r"B=2"):
        hub.attention(q2, kc, vc, block_table=bt3, seqlens_k=sl3, **kw)
    out = hub.attention(q2, kc, vc, block_table=bt2, seqlens_k=sl2, **kw)
    assert spy.seen[-1].block_table.shape[0] == 2 and out.shape == (2, 1, 4, 8)


@pytest.mark.parametrize("how", ["inplace", "data", "smaller_cache", "other_hub"])
def test_paged_layer_shortcut_sees_every_change(spy_hub, monkeypatch, how):
    """The layers of a step take the memo their binding last took with the tensors' identity
    and stamps alone: an edit, a cache the tables do not fit, or the memo replaced by another
    hub's check still goes through the full check."""
    hub, spy = spy_hub
    looked_up: list[int] = []
    real = tables.PAGED.unchanged
    monkeypatch.setattr(tables.PAGED, "unchanged",
                        lambda *a: looked_up.append(1) or real(*a))
    cache, seqs = _cache_step()
    bt, sl = cache.block_table(seqs), cache.seqlens(seqs)
    q = torch.randn(3, 1, 4, 8)
    kc, vc = cache.k_cache(0), cache.v_cache(0)
    kw = dict(layout="paged", block_table=bt, seqlens_k=sl, backend="spy")
    first = [hub.attention(q, kc, vc, **kw) for _ in range(4)]
    assert len(looked_up) == 1  # call 1 binds, call 2 looks the memo up, 3 and 4 take it
    assert all(torch.equal(first[0], o) for o in first[1:])
    if how == "other_hub":  # the memo now holds other tables (checked by the other hub's
        # binding): this hub looks its tables up again
        other = attnhub.Hub(registry=hub.registry, hardware="cpu")
        bt2, sl2 = cache.block_table(seqs[:2]), cache.seqlens(seqs[:2])
        other.attention(q[:2], kc, vc, layout="paged", block_table=bt2, seqlens_k=sl2,
                        backend="spy")
        hub.attention(q, kc, vc, **kw)
        assert len(looked_up) == 2 and spy.seen[-1].block_table.shape[0] == 3
        return
    kc, vc = _break_tables(how, bt, kc, vc)
    with pytest.raises(SeqlensError, match="outside"):
        hub.attention(q, kc, vc, **kw)


def test_unstamped_accelerator_tables_are_said_once(monkeypatch, caplog):
    """Tables made under inference_mode keep no version counter: on an accelerator every
    call then proves them by reading them (a sync per call). That is warned, once per kind
    (meta tensors stand in for an accelerator's: not CPU)."""
    monkeypatch.setattr(tables, "_warned_unstamped", set())
    with torch.inference_mode():
        bt = torch.zeros(2, 4, dtype=torch.int32, device="meta")
        sl = torch.zeros(2, dtype=torch.int32, device="meta")
    memo = tables.PagedTables()
    with caplog.at_level("WARNING", logger="attnhub"):
        memo._store(bt, sl, (), bt, sl, 0)
        memo._store(bt, sl, (), bt, sl, 0)
    said = [r for r in caplog.records if "inference tensors" in r.getMessage()]
    assert len(said) == 1 and "block_table/seqlens_k" in said[0].getMessage()
    stamped = torch.zeros(2, 4, dtype=torch.int32, device="meta")
    caplog.clear()
    with caplog.at_level("WARNING", logger="attnhub"):
        tables.CuSeqlens()._store(stamped, stamped, (), stamped, stamped, 0, 0)
    assert not caplog.records  # a version counter: stamped, nothing to say
