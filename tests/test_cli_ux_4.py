"""The CLI as a new user meets it (run, bench, fp8-check): bad input is one line naming the
flag and the fix (exit non-zero, no traceback), a progress bar only on a terminal, output
files written whole or not at all, and ``run`` saying what it runs. Tiny sizes, CPU."""

from __future__ import annotations

import io
import random
import re
import sys
from pathlib import Path

import pytest

from attnhub.cli import _decoder, bench, main
from attnhub.core.registry import Registry

RNG = random.Random(20261205)
TINY = ["--layers", "1", "--heads", "4:2", "--head-dim", "8", "--vocab", "32", "--batch", "1",
        "--prompt-len", "6", "--new-tokens", "3", "--page-size", "4"]
FP8 = ["fp8-check", "--shape", "1,12,2,1,8", "--magnitudes", "5", "--emulate", "--no-record"]


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str) -> str:
    """``argv`` is refused by argparse (exit 2) with one error line naming ``words``."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and all(w in line for w in words), err
    return line


# ---------------------------------------------------------------- progress only on a terminal


@pytest.mark.parametrize("argv", [
    ["run", *TINY, "--check-steps", "0"],
    ["bench", *TINY, "--backends", "torch_sdpa", "--seqlens", "5", "--repeats", "1",
     "--warmup", "0", "--no-store"],
    FP8,
], ids=["run", "bench", "fp8-check"])
def test_progress_bar_on_a_terminal_only(argv: list[str], capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: run and bench drew tqdm's bar into a pipe or a log (carriage returns in CI
    logs), and fp8-check, whose default shape runs for minutes on a CPU, showed none."""
    main(argv)
    assert "\r" not in capsys.readouterr().err  # captured: not a terminal, no bar
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    main(argv)
    assert "\r" in tty.getvalue() and "%|" in tty.getvalue()
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    main([*argv, "--no-progress"])
    assert "\r" not in tty.getvalue()


# ---------------------------------------------------------------- bad input: one clear line


