"""Adversarial: one bound model used as a model library's user would use it.

Successive calls that change shape, dtype, grad mode and train/eval on one bound layer;
copies, pickles and threads; torch.compile; a hybrid decoder's cached decode against its
one-shot forward; per-layer bindings and what explains them; locks of a bound model that go
stale. Every answer is checked against the reference backend or the model's own forward.
"""

from __future__ import annotations

import copy
import io
import json
import multiprocessing
import pickle
import random
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from attnhub import Hub
from attnhub.core.registry import Registry
from attnhub.models.decoder import Decoder, DecoderConfig
from attnhub.nn import Attention
from attnhub.policy import load_policy
from attnhub.policy.lock import LockfileError, build_lock, check_lock, read_lock, write_lock

SMALL = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, vocab_size=64)
HYBRID = "name: hyb\nversion: 1\nextends: default\nrules:\n" \
         "  - name: linear-gla\n    when: {layer: {kind: linear}}\n    use: [gla]\n"


@pytest.fixture(scope="module")
def hub() -> Hub:
    return Hub(policy=load_policy())


def _qkv(g: torch.Generator, b: int, s: int, dtype: torch.dtype = torch.float32,
         grad: bool = False) -> list[torch.Tensor]:
    return [torch.randn(b, s, h, 16, generator=g).to(dtype).requires_grad_(grad)
            for h in (4, 2, 2)]


