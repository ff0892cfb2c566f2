"""attnhub.nn.Attention, bind() and the built-in decoder with the paged KV cache."""

from __future__ import annotations

import json
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import attnhub
from attnhub import Hub
from attnhub.bind import decode_buckets
from attnhub.core.builtin import ReferenceBackend
from attnhub.core.registry import Registry
from attnhub.hookspecs import hookimpl
from attnhub.models.decoder import Decoder, DecoderConfig, random_prompts
from attnhub.nn import Attention, override_backend
from attnhub.policy import load_policy

CFG = DecoderConfig(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=16, vocab_size=64,
                    seed=3)


class Counting:
    """A policy wrapper that counts resolutions (the call path must not cause any)."""

    def __init__(self, inner):  # type: ignore[no-untyped-def]
        self.inner, self.name, self.calls = inner, inner.name, 0

    def resolve(self, *args):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.inner.resolve(*args)


def _policy(tmp_path: Path, name: str, rules: str) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"name: {name}\nversion: 1\nrules:\n{rules}", encoding="utf-8")
    return p


def _greedy_logits(model: Decoder, prompts: torch.Tensor, steps: int,
                   page_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of each step through the cache, and tokens chosen (B, steps + 1)."""
    cache = model.new_cache(prompts.shape[0], prompts.shape[1] + steps, page_size=page_size)
    seqs, logits = model.prefill(cache, prompts)
    out, toks = [logits], [logits.argmax(-1)]
    for _ in range(steps):
        out.append(model.decode(cache, seqs, toks[-1]))
        toks.append(out[-1].argmax(-1))
    return torch.stack(out, 1), torch.stack(toks, 1)


def test_bind_resolves_every_layer_and_phase_up_front() -> None:
    policy = Counting(load_policy())
    hub = Hub(policy=policy)
    model = Decoder(CFG)
    table = hub.bind(model, batch=2, prompt_len=20, max_len=40, page_size=4)
    buckets = decode_buckets(20, 40)
    assert buckets == [32, 64]
    assert len(table) == CFG.num_layers * (1 + len(buckets))
    assert not table.unbound() and policy.calls == len(table)
    assert {(r.layer, r.phase) for r in table} == {(i, p) for i in range(3)
                                                    for p in ("prefill", "decode")}
    _greedy_logits(model, random_prompts(CFG, 2, 20), steps=14)  # crosses bucket 32 -> 64
    assert policy.calls == len(table), "the call path resolved the policy"
    data = json.loads(json.dumps(table.to_json()))
    assert data["model"] == CFG.name and len(data["bindings"]) == len(table)
    text = str(table)
    assert "0-2" in text and "decode" in text and "prefill" in text  # layers grouped


def test_module_level_bind_uses_the_default_hub() -> None:
    hub = Hub(policy=load_policy())
    attnhub.set_default_hub(hub)
    try:
        model = Decoder(CFG)
        table = attnhub.bind(model, batch=1, prompt_len=8)
        assert all(m.hub is hub for m in model.modules() if isinstance(m, Attention))
        assert table.policy == hub.resolver.name
    finally:
        attnhub.set_default_hub(None)


def test_paged_decode_and_forks_match_a_full_forward() -> None:
    """Every decode step through the paged cache equals recomputing the whole sequence;
    two forks of one prompt decode different tokens into copies of the shared last page."""
    torch.manual_seed(0)
    model = Decoder(CFG)
    Hub(policy=load_policy()).bind(model, batch=2, prompt_len=10, max_len=20, page_size=4)
    prompt = random_prompts(CFG, 1, 10)
    cache = model.new_cache(2, 20, page_size=4)
    (seq,), _ = model.prefill(cache, prompt)
    forks = [cache.fork(seq), cache.fork(seq)]
    toks = torch.randint(0, CFG.vocab_size, (2, 5))
    for i in range(5):
        got = model.decode(cache, forks, toks[:, i])
        with torch.no_grad():
            full = model(torch.cat([prompt.expand(2, -1), toks[:, : i + 1]], 1))[:, -1]
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
    cache.check_invariants()


def test_policy_file_rebinds_without_code_changes(tmp_path: Path) -> None:
    a = _policy(tmp_path, "a", "  - name: all-sdpa\n    use: [torch_sdpa]\n")
    b = _policy(tmp_path, "b", "  - name: layer1-reference\n    when: {layer: {index: 1}}\n"
                               "    use: [reference]\n  - name: rest\n    use: [torch_sdpa]\n")
    model = Decoder(CFG)
    prompts = random_prompts(CFG, 2, 12)
    tables, logits = [], []
    for path in (a, b):
        hub = Hub(policy=path)
        tables.append(hub.bind(model, batch=2, prompt_len=12, max_len=16, page_size=4))
        logits.append(_greedy_logits(model, prompts, 3)[0])
        ran = {(r.decision.context.layer, r.decision.backend) for r in hub.bound()}
        assert ran == {(r.layer, r.backend) for r in tables[-1]}  # what ran is what was bound
    assert set(tables[0].backends().values()) == {"torch_sdpa"}
    assert tables[1].backends() == {0: "torch_sdpa", 1: "reference", 2: "torch_sdpa"}
    assert tables[1].rows[2].decision.rule == "layer1-reference"
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


class DenseOnly(ReferenceBackend):
    """A backend without the paged layout (as a linear/recurrent layer's backend may be)."""

    name = "dense_only"
    tier = "portable"
    capabilities = replace(ReferenceBackend.capabilities, layouts=frozenset({"bshd"}))


@hookimpl
def attnhub_register_backends(register):  # type: ignore[no-untyped-def]
    register(DenseOnly())


def test_layer_without_a_paged_backend_reads_a_gathered_cache(tmp_path: Path) -> None:
    reg = Registry.load()
    reg.add_plugin(types.SimpleNamespace(attnhub_register_backends=attnhub_register_backends),
                   "dense_only_plugin")
    pol = _policy(tmp_path, "mixed", "  - name: layer2-dense\n    when: {layer: {index: 2}}\n"
                                     "    use: [dense_only]\n  - name: rest\n"
                                     "    use: [torch_sdpa]\n")
    model = Decoder(CFG)
    table = Hub(policy=pol, registry=reg).bind(model, batch=2, prompt_len=9, max_len=14,
                                               page_size=4)
    layouts = {r.layer: r.decode_layout for r in table if r.phase == "decode"}
    assert layouts == {0: "paged", 1: "paged", 2: "gather"}
    assert model.layers[2].attn.decode_layout == "gather"
    prompts = random_prompts(CFG, 2, 9)
    logits, toks = _greedy_logits(model, prompts, 4)
    with torch.no_grad():
        full = model(torch.cat([prompts, toks[:, :-1]], 1))[:, -5:]
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)


def test_override_backend_is_scoped_and_errors_are_clear() -> None:
    model = Decoder(CFG)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    with override_backend(model, "reference", only=lambda m: m.layer_idx != 0):
        assert [m.backend_override for m in layers] == [None, "reference", "reference"]
    assert all(m.backend_override is None for m in layers)
    with pytest.raises(ValueError, match="multiple"):
        Attention(6, 4, 16)
    with pytest.raises(ValueError, match="no attnhub.nn.Attention"):
        attnhub.bind(torch.nn.Linear(2, 2), Hub(policy=load_policy()))