def test_odd_head_dim_is_a_usage_error_not_a_traceback(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``run --head-dim 7`` built the model, bound it, then died in the rotary
    embedding with a RuntimeError traceback (so did bench --from-model and profile)."""
    odd = 2 * RNG.randint(1, 40) + 1
    for cmd in ("run", "bench", "profile"):
        line = _usage_error(capsys, [cmd, *TINY, "--head-dim", str(odd)], "--head-dim",
                            "even", str(odd - 1), str(odd + 1))
        assert line.startswith(f"attnhub {cmd}: error")


def test_decoder_config_errors_name_the_flags(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A size the flags' own checks let through and the model refuses is a one-line error."""
    import attnhub.models.decoder as decoder

    why = f"heads {RNG.randint(3, 9)}: refused"

    def refuse(*_: object, **__: object) -> None:
        raise ValueError(why)

    monkeypatch.setattr(decoder, "DecoderConfig", refuse)
    assert main(["run", *TINY, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("attnhub run: error: the decoder flags") and why in err


def test_fp8_check_on_a_simulated_device(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``--hardware sm90`` made fp8-check draw its inputs on CUDA (a RuntimeError
    traceback on a CPU machine), then load fa3 as the BF16 baseline (an ImportError); and a
    record written there would vouch for a kernel that never ran."""
    arch = RNG.choice(["sm90", "h100", "sm80"])
    for extra in ([], ["--emulate"]):
        with pytest.raises(SystemExit) as exc:
            main(["fp8-check", "--shape", "1,12,2,1,8", "--hardware", arch, *extra])
        msg = str(exc.value.code)
        assert "simulated" in msg and "--emulate --no-record" in msg and "\n" not in msg
    rc = main([*FP8, "--hardware", arch, "--json"])
    out = capsys.readouterr()
    assert rc in (0, 1) and '"emulated": true' in out.out and "Traceback" not in out.err


def test_bench_refuses_an_approximate_backend_by_name() -> None:
    """Before: a named approximate backend (linear attention, FP8) was checked against the
    exact reference and reported as a wrong kernel ("FAIL: wrong"), exit 1."""
    reg = Registry.load()
    approx = sorted(n for n, b in reg.backends.items() if not b.capabilities.exact)
    name = RNG.choice(approx)
    with pytest.raises(SystemExit) as exc:
        main(["bench", *TINY, "--backends", f"torch_sdpa,{name}", "--seqlens", "5",
              "--no-store", "--no-progress"])
    msg = str(exc.value.code)
    assert f"--backends {name}" in msg and "not exact" in msg and "\n" not in msg


@pytest.mark.parametrize("phases", [",", " ", "prefill,decod"])
def test_bench_phases_checked_before_anything_runs(phases: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``--phases ,`` timed nothing and printed an empty table as a success."""
    monkeypatch.setattr(_decoder, "build", lambda _: pytest.fail("built before the check"))
    with pytest.raises(SystemExit) as exc:
        main(["bench", *TINY, "--phases", phases, "--no-store"])
    assert "--phases" in str(exc.value.code) and "prefill, decode" in str(exc.value.code)


# ---------------------------------------------------------------- outputs whole or not at all


def test_bench_plot_and_md_are_replaced_only_when_complete(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``--plot`` was saved straight over the old file: a failure halfway left a
    truncated PNG where the previous chart was."""
    png, md = tmp_path / "chart.png", tmp_path / "table.md"
    old = bytes(RNG.randrange(256) for _ in range(64))
    png.write_bytes(old)
    md.write_text("old table\n")

    def half_written(_: object, path: str) -> None:
        Path(path).write_bytes(old[:RNG.randint(1, 63)] + b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(bench, "plot", half_written)
    argv = ["bench", *TINY, "--backends", "torch_sdpa", "--seqlens", "5", "--repeats", "1",
            "--warmup", "0", "--no-store", "--no-progress", "--plot", str(png), "--md", str(md)]
    assert main(argv) != 0  # a named error since review 7 (before: the OSError itself)
    assert f"--plot {png}: cannot write it (disk full)" in capsys.readouterr().err
    assert png.read_bytes() == old
    assert "torch_sdpa" in md.read_text()  # written whole before the plot failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chart.png", "table.md"]


# ---------------------------------------------------------------- run says what it runs


def test_run_says_what_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The binding table's buckets are upper bounds; the line under it gives the sizes."""
    kv = RNG.randint(1, 3)
    heads, dim = f"{kv * RNG.randint(1, 3)}:{kv}", 2 * RNG.randint(2, 6)
    batch, prompt, new = RNG.randint(1, 3), RNG.randint(3, 9), RNG.randint(2, 4)
    argv = ["run", "--layers", "1", "--vocab", "32", "--heads", heads, "--head-dim", str(dim),
            "--batch", str(batch), "--prompt-len", str(prompt), "--new-tokens", str(new),
            "--check-steps", "0", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (f"heads {heads}, head dim {dim}; {batch} prompt(s) of {prompt} tokens, then {new} "
            "decode steps") in out
    assert "--json` lists every rejected candidate" in out


# ---------------------------------------------------------------- --hardware names a device


@pytest.mark.parametrize("cmd", ["run", "bench", "explain", "backends", "fp8-check", "plan",
                                 "lock", "policy check policies/default.yaml"])
def test_empty_hardware_is_refused_not_ignored(cmd: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``--hardware ''`` (an unset shell variable) or ``--hardware ,`` planned for
    this machine, or the policy's targets, as if the flag had not been given."""
    blank = RNG.choice(["", " ", ",", " , "])
    _usage_error(capsys, [*cmd.split(), "--hardware", blank], "--hardware", "names no hardware")


@pytest.mark.parametrize("cmd", ["explain", "backends", "run"])
def test_one_device_commands_refuse_a_list(cmd: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``explain --hardware sm90,sm80`` explained sm90 only, without a word."""
    archs = RNG.sample(["sm80", "sm90", "gfx942", "cpu", "sm100"], 2)
    _usage_error(capsys, [cmd, "--hardware", ",".join(archs)], "one device",
                 f"plan --hardware {','.join(archs)}")


def test_fp8_check_refuses_captured_inputs_that_are_no_attention_call(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: mismatched captured tensors failed inside the baseline with a RuntimeError or
    ValueError traceback, after the synthetic cases had run."""
    import torch

    hkv, d = RNG.randint(2, 3), 2 * RNG.randint(2, 4)
    good = {"q": torch.randn(1, 5, 2 * hkv, d), "k": torch.randn(1, 7, hkv, d),
            "v": torch.randn(1, 7, hkv, d)}
    bad = [dict(good, q=torch.randn(1, 5, 2 * hkv + 1, d)),  # heads not a multiple
           dict(good, v=torch.randn(1, 7, hkv, d + 2)),  # v unlike k
           dict(good, k=torch.randn(7, hkv, d)),  # 3 dims
           dict(good, q=torch.randn(1, 5, 2 * hkv, d + 2))]  # head dims differ
    for i, item in enumerate(bad):
        path = tmp_path / f"bad{i}.pt"
        torch.save([good, item], path)
        with pytest.raises(SystemExit) as exc:
            main([*FP8, "--inputs", str(path)])
        msg = str(exc.value.code)
        assert f"--inputs {path}[1]" in msg and "(B, S, H, D)" in msg and "\n" not in msg
    path = tmp_path / "good.pt"
    torch.save(good, path)
    assert main([*FP8, "--inputs", str(path)]) in (0, 1)
    assert "captured" in capsys.readouterr().out


# ---------------------------------------------------------------- a fix names a real flag


@pytest.mark.parametrize("argv", [
    ["bench", *TINY, "--backends", "torch_sdpa", "--seqlens", "5", "--repeats", "1",
     "--warmup", "0", "--no-progress"],
    ["fp8-check", "--shape", "1,12,2,1,8", "--magnitudes", "5", "--emulate"],
    ["profile", *TINY],
], ids=["bench", "fp8-check", "profile"])
def test_store_failure_names_flags_the_command_has(argv: list[str], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Before: fp8-check, whose flag is --no-record, told the user to pass --no-store."""
    store = tmp_path / "store.json"
    store.write_text("{" + "x" * RNG.randint(1, 9))  # not JSON: cannot be read or written
    assert main([*argv, "--store", str(store)]) == 3
    err = capsys.readouterr().err
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", err))
    assert "--store" in named and named <= _options(argv[0]), err


def _options(command: str) -> set[str]:
    import argparse

    from attnhub.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s for a in sub.choices[command]._actions for s in a.option_strings}


@pytest.mark.parametrize("module,command", [("run", "run"), ("bench", "bench"),
                                            ("explain", "explain"), ("plan", "plan"),
                                            ("backends", "backends"),
                                            ("fp8_check", "fp8-check")])
def test_messages_name_only_flags_of_their_command(module: str, command: str) -> None:
    """Every ``--flag`` in a command module's strings (errors, fixes, help) is an option of
    that command, or of the ``attnhub <other>`` the same string names."""
    import ast

    source = (Path(__file__).parents[1] / "attnhub" / "cli" / f"{module}.py").read_text()
    wrong = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            other = re.search(r"attnhub ([a-z][a-z0-9-]*)", node.value)
            target = other.group(1) if other else command
            wrong += [f"{f} ({target}): {node.value[:60]!r}"
                      for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", node.value)
                      if f not in _options(target)]
    assert not wrong, wrong


def test_bench_regret_and_from_json_honour_json(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``bench --regret --json`` and ``bench --from-json F --json`` printed the
    markdown report: the one command whose --json output was not JSON."""
    import json

    saved = tmp_path / "regret.json"
    rc = main(["bench", "--regret", "--cells", "decode tiny", "--rounds", "1", "--repeats", "1",
               "--warmup", "0", "--no-store", "--json", "--out-json", str(saved)])
    assert rc in (0, 1)  # 1: a regret above the bound (one timed sample on a busy CPU)
    out = json.loads(capsys.readouterr().out)
    assert out["complete"] and out["cells"] == json.loads(saved.read_text())["cells"]
    header = f"run {RNG.randrange(10 ** 6)}"
    assert main(["bench", "--from-json", str(saved), "--header", header, "--json"]) == rc
    again = json.loads(capsys.readouterr().out)
    assert again["header"] == header
    assert [(c["cell"], c["regret"]) for c in again["cells"]] == [
        (c["cell"], c["regret"]) for c in out["cells"]]
