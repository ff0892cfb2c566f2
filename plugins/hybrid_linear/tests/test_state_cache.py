"""RecurrentStateCache: random allocate/write/fork/free programs against a plain-dict model."""

from __future__ import annotations

import pytest
import torch
from attnhub_hybrid_linear import RecurrentStateCache
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from attnhub.plugin import CacheFullError, InputError

LAYERS, H, K, V = [0, 3], 2, 3, 2


class StateMachine(RuleBasedStateMachine):
    """``model`` holds, per live sequence and layer, the state and position it must read."""

    @initialize(slots=st.integers(1, 4))
    def setup(self, slots: int) -> None:
        self.cache = RecurrentStateCache(layers=LAYERS, num_heads=H, key_dim=K, value_dim=V,
                                         max_seqs=slots)
        self.model: dict[int, dict[int, tuple[torch.Tensor, int]]] = {}
        self.next_id = 0
        self.gen = torch.Generator().manual_seed(slots)

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule()
    def allocate(self) -> None:
        sid = self._new_id()
        try:
            self.cache.allocate(sid)
        except CacheFullError as exc:
            assert len(self.model) == self.cache.max_seqs and "No sequence" in str(exc)
            return
        self.model[sid] = {layer: (torch.zeros(H, K, V), 0) for layer in LAYERS}

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 5))
    def write(self, data: st.DataObject, n: int) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        layer = data.draw(st.sampled_from(LAYERS))
        states = torch.randn(len(ids), H, K, V, generator=self.gen)
        self.cache.write(ids, layer, states, n)
        for i, sid in enumerate(ids):
            self.model[sid][layer] = (states[i].clone(), self.model[sid][layer][1] + n)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        src = data.draw(st.sampled_from(sorted(self.model)))
        dst = self._new_id()
        try:
            self.cache.fork(src, dst)
        except CacheFullError:
            assert len(self.model) == self.cache.max_seqs
            return
        self.model[dst] = {layer: (s.clone(), p) for layer, (s, p) in self.model[src].items()}

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free(sid)
        del self.model[sid]

    @invariant()
    def reads_back_what_was_written(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        assert sorted(self.cache.seq_ids) == sorted(self.model)
        for sid, layers in self.model.items():
            for layer, (state, pos) in layers.items():
                got, positions = self.cache.read([sid], layer)
                assert torch.equal(got[0], state) and positions == [pos]
                assert self.cache.position(sid, layer) == pos


TestStateMachine = StateMachine.TestCase
TestStateMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_read_is_a_copy_and_fork_is_not_shared() -> None:
    cache = RecurrentStateCache(layers=1, num_heads=1, key_dim=2, max_seqs=3)
    cache.allocate(1)
    cache.write([1], 0, torch.ones(1, 1, 2, 2), 4)
    got, _ = cache.read([1], 0)
    got.fill_(7)  # mutating what was read changes nothing stored
    cache.fork(1, 2)
    cache.write([2], 0, torch.full((1, 1, 2, 2), 3.0), 1)
    assert torch.equal(cache.read([1], 0)[0], torch.ones(1, 1, 2, 2))
    assert cache.position(1, 0) == 4 and cache.position(2, 0) == 5


def test_freed_slot_is_zeroed_for_its_next_owner() -> None:
    cache = RecurrentStateCache(layers=1, num_heads=1, key_dim=2, max_seqs=1)
    cache.allocate(1)
    cache.write([1], 0, torch.randn(1, 1, 2, 2), 3)
    cache.free(1)
    cache.allocate(2)
    state, pos = cache.read([2], 0)
    assert not state.any() and pos == [0]


def test_errors_name_the_fix() -> None:
    cache = RecurrentStateCache(layers=[4], num_heads=1, key_dim=2, max_seqs=1)
    cache.allocate(1)
    with pytest.raises(CacheFullError, match="max_seqs"):
        cache.allocate(2)
    with pytest.raises(InputError, match="already has a state"):
        cache.allocate(1)
    with pytest.raises(InputError, match="repeat"):
        cache.write([1, 1], 4, torch.zeros(2, 1, 2, 2), 1)
    with pytest.raises(InputError, match="layer 0 has no state"):
        cache.read([1], 0)
    cache.free(1)
    with pytest.raises(InputError, match="unknown sequence id 1"):
        cache.position(1, 4)
