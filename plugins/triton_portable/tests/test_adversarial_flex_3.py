"""Adversarial flex tests (round 3): FlexAttention's score/mask catalogue on random inputs
with GQA and Sq != Sk against the fp64 reference, fully masked rows, and a BlockMask cache
that never serves one call's mask_mod state to another call.

Compiled flex (the GPU default) skips the blocks a cached BlockMask calls empty and skips the
mask_mod in blocks it calls full, so a stale BlockMask is a silent wrong answer there; the
cache tests compare the cached BlockMask with a fresh build (eager flex on the CPU re-applies
the mask_mod everywhere and would hide it)."""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable

import pytest
import torch
from attnhub_triton_portable import flex
from attnhub_triton_portable.backend_flex import FlexBackend

from attnhub import AttentionSpec, Hub, MaskSpec
from attnhub.plugin import AttnParams, reference_attention
from attnhub.testing import assert_fa_rule, assert_lse

B, HQ, HKV, D = 2, 4, 2, 16
SQ, SK = 256, 384  # three key blocks, two query blocks of 128: full and empty blocks exist


@pytest.fixture(scope="module")
def eager() -> FlexBackend:
    b = FlexBackend(compiled=False)
    b.load()
    return b


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv(sq: int, sk: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = _gen(seed)
    return (torch.randn(B, sq, HQ, D, generator=g), torch.randn(B, sk, HKV, D, generator=g),
            torch.randn(B, sk, HKV, D, generator=g))


def _run(backend: FlexBackend, q, k, v, p: AttnParams) -> tuple[torch.Tensor, torch.Tensor]:
    spec = AttentionSpec(phase="prefill", dtype="fp32", head_dim=D, num_q_heads=HQ,
                         num_kv_heads=HKV, return_lse=True, mask=MaskSpec(
                             score_mod=getattr(p.score_mod, "__name__", None),
                             mask_mod=getattr(p.mask_mod, "__name__", None)))
    res = backend.forward(q, k, v, spec, dataclasses.replace(p, return_lse=True))
    return res.out, res.lse


# -- the catalogue -------------------------------------------------------------------------
def _catalogue(g: torch.Generator) -> dict[str, dict[str, Callable]]:
    """FlexAttention's test catalogue, with random parameters drawn from ``g``."""
    bias = torch.randn(HQ, generator=g)
    rel = float(torch.rand((), generator=g)) * 0.2
    offset = int(torch.randint(-20, 20, (), generator=g))
    slopes = torch.rand(HQ, generator=g)
    return {
        "identity": {"score_mod": lambda s, b, h, q, kv: s},
        "times_two": {"score_mod": lambda s, b, h, q, kv: s * 2},
        "squared": {"score_mod": lambda s, b, h, q, kv: s * s},
        "rel_bias": {"score_mod": lambda s, b, h, q, kv: s + rel * (q - kv)},
        "alibi": {"score_mod": lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs()},
        "head_offset": {"score_mod": lambda s, b, h, q, kv: s + bias[h]},
        "trig": {"score_mod": lambda s, b, h, q, kv: torch.sin(s) + torch.cos(q - kv)},
        "causal": {"mask_mod": lambda b, h, q, kv: q >= kv},
        "causal_score": {"score_mod": lambda s, b, h, q, kv: torch.where(  # every row sees kv 0
            q >= kv, s, float("-inf"))},
        "inverse_causal": {"mask_mod": lambda b, h, q, kv: q <= kv},
        "windowed": {"mask_mod": lambda b, h, q, kv: q + offset >= kv},
        "rel_causal": {"score_mod": lambda s, b, h, q, kv: s + rel * (q - kv),
                       "mask_mod": lambda b, h, q, kv: q >= kv},
    }


@pytest.mark.parametrize("name", sorted(_catalogue(_gen(0))))
def test_catalogue_matches_the_fp64_reference_gqa_sq_ne_sk(eager, name) -> None:
    sq, sk = (19, 33) if len(name) % 2 else (33, 19)  # both orders over the catalogue
    g = _gen(zlib.crc32(f"{name}{sq}".encode()))
    mods = _catalogue(g)[name]
    q, k, v = (x * 0.5 for x in _qkv(sq, sk, int(torch.randint(1 << 30, (), generator=g))))
    p = AttnParams(scale=D ** -0.5, **mods)
    out, lse = _run(eager, q, k, v, p)
    ref64, ref_lse = reference_attention(q, k, v, p)
    same, _ = reference_attention(q, k, v, p, compute_dtype=torch.float32)
    assert_fa_rule(out, ref64, same)
    assert_lse(lse, ref_lse)


def test_fully_masked_rows_give_zero_and_minus_inf(eager) -> None:
    """``q < cut`` sees no key (FlexAttention's fully-masked-rows test), GQA, Sq != Sk."""
    q, k, v = _qkv(21, 30, 7)
    cut = int(torch.randint(3, 18, (), generator=_gen(7)))
    p = AttnParams(scale=D ** -0.5, mask_mod=lambda b, h, qi, kv: qi >= cut)
    out, lse = _run(eager, q, k, v, p)
    assert torch.equal(out[:, :cut], torch.zeros_like(out[:, :cut]))
    assert torch.isneginf(lse[:, :, :cut]).all()
    ref64, ref_lse = reference_attention(q, k, v, p)
    same, _ = reference_attention(q, k, v, p, compute_dtype=torch.float32)
    assert_fa_rule(out, ref64, same)
    assert_lse(lse, ref_lse)


# -- the BlockMask cache: a mask_mod's state between calls ----------------------------------
def _blocks(bm) -> tuple[torch.Tensor | None, ...]:
    return (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)


def _same_blocks(a, b) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None
                                             and torch.equal(x, y))
               for x, y in zip(_blocks(a), _blocks(b)))


