"""Shared fixtures of the triton_portable tests."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import pytest
from attnhub_triton_portable import decode
from attnhub_triton_portable.launch_stub import Stubs, stub_triton
from triton.runtime.jit import JITFunction


@pytest.fixture()
def stub_decode(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[Any], Stubs]]:
    """``decode`` with compiled kernels launched on a stub sm90 (132 SMs), every launch
    checked against its binary's specialization; its shape caches and plans isolated (a
    stubbed shape must never serve a later interpreter test). Yields (kernels, stubs)."""
    kernels = [JITFunction(decode._split_kernel.fn), JITFunction(decode._merge_kernel.fn)]
    monkeypatch.setattr(decode, "_split_kernel", kernels[0])
    monkeypatch.setattr(decode, "_merge_kernel", kernels[1])
    monkeypatch.setattr(decode, "_check_interpreter", lambda device: None)
    monkeypatch.setattr(decode, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(decode, "_sm_count", lambda index: 132)
    monkeypatch.setattr(decode, "_shapes", {})
    monkeypatch.setattr(decode, "_families", {})
    monkeypatch.setattr(decode, "_recent", collections.deque())
    monkeypatch.setattr(decode, "_first_sight", [None])
    decode._plan.cache_clear()  # its plans for CPU tensors would say sm90 after the test
    decode._plan_base.cache_clear()
    try:
        with stub_triton(kernels, check=True) as stubs:
            yield kernels, stubs
    finally:
        decode._plan.cache_clear()
        decode._plan_base.cache_clear()


class _Recorder:
    """Stands in for ``fastlaunch.Launcher``: records each launch, runs nothing."""

    log: list[tuple[Any, ...]] = []

    def __init__(self, fn: Any, grid: tuple[int, ...], options: dict[str, Any]) -> None:
        self.fn, self.grid, self.options, self.ready = fn, grid, options, {}

    def __call__(self, device: int, stream: int, direct: bool, args: tuple[Any, ...]) -> None:
        self.log.append((self.fn, self.grid, self.options, args))


@pytest.fixture()
def recorded(stub_decode: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Launches recorded on the stub sm90: (kernel, grid, options, arguments) each; the
    scratch these calls grow is their own (a CPU scratch left large would make later
    tests' buffers views of one allocation)."""
    import threading

    from attnhub_triton_portable import scratch

    monkeypatch.setattr(decode, "Launcher", _Recorder)
    monkeypatch.setattr(_Recorder, "log", [])
    monkeypatch.setattr(scratch, "_tls", threading.local())
    return _Recorder.log