def _reference(hub: Hub, layer: Attention, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
    return hub.attention(q, k, v, causal=layer.causal and q.shape[1] > 1, backend="reference",
                         context=layer.context)


def _tol(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


def _run_cached(model: Decoder, ids: torch.Tensor, prompt: int, page_size: int) -> torch.Tensor:
    """Logits (B, S - prompt + 1, vocab): the prefill's last position, then one per decode."""
    cache = model.new_cache(ids.shape[0], ids.shape[1], page_size=page_size)
    seqs, logits = model.prefill(cache, ids[:, :prompt])
    out = [logits]
    for i in range(prompt, ids.shape[1]):
        out.append(model.decode(cache, seqs, ids[:, i]))
    cache.check_invariants()
    return torch.stack(out, 1)


# -- one index, one layer --------------------------------------------------------------------
def _stack_of_copies(n: int) -> nn.Module:
    """A model built the common way: one layer made, then deep-copied n times."""
    layer = Attention(4, 2, 16, layer_idx=0)
    return nn.ModuleList(copy.deepcopy(layer) for _ in range(n))


@pytest.mark.parametrize("how", ["copies", "mixed"])
def test_two_layers_on_one_index_are_refused(hub: Hub, how: str) -> None:
    """Seen: both layers wrote KV cache layer 0 (decode logits off by ~3, silently)."""
    if how == "copies":
        model = _stack_of_copies(random.Random(1).randint(2, 4))
    else:  # the first layer unnumbered (bind gives it 0), the second claims 0 itself
        model = nn.ModuleList([Attention(4, 2, 16), Attention(4, 2, 16, layer_idx=0)])
    with pytest.raises(ValueError, match=r"both have layer index 0.*layer_idx=") as err:
        hub.bind(model, batch=1, prompt_len=8)
    assert "'0'" in str(err.value) and "'1'" in str(err.value)  # both module paths named


def test_the_decoder_with_copied_indices_is_refused_not_decoded_wrong(hub: Hub) -> None:
    model = Decoder(DecoderConfig(num_layers=3, **SMALL, seed=11))
    for block in model.layers:
        block.attn.layer_idx = 1
    with pytest.raises(ValueError, match="layers.0.attn.*layers.1.attn.*layer index 1"):
        hub.bind(model, batch=2, prompt_len=6)


def test_one_attention_at_two_positions_is_refused_for_a_cache_only(hub: Hub) -> None:
    """A weight-shared stack (one module at every depth) would write one cache layer per
    call; training has no cache, so binding it for training stays allowed."""
    shared = Attention(4, 2, 16)
    model = nn.ModuleList([shared, nn.Identity(), shared])
    with pytest.raises(ValueError, match=r"one attnhub.nn.Attention sits at \['0', '2'\]"):
        hub.bind(model, batch=1, prompt_len=8)
    table = hub.bind(model, batch=1, prompt_len=8, phases=("train",))
    assert [r.phase for r in table] == ["train"]


@pytest.mark.parametrize("kw", [{"head_dim_v": 0}, {"layer_idx": -1}, {"layer_idx": True},
                                {"num_q_heads": 0}, {"head_dim": 0}])
def test_sizes_that_would_be_silently_replaced_are_refused(kw: dict) -> None:
    """Seen: head_dim_v=0 became head_dim, and layer_idx=-1 bound as layer -1 (policy
    rules by index never matched it; the cache refused it only at the first cached call)."""
    args = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16, **kw}
    name = next(iter(kw))
    with pytest.raises(ValueError, match=rf"{name}|query heads"):
        Attention(**args)


def test_an_index_set_after_construction_is_checked_at_bind(hub: Hub) -> None:
    layer = Attention(4, 2, 16)
    layer.layer_idx = -random.Random(2).randint(1, 5)
    with pytest.raises(ValueError, match=r"bind: layer '0': layer_idx=-\d.*int >= 0"):
        hub.bind(nn.ModuleList([layer]), batch=1, prompt_len=8)


class _FailsOnLayer:
    """A resolver that raises for one layer (a broken policy plugin, Ctrl-C mid-bind)."""

    def __init__(self, inner, layer: int):  # type: ignore[no-untyped-def]
        self.inner, self.name, self.layer = inner, "fails", layer

    def resolve(self, spec, device, registry, ctx):  # type: ignore[no-untyped-def]
        if ctx.layer == self.layer:
            raise RuntimeError(f"resolver broke on layer {ctx.layer}")
        return self.inner.resolve(spec, device, registry, ctx)


def test_a_bind_that_fails_half_way_changes_no_layer(hybrid) -> None:
    """Seen: layers before the failing one were moved to the new hub and renamed, the rest
    stayed on the old binding (a model served by two policies at once)."""
    hub, _ = hybrid
    model = _hybrid_model(6)
    hub.bind(model, batch=1, prompt_len=6, max_len=12, page_size=4)
    before = [(m.attn.hub, m.attn.context, m.attn.state_backend, m.attn.decode_layout)
              for m in model.layers]
    broken = Hub(policy=_FailsOnLayer(load_policy(), random.Random(6).randint(1, 2)))
    with pytest.raises(RuntimeError, match="resolver broke"):
        broken.bind(model, batch=1, prompt_len=6, max_len=12, page_size=4, name="other")
    assert [(m.attn.hub, m.attn.context, m.attn.state_backend, m.attn.decode_layout)
            for m in model.layers] == before


# -- successive calls on one bound layer -----------------------------------------------------
def test_successive_calls_that_change_everything_match_the_reference(hub: Hub) -> None:
    model = Decoder(DecoderConfig(num_layers=2, **SMALL, seed=7))
    hub.bind(model, batch=2, prompt_len=8)
    layer = model.layers[1].attn
    rng, g = random.Random(3), torch.Generator().manual_seed(3)
    for _ in range(24):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        b, s = rng.randint(1, 3), rng.randint(1, 21)
        grad = dtype == torch.float32 and rng.random() < 0.4
        model.train(rng.random() < 0.5)
        mode = rng.choice(["grad", "no_grad", "inference"])
        q, k, v = _qkv(g, b, s, dtype, grad)
        ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad,
               "inference": torch.inference_mode}[mode]
        with ctx():
            out = layer(q, k, v)
        want = _reference(hub, layer, q.detach(), k.detach(), v.detach())
        assert out.dtype == dtype and out.shape == q.shape
        assert out.requires_grad == (grad and mode == "grad")
        torch.testing.assert_close(out.detach().float(), want.float(), rtol=_tol(dtype),
                                   atol=_tol(dtype))
        if out.requires_grad:
            out.float().square().sum().backward()
            assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_meta_tensors_give_meta_shapes(hub: Hub) -> None:
    layer = Attention(4, 2, 16, layer_idx=0)
    hub.bind(nn.ModuleList([layer]), batch=1, prompt_len=8)
    q, k, v = (torch.empty(2, 5, h, 16, device="meta") for h in (4, 2, 2))
    out = layer(q, k, v)
    assert out.device.type == "meta" and out.shape == q.shape
    g = torch.Generator().manual_seed(5)
    q, k, v = _qkv(g, 2, 5)  # the next CPU call is not served by the meta call's binding
    torch.testing.assert_close(layer(q, k, v), _reference(hub, layer, q, k, v))