def _offsets(seed: int) -> tuple[int, int]:
    """Two diagonal offsets at least two blocks apart (so the block structure differs)."""
    g = _gen(seed)
    a = int(torch.randint(-200, 0, (), generator=g))
    return a, a + int(torch.randint(256, 400, (), generator=g))


def _global_tensor_mod() -> tuple[Callable, Callable[[int], None]]:
    global _OFFSET
    _OFFSET = torch.zeros(1, dtype=torch.long)

    def mod(b, h, q, kv):
        return q + _OFFSET[0] >= kv

    return mod, lambda o: _OFFSET.fill_(o)


_OFFSET = torch.zeros(1, dtype=torch.long)


def _closure_tensor_mod() -> tuple[Callable, Callable[[int], None]]:
    off = torch.zeros(1, dtype=torch.long)
    return (lambda b, h, q, kv: q + off[0] >= kv), (lambda o: off.fill_(o))


def _nonlocal_int_mod() -> tuple[Callable, Callable[[int], None]]:
    off = 0

    def mod(b, h, q, kv):
        return q + off >= kv

    def set_off(o: int) -> None:
        nonlocal off
        off = o

    return mod, set_off


class _Shifted:
    """A callable object whose attribute is replaced between calls."""

    __name__ = "shifted"

    def __init__(self) -> None:
        self.off = torch.zeros(1, dtype=torch.long)

    def __call__(self, b, h, q, kv):
        return q + self.off[0] >= kv


def _object_mod() -> tuple[Callable, Callable[[int], None]]:
    obj = _Shifted()
    return obj, lambda o: setattr(obj, "off", torch.full((1,), o))


def _partial_list_mod() -> tuple[Callable, Callable[[int], None]]:
    box = [0]

    def mod(box, b, h, q, kv):
        return q + box[0] >= kv

    return functools.partial(mod, box), lambda o: box.__setitem__(0, o)


def _large_gpu_like_mod() -> tuple[Callable, Callable[[int], None]]:
    """A captured tensor too large to hash: proven by version and storage only."""
    big = torch.zeros(flex._HASHED_NUMEL + 1, dtype=torch.long)
    return (lambda b, h, q, kv: q + big[0] >= kv), (lambda o: big.__setitem__(0, o))


@pytest.mark.parametrize("make", [_global_tensor_mod, _closure_tensor_mod, _nonlocal_int_mod,
                                  _object_mod, _partial_list_mod, _large_gpu_like_mod])
def test_cached_block_mask_follows_the_mask_mod_state(make) -> None:
    mod, set_offset = make()
    cache = flex.ModCache()
    first, second = _offsets(zlib.crc32(make.__name__.encode()))
    masks = []
    for off in (first, second, first):
        set_offset(off)
        p = AttnParams(scale=D ** -0.5, mask_mod=mod)
        got = cache.get(p, B, HQ, HKV, SQ, SK, False, torch.device("cpu")).block_mask
        fresh = flex._build(p, B, HQ, HKV, SQ, SK, False, torch.device("cpu")).block_mask
        assert _same_blocks(got, fresh), f"{make.__name__}: a stale BlockMask at offset {off}"
        masks.append(fresh)
    assert not _same_blocks(masks[0], masks[1])  # the test can fail: the offsets differ


def test_unchanged_state_is_still_a_cache_hit() -> None:
    """The fix keys on content, not on the call: a repeated call builds nothing."""
    off = torch.tensor([int(torch.randint(-50, 50, (), generator=_gen(3)))])
    mod = functools.partial(lambda o, b, h, q, kv: q + o[0] >= kv, off)
    cache = flex.ModCache()
    p = AttnParams(scale=D ** -0.5, mask_mod=mod)
    a = cache.get(p, B, HQ, HKV, SQ, SK, False, torch.device("cpu"))
    assert cache.get(p, B, HQ, HKV, SQ, SK, False, torch.device("cpu")) is a
    assert cache.builds == 1


