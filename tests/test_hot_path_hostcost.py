"""The cheaper hot path of issue 15 (host cost) checks what the slow path checks: the memos
still see every change of the tables they vouch for (values, dtype, device, batch), the
last-hit shortcut of the exact table never serves a call another key's binding, and the
guard that keeps the options keyword-only refuses positional ones."""

from __future__ import annotations

import pytest
import torch

from attnhub.errors import DeviceMismatchError, SeqlensError
from attnhub.testing import assert_fa_rule, fa_references

from tests.test_contract_memo import _cache_step, _varlen, spy_hub  # noqa: F401 (fixture)


def test_options_stay_keyword_only(spy_hub):  # noqa: F811
    hub, _ = spy_hub
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    for args in ((True,), (None,), (False, "bottom_right")):
        with pytest.raises(TypeError, match="by keyword"):
            hub.attention(q, k, v, *args, backend="spy")
    with pytest.raises(TypeError, match="by keyword"):
        hub.attention(q, k, v, _only_keywords=None, backend="spy")
    assert hub.attention(q, k, v, causal=True, backend="spy").shape == (1, 2, 4, 8)


def _paged(hub, q, kc, vc, bt, sl):  # type: ignore[no-untyped-def]
    return hub.attention(q, kc, vc, layout="paged", block_table=bt, seqlens_k=sl,
                         backend="spy")


def test_paged_memo_sees_a_dtype_swapped_through_data(spy_hub):  # noqa: F811
    """``t.data = t.long()`` keeps the values and ``_version``; ``equal`` holds across
    dtypes, so the CPU memo also compares dtypes: the int32 rule is checked again."""
    hub, _ = spy_hub
    cache, seqs = _cache_step()
    kc, vc = cache.k_cache(0), cache.v_cache(0)
    bt, sl = cache.block_table(seqs).clone(), cache.seqlens(seqs).clone()
    q = torch.randn(3, 1, 4, 8)
    _paged(hub, q, kc, vc, bt, sl)
    for t in (bt, sl):
        t.data = t.data.long()
        with pytest.raises(SeqlensError, match="torch.int32"):
            _paged(hub, q, kc, vc, bt, sl)
        t.data = t.data.int()
    _paged(hub, q, kc, vc, bt, sl)


@pytest.mark.parametrize("mode", ["grad", "inference"])
def test_paged_memo_sees_in_place_edits_between_layers(spy_hub, mode):  # noqa: F811
    """The same tables for several layers, edited in place between two of them (also as
    inference tensors, which keep no version counter): the edit is seen, each answer is
    right for the tables as they are, and a bad edit is an error."""
    hub, spy = spy_hub
    cache, seqs = _cache_step()
    kc, vc = cache.k_cache(0), cache.v_cache(0)
    q = torch.randn(3, 1, 4, 8)
    ctx = torch.inference_mode() if mode == "inference" else torch.enable_grad()
    with ctx:
        bt, sl = cache.block_table(seqs).clone(), cache.seqlens(seqs).clone()
        assert bt.is_inference() == (mode == "inference")
        for edit in (None, lambda: sl.sub_(1), lambda: bt[1, :2].copy_(bt[1, :2].flip(0))):
            if edit is not None:
                edit()
            for _ in range(2):  # two layers of a step
                out = _paged(hub, q, kc, vc, bt, sl)
                p = spy.seen[-1]
                assert torch.equal(p.block_table, bt) and torch.equal(p.seqlens_k, sl)
                assert p.max_seqlen_k == int(sl.max())
        sl[0] = 99  # past the table's capacity
        with pytest.raises(SeqlensError, match="capacity"):
            _paged(hub, q, kc, vc, bt, sl)
    assert out.shape == (3, 1, 4, 8)


def test_thd_offsets_of_another_dtype_device_or_batch(spy_hub):  # noqa: F811
    """The thd fast key holds the offsets' shape but not their dtype or device (the memo
    vouches for the pair it checked): new offsets of another dtype or device are errors,
    of another batch (same packed lengths) a new binding with the right answer."""
    hub, spy = spy_hub
    q, k, v, cq, ck = _varlen([3, 5, 2], [4, 6, 2])
    kw = dict(layout="thd", causal=True, backend="spy")
    hub.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)
    with pytest.raises(SeqlensError, match="torch.int32"):
        hub.attention(q, k, v, cu_seqlens_q=cq.long(), cu_seqlens_k=ck.long(), **kw)
    with pytest.raises(DeviceMismatchError, match="cu_seqlens_q is on meta"):
        hub.attention(q, k, v, cu_seqlens_q=cq.to("meta"), cu_seqlens_k=ck.to("meta"), **kw)
    _, _, _, cq2, ck2 = _varlen([3, 5, 1, 1], [4, 6, 1, 1])  # batch 4, same totals
    out = hub.attention(q, k, v, cu_seqlens_q=cq2, cu_seqlens_k=ck2, **kw)
    p = spy.seen[-1]
    assert torch.equal(p.cu_seqlens_q, cq2) and hub.bound()[-1].decision.spec.batch == 4
    ref64, _, same = fa_references(q, k, v, p, layout="thd")
    assert_fa_rule(out, ref64, same)


def test_last_hit_never_serves_another_key(spy_hub):  # noqa: F811
    """Alternating two keys (a shape, a flag) and a rebind of one key (another length
    bucket): every call gets the binding of its own key."""
    hub, spy = spy_hub
    q1, kv1 = torch.randn(1, 1, 4, 8), torch.randn(1, 6, 2, 8)
    q2, kv2 = torch.randn(2, 1, 4, 8), torch.randn(2, 6, 2, 8)
    for _ in range(3):
        for q, kv, window in ((q1, kv1, None), (q2, kv2, None), (q1, kv1, 2)):
            out = hub.attention(q, kv, kv, window=window, causal=True, backend="spy")
            p = spy.seen[-1]
            assert out.shape == q.shape and p.window == (None if window is None else (2, 0))
            ref64, _, same = fa_references(q, kv, kv, p)
            assert_fa_rule(out, ref64, same)
    cache, seqs = _cache_step()
    kc, vc = cache.k_cache(0), cache.v_cache(0)
    bt, sl = cache.block_table(seqs).clone(), cache.seqlens(seqs).clone()
    qp = torch.randn(3, 1, 4, 8)
    _paged(hub, qp, kc, vc, bt, sl)
    spec8 = hub.bound()[-1].decision.spec
    sl.fill_(3)  # longest 9 -> 3: another length bucket, the same fast key
    _paged(hub, qp, kc, vc, bt, sl)
    _paged(hub, qp, kc, vc, bt, sl)
    spec4 = hub.bound()[-1].decision.spec
    assert (spec8.max_seqlen_k, spec4.max_seqlen_k) == (16, 4)
    assert spy.seen[-1].max_seqlen_k == 3