def test_threads_share_one_bound_layer(hub: Hub) -> None:
    layer = Attention(4, 2, 16, layer_idx=0)
    hub.bind(nn.ModuleList([layer]), batch=1, prompt_len=8)
    bad: list[str] = []

    def work(seed: int) -> None:
        g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
        for _ in range(20):
            dtype = rng.choice([torch.float32, torch.bfloat16])
            q, k, v = _qkv(g, rng.randint(1, 3), rng.randint(1, 19), dtype)
            out = layer(q, k, v)
            err = (out.float() - _reference(hub, layer, q, k, v).float()).abs().max().item()
            if out.dtype != dtype or out.shape != q.shape or err > _tol(dtype):
                bad.append(f"seed {seed}: {tuple(q.shape)} {dtype} err {err}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad


def test_torch_compile_gives_the_eager_numbers(hub: Hub) -> None:
    model = Decoder(DecoderConfig(num_layers=1, **SMALL, seed=9))
    hub.bind(model, batch=2, prompt_len=8)
    compiled = torch.compile(model, fullgraph=False, backend="eager")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)


# -- copies and pickles ----------------------------------------------------------------------
def test_a_hub_deep_copies_as_itself_and_refuses_pickle_with_the_fix(hub: Hub) -> None:
    """Seen: ``cannot pickle 'module' object`` from both, naming neither the hub nor a fix."""
    state = {"hub": hub, "step": 3}
    assert copy.deepcopy(state)["hub"] is hub and copy.copy(hub) is hub
    with pytest.raises(TypeError, match="Hub cannot be pickled.*bind it again"):
        pickle.dumps(state)
    with pytest.raises(TypeError, match="Hub cannot be pickled"):
        torch.save(hub, io.BytesIO())


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Hub, Path]:
    path = tmp_path_factory.mktemp("hyb") / "hyb.yaml"
    path.write_text(HYBRID, encoding="utf-8")
    return Hub(policy=load_policy(str(path))), path


def _hybrid_model(seed: int) -> Decoder:
    return Decoder(DecoderConfig(num_layers=3, **SMALL, seed=seed,
                                 layer_kinds=("linear", "linear", "softmax")))


