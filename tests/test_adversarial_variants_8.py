"""Review round 8, score/mask variants: a caller's ``mask_mod`` or ``score_mod`` that raised
(a captured tensor shorter than the sequence) or returned the wrong kind of value was taken
for a failure of the CPU backends that run it (torch_sdpa, reference): warned, counted as a
fallback, retried, and ended in ``NoBackendError``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import attnhub
from attnhub.errors import InputError

_DOC = torch.arange(100) // 10  # document ids for 100 positions, called with 130


def _short_capture(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    return _DOC[q_idx] == _DOC[kv_idx]


CASES: dict[str, tuple[dict[str, Callable[..., Any]], str]] = {
    "mask_mod raises": ({"mask_mod": _short_capture}, "_short_capture' raised IndexError"),
    "mask_mod returns a bool": ({"mask_mod": lambda b, h, qi, kv: True}, "returned a bool"),
    "score_mod returns a mask": ({"score_mod": lambda s, b, h, qi, kv: s > 0},
                                 "returned a torch.bool tensor"),
    "score_mod returns ints": ({"score_mod": lambda s, b, h, qi, kv: (s * 10).int()},
                               "returned a torch.int32 tensor"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", [None, "torch_sdpa", "reference"])
def test_a_callers_variant_that_breaks_is_the_callers_error(case: str, backend: str | None
                                                            ) -> None:
    kw, said = CASES[case]
    if backend == "torch_sdpa" and "score_mod" in kw:
        pytest.skip("torch_sdpa declines score_mod")
    hub = attnhub.Hub(hardware="cpu")
    q, k, v = (torch.randn(1, 130, 2, 16) for _ in range(3))
    with pytest.raises(InputError, match=said):
        hub.attention(q, k, v, backend=backend, **kw)
    assert not hub.fallback_counts
