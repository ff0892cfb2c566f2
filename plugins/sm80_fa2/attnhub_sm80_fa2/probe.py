"""What the installed kernel libraries can do, read without importing their kernels.

Capabilities are derived from the installed build: the Python interfaces of flash-attn and
FlashInfer are parsed (``ast``) for the parameters each entry point takes, and torch's own
FlashAttention-2 op is read from its registered schema. FlashInfer is the exception: from
0.6.15 its ``plan()`` is ``plan(..., page_size, *args, **kwargs)``, a signature that names
none of the options, so its installed version decides (``FLASHINFER_SINCE``); only a copy
without distribution metadata is read from its source, where a ``**kwargs`` function counts
the parameters its docstring documents. Nothing here imports a CUDA extension or touches a
GPU, so planning on a CPU box stays cheap.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import re
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
                if a.kwarg is not None:  # **kwargs names nothing: what the docs promise
                    names.update(documented_params(ast.get_docstring(node) or ""))
    return frozenset(names) if found else None


_SECTION = re.compile(r"^\s*(\w[\w ]*)\n\s*-{3,}\s*$", re.M)
_PARAM = re.compile(r"^\s*(\w+)\s*:", re.M)


def documented_params(doc: str) -> frozenset[str]:
    """Names in a numpydoc ``Parameters`` section (``name : type`` lines)."""
    heads = list(_SECTION.finditer(doc))
    for i, head in enumerate(heads):
        if head.group(1).strip() == "Parameters":
            end = heads[i + 1].start() if i + 1 < len(heads) else len(doc)
            return frozenset(_PARAM.findall(doc[head.end():end]))
    return frozenset()


def installed_version(package: str, distributions: tuple[str, ...]) -> tuple[int, ...] | None:
    """Release (major, minor, patch) of the distribution that installed ``package`` (the
    directory probing reads: a copy shadowing it on ``sys.path`` has no version), from its
    metadata, without importing it. None when no distribution vouches for that directory."""
    root = package_dir(package)
    for name in distributions:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        try:
            same = root is not None and Path(str(dist.locate_file(package))).resolve() == \
                root.resolve()
        except OSError:
            same = False
        m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", dist.version or "")
        if same and m:
            return tuple(int(x or 0) for x in m.groups())
    return None


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
    def dropout(self) -> bool:
        return "dropout_p" in self.dense

    @property
    def varlen_ok(self) -> bool:
        return bool(self.varlen)

    @property
    def paged(self) -> bool:
        return "block_table" in self.kvcache


_FA2_UPSTREAM = FlashAttnBuild(
    installed=False,
    dense=frozenset({"q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size",
                     "softcap", "alibi_slopes", "deterministic", "return_attn_probs"}),
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


#: The FlashInfer release from which the wrappers take all that attnhub passes:
#: ``plan(window_left=, logits_soft_cap=, q_data_type=, kv_data_type=, sm_scale=)``,
#: ``run(return_lse=)`` and the decode wrapper's ``use_tensor_cores=`` (0.1.6 had ``plan``
#: without ``kv_data_type``, ``run`` without ``return_lse``; read from flashinfer's tags).
FLASHINFER_SINCE = (0, 2, 0)
FLASHINFER_DISTRIBUTIONS = ("flashinfer-python", "flashinfer")


@dataclass(frozen=True)
class FlashInferBuild:
    """What FlashInfer's paged decode/prefill wrappers take in the installed package: by its
    ``version`` when known (a ``**kwargs`` plan() hides its options), else by the parameters
    its source names or documents."""

    installed: bool
    decode_init: frozenset[str]
    decode_plan: frozenset[str]
    decode_run: frozenset[str]
    prefill_plan: frozenset[str]
    prefill_run: frozenset[str]
    version: tuple[int, ...] | None = None

    def _takes(self, name: str, *where: frozenset[str]) -> bool:
        if self.version is not None:
            return self.version >= FLASHINFER_SINCE
        return all(name in w for w in where)

    @property
    def too_old(self) -> str | None:
        """Why this release cannot serve at all (plan() would raise TypeError), or None."""
        if self.version is None or self.version >= FLASHINFER_SINCE:
            return None
        have = ".".join(map(str, self.version))
        need = ".".join(map(str, FLASHINFER_SINCE))
        return (f"FlashInfer {have} is older than {need}: its plan() takes no kv_data_type "
                "and run() no return_lse; pip install -U flashinfer-python")

    @property
    def window(self) -> bool:
        return self._takes("window_left", self.decode_plan, self.prefill_plan)

    @property
    def softcap(self) -> bool:
        return self._takes("logits_soft_cap", self.decode_plan, self.prefill_plan)

    @property
    def tensor_core_choice(self) -> bool:
        return self._takes("use_tensor_cores", self.decode_init)

    @property
    def lse(self) -> bool:
        return self._takes("return_lse", self.decode_run, self.prefill_run)


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
    version = installed_version("flashinfer", FLASHINFER_DISTRIBUTIONS)
    decode_plan = source_params("flashinfer", "decode.py", f"{dec}.plan")
    if decode_plan is None and version is None:
        return _FI_UPSTREAM
    return FlashInferBuild(
        installed=True, version=version,
        decode_init=source_params("flashinfer", "decode.py", f"{dec}.__init__") or frozenset(),
        decode_plan=decode_plan or frozenset(),
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
