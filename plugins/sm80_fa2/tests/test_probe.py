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


# -- FlashInfer by release: plan() may be ``**kwargs`` ----------------------------------------
# From 0.6.15 ``BatchDecodeWithPagedKVCacheWrapper.plan`` is ``plan(self, indptr, indices,
# last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *deprecated_positional_args,
# **kwargs)`` (flashinfer fb28d72, flashinfer/decode.py): its signature names neither
# ``window_left`` nor ``logits_soft_cap``, and the probe, which read names only, declared
# windows and softcap unsupported on every new release. The fakes take both shapes of plan().
_DOC = '''
        r"""Plan batch decode.

        Parameters
        ----------
        indptr : torch.Tensor
            The indptr of the paged kv cache.
        {extra}
        Returns
        -------
        out : None
            Nothing; ``window_right : int`` below a Returns head is no parameter.
        """'''

_PLAN_KW = '''
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *deprecated_positional_args, **kwargs):{doc}
        return self._plan_impl(**kwargs)
'''

_PLAN_NAMED = '''
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, sm_scale=None):
        pass
'''

_DOCUMENTED = ("window_left : int\n            Left window.\n        logits_soft_cap : "
               "Optional[float]\n            Soft cap.")


def _files(plan: str) -> dict[str, str]:
    """decode.py / prefill.py whose plan() has the given shape (prefill keeps it too)."""
    def wrapper(cls: str, first: str) -> str:
        body = plan.replace("indptr, indices", f"{first}indptr, indices")
        return (f"class {cls}:\n    def __init__(self, float_workspace_buffer, kv_layout='NHD',"
                f" use_tensor_cores=False):\n        pass\n{textwrap.indent(body, '')}\n"
                "    def run(self, q, paged_kv_cache, *args, return_lse=False):\n        pass\n")
    return {"decode.py": wrapper("BatchDecodeWithPagedKVCacheWrapper", ""),
            "prefill.py": wrapper("BatchPrefillWithPagedKVCacheWrapper", "qo_indptr, ")}


def _install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str],
             version: str | None = None, located: bool = True) -> None:
    """A fake flashinfer, with a distribution's metadata for its directory or another."""
    install_fake(tmp_path, monkeypatch, "flashinfer", files)
    if version is not None:
        base = tmp_path if located else tmp_path / "elsewhere"
        info = base / f"flashinfer_python-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: flashinfer-python\nVersion: {version}\n")
        if not located:
            monkeypatch.syspath_prepend(str(base))


def _declares(window: bool, softcap: bool) -> None:
    for backend in (FlashInferDecodeBackend(), FlashInferPrefillBackend()):
        masks = backend.capabilities.masks
        assert ("sliding_window" in masks) == window and ("softcap" in masks) == softcap, \
            f"{backend.name}: {sorted(masks)}"
    assert "flashinfer" not in sys.modules


@pytest.mark.parametrize("version", ["0.6.18", "0.6.15rc1", "0.2.0.post1", "1.0"])
def test_a_kwargs_plan_of_a_known_release_declares_window_and_softcap(tmp_path, monkeypatch,
                                                                      version):
    _install(tmp_path, monkeypatch, _files(_PLAN_KW.format(doc="")), version=version)
    _declares(window=True, softcap=True)
    build = probe.flashinfer_build()
    assert build.version is not None and build.lse and build.tensor_core_choice
    assert build.too_old is None


def test_a_kwargs_plan_without_metadata_is_read_from_its_documentation(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch,
             _files(_PLAN_KW.format(doc=_DOC.format(extra=_DOCUMENTED))))
    _declares(window=True, softcap=True)
    assert probe.flashinfer_build().version is None


def test_a_kwargs_plan_that_documents_neither_declares_neither(tmp_path, monkeypatch):
    """No version and no promise: not declared (a call with a window is refused, not run
    on a plan() that might drop it). ``window_right`` under Returns is not a parameter."""
    _install(tmp_path, monkeypatch, _files(_PLAN_KW.format(doc=_DOC.format(extra=""))))
    build = probe.flashinfer_build()
    assert build.version is None and not build.window and not build.softcap
    _declares(window=False, softcap=False)


@pytest.mark.parametrize("located", [True, False])
def test_a_named_plan_is_read_by_version_or_by_its_names(tmp_path, monkeypatch, located):
    """The old shape: names decide without metadata, and metadata of another directory (a
    copy shadowing the installed one) is not this build's version."""
    _install(tmp_path, monkeypatch, _files(_PLAN_NAMED), version="0.3.1", located=located)
    build = probe.flashinfer_build()
    assert build.version == ((0, 3, 1) if located else None)
    assert build.window and build.softcap
    _declares(window=True, softcap=True)


def test_a_release_older_than_the_interface_is_refused_by_name(tmp_path, monkeypatch):
    """0.1.6's plan() names window_left but takes no kv_data_type: by version, it cannot
    serve at all, and the reason says which release is needed."""
    _install(tmp_path, monkeypatch, _files(_PLAN_NAMED), version="0.1.6")
    backend = FlashInferDecodeBackend()
    assert not backend.build.window and not backend.build.lse
    reasons = backend.check(attnhub.AttentionSpec(phase="decode", layout="paged"),
                            attnhub.simulate("sm80"))
    assert any("FlashInfer 0.1.6 is older than 0.2.0" in r for r in reasons), reasons
    assert "flashinfer" not in sys.modules


def test_documented_params_reads_the_parameters_section_only() -> None:
    doc = _DOC.format(extra=_DOCUMENTED)
    assert probe.documented_params(textwrap.dedent(doc)) == {
        "indptr", "window_left", "logits_soft_cap"}
    assert probe.documented_params("no sections here\nx : int") == frozenset()
