"""Review round 8 of the linear layers.

* A NaN or inf key, or a NaN value, at token t turned the earlier rows of its chunk into NaN
  in the chunked form (train/prefill), on the torch form and in the Triton kernel: the masked
  decay of a later token is 0, and 0 x NaN/inf is NaN. A row must not depend on a token it
  cannot see (docs/contract.md, "NaN in means NaN out"): rows before t, and their gradients,
  are those of the prefix alone. Likewise a NaN query reached the gradients of later keys.
* gla's default gate (no ``gla_gate``) was not floored at GATE_FLOOR like a given gate: a key
  of -1e6 put prefill (chunked) 0.3% off the recurrence (-1e30: 87%) that decode follows.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from attnhub_hybrid_linear import linear_torch
from attnhub_hybrid_linear.linear_backends import GATE_FLOOR, default_gate

import attnhub

#: what is poisoned at token t: (tensor, value)
POISON = {"nan-key": ("k", math.nan), "inf-key": ("k", math.inf), "nan-value": ("v", math.nan)}


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub(hardware="cpu")


def _inputs(s: int, h: int = 2, d: int = 16) -> list[torch.Tensor]:
    """q, k, v, a finite log-decay gate and an output weight w, (1, s, h, d)."""
    g = torch.Generator().manual_seed(s)
    q, k, v, w = (torch.randn(1, s, h, d, generator=g) for _ in range(4))
    gate = F.logsigmoid(torch.randn(1, s, h, d, generator=g)) / 8
    return [q, k, v, gate, w]


def _poison(x: dict[str, torch.Tensor], what: str, t: int) -> None:
    name, value = POISON[what]
    x[name][0, t, 0, 3] = value


def _rows_before(run, xs: list[torch.Tensor], n: int, t: int,  # type: ignore[no-untyped-def]
                 grads: int = 3) -> list[torch.Tensor]:
    """Rows < t of ``run``'s output on the first n tokens, and the gradients of the first
    ``grads`` of q, k, v of those tokens, for a loss over those rows only."""
    leaves = [x[:, :n].clone().requires_grad_() for x in xs[:3]]
    o = run(*leaves, xs[3][:, :n])
    dx = torch.autograd.grad((o[:, :t] * xs[4][:, :t]).sum(), leaves[:grads])
    return [o[:, :t], *(d[:, :t] for d in dx)]


def _same(full: list[torch.Tensor], alone: list[torch.Tensor]) -> None:
    for name, a, b in zip(("out", "dq", "dk", "dv"), full, alone):
        assert bool(a.isfinite().all()), f"{name}: rows before the poisoned token hold NaN/inf"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.usefixtures("torch_impl")
@pytest.mark.parametrize("s,t", [(40, 20), (20, 12)])
@pytest.mark.parametrize("what", sorted(POISON))
@pytest.mark.parametrize("backend", ["gla", "linear", "retention"])
def test_a_later_non_finite_token_leaves_earlier_rows_exact(hub: attnhub.Hub, backend: str,
                                                            what: str, s: int, t: int) -> None:
    """Through the hub on the torch form. gla's default gate derives from k, so a NaN key
    also makes its gate NaN: the rows that see it pass their zero gradient times that NaN
    to the earlier keys' gates (the softmax backends' gradients all turn NaN there); so for
    gla only the output and dq, which belong to the rows, are held."""
    xs = _inputs(s)
    _poison(dict(zip("qkv", xs)), what, t)

    def run(q, k, v, _gate):  # type: ignore[no-untyped-def]
        return hub.attention(q, k, v, causal=True, backend=backend)

    grads = 1 if backend == "gla" else 3
    _same(_rows_before(run, xs, s, t, grads), _rows_before(run, xs, t, t, grads))


@pytest.mark.parametrize("t", [20, 3])
@pytest.mark.parametrize("what", sorted(POISON))
def test_the_triton_chunk_kernels_keep_earlier_rows_exact(kernels: ModuleType, what: str,
                                                          t: int) -> None:
    """The Triton chunk kernels (interpreted here), forward and backward, with a given gate
    (t = 3: inside the first sub-chunk; 20: the second, both in the first 64-token chunk)."""
    xs = _inputs(40, h=1)
    _poison(dict(zip("qkv", xs)), what, t)

    def run(q, k, v, gate):  # type: ignore[no-untyped-def]
        return kernels.chunked(q, k, v, gate, 0.25)[0]

    _same(_rows_before(run, xs, 40, t), _rows_before(run, xs, t, t))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_nan_query_leaves_later_keys_gradients_exact(impl: str,
                                                       request: pytest.FixtureRequest) -> None:
    """A NaN query at row r whose output the loss leaves out: the other rows, dq and the
    gradients of the keys and values after r are those of a zero query there."""
    fn = (request.getfixturevalue("kernels").chunked if impl == "triton"
          else linear_torch.chunked)
    r, s = 20, 40
    q, k, v, gate, w = _inputs(s, h=1)
    w[:, r] = 0

    def run(qr: float) -> list[torch.Tensor]:
        leaves = [q.clone(), k.clone(), v.clone()]
        leaves[0][0, r] = qr
        for x in leaves:
            x.requires_grad_()
        o = fn(*leaves, gate, 0.25)[0]
        dq, dk, dv = torch.autograd.grad((o * w).sum(), leaves)
        rows = torch.arange(s) != r
        return [o[:, rows], dq[:, rows], dk[:, r + 1:], dv[:, r + 1:]]

    _same(run(math.nan), run(0.0))


def test_the_default_gate_is_floored() -> None:
    k = torch.tensor([-math.inf, -1e30, -1e6, 0.0])
    assert default_gate(k).tolist()[:3] == [GATE_FLOOR] * 3
    assert default_gate(k)[3] == pytest.approx(math.log(0.5) / 16)


def _recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp64 recurrence with the unfloored default gate logsigmoid(k) / 16."""
    gate = F.logsigmoid(k.double()) / 16
    return linear_torch.recurrent(q.double(), k.double(), v.double(), gate,
                                  q.shape[-1] ** -0.5)[0]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("big", [-1e6, -1e30])
def test_prefill_and_decode_agree_with_the_recurrence_on_extreme_keys(
        hub: attnhub.Hub, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
        impl: str, big: float) -> None:
    """A finite but extreme key channel at token 18, default gate: prefill (chunked) and
    token-by-token decode (recurrent) both follow the fp64 recurrence per row."""
    if impl == "triton":
        request.getfixturevalue("kernels")
    monkeypatch.setenv("ATTNHUB_LINEAR_IMPL", impl)
    s = 24
    q, k, v = _inputs(s, d=8)[:3]
    k[0, 18, :, 2] = big
    want = _recurrence(q, k, v)
    prefill = hub.attention(q, k, v, causal=True, backend="gla")
    decode = torch.cat([hub.attention(q[:, i:i + 1], k[:, :i + 1], v[:, :i + 1], causal=True,
                                      backend="gla") for i in range(s)], 1)
    for name, got in (("prefill", prefill), ("decode", decode)):
        per_row = (got.double() - want).norm(dim=-1) / want.norm(dim=-1)
        assert float(per_row.max()) < 2e-5, f"{name}: rows off by {float(per_row.max()):.2e}"
