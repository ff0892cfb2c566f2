"""A hybrid model (policies/hybrid-model.yaml: GLA layers and softmax layers) decodes through
the recurrent state kept beside its KV cache: the same tokens and logits as recomputing each
step from the cache, with a per-step work that no longer grows with the context."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from attnhub_hybrid_linear import RecurrentStateCache, linear_ops
from attnhub_hybrid_linear.metrics import rel_rmse

from attnhub import Hub
from attnhub.cli import main as cli_main
from attnhub.core.kvcache import free_all
from attnhub.models.decoder import Decoder, DecoderConfig, random_prompts

POLICY = Path(__file__).resolve().parents[3] / "policies" / "hybrid-model.yaml"
CFG = DecoderConfig(num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=16, vocab_size=64,
                    seed=5)
BATCH, PROMPT, STEPS, GLA_LAYERS = 2, 12, 6, (0, 1, 2)
BUDGET = 5e-3  # the plugin's relative RMSE budget between two forms of one recurrence


@pytest.fixture
def tokens_processed(monkeypatch: pytest.MonkeyPatch, torch_impl: None) -> list[int]:
    """Key tokens the linear layers' ops process (batch x length per call), summed."""
    seen = [0]

    def counting(fn):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kw):  # type: ignore[no-untyped-def]
            k = args[1] if fn is not linear_ops.state_after else args[0]
            seen[0] += k.shape[0] * k.shape[1]
            return fn(*args, **kw)
        return wrapped

    for op in ("chunked", "recurrent", "state_after"):
        monkeypatch.setattr(linear_ops, op, counting(getattr(linear_ops, op)))
    return seen


def _greedy(model: Decoder, sequence_state: bool,
            seen: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Greedy decode on forks of the prompts: logits (B, STEPS, V), tokens, work per step."""
    cache = model.new_cache(BATCH, PROMPT + STEPS, page_size=4,
                            sequence_state=sequence_state)
    seqs, logits = model.prefill(cache, random_prompts(CFG, BATCH, PROMPT))
    forks = [cache.fork(s) for s in seqs]
    out, toks, work = [], [logits.argmax(-1)], []
    for _ in range(STEPS):
        before = seen[0]
        out.append(model.decode(cache, forks, toks[-1]))
        toks.append(out[-1].argmax(-1))
        work.append(seen[0] - before)
    if sequence_state:
        store = cache.states.store(GLA_LAYERS[0])
        assert isinstance(store, RecurrentStateCache)
        # forks decode from copies: the prompts' states still stand after the prompt
        assert all(store.position(s, layer) == PROMPT for s in seqs for layer in GLA_LAYERS)
        assert all(store.position(f, 0) == PROMPT + STEPS for f in forks)
        free_all(cache, forks)
        assert sorted(store.seq_ids) == sorted(cache.seq_ids) == sorted(seqs)
    return torch.stack(out, 1), torch.stack(toks[1:], 1), work


def test_hybrid_decode_with_state_equals_recompute_at_constant_work(tokens_processed) -> None:  # type: ignore[no-untyped-def]
    hub = Hub(policy=POLICY, hardware="cpu")
    model = Decoder(CFG)
    table = hub.bind(model, batch=BATCH, prompt_len=PROMPT, max_len=PROMPT + STEPS,
                     page_size=4)
    stateful = {r.layer for r in table if r.sequence_state}
    assert stateful == set(GLA_LAYERS) and all(r.backend == "gla" for r in table
                                               if r.layer in stateful)
    logits, toks, work = _greedy(model, True, tokens_processed)
    with pytest.warns(UserWarning, match="recomputes the context"):
        ref_logits, ref_toks, ref_work = _greedy(model, False, tokens_processed)
    assert torch.equal(toks, ref_toks)
    assert rel_rmse(logits, ref_logits) < BUDGET
    # state: one new token per sequence and GLA layer, at any context length;
    # recompute: the whole context again, growing with every step
    assert work == [BATCH * len(GLA_LAYERS)] * STEPS
    assert all(b > a for a, b in itertools.pairwise(ref_work)) and ref_work[0] > work[0]


def test_binding_without_prefill_keeps_no_state() -> None:
    hub = Hub(policy=POLICY, hardware="cpu")
    model = Decoder(CFG)
    table = hub.bind(model, batch=BATCH, prompt_len=PROMPT, phases=("decode",))
    assert {r.backend for r in table if r.layer in GLA_LAYERS} == {"gla"}
    assert not any(r.sequence_state for r in table)
    assert not model.new_cache(BATCH, PROMPT + STEPS, page_size=4).states


def test_attnhub_run_with_the_hybrid_policy(capsys, torch_impl) -> None:  # type: ignore[no-untyped-def]
    argv = ["run", "--policy", str(POLICY), "--layers", "4", "--heads", "4:2", "--head-dim",
            "16", "--vocab", "64", "--batch", "2", "--prompt-len", "12", "--new-tokens", "4",
            "--page-size", "4", "--json"]
    assert cli_main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    rows = r["bindings"]["bindings"]
    assert {b["layer"] for b in rows if b["sequence_state"]} == set(GLA_LAYERS)
    assert {b["backend"] for b in rows if b["sequence_state"]} == {"gla"}
    assert r["check"]["ok"] and r["phases"]["decode"]["tokens"] == 2 * 4