def test_unprovable_state_is_built_per_call() -> None:
    """A mask_mod over an object nothing can vouch for (no ``__dict__``) is never cached."""
    class Slotted:
        __slots__ = ("off",)

    box = Slotted()
    box.off = 0
    mod = functools.partial(lambda o, b, h, q, kv: q + o.off >= kv, box)
    cache = flex.ModCache()
    first, second = _offsets(11)
    for off in (first, second):
        box.off = off
        p = AttnParams(scale=D ** -0.5, mask_mod=mod)
        got = cache.get(p, B, HQ, HKV, SQ, SK, False, torch.device("cpu")).block_mask
        fresh = flex._build(p, B, HQ, HKV, SQ, SK, False, torch.device("cpu")).block_mask
        assert _same_blocks(got, fresh)
    assert cache.builds == 2


# -- FlashMask-style column-sparse ranges and prefix-LM through flex ---------------------------
@pytest.mark.parametrize("dtype,heads", [(torch.int64, HKV), (torch.uint8, 1), (torch.int8, HKV),
                                         (torch.int32, 1)])
def test_column_sparse_and_prefix_ranges_match_the_reference(dtype, heads) -> None:
    """start > end, ranges past [0, Sq], prefixes past [0, Sk], in the hub's contract dtypes;
    the reference answers the same call (its masks are written independently of flex's)."""
    g = _gen(zlib.crc32(f"{dtype}{heads}".encode()))
    q, k, v = _qkv(10, 14, int(torch.randint(1 << 30, (), generator=g)))
    low = 0 if dtype == torch.uint8 else -4
    start, end = (torch.randint(low, 16, (B, heads, 14), generator=g).to(dtype)
                  for _ in range(2))
    start[:, :, 0] = end[:, :, 0] + 1  # an inverted range: nothing masked
    lens = torch.randint(low, 19, (B,), generator=g).to(dtype)
    hub = Hub()
    kw = dict(causal=True, colmask_start=start, colmask_end=end, prefix_lens=lens,
              return_lse=True)
    out, lse = hub.attention(q, k, v, backend="flex", **kw)
    ref, ref_lse = hub.attention(q, k, v, backend="reference", **kw)
    assert (out - ref).abs().max() <= 1e-5
    assert_lse(lse, ref_lse, atol=1e-5)


# -- a variant made for another head count ---------------------------------------------------
@pytest.mark.parametrize("backend", ["flex", "reference"])
def test_alibi_variant_of_another_head_count_is_refused(backend) -> None:
    """``alibi8`` holds an 8-head model's slopes: on fewer heads it silently gave other
    slopes than the model's, on more it read past them (compiled flex: no bound check)."""
    from attnhub_triton_portable import variants

    from attnhub.errors import InputError

    g = _gen(21)
    made = 1 << int(torch.randint(2, 5, (), generator=g))  # 4, 8 or 16 heads
    heads = made * 2 if torch.rand((), generator=g) < 0.5 else made // 2
    q = torch.randn(1, 9, heads, D, generator=g)
    k, v = (torch.randn(1, 9, 1, D, generator=g) for _ in range(2))
    with pytest.raises(InputError, match=f"{made}-head model.*{heads} query heads"):
        Hub().attention(q, k, v, backend=backend, score_mod=variants.alibi(made))
    fits = Hub().attention(q, k, v, backend=backend, score_mod=variants.alibi(heads))
    want = Hub().attention(q, k, v, backend="reference",
                           alibi_slopes=variants.alibi_slopes(heads))
    assert (fits - want).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", [torch.int32, torch.float32])
def test_a_non_bool_mask_mod_reads_as_the_reference_reads_it(kind) -> None:
    """The reference (and torch_sdpa) read a mask_mod's result as ``nonzero = visible``;
    flex raised on it (an AssertionError inside the kernel build, a backend failure), so the
    same call served on the CPU failed where the policy picks flex."""
    g = _gen(31)
    q, k, v = _qkv(12, 17, int(torch.randint(1 << 30, (), generator=g)))
    off = int(torch.randint(-4, 8, (), generator=g))
    mod = lambda b, h, qi, kv: (qi + off - kv).clamp(min=0).to(kind)  # noqa: E731
    hub = Hub()
    out = hub.attention(q, k, v, backend="flex", mask_mod=mod)
    ref = hub.attention(q, k, v, backend="reference", mask_mod=mod)
    assert (out - ref).abs().max() <= 1e-5
