"""Adversarial hybrid-layer tests (round 4), on random inputs:

* a decode step that fails half-way (a later layer raises) is aborted by the KV cache; the
  linear layers that ran had already advanced their recurrent states. Retrying the step must
  give the logits of a step that never failed (the states rebuilt from the context), not an
  error and not a state that counted the aborted token twice;
* gla gates that are not log-decays (positive, NaN), not floating point (int, bool), or a thd
  gate with more or fewer rows than k packs: refused with the key and the fix, before any
  state is written (they used to give NaN/inf, or read past the documents silently);
* the chunked and recurrent forms of one recurrence agree under a random gate and start state;
* lsh's declared error budget holds on random draws of the input class it is stated for (it
  was stated for clusters of ~15 degrees, where it reached 0.28 against its 0.1).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from attnhub_hybrid_linear import RecurrentStateCache, linear_torch
from attnhub_hybrid_linear.metrics import rel_rmse
from attnhub_hybrid_linear.sparse_backends import LSH_BUDGET

import attnhub
from attnhub import Hub, InputError
from attnhub.models.decoder import Decoder, DecoderConfig, random_prompts
from attnhub.plugin import AttnParams, reference_attention

POLICY = Path(__file__).resolve().parents[3] / "policies" / "hybrid-model.yaml"

CFG = DecoderConfig(num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=16, vocab_size=64,
                    seed=13)
BUDGET = 5e-3  # two forms of one recurrence (test_decode_state.py)


class _Boom(RuntimeError):
    pass


def _decode_steps(model: Decoder, fail_at: int | None) -> torch.Tensor:
    """Prefill then 3 greedy decode steps; at step ``fail_at`` the last (softmax) layer
    raises once, after the GLA layers ran, and the step is retried."""
    cache = model.new_cache(2, 12, page_size=4, sequence_state=True)
    seqs, logits = model.prefill(cache, random_prompts(CFG, 2, 6))
    tok, out = logits.argmax(-1), []
    last = model.layers[-1].attn
    for step in range(3):
        if step == fail_at:
            real = last.forward

            def boom(*a: object, **kw: object) -> torch.Tensor:
                raise _Boom("injected failure in the last layer")

            last.forward = boom  # type: ignore[method-assign]
            with pytest.raises(_Boom):
                model.decode(cache, seqs, tok)
            last.forward = real  # type: ignore[method-assign]
            store = cache.states.store(0)
            assert isinstance(store, RecurrentStateCache)
            assert cache.length(seqs[0]) == 6 + step  # the KV cache rolled back
        out.append(model.decode(cache, seqs, tok))
        tok = out[-1].argmax(-1)
    return torch.stack(out, 1)


def test_a_decode_step_aborted_half_way_then_retried_gives_the_clean_logits() -> None:
    hub = Hub(policy=POLICY, hardware="cpu")
    model = Decoder(CFG)
    hub.bind(model, batch=2, prompt_len=6, max_len=12, page_size=4)
    clean = _decode_steps(model, None)
    for fail_at in (0, 2):
        again = _decode_steps(model, fail_at)
        assert rel_rmse(again, clean) < BUDGET, f"failure at step {fail_at}"


def _qkv(seed: int, b: int = 2, s: int = 9, h: int = 2, d: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g) for _ in range(3)]


@pytest.mark.parametrize("bad, words", [
    (lambda g: torch.rand(g.shape) * 3, "> 0 or NaN"),
    (lambda g: g.masked_fill(torch.rand(g.shape) < 0.1, float("nan")), "> 0 or NaN"),
    (lambda g: (g * 4).round().long(), "dtype torch.int64"),
    (lambda g: g < -0.3, "dtype torch.bool"),
])
def test_a_gate_that_is_no_log_decay_is_refused_before_the_state_changes(bad, words) -> None:
    q, k, v = _qkv(3)
    gate = F.logsigmoid(torch.randn(*k.shape)) / 4
    states = RecurrentStateCache(layers=[0], num_heads=2, key_dim=8, max_seqs=2)
    for s in (0, 1):
        states.allocate(s)
    extra = {"recurrent_state": states, "seq_ids": [0, 1], "layer": 0}
    hub = attnhub.Hub()
    hub.attention(q[:, :5], k[:, :5], v[:, :5], causal=True, backend="gla",
                  extra={**extra, "gla_gate": gate[:, :5]})
    before = states.read([0, 1], 0)
    with pytest.raises(InputError, match="gla_gate.*" + words.replace("(", r"\(")):
        hub.attention(q[:, 5:], k, v, causal=True, backend="gla",
                      extra={**extra, "gla_gate": bad(gate)})
    after = states.read([0, 1], 0)
    assert torch.equal(before[0], after[0]) and before[1] == after[1] == [5, 5]


@pytest.mark.parametrize("rows", [-1, 1])
def test_a_thd_gate_that_does_not_pack_like_k_is_refused(rows: int) -> None:
    q, k, v = (x[0] for x in _qkv(4))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    gate = -torch.rand(k.shape[0] + rows, *k.shape[1:])
    with pytest.raises(InputError, match="packed like k"):
        attnhub.Hub().attention(q, k, v, causal=True, backend="gla", layout="thd",
                                cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5,
                                max_seqlen_k=5, extra={"gla_gate": gate})


def test_chunked_and_recurrent_forms_agree_on_a_random_gate() -> None:
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 23, 3, 8, generator=g) for _ in range(3))
    gate = F.logsigmoid(torch.randn(2, 23, 3, 8, generator=g) * 3)
    h0 = torch.randn(2, 3, 8, 8, generator=g)
    want, want_h = linear_torch.recurrent(*(x.double() for x in (q, k, v, gate)), 0.3,
                                          h0.double())
    got, got_h = linear_torch.chunked(q, k, v, gate, 0.3, h0)
    assert rel_rmse(got, want) < 1e-5 and rel_rmse(got_h, want_h) < 1e-5


@pytest.mark.parametrize("degrees, draws", [(6, 48), (7, 16)])
def test_lsh_meets_its_declared_budget_on_random_clustered_draws(degrees: int,
                                                                 draws: int) -> None:
    """The budget's stated input class, drawn at random (head dims, lengths, GQA/MQA, 2-8
    centres) at ~6 degrees and past it: the 0.1 budget was stated for ~15 degrees, where
    random draws reach 0.28, and 0.5-1% of draws at 6 degrees broke it (hashing's tail)."""
    hub, rng = attnhub.Hub(), random.Random(7 + degrees)
    errs = []
    for seed in range(draws):
        gen = torch.Generator().manual_seed(seed)
        d, s, hkv, nc = rng.choice([16, 32, 64, 128]), rng.randint(32, 300), rng.choice([1, 2]), \
            rng.randint(2, 8)
        hq = hkv * rng.choice([1, 2])
        centres = F.normalize(torch.randn(nc, d, generator=gen), dim=-1)
        noise = 8 * math.tan(math.radians(degrees)) / math.sqrt(d)

        def draw(h: int) -> torch.Tensor:
            at = centres[torch.randint(0, nc, (1, s, h), generator=gen)]
            return 8 * at + noise * torch.randn(1, s, h, d, generator=gen)

        q, k, v = draw(hq), draw(hkv), torch.randn(1, s, hkv, d, generator=gen)
        out = hub.attention(q, k, v, backend="lsh")
        dense, _ = reference_attention(q, k, v, AttnParams(scale=d ** -0.5))
        errs.append(rel_rmse(out, dense))
    assert max(errs) <= LSH_BUDGET, [round(e, 3) for e in errs]
