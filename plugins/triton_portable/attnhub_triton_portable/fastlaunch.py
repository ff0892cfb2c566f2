"""Launch a Triton kernel with the least host work once its specialization is known.

``kernel[grid](*args)`` runs Triton's whole JIT dispatch on every call (3.6 and 3.9 alike,
``JITFunction.run``): read three knobs, ask the driver for device and stream, bind and
specialize every argument (dtype and 16-byte alignment of each pointer, divisibility of
each integer), build a cache key from the specialization and the options, look it up,
re-check the kernel's global variables, then call the launcher. For a decode kernel with
~60 arguments that is tens of microseconds per launch, more than the kernel itself at small
contexts. None of it changes while the arguments' types, integer values and pointer
alignments stay the same; the C launcher, which reads the arguments, is the only part each
call needs.

``Launcher`` is one kernel at one specialization: the caller builds it under a key that
fixes everything Triton specializes on (all integer arguments and constexprs, tensor dtypes
and pointer alignment, launch options), so its first call on a device goes through Triton's
JIT, which compiles or finds the binary and launches it, and later calls on that device
launch the binary directly (``_direct``). The caller reads the device's current stream and
whether the direct path is allowed once per call (``launch_state``) and passes them to each
of its launches. When a launch hook is registered (a profiler such as proton) every launch
takes Triton's full path, so profilers see what they expect.

The direct path calls Triton's C launcher itself where Triton's Python wrapper around it
(``CudaLauncher.__call__``) would only pass constants through: for a binary that needs no
global or profile scratch, no GSan, on a Triton whose wrapper this module knows (3.6, 3.9).
Anything else keeps the wrapper. ``launch_state`` reads the device and stream from torch
without Triton's driver wrappers (``torch.cuda.current_device`` re-runs ``_lazy_init``).

Assumes what Triton itself reads once per process stays fixed after the first launch:
``TRITON_DEBUG``/``knobs.runtime.debug`` and the instrumentation mode.
``ATTNHUB_TRITON_DIRECT_LAUNCH=0`` (or ``fastlaunch.DIRECT = False``) sends every launch
through Triton's dispatch, to compare or to rule this path out.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.knobs import HookChain
from triton.runtime.driver import driver
from triton.runtime.interpreter import InterpretedFunction

try:
    from triton.backends.nvidia.driver import CudaLauncher
except ImportError:  # a Triton without the NVIDIA backend: every launch keeps its wrapper
    CudaLauncher = None

#: Launch known binaries directly (see the module docstring); False: always Triton's path.
DIRECT = os.environ.get("ATTNHUB_TRITON_DIRECT_LAUNCH", "1") != "0"

#: (device index, raw stream) -> None: one direct launch of a fixed grid.
DirectLaunch = Callable[[int, tuple[Any, ...]], None]

#: ``CudaLauncher.__call__``'s parameters -> the order its C launcher takes arguments in,
#: for the Triton versions whose wrapper was read (the versions below): "3.9" (hooks,
#: then scratch, then the kernel's arguments as one tuple with their annotations) or "3.6"
#: (scratch, then hooks, then the kernel's arguments spread).
_WRAPPERS = {
    ("3.9", ("self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata",
             "launch_metadata", "launch_enter_hook", "launch_exit_hook", "args")): "3.9",
    ("3.6", ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")): "3.6",
}


def _c_layout() -> str | None:
    """The argument order of this Triton's C launcher, or None if its wrapper is unknown."""
    if CudaLauncher is None:
        return None
    params = tuple(inspect.signature(CudaLauncher.__call__).parameters)
    return _WRAPPERS.get((".".join(triton.__version__.split(".")[:2]), params))


#: See ``_c_layout``; read by ``launch_stub`` to parse what its stub C launcher receives.
C_LAYOUT = _c_layout()

try:  # CUDA (and ROCm) builds of torch; a CPU build has no CUDA tensors to launch on
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
    from torch._C import _cuda_getDevice as _current_device
except ImportError:
    pass


def launch_state(cuda_index: int | None) -> tuple[int, int, bool] | None:
    """What a call's launches on tensors on CUDA device ``cuda_index`` share, read once per
    call: (device index, raw handle of its current stream, whether launches may skip
    Triton's dispatch: the switch is on and no launch hook is registered). None when that
    device is not the current one: the caller then runs under ``torch.cuda.device`` (Triton
    launches on the current device's context). ``cuda_index`` None: tensors of another
    type, which only reach compiled kernels under ``launch_stub``, whose driver answers.
    (The caller keeps the index: ``torch.device.type`` formats a string on every read.)"""
    runtime = knobs.runtime
    direct = DIRECT and _idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)
    if cuda_index is not None:
        if _current_device() != cuda_index:
            return None
        return cuda_index, _raw_stream(cuda_index), direct
    active = driver.active
    index = active.get_current_device()
    return index, active.get_current_stream(index), direct


