"""Triton launches without a GPU: the host side of a launch, measured and checked on a CPU.

``stub_triton(kernels)`` makes Triton's active driver report an sm90 GPU (device 0, stream
0) and makes each given ``JITFunction`` "compile" to a ``StubKernel``, stored in Triton's
own kernel cache, whose C launcher only counts. Everything before the C launcher runs for
real: ``JITFunction.run`` (binding, specialization, cache key), Triton's Python launcher
wrapper (``CudaLauncher.__call__``, where ``fastlaunch`` knows it), ``fastlaunch.Launcher``
and the callers' Python. With ``check=True`` each stub launch is also logged (grid and
arguments, to compare launch paths) and asks Triton's binder how it would specialize the
arguments it received, raising if that is not the specialization the binary was built for:
a launch path that skips Triton's dispatch is then checked, call by call, to launch each
binary only with arguments that binary was specialized for.

Used by ``benchmarks/decode_host_overhead.py`` and the launch tests; never by the backends.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel
from triton.compiler.compiler import LazyDict
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from .fastlaunch import C_LAYOUT, CudaLauncher


class StubDriver:
    """What ``JITFunction.run`` and ``fastlaunch.place`` ask of Triton's driver: device 0,
    stream 0, an sm90 target."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


class StubKernel(CompiledKernel):
    """A "binary" for one specialization: launching it counts, and checks the arguments.

    A ``CompiledKernel`` without a binary (``__init__`` reads none), so code that checks
    for the type accepts it; ``module`` stays None, so ``__del__`` unloads nothing. Its
    ``run`` is a ``StubLauncher``: Triton's own Python launcher wrapper around a C launcher
    (``launched``) that only counts, so a launch through the wrapper and one that calls the
    C launcher directly both end there.
    """

    function = None
    packed_metadata = None
    module = None
    run = None  # type: ignore[assignment]  # an instance attribute here, not the property

    def __init__(self, fn: JITFunction, specialization: list[Any], binder: Any,
                 log: list[tuple[str, tuple[int, ...], tuple[Any, ...]]] | None):
        self.fn, self.specialization, self._binder, self._log = fn, specialization, binder, log
        self.launches = 0
        # markers where a binary has its handle and packed metadata, so that a test can
        # see each lands where Triton's wrapper puts it
        self.function, self.packed_metadata = ("function", fn.__name__), ("metadata", fn.__name__)
        #: every argument of the last C launch, to compare launch paths (``c_split``)
        self.last_c_call: tuple[Any, ...] = ()
        self.run = StubLauncher(self) if C_LAYOUT else self.launched  # type: ignore[assignment]

    def launched(self, *c_args: Any) -> None:
        """The C launcher: counts; with ``check``, logs the launch and raises unless Triton
        would specialize its arguments as this binary."""
        self.launches += 1
        self.last_c_call = c_args
        if self._log is None:
            return
        head, args = c_split(c_args)
        self._log.append((self.fn.__name__, head[:3], args))
        got = self._binder(*args)[1]
        if got != self.specialization:
            diff = [(name, want, have) for name, want, have in
                    zip(self.fn.arg_names, self.specialization, got) if want != have]
            raise AssertionError(f"{self.fn.__name__}: launched with arguments specialized "
                                 f"as {diff} (name, binary, arguments)")

    def launch_metadata(self, grid: Any, stream: Any, *args: Any) -> LazyDict | None:
        """As ``CompiledKernel.launch_metadata`` for a kernel without its own: Triton builds
        this on every launch through its dispatch while a hook chain is installed."""
        if knobs.runtime.launch_enter_hook is None:
            return None
        return LazyDict({"name": self.fn.__name__, "function": None, "stream": stream})


def c_split(c_args: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """A stub C launch's arguments as (what comes before the kernel's arguments: grid,
    stream, function, hooks, scratch..., the kernel's arguments), in ``C_LAYOUT``'s order:
    3.9 passes them as one tuple after 15 others, 3.6 spread after 13, and where the wrapper
    itself is the stub (an unknown wrapper) they come spread after 9."""
    if C_LAYOUT == "3.9":
        return c_args[:15], tuple(c_args[15])
    split = 13 if C_LAYOUT == "3.6" else 9
    return c_args[:split], c_args[split:]


if C_LAYOUT is not None:
    class StubLauncher(CudaLauncher):  # type: ignore[misc,valid-type]
        """Triton's ``CudaLauncher`` (its ``__call__`` runs as is) over the stub C launcher,
        with the metadata of a binary that needs no scratch. Launch flags, annotations and
        signature are markers, as the binary's handle and metadata are."""

        def __init__(self, kernel: StubKernel):  # no source to build a C launcher from
            self.launch = kernel.launched
            self.gsan_enabled = False
            self.num_ctas = 1
            self.global_scratch_size = self.profile_scratch_size = 0
            self.global_scratch_align = self.profile_scratch_align = 1
            self.launch_cooperative_grid, self.launch_pdl = ("cooperative",), ("pdl",)
            self.arg_annotations = ("annotations", kernel.fn.__name__)
            self.kernel_signature = ("signature", kernel.fn.__name__)


class _Recorder:
    """Triton's binder for one kernel, remembering the specialization of its last call."""

    def __init__(self, binder: Any):
        self.binder = binder
        self.last: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound, specialization, options = self.binder(*args, **kwargs)
        self.last = specialization
        return bound, specialization, options


class Stubs(NamedTuple):
    """What a ``stub_triton`` block made: the stub binaries per kernel name (one per
    specialization) and, when checking, every launch as (kernel name, grid, arguments)."""

    made: dict[str, list[StubKernel]]
    log: list[tuple[str, tuple[int, ...], tuple[Any, ...]]]


@contextmanager
def stub_triton(kernels: Sequence[JITFunction], *, check: bool = False) -> Iterator[Stubs]:
    """Within the block, ``kernels`` launch without a GPU (see the module docstring).
    Restores the driver and the kernels after."""
    stubs = Stubs({fn.__name__: [] for fn in kernels}, [])
    previous = driver._active
    driver.set_active(StubDriver())  # type: ignore[arg-type]
    try:
        for fn in kernels:
            _stub(fn, stubs.made[fn.__name__], stubs.log if check else None)
        yield stubs
    finally:
        driver._active = previous
        for fn in kernels:
            fn.__dict__.pop("_do_compile", None)
            fn.device_caches.clear()


def _stub(fn: JITFunction, made: list[StubKernel], log: list[Any] | None) -> None:
    fn.device_caches.clear()
    cache, key_cache, target, backend, binder = fn.create_binder()
    # Only a checking run wraps the binder (to learn each binary's specialization): timing
    # runs keep Triton's per-launch path exactly as it is.
    recorder = _Recorder(binder) if log is not None else None
    fn.device_caches[0] = (cache, key_cache, target, backend, recorder or binder)

    def _do_compile(key, signature, device, constexprs, options, attrs, warmup):
        kernel = StubKernel(fn, recorder.last if recorder else [], binder, log)
        cache[key] = kernel
        made.append(kernel)
        return kernel

    fn._do_compile = _do_compile  # type: ignore[method-assign]
