"""Policies and the CLI, eighth round: a path too long for the file system escaped three CLI
checks as a traceback; ``--json`` printed nothing when a command failed, and ``lock --check``
reported a policy that does not load with the drift status; ``1e308`` was answered with a
309-digit fix; ``on:`` keys were placed as a list index, ``.nan:`` at 1:1; UTF-16 was a NUL
to remove; ``doctor`` passed settings that fail every call and ``explain`` hid
ATTNHUB_BACKEND; a plugin registering a name twice replaced itself when it was the
deployment's pick; ``extends: ''`` and a symlink loop got misleading messages."""

from __future__ import annotations

import json
import os
import re
import textwrap
import types
from pathlib import Path

import pytest
import torch

from attnhub.cli import main
from attnhub.core.registry import Registry
from attnhub.errors import InputError, PolicyError
from attnhub.hookspecs import hookimpl
from attnhub.plugin import AttentionOutput, Backend, Capabilities
from attnhub.policy.lock import EXIT_BAD_LOCK
from attnhub.policy.loader import load_data

LONG = "a" * 300  # one path component past NAME_MAX (255)
TOO_LONG = os.strerror(36)  # "File name too long" (ENAMETOOLONG)


@pytest.fixture(autouse=True)
def _core_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The core backends only (the same code paths, faster), and no setting of the
    environment these tests do not make themselves."""
    monkeypatch.setenv("ATTNHUB_PLUGINS", "")
    for var in ("ATTNHUB_HARDWARE", "ATTNHUB_BACKEND", "ATTNHUB_DEBUG", "ATTNHUB_SETTLE_TIES",
                "ATTNHUB_POLICY", "ATTNHUB_PROVIDERS"):
        monkeypatch.delenv(var, raising=False)


def _problems(tmp_path: Path, text: str | bytes, name: str = "p.yaml") -> list[str]:
    p = tmp_path / name
    if isinstance(text, str):
        p.write_text(textwrap.dedent(text), encoding="utf-8")
    else:
        p.write_bytes(text)
    with pytest.raises(PolicyError) as exc:
        load_data(p)
    return exc.value.problems


def _at(line: str) -> str:
    m = re.match(r"\S*?:(\d+:\d+) ", line)
    assert m, line
    return m.group(1)


def _lock(tmp_path: Path, files: list[str]) -> Path:
    """A lock of the core on cpu whose recorded policy files are ``files`` (hand-edited)."""
    lock = tmp_path / "a.lock.json"
    assert main(["lock", "--hardware", "cpu", "-o", str(lock)]) == 0
    data = json.loads(lock.read_text())
    data["policy"]["files"] = files
    lock.write_text(json.dumps(data))
    return lock


# (B1) paths the file system refuses ---------------------------------------------------------

def test_lock_check_with_a_recorded_policy_name_too_long(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``beside.is_file()`` raised ENAMETOOLONG: a traceback instead of the unreadable
    policy, named, and a status that is not drift."""
    lock = _lock(tmp_path, [LONG + ".yaml"])
    capsys.readouterr()
    assert main(["lock", "--check", str(lock)]) == EXIT_BAD_LOCK
    err = capsys.readouterr().err
    assert "cannot read policy" in err and TOO_LONG in err


def test_fp8_check_inputs_too_long_is_named() -> None:
    from attnhub.cli.fp8_check import captured_cases

    with pytest.raises(InputError, match=f"^--inputs .*: cannot use this path \\({TOO_LONG}"):
        captured_cases(f"/tmp/{LONG}.pt", torch.device("cpu"))


@pytest.mark.parametrize("flag", ["--md", "--plot", "--out-json", "--pack"])
@pytest.mark.parametrize("where", ["name", "folder"])
def test_bench_outputs_too_long_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          flag: str, where: str) -> None:
    """``_check_outputs`` called ``is_dir()``/``exists()``: a traceback before anything ran."""
    out = tmp_path / (f"{LONG}.png" if where == "name" else f"{LONG}/r.png")
    assert main(["bench", "--from-json", str(tmp_path / "r.json"), flag, str(out)]) == 1
    err = capsys.readouterr().err
    assert f"error: {flag} " in err and f"({TOO_LONG})" in err and len(err.splitlines()) == 1


# (C1) --json on failure; lock --check: no check is not drift ---------------------------------

