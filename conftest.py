"""Session-wide test set-up, read before any test module is imported.

Without a GPU, every Triton kernel in the suite runs under the interpreter. Triton decides at
``@triton.jit`` time whether a function is interpreted, so the variable must be set before
the first kernel module is imported by any test, in every xdist worker.

No test may leave a ``threading.Timer`` armed (``_no_timer_left_armed``) or torch's
gradients switched off (``_grad_mode_kept``).
"""

import os
import threading
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _no_timer_left_armed() -> Iterator[None]:
    """A test must not leave a ``threading.Timer`` running: a benchmark's watchdog
    (``benchmarks/hf_generate.py``: ``os._exit(124)``) run in process would end the xdist
    worker minutes later, reported as a crash of whatever test runs then. Cancelled here,
    and the test that armed it errors."""
    before = {t for t in threading.enumerate() if isinstance(t, threading.Timer)}
    yield
    left = [t for t in threading.enumerate()  # armed: neither fired nor cancelled
            if isinstance(t, threading.Timer) and t not in before and not t.finished.is_set()]
    for t in left:
        t.cancel()
    assert not left, f"the test left threading.Timer(s) armed (cancelled now): {left}"


@pytest.fixture(autouse=True)
def _grad_mode_kept() -> Iterator[None]:
    """A test must leave torch's grad mode as it found it: one left off made every later
    backward test of its xdist worker fail ("does not require grad"), far from the cause.
    Put back here, and the test that changed it errors."""
    before = torch.is_grad_enabled()
    yield
    after = torch.is_grad_enabled()
    torch.set_grad_enabled(before)
    assert after == before, f"the test left torch's grad mode {after} (was {before}): restored"
