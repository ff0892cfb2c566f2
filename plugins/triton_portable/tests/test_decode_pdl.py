"""The merge as pass 1's programmatic dependent launch (``DecodeConfig.pdl``): on sm90 and
later both kernels are told (``GDC``) and the merge is launched with ``launch_pdl``; nowhere
else, and never without a merge launch. The kernels themselves run on the GPU tests (every
sm90 decode there takes this path by default); here launches are recorded on a stub sm90."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # Triton reads this when a kernel is decorated (import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnhub_triton_portable import decode
from attnhub_triton_portable.decode_configs import decode_config


def _call(splits: int, **config: Any) -> None:
    g = torch.Generator().manual_seed(1)
    b, hq, hkv, d, page, pages = 2, 8, 2, 64, 16, 12
    q = torch.randn(b, 1, hq, d, generator=g, dtype=torch.bfloat16)
    k = torch.randn(pages, page, hkv, d, generator=g, dtype=torch.bfloat16)
    v = torch.randn(pages, page, hkv, d, generator=g, dtype=torch.bfloat16)
    table = torch.randperm(pages, generator=g)[:10].view(b, 5).to(torch.int32)
    cfg = decode_config("sm90", "bf16", True).with_(**config) if config else None
    decode.decode_attention(q, k, v, scale=d ** -0.5, block_table=table,
                            seqlens_k=torch.tensor([70, 33], dtype=torch.int32),
                            num_splits=splits, config=cfg)


def _gdc(launch: tuple[Any, ...]) -> bool:
    fn, _, _, args = launch
    return dict(zip(fn.arg_names, args))["GDC"]


def test_sm90_launches_the_merge_as_a_dependent(recorded: list[tuple[Any, ...]]) -> None:
    _call(3)
    (split, merge) = recorded
    assert split[0] is decode._split_kernel and merge[0] is decode._merge_kernel
    assert _gdc(split) is True and _gdc(merge) is True
    assert merge[2].get("launch_pdl") is True and "launch_pdl" not in split[2]


@pytest.mark.parametrize(("splits", "config"), [
    (1, {}),  # one split: no merge to launch early
    (3, {"pdl": False}),
    (3, {"fused_merge": True}),  # the merge runs inside pass 1
])
def test_no_dependent_launch_without_a_merge_launch_or_when_off(
        recorded: list[tuple[Any, ...]], splits: int, config: dict[str, Any]) -> None:
    _call(splits, **config)
    assert recorded and all(_gdc(launch) is False for launch in recorded)
    assert all("launch_pdl" not in launch[2] for launch in recorded)
    assert len(recorded) == (2 if splits > 1 and not config.get("fused_merge") else 1)


@pytest.mark.parametrize("arch", ["sm80", "sm89", "gfx942", "cpu"])
def test_other_architectures_never_ask_for_it(recorded: list[tuple[Any, ...]],
                                              monkeypatch: pytest.MonkeyPatch,
                                              arch: str) -> None:
    monkeypatch.setattr(decode, "device_arch", lambda device: arch)
    _call(3, pdl=True)
    assert len(recorded) == 2 and not any(_gdc(launch) for launch in recorded)
    assert all("launch_pdl" not in launch[2] for launch in recorded)


def test_which_architectures_have_it() -> None:
    assert [a for a in ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120", "gfx942", "cpu",
                        "smx", "generic") if decode._pdl_arch(a)] == ["sm90", "sm100", "sm120"]
