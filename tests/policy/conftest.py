"""Fixtures for the policy tests: an isolated profile store, a registry with every
first-party backend name (real plugins where installed, fakes standing in for the rest),
and fake backends made to order (one that raises, one that is approximate, ...)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest

from attnhub.core.backend import AttentionOutput, Backend
from attnhub.core.capabilities import ALL_MASKS
from attnhub.core.capabilities import Capabilities as _Capabilities
from attnhub.core.reference import reference_attention
from attnhub.core.registry import Registry
from attnhub.hookspecs import hookimpl
from attnhub.policy import ProfileStore
from attnhub.policy.lint import FIRST_PARTY

_CUDA = frozenset({"cuda"})
#: What a stand-in claims unless told otherwise (Capabilities itself claims nothing).
_CLAIMS = dict(masks=ALL_MASKS, gqa=True, returns_lse=True, top_left_causal=True,
               deterministic_forward=True)


def Capabilities(**kw: Any) -> _Capabilities:  # noqa: N802 - a constructor with defaults
    return _Capabilities(**{**_CLAIMS, **kw})


_ROCM = frozenset({"rocm"})
#: Stand-in capabilities for first-party names whose plugin is not installed here.
_STAND_INS: dict[str, tuple[str, _Capabilities]] = {
    "fa2": ("vendor", Capabilities(vendors=_CUDA, min_capability=(8, 0), backward=True)),
    "fa2_torch": ("vendor", Capabilities(vendors=_CUDA, min_capability=(8, 0), backward=True)),
    "fa3": ("vendor", Capabilities(vendors=_CUDA, archs=frozenset({"sm90"}), backward=True)),
    "cudnn": ("vendor", Capabilities(vendors=_CUDA, min_capability=(8, 0), backward=True)),
    "fa3_fp8": ("vendor", Capabilities(vendors=_CUDA, archs=frozenset({"sm90"}),
                                       kv_dtypes=frozenset({"fp8_e4m3"}), exact=False,
                                       error_budget=0.05, phases=frozenset({"prefill"}))),
    "flashinfer_decode": ("serving", Capabilities(vendors=_CUDA, phases=frozenset({"decode"}),
                                                  layouts=frozenset({"paged"}))),
    "flashinfer_prefill": ("serving", Capabilities(vendors=_CUDA, layouts=frozenset({"paged"}))),
    "triton": ("portable", Capabilities(backward=True)),
    "triton_decode": ("serving", Capabilities(phases=frozenset({"decode"}))),
    "flex": ("variant", Capabilities(phases=frozenset({"train", "prefill"}), backward=True)),
    "ck_fa": ("vendor", Capabilities(vendors=_ROCM, backward=True)),
    "triton_rocm": ("portable", Capabilities(vendors=_ROCM, backward=True)),
    "sliding_window": ("variant", Capabilities(backward=True)),
    "ring": ("distributed", Capabilities(backward=True)),
    **{n: ("approximate", Capabilities(exact=False, error_budget=0.1, backward=True))
       for n in ("gla", "linear", "retention", "longformer", "lsh")},
}


class FakeBackend(Backend):
    """A backend computing exact attention with the fp64 reference, or raising on demand."""

    name = "fake"

    def __init__(self, name: str, tier: str = "portable", caps: _Capabilities | None = None,
                 raises: Exception | None = None):
        super().__init__()
        self.name = name  # type: ignore[misc]
        self.tier = tier  # type: ignore[misc]
        self.capabilities = caps or Capabilities(backward=True)  # type: ignore[misc]
        self.raises = raises
        self.calls = 0

    def forward(self, q, k, v, spec, params):  # type: ignore[override]
        self.calls += 1
        if self.raises is not None:
            raise self.raises
        out, lse = reference_attention(q, k, v, params, layout=spec.layout)
        return AttentionOutput(out.to(q.dtype), lse if params.return_lse else None)


class FakePlugin:
    """A plugin object for ``Registry.add_plugin`` registering the given backends."""

    def __init__(self, backends: list[Backend]):
        self.backends = backends

    @hookimpl
    def attnhub_register_backends(self, register: Callable[[Any], None]) -> None:
        for b in self.backends:
            register(b)


def registry_with(*backends: Backend, base: Registry | None = None) -> Registry:
    """The core registry (or ``base``) plus the given fake backends."""
    reg = base or Registry.load(allow=[])
    reg.add_plugin(FakePlugin(list(backends)), f"fakes{len(reg.plugins)}")
    return reg


@pytest.fixture(autouse=True)
def _isolated_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never read or write the user's profile store or honour their policy choice."""
    monkeypatch.setenv("ATTNHUB_PROFILE", str(tmp_path / "profile.json"))
    monkeypatch.delenv("ATTNHUB_POLICY", raising=False)
    monkeypatch.delenv("ATTNHUB_HARDWARE", raising=False)
    monkeypatch.delenv("ATTNHUB_BACKEND", raising=False)


@pytest.fixture(scope="session")
def full_registry() -> Registry:
    """Every installed plugin, plus stand-ins for first-party names not installed here."""
    reg = Registry.load()
    missing = [n for n in FIRST_PARTY if n not in reg.backends]
    return registry_with(*(FakeBackend(n, *_STAND_INS[n]) for n in missing), base=reg)


@pytest.fixture
def store(tmp_path: Path) -> ProfileStore:
    return ProfileStore(tmp_path / "profile.json")


@pytest.fixture
def write(tmp_path: Path) -> Callable[[str, str], Path]:
    """``write("name.yaml", yaml_text)`` -> path (text dedented)."""

    def _write(name: str, text: str) -> Path:
        p = tmp_path / name
        p.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
        return p

    return _write


@pytest.fixture
def fake() -> type[FakeBackend]:
    """The fake backend class: ``fake("name", tier, caps, raises=...)``."""
    return FakeBackend


@pytest.fixture
def make_registry() -> Callable[..., Registry]:
    """``make_registry(*backends, base=None)``: the core registry plus fakes."""
    return registry_with
