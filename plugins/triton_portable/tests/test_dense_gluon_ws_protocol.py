"""The mbarrier protocol of the warp-specialised Gluon forward (:mod:`.fwd_gluon_ws`), checked
on a CPU: a model of its three partitions (the producer warp, two consumer warpgroups) and of
the TMA engine, each doing the kernel's sequence of waits and arrives on the same barriers
with the same phase arithmetic, run under many random interleavings. It asserts that no
schedule deadlocks (the kernel would hang) and that every tile a consumer reads is the one it
expects from its wait until its release (no buffer is refilled under a reader). The kernel
itself runs only on an sm90 GPU; keep this model in step with ``_producer``, ``_consumer`` and
``_consumer_step`` when their order of waits and arrives changes."""

from __future__ import annotations

import random

import pytest


class Barrier:
    """An mbarrier: ``count`` arrivals complete a phase; a parity wait passes once the phase
    of that parity has completed (a fresh barrier passes parity 1 at once)."""

    def __init__(self, count: int):
        self.count, self.pending, self.phases = count, count, 0

    def arrive(self) -> None:
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phases, self.pending = self.phases + 1, self.count

    def passes(self, parity: int) -> bool:
        return (self.phases & 1) != parity


def _run(n_tiles: int, stages: int, pingpong: int, rng: random.Random,
         mutation: str = "") -> None:
    q_bar = [Barrier(1) for _ in range(2)]
    turn = [Barrier(1) for _ in range(2)]
    k_ready, v_ready = ([Barrier(1) for _ in range(stages)] for _ in range(2))
    k_empty, v_empty = ([Barrier(2) for _ in range(stages)] for _ in range(2))
    k_buf, v_buf = [None] * stages, [None] * stages
    procs: list = []

    def tma(buf, slot, tile, bar):  # the copy lands some time after its issue
        yield None
        if buf is not None:
            buf[slot] = tile
        bar.arrive()

    def producer():
        for w in range(2):
            procs.append(tma(None, 0, 0, q_bar[w]))
        for i in range(n_tiles):
            st, ph = i % stages, (i // stages) & 1
            if mutation != "no_empty_wait":
                yield k_empty[st], ph ^ 1
            procs.append(tma(k_buf, st, i, k_ready[st]))
            yield v_empty[st], ph ^ 1
            procs.append(tma(v_buf, st, i, v_ready[st]))

    def consumer(w: int):
        def turn_wait(k):
            if pingpong:
                yield turn[w], (k & 1) ^ (1 - w) ^ (mutation == "turn_phase_off" and w == 0)

        def turn_pass(when):
            if pingpong == when:
                turn[1 - w].arrive()

        yield q_bar[w], 0
        if n_tiles == 0:
            return
        yield from turn_wait(0)
        yield k_ready[0], 0
        assert k_buf[0] == 0
        if pingpong:
            turn[1 - w].arrive()
        assert k_buf[0] == 0
        k_empty[0].arrive()
        for i in range(1, n_tiles):
            ks, vs = i % stages, (i - 1) % stages
            yield from turn_wait(i)
            yield k_ready[ks], (i // stages) & 1
            assert k_buf[ks] == i, (w, i, k_buf)
            yield None  # QK^T in flight
            assert k_buf[ks] == i, (w, i, k_buf)
            turn_pass(2)
            k_empty[ks].arrive()
            yield v_ready[vs], (((i - 1) // stages) & 1) ^ (mutation == "v_phase_off")
            assert v_buf[vs] == i - 1, (w, i, v_buf)
            turn_pass(1)
            yield None  # PV in flight under the softmax
            assert v_buf[vs] == i - 1, (w, i, v_buf)
            v_empty[vs].arrive()
        last = n_tiles - 1
        yield v_ready[last % stages], (last // stages) & 1
        assert v_buf[last % stages] == last
        yield None
        assert v_buf[last % stages] == last
        v_empty[last % stages].arrive()

    procs += [producer(), consumer(0), consumer(1)]
    waiting: dict = {}
    while procs or waiting:
        ready = [p for p in procs if p not in waiting or waiting[p][0].passes(waiting[p][1])]
        assert ready, f"deadlock: n_tiles={n_tiles} stages={stages} pingpong={pingpong}"
        p = rng.choice(ready)
        waiting.pop(p, None)
        try:
            cond = next(p)
        except StopIteration:
            procs.remove(p)
            continue
        if cond is not None:
            waiting[p] = cond


@pytest.mark.parametrize("pingpong", [0, 1, 2])
@pytest.mark.parametrize("stages", [2, 3])
def test_no_deadlock_and_no_buffer_refilled_under_a_reader(stages: int, pingpong: int) -> None:
    rng = random.Random(stages * 10 + pingpong)
    for n_tiles in range(0, 9):
        for _ in range(60):
            _run(n_tiles, stages, pingpong, rng)


@pytest.mark.parametrize("mutation", ["no_empty_wait", "v_phase_off", "turn_phase_off"])
def test_the_model_catches_a_broken_protocol(mutation: str) -> None:
    """Sanity of the model itself: each of these bugs is caught (a refilled buffer under a
    reader, or a deadlock) within a few hundred random schedules."""
    rng = random.Random(1)
    with pytest.raises(AssertionError):
        for _ in range(300):
            _run(6, 2, 1, rng, mutation)
