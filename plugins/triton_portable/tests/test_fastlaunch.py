"""``fastlaunch``'s direct launch against Triton's own path: the C launcher called directly
gets what Triton's Python wrapper (``CudaLauncher.__call__``) would pass it, and a binary
that needs scratch keeps the wrapper.

Compiled (not interpreted) kernels on the stub driver of ``launch_stub``: the stub's
launcher is Triton's real ``CudaLauncher.__call__`` over a C launcher that records its
arguments, so both paths end in the same place and can be compared argument by argument.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # Triton reads this when a kernel is decorated (import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
from attnhub_triton_portable import decode, fastlaunch
from attnhub_triton_portable.launch_stub import StubKernel, c_split
from triton.compiler.compiler import LazyDict
from triton.knobs import HookChain
from triton.runtime.jit import JITFunction


@pytest.fixture()
def stubbed(stub_decode: tuple[list[Any], Any]) -> dict[str, list[StubKernel]]:
    """decode on the stub sm90 (``stub_decode``): the binaries made, by kernel name."""
    return stub_decode[1].made


def test_layout_known_for_this_triton() -> None:
    """The Triton here (CI: 3.9) is one whose wrapper was read, so the direct C launch is
    what these tests exercise, not the fallback."""
    if triton.__version__.startswith(("3.6.", "3.9.")):
        assert fastlaunch.C_LAYOUT == triton.__version__[:3]


@pytest.mark.parametrize("paged", [False, True])
def test_direct_c_launch_gets_what_tritons_wrapper_passes(stubbed: dict[str, list[StubKernel]],
                                                          paged: bool) -> None:
    """The first call goes through Triton's dispatch and wrapper, the second calls the C
    launcher directly: per kernel, every C-launcher argument is the same (grid, stream,
    function, metadata, scratch, annotations, the kernel's arguments) except launch
    metadata and hooks, which the direct launch passes as None (nothing is registered)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 8, 32, generator=g)
    if paged:
        k, v = torch.randn(12, 16, 2, 32, generator=g), torch.randn(12, 16, 2, 32, generator=g)
        kw: dict[str, Any] = {"block_table": torch.randperm(12, generator=g)[:10].view(2, 5)
                              .to(torch.int32),
                              "seqlens_k": torch.tensor([80, 33], dtype=torch.int32)}
    else:
        k, v = torch.randn(2, 300, 2, 32, generator=g), torch.randn(2, 300, 2, 32, generator=g)
        kw = {}
    calls = []
    for _ in range(2):
        out, _ = decode.decode_attention(q, k, v, scale=0.3, num_splits=3, **kw)
        calls.append({name: [c_split(b.last_c_call) for b in bins]
                      for name, bins in stubbed.items()})
        for name, bins in stubbed.items():  # the outputs by role: each call has its own
            for b in bins:
                assert any(a is out for a in c_split(b.last_c_call)[1]), name
    assert all(len(bins) == 1 for bins in stubbed.values())  # split and merge, one each
    for name in stubbed:
        (via_triton, triton_args), (direct, direct_args) = calls[0][name][0], calls[1][name][0]
        assert len(via_triton) == len(direct) and len(triton_args) == len(direct_args), name
        for i, (a, b) in enumerate(zip(via_triton, direct)):
            if b is None and isinstance(a, (HookChain, LazyDict)):
                continue  # hooks and launch metadata: None when no hook is registered
            assert a == b or a is b, (name, i, a, b)
        for a, b in zip(triton_args, direct_args):
            if isinstance(a, torch.Tensor):
                assert (a.data_ptr() == b.data_ptr() or (a.shape == b.shape
                                                         and a.dtype == b.dtype)), name
            else:
                assert type(a) is type(b) and a == b, name


def _fake_binary(scratch: int) -> Any:
    """A CompiledKernel whose launcher records whether its wrapper or its C part ran."""
    seen: list[str] = []
    kernel = StubKernel(JITFunction(decode._merge_kernel.fn), [], None, None)
    run = kernel.run
    if fastlaunch.C_LAYOUT is None:
        return kernel, seen
    run.global_scratch_size = scratch
    run.launch = lambda *c_args: seen.append("c")

    class Wrapped(type(run)):  # type: ignore[misc,valid-type]
        def __call__(self, *args: Any) -> None:
            seen.append("wrapper")

    run.__class__ = Wrapped
    return kernel, seen


@pytest.mark.parametrize("scratch", [0, 256])
def test_binary_with_scratch_keeps_the_wrapper(scratch: int) -> None:
    """Global scratch to allocate: the wrapper runs (it allocates); none: the C part only."""
    kernel, seen = _fake_binary(scratch)
    if fastlaunch.C_LAYOUT is None:
        pytest.skip("this Triton's launcher wrapper is unknown: every launch keeps it")
    fastlaunch._direct(kernel, (2, 1, 1))(0, (1, 2, 3))
    assert seen == (["wrapper"] if scratch else ["c"])
