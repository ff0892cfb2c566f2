"""What the installed kernel libraries can do, read without importing their kernels.

Capabilities are derived from the installed build, never from a version string: the Python
interfaces of flash-attn and FlashInfer are parsed (``ast``) for the parameters each entry
point takes, and torch's own FlashAttention-2 op is read from its registered schema. Nothing
here imports a CUDA extension or touches a GPU, so planning on a CPU box stays cheap.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch


def package_dir(package: str) -> Path | None:
    """Directory of an installed top-level package, found without importing it."""
    mod = sys.modules.get(package)
    locations = getattr(mod, "__path__", None) if mod is not None else None
    if locations is None:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            return None
        locations = spec.submodule_search_locations if spec is not None else None
    return Path(next(iter(locations))) if locations else None


@functools.lru_cache(maxsize=None)
def source_params(package: str, relpath: str, qualname: str) -> frozenset[str] | None:
    """Parameter names of ``qualname`` (``func`` or ``Class.method``) in ``package/relpath``,
    read by parsing the file; the union over overloads. None when the file or name is absent."""
    root = package_dir(package)
    path = root / relpath if root is not None else None
    if path is None or not path.is_file():
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    *owner, func = qualname.split(".")
    scopes: list[ast.AST] = [tree]
    for name in owner:
        scopes = [n for s in scopes for n in ast.iter_child_nodes(s)
                  if isinstance(n, ast.ClassDef) and n.name == name]
    names: set[str] = set()
    found = False
    for scope in scopes:
        for node in ast.iter_child_nodes(scope):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == func:
                found = True
                a = node.args
                names.update(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs)
    return frozenset(names) if found else None


@dataclass(frozen=True)
class FlashAttnBuild:
    """The entry points of the installed ``flash_attn`` and the parameters each accepts.

    ``installed`` False means nothing could be read: the declaration then follows the
    upstream interface (for planning on machines without the library).
    """

    installed: bool
    dense: frozenset[str]
    varlen: frozenset[str]
    kvcache: frozenset[str]

    @property
    def window(self) -> bool:
        return "window_size" in self.dense

    @property
    def softcap(self) -> bool:
        return "softcap" in self.dense

    @property
    def alibi(self) -> bool:
        return "alibi_slopes" in self.dense

    @property
    def deterministic(self) -> bool:
        return "deterministic" in self.dense

    @property
    def varlen_ok(self) -> bool:
        return bool(self.varlen)

    @property
    def paged(self) -> bool:
        return "block_table" in self.kvcache


_FA2_UPSTREAM = FlashAttnBuild(
    installed=False,
    dense=frozenset({"q", "k", "v", "softmax_scale", "causal", "window_size", "softcap",
                     "alibi_slopes", "deterministic", "return_attn_probs"}),
    varlen=frozenset({"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}),
    kvcache=frozenset({"cache_seqlens", "block_table", "return_softmax_lse"}),
)


def flash_attn_build() -> FlashAttnBuild:
    """Parameters of ``flash_attn.flash_attn_interface``'s three entry points."""
    rel = "flash_attn_interface.py"
    dense = source_params("flash_attn", rel, "flash_attn_func")
    if dense is None:
        return _FA2_UPSTREAM
    return FlashAttnBuild(
        installed=True, dense=dense,
        varlen=source_params("flash_attn", rel, "flash_attn_varlen_func") or frozenset(),
        kvcache=source_params("flash_attn", rel, "flash_attn_with_kvcache") or frozenset(),
    )


@dataclass(frozen=True)
class FlashInferBuild:
    """Parameters of FlashInfer's paged decode/prefill wrappers in the installed package."""

    installed: bool
    decode_init: frozenset[str]
    decode_plan: frozenset[str]
    decode_run: frozenset[str]
    prefill_plan: frozenset[str]
    prefill_run: frozenset[str]

    @property
    def window(self) -> bool:
        return "window_left" in self.decode_plan and "window_left" in self.prefill_plan

    @property
    def softcap(self) -> bool:
        return "logits_soft_cap" in self.decode_plan and "logits_soft_cap" in self.prefill_plan

    @property
    def tensor_core_choice(self) -> bool:
        return "use_tensor_cores" in self.decode_init

    @property
    def lse(self) -> bool:
        return "return_lse" in self.decode_run and "return_lse" in self.prefill_run


_FI_UPSTREAM = FlashInferBuild(
    installed=False,
    decode_init=frozenset({"kv_layout", "use_tensor_cores"}),
    decode_plan=frozenset({"window_left", "logits_soft_cap", "sm_scale"}),
    decode_run=frozenset({"return_lse"}),
    prefill_plan=frozenset({"causal", "window_left", "logits_soft_cap", "sm_scale"}),
    prefill_run=frozenset({"return_lse"}),
)


def flashinfer_build() -> FlashInferBuild:
    """Parameters of ``BatchDecode/BatchPrefillWithPagedKVCacheWrapper`` as installed."""
    dec = "BatchDecodeWithPagedKVCacheWrapper"
    pre = "BatchPrefillWithPagedKVCacheWrapper"
    decode_plan = source_params("flashinfer", "decode.py", f"{dec}.plan")
    if decode_plan is None:
        return _FI_UPSTREAM
    return FlashInferBuild(
        installed=True,
        decode_init=source_params("flashinfer", "decode.py", f"{dec}.__init__") or frozenset(),
        decode_plan=decode_plan,
        decode_run=source_params("flashinfer", "decode.py", f"{dec}.run") or frozenset(),
        prefill_plan=source_params("flashinfer", "prefill.py", f"{pre}.plan") or frozenset(),
        prefill_run=source_params("flashinfer", "prefill.py", f"{pre}.run") or frozenset(),
    )


def torch_flash_schema() -> frozenset[str]:
    """Argument names of ``aten::_flash_attention_forward`` in this torch (empty if absent)."""
    try:
        op = torch.ops.aten._flash_attention_forward.default
    except (AttributeError, RuntimeError):
        return frozenset()
    return frozenset(a.name for a in op._schema.arguments)
