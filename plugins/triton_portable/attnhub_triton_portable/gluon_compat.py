"""Gluon builtins renamed between Triton releases, bound once to the name this Triton has.

The kernels are written against Triton 3.6 (the H200's); 3.8 and later renamed the copies
and the CTA barrier, and their old names raise when a kernel is compiled, not at import.
"""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

#: cp.async global -> shared (3.6: async_copy_global_to_shared; 3.8+: async_load).
cp_async = (async_copy.async_load if hasattr(async_copy, "async_load")
            else async_copy.async_copy_global_to_shared)
#: TMA global -> shared (renamed the same way).
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
#: A barrier of the CTA's threads (3.6: thread_barrier; 3.9: barrier).
cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


def _tma_reduce_add_36():
    """TMA reduce-add shared -> global for a Triton without ``tma.async_atomic_add`` (3.6
    has the op, ``ttng.async_tma_reduce``, but no Gluon builtin for it)."""
    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def reduce_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                                  tensor_desc.handle, coord, src.handle)

    return reduce_add


#: TMA reduce-add of a shared-memory tile into global memory (completion: ``tma.store_wait``).
tma_reduce_add = (tma.async_atomic_add if hasattr(tma, "async_atomic_add")
                  else _tma_reduce_add_36())

