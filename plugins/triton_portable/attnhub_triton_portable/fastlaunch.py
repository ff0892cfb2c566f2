"""Launch a Triton kernel with the least host work once its specialization is known.

``kernel[grid](*args)`` runs Triton's whole JIT dispatch on every call (3.6 and 3.9 alike,
``JITFunction.run``): read three knobs, ask the driver for device and stream, bind and
specialize every argument (dtype and 16-byte alignment of each pointer, divisibility of
each integer), build a cache key from the specialization and the options, look it up,
re-check the kernel's global variables, then call the C launcher. For a decode kernel with
~45 arguments that is tens of microseconds per launch, more than the kernel itself at small
contexts. None of it changes while the arguments' types, integer values and pointer
alignments stay the same; the C launcher, which reads the arguments, is the only part each
call needs.

``Launcher`` is one kernel at one specialization: the caller builds it under a key that
fixes everything Triton specializes on (all integer arguments and constexprs, tensor dtypes
and pointer alignment, launch options), so its first call goes through Triton's JIT, which
compiles or finds the binary and launches it, and later calls on the same device launch
that binary directly. When a launch hook is registered (a profiler such as proton) every
call takes Triton's full path, so profilers see what they expect.

Assumes what Triton itself reads once per process stays fixed after the first launch:
``TRITON_DEBUG``/``knobs.runtime.debug`` and the instrumentation mode.
``ATTNHUB_TRITON_DIRECT_LAUNCH=0`` (or ``fastlaunch.DIRECT = False``) sends every launch
through Triton's dispatch, to compare or to rule this path out.
"""

from __future__ import annotations

import os
from typing import Any

from triton import knobs
from triton.compiler import CompiledKernel
from triton.knobs import HookChain
from triton.runtime.driver import driver
from triton.runtime.interpreter import InterpretedFunction

#: Launch known binaries directly (see the module docstring); False: always Triton's path.
DIRECT = os.environ.get("ATTNHUB_TRITON_DIRECT_LAUNCH", "1") != "0"


class Launcher:
    """``fn[grid](*args, **options)`` for arguments whose specialization never varies.

    ``args`` are every kernel parameter in order, constexprs included, positionally: that is
    the tuple Triton's launcher itself receives. The caller guarantees that all calls of one
    ``Launcher`` agree in every integer/bool/str argument, every tensor's dtype and 16-byte
    pointer alignment, and pass floats as Python floats.
    """

    __slots__ = ("_bins", "fn", "grid", "interpreted", "options")

    def __init__(self, fn: Any, grid: tuple[int, ...], options: dict[str, Any]):
        self.fn = fn
        self.grid = (grid + (1, 1))[:3]
        self.options = options
        self.interpreted = isinstance(fn, InterpretedFunction)
        #: device index -> (C launcher, function handle, packed metadata, the binary kept
        #: alive so that Triton never unloads it while it is cached here)
        self._bins: dict[int, tuple[Any, Any, Any, CompiledKernel]] = {}

    def __call__(self, *args: Any) -> None:
        if self.interpreted:
            self.fn.run(*args, grid=self.grid, warmup=False, **self.options)
            return
        active = driver.active
        device = active.get_current_device()
        hit = self._bins.get(device)
        if hit is None or not (DIRECT and _idle(knobs.runtime.launch_enter_hook)
                               and _idle(knobs.runtime.launch_exit_hook)):
            self._slow(device, args)
            return
        run, function, metadata, _ = hit
        g0, g1, g2 = self.grid
        # No hook to call: no launch metadata to build (Triton builds it on every launch)
        run(g0, g1, g2, active.get_current_stream(device), function, metadata, None, None,
            None, *args)

    def _slow(self, device: int, args: tuple[Any, ...]) -> None:
        """Triton's own dispatch; keeps the binary it returns for the direct path."""
        kernel = self.fn.run(*args, grid=self.grid, warmup=False, **self.options)
        if isinstance(kernel, CompiledKernel) and device not in self._bins:
            self._bins[device] = (kernel.run, kernel.function, kernel.packed_metadata, kernel)


def _idle(hook: Any) -> bool:
    """Whether a launch hook would do nothing: unset, or (Triton >= 3.5) an empty chain.
    The launchers skip a None hook, so passing None then is the same launch."""
    return hook is None or (type(hook) is HookChain and not hook.calls)