class Launcher:
    """``fn[grid](*args, **options)`` for arguments whose specialization never varies.

    ``args`` are every kernel parameter in order, constexprs included, positionally: that is
    the tuple Triton's launcher itself receives. The caller guarantees that all calls of one
    ``Launcher`` agree in every integer/bool/str argument, every tensor's dtype and 16-byte
    pointer alignment, and pass floats as Python floats.
    """

    __slots__ = ("_bins", "fn", "grid", "interpreted", "options", "ready")

    def __init__(self, fn: Any, grid: tuple[int, ...], options: dict[str, Any]):
        self.fn = fn
        self.grid = (grid + (1, 1))[:3]
        self.options = options
        self.interpreted = isinstance(fn, InterpretedFunction)
        #: device index -> the direct launch of its binary, once known. A caller may call
        #: it itself (``ready[device](stream, args)``) where ``launch_state`` allows it.
        self.ready: dict[int, DirectLaunch] = {}
        #: device index -> the binary, kept alive so that Triton never unloads it while a
        #: direct launch holds its function handle
        self._bins: dict[int, CompiledKernel] = {}

    def __call__(self, device: int, stream: int, direct: bool, args: tuple[Any, ...]) -> None:
        """Launch on ``device`` (the current one) and ``stream`` (its current stream), with
        ``direct`` as ``launch_state`` gives them."""
        if self.interpreted:
            self.fn.run(*args, grid=self.grid, warmup=False, **self.options)
            return
        go = self.ready.get(device)
        if go is None or not direct:
            self._slow(device, args)
            return
        go(stream, args)

    def _slow(self, device: int, args: tuple[Any, ...]) -> None:
        """Triton's own dispatch; keeps the binary it returns for the direct path."""
        kernel = self.fn.run(*args, grid=self.grid, warmup=False, **self.options)
        if isinstance(kernel, CompiledKernel) and device not in self.ready:
            self.ready[device] = _direct(kernel, self.grid)
            self._bins[device] = kernel


class LaunchTable:
    """Launchers of positional launches, each under a key the caller makes fix everything
    Triton specializes on, with its kernel's constexprs in parameter order (bounded: cleared
    when full). ``who`` names the caller in errors."""

    __slots__ = ("entries", "limit", "who")

    def __init__(self, who: str, limit: int = 256) -> None:
        self.who, self.limit = who, limit
        self.entries: dict[tuple[Any, ...], tuple[Launcher, tuple[Any, ...]]] = {}

    def get(self, key: tuple[Any, ...], kernel: Any, grid: tuple[int, ...], n_runtime: int,
            consts: dict[str, Any], options: dict[str, Any]) -> tuple[Launcher, tuple[Any, ...]]:
        """(the launcher, the constexprs' values after the ``n_runtime`` runtime arguments)."""
        entry = self.entries.get(key)
        if entry is None:
            names = kernel.arg_names
            if set(names[n_runtime:]) != set(consts):  # positional: every one, in order
                raise TypeError(f"{self.who}: {getattr(kernel, '__name__', kernel)} takes "
                                f"constexprs {names[n_runtime:]}, the launch gave "
                                f"{sorted(consts)}; pass every constexpr of the kernel (and "
                                f"only those) after its {n_runtime} runtime arguments")
            tail = tuple(consts[n] for n in names[n_runtime:])
            if len(self.entries) >= self.limit:
                self.entries.clear()
            entry = self.entries[key] = (Launcher(kernel, grid, options), tail)
        return entry


def launch_on(cuda_index: int | None, launcher: Launcher, args: tuple[Any, ...]) -> None:
    """``launcher(args)`` on the device of the call's tensors (CUDA index ``cuda_index``),
    on its current stream."""
    state = launch_state(cuda_index)
    if state is None:  # the tensors are not on the current device: launch where they are
        import torch

        with torch.cuda.device(cuda_index):
            launcher(*launch_state(cuda_index), args)  # type: ignore[misc]
    else:
        launcher(*state, args)


def _direct(kernel: CompiledKernel, grid: tuple[int, ...]) -> DirectLaunch:
    """A launch of ``kernel`` over ``grid`` without Triton's dispatch: no launch metadata
    and ``None`` hooks (the launchers skip a ``None`` hook, so with no hook registered it is
    the same launch), and, where ``_c_layout`` allows, without the Python wrapper."""
    run = kernel.run
    g0, g1, g2 = grid
    function, metadata = kernel.function, kernel.packed_metadata
    if (C_LAYOUT is None or not isinstance(run, CudaLauncher) or run.global_scratch_size
            or run.profile_scratch_size or getattr(run, "gsan_enabled", False)):
        def wrapped(stream: int, args: tuple[Any, ...]) -> None:
            run(g0, g1, g2, stream, function, metadata, None, None, None, *args)

        return wrapped
    # The wrapper would allocate no scratch (sizes 0: it passes None) and pass these through
    launch, coop, pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl
    if C_LAYOUT == "3.9":
        annotations, signature = run.arg_annotations, run.kernel_signature

        def c_launch(stream: int, args: tuple[Any, ...]) -> None:
            launch(g0, g1, g2, stream, function, coop, pdl, metadata, None, None, None, None,
                   None, annotations, signature, args)
    else:
        def c_launch(stream: int, args: tuple[Any, ...]) -> None:
            launch(g0, g1, g2, stream, function, coop, pdl, None, None, metadata, None, None,
                   None, *args)
    return c_launch


def _idle(hook: Any) -> bool:
    """Whether a launch hook would do nothing: unset, or (Triton >= 3.5) an empty chain.
    The launchers skip a None hook, so passing None then is the same launch."""
    return hook is None or (type(hook) is HookChain and not hook.calls)