def test_hybrid_prefill_and_decode_match_a_one_shot_forward(hybrid) -> None:
    hub, _ = hybrid
    seed = 1
    rng = random.Random(seed)
    prompt, total, page = rng.randint(3, 6), rng.randint(9, 11), rng.choice([2, 4])
    model = _hybrid_model(seed)
    table = hub.bind(model, batch=2, prompt_len=prompt, max_len=total, page_size=page)
    assert [m.attn.state_backend for m in model.layers] == ["gla", "gla", None]
    ids = torch.randint(0, SMALL["vocab_size"], (2, total),
                        generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full = model(ids)[:, prompt - 1:]
    torch.testing.assert_close(_run_cached(model, ids, prompt, page), full, rtol=1e-4,
                               atol=1e-4)
    # a deep copy shares the hub and the binding; a pickle drops the hub: bound again, the
    # loaded model gives the same numbers
    twin = copy.deepcopy(model)
    assert all(a.attn.hub is hub for a in twin.layers)
    torch.testing.assert_close(_run_cached(twin, ids, prompt, page), full, rtol=1e-4,
                               atol=1e-4)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert all(m.attn.hub is None for m in loaded.layers)
    again = hub.bind(loaded, batch=2, prompt_len=prompt, max_len=total, page_size=page)
    assert again.backends() == table.backends()
    torch.testing.assert_close(_run_cached(loaded, ids, prompt, page), full, rtol=1e-4,
                               atol=1e-4)


def test_per_layer_bindings_say_which_and_why(hybrid) -> None:
    hub, path = hybrid
    model = _hybrid_model(4)
    table = hub.bind(model, batch=1, prompt_len=6, max_len=12, page_size=4)
    assert table.backends("prefill") == {0: "gla", 1: "gla", 2: "torch_sdpa"}
    for r in table:
        want_rule = "linear-gla" if r.layer < 2 else "cpu"
        assert r.decision.rule == want_rule and r.sequence_state == (r.layer < 2)
        assert r.decision.context.layer == r.layer
    text = str(table)
    assert "gla +state" in text and f"linear-gla ({path}:5)" in text
    assert "| 2      | softmax | prefill" in text
    ids = torch.randint(0, SMALL["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(4))
    _run_cached(model, ids, 6, 4)
    ran = {(r.decision.context.layer, r.decision.backend) for r in hub.bound()
           if r.decision.context.model == model.cfg.name}
    assert ran == {(r.layer, r.backend) for r in table}  # what ran is what was bound


# -- locks of a bound model ------------------------------------------------------------------
def _lock_of(hub: Hub, table) -> dict:  # type: ignore[no-untyped-def]
    return build_lock(hub.resolver, hub.registry, [(hub.device, r.decision) for r in table])


def test_a_stale_lock_of_a_bound_model_reports_each_changed_layer(hybrid, tmp_path) -> None:
    hub, path = hybrid
    table = hub.bind(_hybrid_model(2), batch=1, prompt_len=6, max_len=12, page_size=4)
    lock_path = tmp_path / "model.lock"
    write_lock(lock_path, _lock_of(hub, table))
    lock = read_lock(lock_path)
    assert not check_lock(lock, hub.resolver, hub.registry).drifted
    changed = tmp_path / "hyb2.yaml"  # the linear layers now bound to retention
    changed.write_text(HYBRID.replace("[gla]", "[retention]"), encoding="utf-8")
    drift = check_lock(lock, load_policy(str(changed)), hub.registry)
    assert drift.drifted and drift.policy
    assert all("'gla' -> 'retention'" in c and "kind=linear" in c for c in drift.changed)
    assert {c.split("layer=")[1][0] for c in drift.changed} == {"0", "1"}
    # the plugin that served gla is gone: its bindings and its provider are drift
    core = Registry.load(allow=[])
    drift = check_lock(lock, load_policy(str(path)), core)
    assert any(c.startswith("backend gla: provider") for c in drift.changed)
    assert sum("'gla' -> " in c for c in drift.changed) == sum(r.layer < 2 for r in table)


def test_a_truncated_lock_is_located(hybrid, tmp_path) -> None:
    hub, _ = hybrid
    table = hub.bind(_hybrid_model(3), batch=1, prompt_len=6, max_len=12, page_size=4)
    lock_path = tmp_path / "model.lock"
    write_lock(lock_path, _lock_of(hub, table))
    text = lock_path.read_text(encoding="utf-8")
    for cut in sorted(random.Random(5).sample(range(1, len(text) - 2), 4)):
        lock_path.write_text(text[:cut], encoding="utf-8")
        with pytest.raises(LockfileError, match=rf"{lock_path}:\d+:\d+.*attnhub lock -o"):
            read_lock(lock_path)


def _write_many(target: Path, writer: str) -> None:
    for _ in range(40):
        write_lock(target, {"schema": "x", "writer": writer, "pad": [writer] * 2000})


def test_two_processes_writing_one_lock_leave_one_whole_lock(tmp_path: Path) -> None:
    target = tmp_path / "attnhub.lock"
    ctx = multiprocessing.get_context("fork")  # no second import of torch
    procs = [ctx.Process(target=_write_many, args=(target, w)) for w in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    data = json.loads(target.read_text(encoding="utf-8"))
    assert data["writer"] in "ab" and set(data["pad"]) == {data["writer"]}
    assert [p.name for p in tmp_path.iterdir()] == ["attnhub.lock"]  # no temporary left
