"""The hub's tables under threads and broken backends: a binding's exact-shape entry is
stored before its first call has run, so a second thread must not reach the unchecked hot
path of a backend whose first result the slow lane has not vetted yet; and many threads
with different shapes, flags and faults each get their own right answer."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import torch

from attnhub.core.backend import AttentionOutput
from tests.test_adversarial_faults_2 import _hub


def test_a_second_thread_never_takes_the_hot_path_of_an_unvetted_first_call(
        tmp_path: Path) -> None:
    """Before: thread B found the entry thread A stored, and (A's load done, A's first
    forward not yet checked) called the backend on the hot path, whose metadata checks
    passed its output: the caller's own q came back as the answer."""
    inside, done = threading.Event(), threading.Event()

    def alias_q(s, out, lse, q, k, v, p):  # type: ignore[no-untyped-def]
        if s.calls == 1:  # the first call waits for the other thread's call to finish
            inside.set()
            done.wait(10)
        return AttentionOutput(q, lse)

    hub = _hub(tmp_path, alias_q)
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    want = hub.attention(q, k, v, backend="torch_sdpa")
    got: dict[str, torch.Tensor] = {}

    def call(name: str) -> None:
        got[name] = hub.attention(q, k, v)

    a = threading.Thread(target=call, args=("a",))
    a.start()
    assert inside.wait(10)
    try:
        call("b")
    finally:
        done.set()
        a.join(10)
    for name in "ab":
        assert got[name].data_ptr() != q.data_ptr(), name
        torch.testing.assert_close(got[name], want)


def test_threads_with_different_shapes_flags_and_faults_each_get_their_answer(
        tmp_path: Path) -> None:
    """Raises for Sq=3, returns q for Sq=4, a detached output for Sq=6 (training calls):
    every call of every thread gets the reference's answer, in the graph when it should."""

    def spoil(s, out, lse, q, k, v, p):  # type: ignore[no-untyped-def]
        if q.shape[1] == 3:
            raise RuntimeError("no kernel for Sq=3")
        if q.shape[1] == 4:
            return AttentionOutput(q, lse)
        if q.shape[1] == 6:
            return AttentionOutput(out.detach(), lse)
        return AttentionOutput(out, lse)

    hub = _hub(tmp_path, spoil)
    cases = []
    for i in range(24):
        r = random.Random(i)
        sq, sk, grad = r.choice([1, 2, 3, 4, 5, 6]), r.choice([6, 9]), r.random() < 0.4
        q = torch.randn(1, sq, 4, 8, requires_grad=grad)
        k, v = (torch.randn(1, sk, 2, 8, requires_grad=grad) for _ in range(2))
        kw = {"causal": r.random() < 0.5, "scale": r.choice([None, 0.3])}
        ref = hub.attention(q.detach(), k.detach(), v.detach(), backend="reference", **kw)
        cases.append((q, k, v, kw, ref, grad))
    bad: list[tuple] = []

    def work(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(40):
            q, k, v, kw, ref, grad = cases[r.randrange(len(cases))]
            try:
                out = hub.attention(q, k, v, **kw)
            except Exception as exc:  # a thread's failure must fail the test, not vanish
                bad.append((q.shape, kw, grad, str(exc)[:400]))
                continue
            if (out.requires_grad is not grad or out.data_ptr() == q.data_ptr()
                    or not torch.allclose(out.detach(), ref, atol=1e-5)):
                bad.append((q.shape, kw, grad))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not bad, bad[:3]
