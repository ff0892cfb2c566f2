"""Which FlashAttention-3 is installed and what its build was compiled with.

FA3 builds drop features with ``FLASHATTENTION_DISABLE_*`` flags (``hopper/setup.py``); the
generated config module (``flash_attn_config``, shipped by the ``fa3-fwd`` wheel as
``fa3_fwd_config``) records them. That dict, not a version string, decides what ``fa3`` and
``fa3_fp8`` declare. Reading it imports no kernel: the config modules are plain Python.
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from attnhub.plugin import module_available

#: Interface module -> its build-config module, in order of preference.
INTERFACES: tuple[tuple[str, str], ...] = (
    ("flash_attn_interface", "flash_attn_config"),  # upstream hopper/ build
    ("fa3_fwd_interface", "fa3_fwd_config"),  # fa3-fwd wheel (forward only)
)
HEAD_DIM_BUCKETS: tuple[int, ...] = (64, 96, 128, 192, 256)
INSTALL_FA3 = "pip install 'attnhub-sm90-fa3[fa3]'"


@dataclass(frozen=True)
class Fa3Build:
    """The installed FA3 interface module and its compile-time feature flags."""

    module: str | None
    config_module: str | None
    flags: tuple[tuple[str, bool], ...]
    source: str

    @functools.cached_property
    def _off(self) -> frozenset[str]:
        """Features switched off, by name (both flag spellings that setup.py uses)."""
        return frozenset(k.split("_DISABLE_", 1)[1] for k, v in self.flags
                         if v and "_DISABLE_" in k)

    def has(self, feature: str) -> bool:
        """Whether the build kept ``feature`` (e.g. ``BACKWARD``, ``PAGEDKV``, ``HDIM256``)."""
        return feature not in self._off

    @property
    def max_head_dim(self) -> int:
        kept = [h for h in HEAD_DIM_BUCKETS if self.has(f"HDIM{h}")]
        return max(kept) if kept else 0

    def describe(self) -> str:
        feats = {"backward": "BACKWARD", "paged KV": "PAGEDKV", "window": "LOCAL",
                 "softcap": "SOFTCAP", "fp16": "FP16", "fp8": "FP8", "varlen": "VARLEN",
                 "split-KV": "SPLIT"}
        off = [name for name, flag in feats.items() if not self.has(flag)]
        where = self.module or "not installed"
        return f"{where} ({self.source}); without: {', '.join(off) or 'nothing'}"


def _config_flags(config_module: str) -> dict[str, bool] | None:
    """``CONFIG['build_flags']`` of a config module, or None when there is none."""
    if not module_available(config_module):
        return None
    mod = importlib.import_module(config_module)
    config: Any = getattr(mod, "CONFIG", None)
    flags = config.get("build_flags") if isinstance(config, dict) else None
    return {str(k): bool(v) for k, v in flags.items()} if isinstance(flags, dict) else None


def fa3_build() -> Fa3Build:
    """Probe the installed FA3: first interface found, with its build flags."""
    for interface, config in INTERFACES:
        if not module_available(interface):
            continue
        flags = _config_flags(config)
        if flags is None:
            return Fa3Build(interface, None, (),
                            f"no {config} module: upstream default build assumed")
        return Fa3Build(interface, config, tuple(sorted(flags.items())), f"{config}.CONFIG")
    return Fa3Build(None, None, (), "not installed: the upstream default build is declared")


def import_interface(build: Fa3Build) -> ModuleType:
    """Import the FA3 interface (this loads its kernels). The fa3-fwd wheel's interface
    imports ``flash_attn_config`` while shipping it as ``fa3_fwd_config``: alias it first."""
    if build.module is None:
        raise ImportError(f"FlashAttention-3 is not installed ({INSTALL_FA3})")
    if build.config_module and build.config_module != "flash_attn_config":
        sys.modules.setdefault("flash_attn_config",
                               importlib.import_module(build.config_module))
    return importlib.import_module(build.module)
