"""Review round 9 of the linear layers.

* A packed (thd) training call with a document that brings keys but no query (Sq = 0 < Sk)
  was refused as a whole: "gradients with Sq (0) < Sk (n) are not supported", from the
  prefix-state rule, although such a document has no output and needs no prefix state. Every
  other document's output and gradients must be those of that document alone, and the
  query-less document's keys get zero gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnhub


@pytest.fixture(scope="module")
def hub() -> attnhub.Hub:
    return attnhub.Hub(hardware="cpu")


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.usefixtures("torch_impl")
@pytest.mark.parametrize("backend,gate", [("gla", False), ("gla", True), ("linear", False),
                                          ("retention", False)])
def test_a_document_without_queries_leaves_a_training_call_exact(hub: attnhub.Hub,
                                                                 backend: str,
                                                                 gate: bool) -> None:
    g = torch.Generator().manual_seed(9)
    lq, lk = [5, 0, 19, 0], [5, 3, 19, 2]  # documents 1 and 3: keys, no query
    hq, hkv, d = 4, 2, 8
    q = torch.randn(sum(lq), hq, d, generator=g).requires_grad_()
    k, v = (torch.randn(sum(lk), hkv, d, generator=g).requires_grad_() for _ in range(2))
    w = torch.randn(sum(lq), hq, d, generator=g)
    gl = (F.logsigmoid(torch.randn(sum(lk), hkv, generator=g)) / 4).requires_grad_()
    extra = {"gla_gate": gl} if gate else {}
    out = hub.attention(q, k, v, causal=True, backend=backend, layout="thd",
                        cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk), extra=extra)
    leaves = [q, k, v, gl] if gate else [q, k, v]
    grads = torch.autograd.grad((out * w).sum(), leaves)
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for i in (0, 2):  # the documents with queries: as if alone
        sl_q, sl_k = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        alone = [x[sl_q if j == 0 else sl_k].detach()[None].requires_grad_()
                 for j, x in enumerate(leaves)]
        e = {"gla_gate": alone[3]} if gate else {}
        o = hub.attention(*alone[:3], causal=True, backend=backend, extra=e)
        want = torch.autograd.grad((o * w[sl_q][None]).sum(), alone)
        torch.testing.assert_close(out[sl_q], o[0].detach(), rtol=1e-5, atol=1e-5)
        for j, (a, b) in enumerate(zip(grads, want)):
            torch.testing.assert_close(a[sl_q if j == 0 else sl_k], b[0], rtol=1e-5,
                                       atol=1e-5, msg=f"document {i} gradient {j}")
    for i in (1, 3):  # the query-less documents' keys (and gates) get zero gradients
        for j in range(1, len(leaves)):
            assert not bool(grads[j][ck[i]:ck[i + 1]].any()), (i, j)
