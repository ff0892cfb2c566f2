"""Review 9: a recurrent state cache's layer and sequence ids are ints, never rounded into
one (``int(0.7)`` read layer 0.7 as layer 0, another layer's state; True as sequence 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attnhub_hybrid_linear import RecurrentStateCache
from attnhub_hybrid_linear.extra import state_ref

import attnhub
from attnhub.plugin import InputError


def _cache() -> RecurrentStateCache:
    st = RecurrentStateCache(layers=[0, 1], num_heads=2, key_dim=4, max_seqs=2)
    st.allocate(0)
    st.allocate(1)
    return st


@pytest.mark.parametrize("layer", [0.7, 1.0, True, "0", torch.tensor(0.0), [0]])
def test_a_layer_that_is_not_an_int_is_refused_naming_it(layer: object) -> None:
    extra = {"recurrent_state": _cache(), "seq_ids": [0], "layer": layer}
    with pytest.raises(InputError, match=r"gla: extra\['layer'\]=.*expected an int"):
        state_ref(extra, 1, "gla")


@pytest.mark.parametrize("ids", [[0.7], [True], ["1"], torch.tensor([0.0]),
                                 torch.tensor([True]), torch.zeros(1, 1, dtype=torch.long), 0])
def test_seq_ids_that_are_not_ints_are_refused_naming_them(ids: object) -> None:
    extra = {"recurrent_state": _cache(), "seq_ids": ids, "layer": 0}
    with pytest.raises(InputError, match=r"gla: extra\['seq_ids'\]"):
        state_ref(extra, 1, "gla")


@pytest.mark.parametrize("ids,layer", [([1], 1), ((np.int64(1),), np.int64(1)),
                                       (torch.tensor([1]), torch.tensor(1))])
def test_int_ids_of_any_int_type_still_name_the_state(ids: object, layer: object) -> None:
    ref = state_ref({"recurrent_state": _cache(), "seq_ids": ids, "layer": layer}, 1, "gla")
    assert ref is not None and ref.seq_ids == (1,) and ref.layer == 1
    assert all(type(s) is int for s in ref.seq_ids) and type(ref.layer) is int


def test_a_call_with_a_fractional_layer_raises_before_any_state_changes() -> None:
    st = _cache()
    q, k, v = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)
    with pytest.raises(InputError, match=r"extra\['layer'\]=0\.7 \(float\)"):
        attnhub.Hub(hardware="cpu").attention(
            q, k, v, causal=True, backend="gla",
            extra={"recurrent_state": st, "seq_ids": [0], "layer": 0.7})
    assert st.position(0, 0) == 0 and st.position(0, 1) == 0  # layer 0 was not advanced


def test_the_cache_api_refuses_non_int_ids_and_counts() -> None:
    st = _cache()
    with pytest.raises(InputError, match="RecurrentStateCache: layer=0.5"):
        st.read([0], 0.5)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="RecurrentStateCache: layer=1.0"):
        st.read([0], 1.0)  # type: ignore[arg-type]  # (found layer 1 before)
    with pytest.raises(InputError, match="RecurrentStateCache.read: sequence id=True"):
        st.read([True], 0)  # type: ignore[list-item]
    with pytest.raises(InputError, match="RecurrentStateCache.allocate: seq_id=2.0"):
        st.allocate(2.0)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="RecurrentStateCache.write: advance=0.7"):
        st.write([0], 0, torch.zeros(1, 2, 4, 4), 0.7)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="RecurrentStateCache: layer id=0.5"):
        RecurrentStateCache(layers=[0.5], num_heads=1, key_dim=1, max_seqs=1)  # type: ignore
    assert st.position(0, 0) == 0
    st.check_invariants()