@pytest.mark.parametrize("argv, kind", [
    (["policy", "show", "{empty}", "--json"], "PolicyError"),
    (["plan", "--policy", "{empty}", "--json"], "PolicyError"),
    (["explain", "--policy", "{empty}", "--json"], "PolicyError"),
    (["backends", "--hardware", "zz", "--json"], "HardwareError"),
    (["policy", "check", "--hardware", "zz", "{empty}", "--json"], "HardwareError"),
])
def test_json_prints_an_error_object_when_the_command_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
        kind: str) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert main([a.format(empty=empty) for a in argv]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["error"] == kind and report["message"] in err and report["problems"]
    if kind == "PolicyError":
        assert report["problems"][0].startswith(f"{empty}:1:1 (document): got no value")


def test_json_error_object_for_a_flag_the_command_refuses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``SystemExit("attnhub bench: ...")`` printed nothing on stdout either."""
    with pytest.raises(SystemExit):
        main(["bench", "--from-json", str(tmp_path / "none.json"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["error"] == "CommandError" and report["message"].startswith("--from-json")


def test_lock_check_policy_that_does_not_load_is_not_drift(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 1 (drift) and no JSON: a CI job could not tell drift from a broken setup."""
    (tmp_path / "empty.yaml").write_text("")
    lock = _lock(tmp_path, ["empty.yaml"])
    capsys.readouterr()
    assert main(["lock", "--check", str(lock), "--json"]) == EXIT_BAD_LOCK
    report = json.loads(capsys.readouterr().out)
    assert report["error"] == "PolicyError" and "got no value" in report["problems"][0]
    (tmp_path / "bad.lock").write_text("{}")
    assert main(["lock", "--check", str(tmp_path / "bad.lock"), "--json"]) == EXIT_BAD_LOCK
    assert json.loads(capsys.readouterr().out)["error"] == "bad-lockfile"


# (C2) a short fix for a large number YAML reads as text ----------------------------------------

def test_the_fix_for_1e308_is_short(tmp_path: Path) -> None:
    (line,) = _problems(tmp_path, """\
        name: p
        rules:
          - name: r
            when: {capability: {ge: 1e308}}
            use: [torch_sdpa]
        """)
    assert line.endswith("write 1.0e+308)") and len(line) < 250, line


# (C3) keys that YAML does not read as text ---------------------------------------------------

@pytest.mark.parametrize("key, reads", [("on", "the flag True"), ("No", "the flag False"),
                                        (".nan", "the number nan"), ("1", "the number 1")])
def test_a_non_text_key_is_refused_at_its_own_place(tmp_path: Path, key: str,
                                                    reads: str) -> None:
    """``.nan:`` was placed at 1:1, ``on:`` as ``[1]`` at its value's column, no hint."""
    (line,) = _problems(tmp_path, f"name: p\nrules: []\n{key}: x\n")
    assert _at(line) == "3:1" and " (document): got the key " in line, line
    assert f"{key!r}, which YAML reads as {reads}" in line and "quote it" in line
    if key in ("on", "No"):
        assert "yes/no/on/off" in line


def test_a_yes_key_in_when_is_placed_at_the_key(tmp_path: Path) -> None:
    (line,) = _problems(tmp_path, "name: p\nrules:\n  - name: r\n    when: {yes: 1}\n"
                                  "    use: [torch_sdpa]\n")
    assert _at(line) == "4:12" and " rules[0].when: got the key 'yes'" in line, line


# (C4) UTF-16 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-16"])
def test_utf16_is_named_with_the_right_fix(tmp_path: Path, encoding: str) -> None:
    """Without a byte-order mark it was "character U+0000 ... (remove it)"."""
    text = "name: p\nrules:\n  - name: r\n    use: [torch_sdpa]\n".encode(encoding)
    (line,) = _problems(tmp_path, text)
    assert "(encoding): the file is UTF-16" in line and "re-save it as UTF-8" in line, line
    assert "remove it" not in line


# (C5) settings that change or break every call -----------------------------------------------

@pytest.mark.parametrize("var, value, said", [
    ("ATTNHUB_BACKEND", "torch_sdpx", "names no registered backend (did you mean 'torch_sdpa'?)"),
    ("ATTNHUB_DEBUG", "maybe", "ATTNHUB_DEBUG='maybe'"),
    ("ATTNHUB_SETTLE_TIES", "2", "(default on)"),
])
def test_doctor_fails_on_a_setting_every_call_fails_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], var: str,
        value: str, said: str) -> None:
    monkeypatch.setenv(var, value)
    assert main(["doctor"]) == 1
    assert f"setting error: {var}" in (out := capsys.readouterr().out) and said in out
    assert main(["doctor", "--json"]) == 1
    assert said in json.loads(capsys.readouterr().out)["settings"]["errors"][0]


