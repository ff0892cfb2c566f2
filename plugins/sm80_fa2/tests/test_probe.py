"""Capabilities come from the installed library files, read without importing kernels.

Each fake library here is a package whose ``__init__`` raises: probing must parse its files,
never import it.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from attnhub_sm80_fa2 import probe
from attnhub_sm80_fa2.fa2 import FlashAttn2Backend
from attnhub_sm80_fa2.flashinfer_paged import FlashInferDecodeBackend, FlashInferPrefillBackend

import attnhub

BOMB = "raise RuntimeError('kernel library imported during probing')\n"


def install_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package: str,
                 files: dict[str, str]) -> None:
    root = tmp_path / package
    root.mkdir()
    (root / "__init__.py").write_text(BOMB)
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, package, raising=False)
    probe.source_params.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_probe_cache():
    probe.source_params.cache_clear()
    yield
    probe.source_params.cache_clear()


def test_flash_attn_build_without_softcap_alibi_varlen_paging(tmp_path, monkeypatch):
    install_fake(tmp_path, monkeypatch, "flash_attn", {"flash_attn_interface.py": """
        def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                            window_size=(-1, -1), deterministic=False, return_attn_probs=False):
            pass
        def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, causal=False):
            pass
    """})
    backend = FlashAttn2Backend()
    caps = backend.capabilities
    assert backend.build.installed
    assert "sliding_window" in caps.masks and caps.deterministic_backward
    assert not {"softcap", "alibi", "document"} & caps.masks
    assert not {"thd", "paged"} & caps.layouts
    s = attnhub.AttentionSpec(mask=attnhub.MaskSpec(softcap=True))
    assert any("softcap" in r for r in backend.check(s, attnhub.simulate("sm80")))
    backend.available(attnhub.probe())  # find_spec only: must not import
    assert "flash_attn" not in sys.modules


def test_flashinfer_build_without_window_softcap_or_tensor_core_switch(tmp_path, monkeypatch):
    install_fake(tmp_path, monkeypatch, "flashinfer", {
        "decode.py": """
            class BatchDecodeWithPagedKVCacheWrapper:
                def __init__(self, float_workspace_buffer, kv_layout="NHD"):
                    pass
                def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                         head_dim, page_size, sm_scale=None):
                    pass
                def run(self, q, paged_kv_cache, return_lse=False):
                    pass
        """,
        "prefill.py": """
            class BatchPrefillWithPagedKVCacheWrapper:
                def plan(self, qo_indptr, kv_indptr, indices, last_page_len, causal=False,
                         window_left=-1):
                    pass
                def run(self, q, paged_kv_cache):
                    pass
        """})
    build = probe.flashinfer_build()
    assert build.installed and not build.window and not build.softcap
    assert not build.tensor_core_choice and not build.lse
    caps = FlashInferDecodeBackend().capabilities
    assert caps.masks == {"causal"} and not caps.returns_lse
    assert FlashInferPrefillBackend().capabilities.masks == {"causal"}
    assert "flashinfer" not in sys.modules


def test_source_params_reads_overloads_and_misses(tmp_path, monkeypatch):
    install_fake(tmp_path, monkeypatch, "libx", {"m.py": """
        class W:
            def run(self, q, a=1):
                pass
            def run(self, q, b=2):  # an overload: parameters are unioned
                pass
    """})
    assert probe.source_params("libx", "m.py", "W.run") == {"self", "q", "a", "b"}
    assert probe.source_params("libx", "m.py", "W.plan") is None
    assert probe.source_params("libx", "absent.py", "f") is None
    assert probe.source_params("no_such_package_here", "m.py", "f") is None
    assert "libx" not in sys.modules


def test_importing_the_plugin_imports_no_kernel(tmp_path, monkeypatch):
    install_fake(tmp_path, monkeypatch, "flash_attn", {"flash_attn_interface.py": "x = 1\n"})
    install_fake(tmp_path, monkeypatch, "flashinfer", {})
    import importlib

    import attnhub_sm80_fa2.plugin as plugin

    importlib.reload(plugin)
    registered: list = []
    plugin.attnhub_register_backends(registered.append)
    for b in registered:
        b.check(attnhub.AttentionSpec(), attnhub.simulate("sm90"))
        b.available(attnhub.probe())
    assert {b.name for b in registered} == {"fa2", "fa2_torch", "flashinfer_decode",
                                            "flashinfer_prefill"}
    assert "flash_attn" not in sys.modules and "flashinfer" not in sys.modules
