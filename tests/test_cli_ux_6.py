"""The CLI, sixth round: sizes the machine cannot hold are refused before anything is
allocated (they swapped, then died in the OOM killer without a word, or built 10**8 layers for
hours), lockfiles find their policy from any directory, and aliases of one device plan once."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

import attnhub.core.memory as memory
from attnhub.cli import main
from attnhub.models.decoder import Decoder, DecoderConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("seed", range(6))
def test_the_decoder_counts_its_weights_before_building(seed: int) -> None:
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 4])
    cfg = DecoderConfig(num_layers=rng.randint(1, 5), num_q_heads=hkv * rng.randint(1, 3),
                        num_kv_heads=hkv, head_dim=2 * rng.randint(4, 40),
                        vocab_size=rng.randint(1, 3000),
                        intermediate=rng.choice([None, rng.randint(1, 500)]),
                        layer_kinds=tuple(rng.sample(["softmax", "sliding", "linear"],
                                                     rng.randint(1, 3))))
    model = Decoder(cfg, device="meta")
    assert cfg.parameter_count() == sum(p.numel() for p in model.parameters())


def test_a_depth_no_model_has_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--layers", str(10**8)])
    assert exc.value.code == 2 and "at most 4096" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["run", "--no-progress"], "--layers"),
    (["explain", "--run", "--seqlen", "64", "--dtype", "fp32"], "--seqlen"),
    (["bench", "--seqlens", str(4 * 10**6), "--phases", "prefill", "--no-store"], "--seqlens"),
])
def test_sizes_past_free_memory_are_refused_before_allocating(
        argv: list[str], flag: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """With 1 MiB free (200 MiB for bench, whose decoder fits), what does not fit is refused
    in one line naming it and the flags that shrink it, exit 1, before any tensor of those
    sizes is made."""
    free = 200 * 2**20 if argv[0] == "bench" else 2**20
    monkeypatch.setattr(memory, "available_memory", lambda device: free)
    made: list[int] = []
    randn = torch.randn

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        out = randn(*a, **k)
        made.append(out.numel())
        return out

    monkeypatch.setattr(torch, "randn", counted)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f" needed on cpu, {free / 2**20:.1f} MiB free" in err and flag in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert sum(made) * 4 < free, made


def test_free_memory_is_read_on_this_machine() -> None:
    free = memory.available_memory(torch.device("cpu"))
    assert free is None or 0 < free <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory.available_memory(torch.device("meta")) is None


def test_lock_check_finds_the_policy_from_any_directory(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """The lock recorded the policy relative to where it was written: --check from another
    directory looked for it beside the lockfile, or in the new working directory."""
    (tmp_path / "locks").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "mine.yaml").write_text(
        (REPO / "policies" / "h100-training.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["lock", "--policy", "mine.yaml", "--hardware", "h100",
                 "-o", "locks/a.json"]) == 0
    files = json.loads((tmp_path / "locks" / "a.json").read_text())["policy"]["files"]
    assert files == ["default", "../mine.yaml"]
    for cwd, path in ((tmp_path / "elsewhere", "../locks/a.json"),
                      (tmp_path / "locks", "a.json"), (Path("/"), str(tmp_path / "locks/a.json"))):
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        assert main(["lock", "--check", path]) == 0
        assert "binding(s) unchanged" in capsys.readouterr().out


def test_aliases_of_one_device_plan_one_column(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--hardware", "h100,sm90,h100,sm80", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"] == ["sm90", "sm80"]


def test_profile_help_says_hardware_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--hardware ARCH refused: measurements need the real machine" in out