def test_doctor_notes_a_valid_forced_backend(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ATTNHUB_BACKEND", "reference")
    assert main(["doctor", "--json"]) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert not settings["errors"] and "ATTNHUB_BACKEND=reference forces" in settings["notes"][0]


def test_explain_notes_the_forced_backend(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``chosen: torch_sdpa`` and no word that every call runs the reference."""
    monkeypatch.setenv("ATTNHUB_BACKEND", "reference")
    assert main(["explain", "--hardware", "cpu", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "  note: ATTNHUB_BACKEND=reference forces every attention call" in out
    assert main(["explain", "--hardware", "cpu", "--dtype", "fp32", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["decision"]["notes"]
    assert "ATTNHUB_BACKEND=reference forces every attention call" in notes[-1]
    monkeypatch.setenv("ATTNHUB_BACKEND", "refrence")  # every call would raise: said
    assert main(["explain", "--hardware", "cpu", "--dtype", "fp32"]) == 0
    assert "names no registered backend (did you mean 'reference'?)" in capsys.readouterr().out


# (C6) one plugin, one name, twice ----------------------------------------------------------

def _backend(tag: str) -> Backend:
    class B(Backend):
        name, tier, description = "dup", "portable", tag
        capabilities = Capabilities(vendors=("cpu",), dtypes=("fp32",), phases=("prefill",))

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def]
            return AttentionOutput(out=torch.zeros_like(q))

    return B()


def _plugin(*tags: str) -> object:
    @hookimpl
    def attnhub_register_backends(register):  # type: ignore[no-untyped-def]
        for t in tags:
            register(_backend(t))

    return types.SimpleNamespace(attnhub_register_backends=attnhub_register_backends)


@pytest.mark.parametrize("providers", [{}, {"dup": "p"}])
def test_a_name_registered_twice_by_the_picked_plugin_keeps_the_first(
        providers: dict[str, str]) -> None:
    """With the pick, the second object replaced the first and the record blamed the
    deployment."""
    reg = Registry(providers)
    reg.add_plugin(_plugin("first", "second"), "p")
    assert reg.backends["dup"].description == "first"
    assert reg.plugins["p"].errors == ["backend name 'dup' is registered twice by this plugin"]


def test_a_conflict_names_each_plugin_once() -> None:
    reg = Registry({})
    reg.add_plugin(_plugin("other"), "o")
    reg.add_plugin(_plugin("first", "second"), "p")
    assert reg.conflicts["dup"] == ["o", "p"] and "dup" not in reg.backends
    assert not [e for e in reg.plugins["p"].errors if e.count("'p' (") > 1]
    assert reg.plugins["p"].errors[-1] == "backend name 'dup' is registered twice by this plugin"


# (C7) extends --------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["''", "'  '"])
def test_an_empty_extends_is_refused(tmp_path: Path, value: str) -> None:
    """It was read as the policy's own folder: "cannot read policy ... (Is a directory)"."""
    (line,) = _problems(tmp_path, f"name: p\nextends: {value}\nrules: []\n")
    assert _at(line) == "2:10" and "extends: got an empty extends" in line, line


def test_a_symlink_loop_beside_the_file_is_that_file(tmp_path: Path) -> None:
    """It fell through to the packaged lookup: "policies/loopa.yaml (No such file ...)"."""
    os.symlink(tmp_path / "loopb", tmp_path / "loopa")
    os.symlink(tmp_path / "loopa", tmp_path / "loopb")
    (line,) = _problems(tmp_path, "name: p\nextends: loopa\nrules: []\n")
    assert f"cannot read policy {tmp_path / 'loopa'} ({os.strerror(40)})" in line, line
    assert "packaged policies" not in line


def test_a_folder_named_like_a_packaged_policy_still_means_the_packaged_one(
        tmp_path: Path) -> None:
    (tmp_path / "portable").mkdir()
    (tmp_path / "p.yaml").write_text("name: p\nextends: portable\nrules: []\n")
    assert load_data(tmp_path / "p.yaml").files[0].endswith("portable.yaml")


# ninth review (selfdiff3) -----------------------------------------------------------------

def test_batches_of_two_asyncio_tasks_keep_their_own_records(tmp_path: Path) -> None:
    """(A) One thread, two tasks: the open batches were a per-thread stack and exit popped the
    top, so task A's record went into B's batch and B's record was lost."""
    import asyncio

    from attnhub.core.device import probe
    from attnhub.policy.profile import ProfileStore

    dev, path = probe(), tmp_path / "store.json"
    store = ProfileStore(path)

    async def task(name: str, first: float) -> None:
        with store.batch():
            await asyncio.sleep(first)
            store.record_attention_share(dev, name, 0.5)
            with store.batch():  # nested: joins this task's batch
                store.record_attention_share(dev, name + "2", 0.5)

    async def both() -> None:
        await asyncio.gather(task("A", 0.01), task("B", 0.03))

    asyncio.run(both())
    have = sorted(k.split("|")[0] for d in ProfileStore(path).data()["devices"].values()
                  for k in d.get("attention_share", {}))
    assert have == ["A", "A2", "B", "B2"]


def test_a_huge_hex_key_is_a_located_error(tmp_path: Path) -> None:
    """(B) repr() of an int past 4,300 digits raised a raw ValueError from the key message."""
    from attnhub.policy.located import show

    (line,) = _problems(tmp_path, "name: x\n? 0x" + "f" * 4000 + "\n: 1\nrules: []\n")
    assert line.startswith(f"{tmp_path / 'p.yaml'}:2:3 ") and len(line) < 300, line
    assert show(16 ** 4000) == "an integer of 16001 bits"
    (line,) = _problems(tmp_path, "name: x\n0x" + "f" * 1000 + ": 1\nrules: []\n")
    assert len(line) < 300, line


@pytest.mark.parametrize("text, at", [
    ("name: x\nrules:\n  - name: r\n    use: [torch_sdpa]\n    when: {head_dim: {ge: BIG}}\n",
     "5:27 rules[0].when.head_dim.ge"),
    ("name: x\nversion: BIG\nrules: []\n", "2:10 version"),
    ("name: x\nversion: 0b1" + "0" * 64 + "\nrules: []\n", "2:10 version"),
])
def test_an_integer_beyond_64_bits_is_refused_where_it_is(tmp_path: Path, text: str,
                                                          at: str) -> None:
    """(B) hex and binary integers had no size limit: a raw ValueError, or a policy that
    loaded and crashed `policy show`."""
    (line,) = _problems(tmp_path, text.replace("BIG", "0x" + "f" * 4000))
    assert f"p.yaml:{at}: the number '0" in line and "is too large" in line, line
    assert "expected an integer of at most 64 bits" in line and len(line) < 300, line


class _ClosedPipe:
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_stdout_keeps_the_status_of_a_failing_json_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """(B) plan --json of a bad policy raised BrokenPipeError (a traceback); lock --check of
    a malformed lock exited 0."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nrules:\n  - name: r\n    use: [torch_sdpa]\n    when: {bogus: 1}\n")
    lock = tmp_path / "bad.lock"
    lock.write_text("{not json")
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    assert main(["plan", "--policy", str(bad), "--json"]) == 1
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    assert main(["lock", "--check", str(lock), "--json"]) == EXIT_BAD_LOCK
    assert "attnhub lock: error:" in capsys.readouterr().err


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
@pytest.mark.parametrize("first", ["# Политика для сервера", "# " + "中文" * 100])
def test_utf16_without_a_mark_and_non_latin_first_line(tmp_path: Path, encoding: str,
                                                       first: str) -> None:
    """(C) the first 64 bytes had no zero at either parity: "U+0000 ... remove it"."""
    text = first + "\nname: x\nrules:\n  - name: r\n    use: [torch_sdpa]\n"
    (line,) = _problems(tmp_path, text.encode(encoding))
    assert "1:1 (encoding): the file is UTF-16" in line and "re-save it as UTF-8" in line, line


def test_a_stray_nul_in_utf8_is_not_utf16(tmp_path: Path) -> None:
    problems = _problems(tmp_path, b"name: x\x00\nrules: []\n")
    assert not any("UTF-16" in p for p in problems), problems


_BENCH = ["bench", "--phases", "decode", "--backends", "torch_sdpa", "--layers", "1",
          "--prompt-len", "16", "--new-tokens", "2", "--repeats", "1", "--warmup", "0",
          "--no-progress"]


def test_bench_report_write_failure_says_what_was_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """(C) "printed and stored" with --no-store, and with a store that failed (exit 1, not
    the store's 3)."""
    import errno

    import attnhub.cli.bench as bench
    from attnhub.cli._common import STORE_FAILED

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(bench, "write_text_atomic", full)
    md = str(tmp_path / "r.md")
    assert main(_BENCH + ["--no-store", "--md", md]) == 1
    line = [x for x in capsys.readouterr().err.splitlines() if "--md" in x][-1]
    assert "nothing was stored" in line and "printed and stored" not in line, line
    (tmp_path / "file").write_text("")
    store = str(tmp_path / "file" / "store.json")
    assert main(_BENCH + ["--store", store, "--md", md]) == STORE_FAILED
    line = [x for x in capsys.readouterr().err.splitlines() if "--md" in x][-1]
    assert "store was not written" in line and "printed and stored" not in line, line


def test_json_output_is_strict_json(capsys: pytest.CaptureFixture[str]) -> None:
    """(C) fp8-check --json printed NaN: every --json document goes through print_json."""
    from attnhub.cli._common import print_json

    print_json({"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": (2.0,)})

    def refuse(c: str) -> None:
        raise ValueError(c)

    assert json.loads(capsys.readouterr().out, parse_constant=refuse) == {
        "a": None, "b": [None, None, 1.5], "c": [2.0]}


def test_the_unquoted_hint_for_a_long_integer_keeps_its_value(tmp_path: Path) -> None:
    """(C) '123456789012345678' was answered with 1.2345678901234568e+17 (another value)."""
    rule = "name: x\nrules:\n  - {name: r, use: [reference], when: {seqlen: {lt: %s}}}\n"
    (line,) = _problems(tmp_path, rule % "'123456789012345678'")
    assert line.endswith("(write it unquoted as 123456789012345678)"), line
    (tmp_path / "p.yaml").write_text(rule % "123456789012345678")
    assert "123456789012345678" in str(load_data(tmp_path / "p.yaml").rules[0])


def test_explain_says_a_forced_backend_that_cannot_run_here_raises(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """(C) on a CPU, ATTNHUB_BACKEND naming a CUDA-only backend was "forced onto" it while
    doctor said, and every call did, raise."""
    from attnhub.cli import _policy_common

    class Gpu(Backend):
        name, tier, description = "gpu_only", "portable", "cuda only"
        capabilities = Capabilities(vendors=("cuda",), dtypes=("fp32",), phases=("prefill",))

        def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def]
            return AttentionOutput(out=torch.zeros_like(q))

    @hookimpl
    def attnhub_register_backends(register):  # type: ignore[no-untyped-def]
        register(Gpu())

    load = Registry.load

    def with_gpu(*a: object, **k: object) -> Registry:
        reg = load(*a, **k)
        reg.add_plugin(types.SimpleNamespace(
            attnhub_register_backends=attnhub_register_backends), "gpu_plugin")
        return reg

    monkeypatch.setattr(_policy_common.Registry, "load", staticmethod(with_gpu))
    monkeypatch.setenv("ATTNHUB_BACKEND", "gpu_only")
    assert main(["explain", "--dtype", "fp32"]) == 0
    note = [x for x in capsys.readouterr().out.splitlines() if "ATTNHUB_BACKEND" in x][0]
    assert "cannot run on this device, so every attention call raises" in note, note
    assert "runs on cuda" in note and "forces every attention call" not in note, note


def test_docs_name_every_use_of_exit_2_and_usage_errors_on_stderr() -> None:
    """(D) check-plugin exits 2 when it checked nothing; a usage error prints no object."""
    root = Path(__file__).resolve().parents[1]
    for doc in (root / "README.md", root / "docs" / "policy.md"):
        text = " ".join(doc.read_text().split())
        assert "check-plugin" in text.split("2 a usage error" if doc.name == "README.md"
                                            else "2 on a usage error")[1][:200], doc
        assert "stderr only" in text, doc
