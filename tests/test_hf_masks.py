"""The masks transformers hands the attention function, translated exactly or refused:
custom 4-D masks changed between calls and in place, boolean-in-meaning float and int masks,
padding masks of every shape, additive biases refused with the fix."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnhub import AttnParams, Hub, InputError
from attnhub.core.masking import allowed_mask
from attnhub.core.reference import reference_attention
from attnhub.integrations import transformers as hf
from attnhub.integrations.transformers.masks import DenseMask, as_bool, mask_args
from attnhub.integrations.transformers.testing import one_intraop_thread, twin_models
from attnhub.policy import load_policy
from attnhub.testing import assert_fa_rule

B, S, VOCAB = 2, 10, 96


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    with one_intraop_thread():
        yield


@pytest.fixture(scope="module")
def hub() -> Hub:
    h = Hub(policy=load_policy())
    hf.register(h)
    return h


@pytest.fixture(scope="module")
def models(hub: Hub) -> tuple[torch.nn.Module, torch.nn.Module]:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return twin_models(cfg)


def prefix_lm(prefix: list[int]) -> torch.Tensor:
    """(B, 1, S, S) boolean prefix-LM mask: causal, plus the first ``prefix[b]`` keys."""
    i = torch.arange(S).view(S, 1)
    j = torch.arange(S).view(1, S)
    p = torch.tensor(prefix).view(-1, 1, 1, 1)
    return (j <= i) | (j < p)


def additive(mask: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.zeros(mask.shape).masked_fill(~mask, fill)


def _check(ours, eager, ids: torch.Tensor, given: torch.Tensor, truth: torch.Tensor,
           what: str) -> None:
    """ours with the mask ``given`` against eager (additive form of ``truth``) and an fp64
    eager run of the same weights."""
    ref = copy.deepcopy(eager).double()
    with torch.no_grad():
        got = ours(ids, attention_mask=given).logits
        same = eager(ids, attention_mask=additive(truth, torch.finfo(torch.float32).min)).logits
        ref64 = ref(ids, attention_mask=additive(truth, float("-inf")).double()).logits
    assert_fa_rule(got, ref64, same, what=what)


def test_custom_4d_mask_changed_between_calls_and_in_place(models) -> None:
    ours, eager = models
    ids = torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(4))
    first = prefix_lm([3, 7])
    _check(ours, eager, ids, first, first, "prefix-LM 3/7")
    other = prefix_lm([6, 1])  # same shape, other mask: a new tensor
    _check(ours, eager, ids, other, other, "prefix-LM 6/1")
    mask = prefix_lm([2, 2])
    _check(ours, eager, ids, mask, mask.clone(), "prefix-LM 2/2")
    mask[:, :, :, :5] = True  # in place: the version counter moves
    _check(ours, eager, ids, mask, mask.clone(), "edited in place")
    version = mask._version
    mask.data.copy_(prefix_lm([9, 4]))  # through .data: the version counter does not move
    assert mask._version == version
    _check(ours, eager, ids, mask, mask.clone(), "edited through .data")


@pytest.mark.parametrize("form", ["float -1e9", "float finfo.min", "float -inf", "int64",
                                  "bool (B,1,1,S) padding"])
def test_boolean_in_meaning_masks_are_accepted(models, form: str) -> None:
    ours, eager = models
    ids = torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(5))
    truth = prefix_lm([4, 8])
    truth[1, :, :, 0] = False  # sequence 1 never sees key 0 (a padded key)
    truth[1, :, 0, 1] = True  # so its row 0 sees key 1: no row is fully masked
    given = {"float -1e9": lambda: additive(truth, -1e9),
             "float finfo.min": lambda: additive(truth, torch.finfo(torch.float32).min),
             "float -inf": lambda: additive(truth, float("-inf")),
             "int64": lambda: truth.long(),
             "bool (B,1,1,S) padding": None}[form]
    if given is None:  # an encoder-style padding mask broadcast over the queries
        truth = torch.ones(B, 1, 1, S, dtype=torch.bool)
        truth[0, ..., :3] = False
        _check(ours, eager, ids, truth, truth.expand(B, 1, S, S), form)
        return
    _check(ours, eager, ids, given(), truth, form)


@pytest.mark.parametrize("bad,match", [
    (lambda m: additive(m, -1e9) - 0.5 * torch.rand(m.shape), "additive bias.*boolean.*eager"),
    (lambda m: m.long() * 2, "0 \\(masked\\) and 1"),
    (lambda m: m[:, :, :, :-1], "does not fit this call"),
    # one key column for every key (MiniMax's padded decode: a mask for another cache)
    (lambda m: m[:, :, :, :1], "one key column for a call with .* keys.*without padding"),
])
def test_biases_and_misfit_masks_are_refused_with_the_fix(bad, match: str) -> None:
    with pytest.raises(InputError, match=match):
        mask_args(bad(prefix_lm([2, 5])), True, None, B, S, S, caller=object())


def test_padding_of_either_shape_is_structured_not_dense() -> None:
    """(B,1,1,Sk) and (B,1,Sq,Sk) key padding, with and without causal, become column ranges
    whose meaning equals the mask (the old check compared unbroadcast shapes: always dense)."""
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, :4] = False
    i, j = torch.arange(S).view(S, 1), torch.arange(S).view(1, S)
    for causal, mask in ((False, keep.view(B, 1, 1, S)),
                         (False, keep.view(B, 1, 1, S).expand(B, 1, S, S).clone()),
                         (True, (keep.view(B, 1, 1, S) & (j <= i)))):
        args = mask_args(mask, causal, None, B, S, S, caller=object())
        assert "mask_mod" not in args and args["colmask_start"] is not None, args
        params = AttnParams(scale=1.0, **args)
        assert torch.equal(allowed_mask(params, B, 1, S, S, mask.device),
                           mask.expand(B, 1, S, S))


def test_each_forward_retranslates_and_layers_share_one_translation() -> None:
    mask = prefix_lm([3, 3])
    layer0, layer1 = object(), object()
    a = mask_args(mask, True, None, B, S, S, layer0)
    assert mask_args(mask, True, None, B, S, S, layer1) is a  # one forward: shared
    b = mask_args(mask, True, None, B, S, S, layer0)  # the same layer again: a new forward
    assert b is not a and b["mask_mod"] != a["mask_mod"]


def test_dense_masks_never_collide_and_refuse_once_freed() -> None:
    m1, m2 = prefix_lm([1, 2]), prefix_lm([1, 2])
    d1, d2 = DenseMask(m1), DenseMask(m2)
    assert d1 != d2 and d1 == d1 and len({d1, d2}) == 2
    dead = DenseMask(prefix_lm([1, 1]))  # nothing keeps the tensor alive
    with pytest.raises(InputError, match="freed"):
        dead(torch.tensor(0), torch.tensor(0), torch.tensor(0), torch.tensor(0))
    assert as_bool(m1)[1] is None and as_bool(m1.long())[0].dtype == torch.bool


def test_hub_serves_each_dense_mask_of_one_shape(hub: Hub) -> None:
    """Successive calls of one shape with different dense masks, through the hub's exact-shape
    path: each gets its own mask."""
    gen = torch.Generator().manual_seed(6)
    module = torch.nn.Module()
    module.is_causal, module.layer_idx = True, 0
    for _ in range(3):
        q, k, v = (torch.randn(2, n, 6, 8, generator=gen) for n in (4, 2, 2))
        allowed = torch.rand(2, 1, 6, 6, generator=gen) < 0.5
        allowed[..., 0] = True
        out, _ = hf.attention_forward(module, q, k, v, allowed, scaling=0.4)
        params = AttnParams(scale=0.4, mask_mod=DenseMask(allowed))
        tq, tk, tv = (x.transpose(1, 2) for x in (q, k, v))
        ref64, _ = reference_attention(tq, tk, tv, params)
        same, _ = reference_attention(tq, tk, tv, params, compute_dtype=torch.float32)
        assert_fa_rule(out, ref64, same)


@pytest.mark.parametrize("seed", range(6))
def test_any_mask_translates_to_the_same_visible_pairs(seed: int) -> None:
    """Random masks of every family and broadcast shape (causal/window/padding in any
    combination, or arbitrary): the attnhub arguments mark exactly the same (query, key)
    pairs visible, through the structured form when there is one."""
    g = torch.Generator().manual_seed(seed)
    b, sq = 3, int(torch.randint(1, 9, (1,), generator=g))
    sk = sq + int(torch.randint(0, 6, (1,), generator=g))
    i = torch.arange(sq).view(sq, 1) + (sk - sq)
    j = torch.arange(sk).view(1, sk)
    keep = torch.rand(b, 1, 1, sk, generator=g) < 0.7
    causal = bool(seed % 2)
    w = int(torch.randint(0, 4, (1,), generator=g))
    window = ((w, 0) if causal else (w, w)) if seed % 3 == 0 else None
    structured = keep & ((j <= i) if causal else torch.ones_like(j <= i))
    if window is not None:
        structured = structured & (j >= i - window[0]) & (j <= i + window[1])
    arbitrary = torch.rand(1, 1, sq, sk, generator=g) < 0.5
    for mask, expect_dense in ((structured, False), (keep, False), (arbitrary, None)):
        args = mask_args(mask, causal, window, b, sq, sk, caller=object())
        if expect_dense is False:
            assert "mask_mod" not in args, (mask.shape, causal, window)
        params = AttnParams(scale=1.0, **args)
        got = allowed_mask(params, b, 1, sq, sk, mask.device)
        want = mask.expand(b, 1, sq, sk)
        assert torch.equal(got if got is not None else torch.ones_like(want), want)
