"""Review 11: a training call whose queries follow a prefix (Sq < Sk) passed the linear
backends' check and then raised ``InputError`` from ``forward`` (the prefix's state is not
differentiated): a call ``check`` had accepted, which the kit counts as a failure and the
hub reports as the caller's bad input. Now ``forward`` declines it
(``BackendUnavailableError``, with the reason; ``check`` cannot see whether ``extra`` brings
the prefix's state, which makes the call servable). No other backend is substituted: a GLA
layer runs GLA or fails with the reason. Sq == Sk training is unchanged."""

from __future__ import annotations

import pytest
import torch

import attnhub
from attnhub.errors import BackendUnavailableError


def _training(sq: int, sk: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(sq * 100 + sk)
    return tuple(torch.randn(1, s, 2, 16, generator=g).requires_grad_()
                 for s in (sq, sk, sk))


@pytest.mark.parametrize("name", ["gla", "linear", "retention"])
@pytest.mark.parametrize("sq,sk", [(4, 16), (5, 7)])  # other buckets / one bucket
def test_a_prefix_training_call_is_declined_with_the_reason(name: str, sq: int, sk: int
                                                            ) -> None:
    hub = attnhub.Hub(hardware="cpu")
    with pytest.raises(BackendUnavailableError, match="does not differentiate the state"):
        hub.attention(*_training(sq, sk), causal=True, backend=name)


def test_whole_sequence_training_still_runs() -> None:
    hub = attnhub.Hub(hardware="cpu")
    q, k, v = _training(8, 8)
    hub.attention(q, k, v, causal=True, backend="gla").sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
