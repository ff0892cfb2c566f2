"""flex never answers one call with another call's mask, and never runs uncompiled silently:
BlockMasks keyed on proof of content (callable identity, tensor identity + version + data
pointer, bytes of small CPU tensors), one compile per static shape, a loud error past the
recompile limit."""

from __future__ import annotations

import pytest
import torch
from attnhub_triton_portable import flex
from attnhub_triton_portable.backend_flex import FlexBackend

from attnhub import AttentionSpec, MaskSpec
from attnhub.plugin import AttnParams, DeviceInfo, reference_attention
from attnhub.testing import assert_fa_rule


def _qkv(sq: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, sq, h, 16, generator=g) for h in (4, 2, 2))


def _spec(**mask) -> AttentionSpec:
    return AttentionSpec(phase="prefill", dtype="fp32", head_dim=16, num_q_heads=4,
                         num_kv_heads=2, mask=MaskSpec(**mask))


def _check(out: torch.Tensor, q, k, v, params: AttnParams) -> None:
    ref64, _ = reference_attention(q, k, v, params)
    same, _ = reference_attention(q, k, v, params, compute_dtype=q.dtype)
    assert_fa_rule(out, ref64, same)


class AlwaysEqual:
    """A mask_mod over data whose ``__eq__`` says every instance is the same (the old
    transformers DenseMask): a cache that trusts ``__eq__`` serves the first mask to all."""

    __name__ = "always_equal"

    def __init__(self, allowed: torch.Tensor):
        self.allowed = allowed

    def __call__(self, b, h, q_idx, kv_idx):
        return self.allowed[b, 0, q_idx, kv_idx]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AlwaysEqual)

    def __hash__(self) -> int:
        return 0


@pytest.fixture
def eager() -> FlexBackend:
    b = FlexBackend(compiled=False)
    b.load()
    return b


def test_equal_comparing_mask_mods_of_one_shape_get_their_own_block_mask(eager) -> None:
    q, k, v = _qkv(20, seed=1)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        allowed = torch.rand(2, 1, 20, 20, generator=g) < 0.4
        allowed[..., 3] = True
        params = AttnParams(scale=0.25, mask_mod=AlwaysEqual(allowed))
        _check(eager.forward(q, k, v, _spec(mask_mod="always_equal"), params).out,
               q, k, v, params)
    assert eager.mask_builds == 3


def test_small_cpu_tensor_edited_through_data_is_rebuilt(eager) -> None:
    """``.data`` edits do not move the version counter; the content proof still sees them."""
    q, k, v = _qkv(16, seed=3)
    prefix = torch.tensor([2, 3])
    params = AttnParams(scale=0.25, causal=True, prefix_lens=prefix)
    spec = _spec(causal=True, prefix_lm=True)
    first = eager.forward(q, k, v, spec, params).out
    version = prefix._version
    prefix.data.copy_(torch.tensor([12, 9]))
    assert prefix._version == version
    second = eager.forward(q, k, v, spec, params).out
    assert eager.mask_builds == 2 and not torch.allclose(first, second)
    _check(second, q, k, v, params)


def test_inference_tensors_are_proven_by_content_or_not_cached(eager, monkeypatch) -> None:
    """Tensors made under ``torch.inference_mode`` have no version counter: a small CPU one
    is cached by its bytes (an in-place edit is seen), one too large to hash is rebuilt on
    every call (nothing cheap can vouch for it)."""
    q, k, v = _qkv(16, seed=4)
    spec = _spec(causal=True, prefix_lm=True)
    with torch.inference_mode():
        prefix = torch.tensor([2, 3])
        params = AttnParams(scale=0.25, causal=True, prefix_lens=prefix)
        first = eager.forward(q, k, v, spec, params).out
        eager.forward(q, k, v, spec, params)
        assert eager.mask_builds == 1  # same bytes: cached
        prefix.copy_(torch.tensor([12, 9]))
        second = eager.forward(q, k, v, spec, params).out
        assert eager.mask_builds == 2 and not torch.allclose(first, second)
        _check(second, q, k, v, params)
        monkeypatch.setattr(flex, "_HASHED_NUMEL", 1)  # as a device tensor: no byte proof
        for _ in range(2):
            _check(eager.forward(q, k, v, spec, params).out, q, k, v, params)
        assert eager.mask_builds == 4


def test_compiled_per_static_shape_then_loud_at_the_limit(monkeypatch) -> None:
    """The second shape compiles as reliably as the first (dynamic shapes broke Inductor's
    CPU template); past the recompile limit the call raises instead of running uncompiled."""
    backend = FlexBackend(compiled=True)  # the default runs eagerly on the CPU
    spec = _spec(causal=True, softcap=True)
    assert backend.check(spec, DeviceInfo(vendor="cpu", arch="cpu")) == []
    backend.load()
    torch._dynamo.reset()  # count this test's compiles only
    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 2)
    monkeypatch.setattr(flex, "_seen", set())
    params = AttnParams(scale=0.25, causal=True, softcap=2.0)
    # the repeat runs the compiled kernel without the limit dance; never 8 mod 16 here: on
    # AVX2 the compiled template reads up to 8 key rows past k there (a segfault at a page end)
    for sq in (21, 13, 21):
        q, k, v = _qkv(sq, seed=sq)
        _check(backend.forward(q, k, v, spec, params).out, q, k, v, params)
    assert len(flex._seen) == 2
    q, k, v = _qkv(9, seed=9)
    with pytest.raises(flex.FlexRecompileLimit, match="refused") as refused:
        backend.forward(q, k, v, spec, params)
    assert refused.value.lasting and refused.value.backend == "flex"  # moved back by the hub
