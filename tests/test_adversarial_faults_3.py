"""Fault injection, third round: the built-in decoder with a layer failing half-way through a
multi-layer step (out of memory, MemoryError, Ctrl-C), the profile store given values its
reader refuses or reached through a symlink, and the decoder commands given flags they
cannot use.

A failed step leaves the cache exactly as a run that never tried it; a store never holds what
it cannot read back, and a write through a symlink updates the file it points to; a bad flag
is a usage error naming the flag, never a traceback after the model was built."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from attnhub.cli import main as cli_main
from attnhub.core.device import simulate
from attnhub.errors import CacheFullError
from attnhub.models.decoder import Decoder, DecoderConfig
from attnhub.policy.profile import ProfileStore
from tests.test_adversarial_kvcache_3 import _same_cache


# -- the built-in decoder with a layer failing mid step --------------------------------------
def _model() -> Decoder:
    return Decoder(DecoderConfig(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=8,
                                 vocab_size=32, seed=random.randrange(1000)))


@pytest.mark.parametrize("seed", range(2))
def test_a_layer_failing_mid_decode_leaves_the_cache_as_a_clean_run(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode on forks that share partly filled prompt pages; at random steps one random
    layer fails before or after its attention ran (the step's k/v written for some layers
    only). The cache then equals a twin's that never ran the failed step, and the next
    logits are bit for bit the twin's."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = _model()
    faulty = model.new_cache(batch=3, max_len=24, page_size=4, spare_pages=6)
    twin = model.new_cache(batch=3, max_len=24, page_size=4, spare_pages=6)
    prompts = torch.randint(0, 32, (3, rng.randint(2, 7)))
    seqs, first = model.prefill(faulty, prompts)
    assert model.prefill(twin, prompts)[0] == seqs
    forks = [faulty.fork(s) for s in seqs]
    assert [twin.fork(s) for s in seqs] == forks
    tok = first.argmax(-1)
    for _ in range(6):
        if rng.random() < 0.6:
            layer = model.layers[rng.randrange(3)].attn
            exc = rng.choice([RuntimeError("CUDA out of memory"), MemoryError(),
                              KeyboardInterrupt()])
            after = rng.random() < 0.5
            real = layer.forward

            def fail(*a, _real=real, _exc=exc, _after=after):  # type: ignore[no-untyped-def]
                if _after:
                    _real(*a)
                raise _exc

            monkeypatch.setattr(layer, "forward", fail)
            with pytest.raises(type(exc)):
                model.decode(faulty, forks, tok)
            monkeypatch.undo()
            _same_cache(faulty, twin)
        got, want = model.decode(faulty, forks, tok), model.decode(twin, forks, tok)
        assert torch.equal(got, want)
        _same_cache(faulty, twin)
        tok = got.argmax(-1)


# -- the profile store never holds what it cannot read back ----------------------------------
DEV = simulate("sm90")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_record_the_reader_would_refuse_is_refused_and_the_store_kept(
        tmp_path: Path, bad: float) -> None:
    """Before: ``record_accuracy`` wrote a NaN metric (an FP8 check whose error is NaN) as
    ``NaN`` in the JSON, and every later read of the store, the good records included, was
    a PolicyError until the file was edited by hand."""
    path = tmp_path / "p.json"
    store = ProfileStore(path, packs="off")
    err = random.uniform(1e-4, 1e-2)
    store.record_accuracy(DEV, "*", "fp8", True, {"rel_error": err})
    before = path.read_text()
    with pytest.raises(ValueError, match=r"metrics.*rel_error") as exc:
        store.record_accuracy(DEV, "lbl", "fp8", False, {"rel_error": bad, "max": err})
    assert "fp8" in str(exc.value)
    assert path.read_text() == before
    rec = ProfileStore(path, packs="off").accuracy(DEV, "*", "fp8")
    assert rec is not None and rec.metrics == {"rel_error": err}


class _Case:
    """What ``fp8_check._verdicts`` reads of a case."""

    label, kind, magnitude = "s", "random", 1.0

    def __init__(self, rel: float) -> None:
        self.errors = {"fp8 default": {"rel": rel, "max": rel}, "bf16": {"rel": rel, "max": rel}}


def test_fp8_check_keeps_a_nan_error_visible() -> None:
    """Before: the verdict took ``max(0.0, nan)``, which is 0.0: a case whose error was NaN
    reported a relative error of 0 beside its FAIL, whichever case came first."""
    from attnhub.cli import fp8_check

    good = random.uniform(1e-4, 1e-3)
    for cases in ([_Case(good), _Case(math.nan)], [_Case(math.nan), _Case(good)]):
        v = fp8_check._verdicts(cases, "fp8 default", 0.1, 10.0)["s"]
        assert v["passed"] is False and math.isnan(v["metrics"]["rel_error"])


def test_fp8_check_records_a_nan_case_as_failed_and_keeps_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the NaN metrics went into the store, which no read could load again."""
    from attnhub.cli import fp8_check

    path = tmp_path / "p.json"
    good = random.uniform(1e-4, 1e-3)
    ProfileStore(path, packs="off").record_accuracy(DEV, "*", "fp8", True, {"rel_error": good})
    args = type("Args", (), {"store": str(path), "emulate": True})()
    monkeypatch.setattr(fp8_check, "_spec", lambda case: "label-s")
    cases = [_Case(good), _Case(math.nan)]
    verdicts = fp8_check._verdicts(cases, "fp8 default", 0.1, 10.0)
    fp8_check._record(args, DEV, cases, verdicts, "fp8", "default", 0.1)
    again = ProfileStore(path, packs="off")
    rec = again.accuracy(DEV, "label-s", "fp8")
    assert rec is not None and rec.passed is False
    assert all(math.isfinite(x) for x in rec.metrics.values()) and rec.metrics["budget"] == 0.1
    kept = again.accuracy(DEV, "*", "fp8")
    assert kept is not None and kept.metrics == {"rel_error": good}


def test_a_store_reached_through_a_symlink_updates_its_target(tmp_path: Path) -> None:
    """Before: the atomic rename replaced the symlink by a plain file: the file it pointed
    to (a shared or managed store) never saw the record, and the link was gone."""
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    secs = random.uniform(1e-5, 1e-3)
    ProfileStore(real, packs="off").record_attention_share(DEV, "m", 0.5)
    link.symlink_to(real)
    ProfileStore(link, packs="off").record_accuracy(DEV, "*", "fp8", True, {"t": secs})
    assert link.is_symlink() and link.resolve() == real.resolve()
    direct = ProfileStore(real, packs="off")
    assert direct.accuracy(DEV, "*", "fp8").metrics == {"t": secs}  # type: ignore[union-attr]
    assert direct.attention_share(DEV, "m", "*") == 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == [".real.json.lock", "link.json",
                                                          "real.json"]
    json.loads(real.read_text())


# -- decoder commands given flags they cannot use --------------------------------------------
SMALL = ["--layers", "1", "--heads", "2:1", "--head-dim", "8", "--vocab", "16", "--batch", "1",
         "--prompt-len", "3", "--new-tokens", "2"]


@pytest.mark.parametrize("command", ["run", "profile"])
@pytest.mark.parametrize("flag, value", [
    ("--layer-kinds", "softmax,bogus"), ("--layer-kinds", ""), ("--layer-kinds", "linear,,"),
    ("--device", "nonsense"), ("--device", "meta"), ("--device", "cuda:99"),
    ("--device", "mps"), ("--seed", "99999999999999999999999"),
])
def test_decoder_flags_are_usage_errors_not_tracebacks(
        command: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ValueError / RuntimeError / AssertionError tracebacks from the model or torch,
    after the hub was built (or, for --device meta, a run failing in the backend)."""
    with pytest.raises(SystemExit) as exc:
        cli_main([command, *SMALL, flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "Traceback" not in err


FP8 = ["fp8-check", "--emulate", "--no-record", "--shape", "1,16,2,1,8", "--magnitudes", "5"]


@pytest.mark.parametrize("flag, value", [
    ("--shape", "1,16,2,3,8"), ("--shape", "0,16,2,1,8"), ("--shape", "1,16"),
    ("--magnitudes", "5,x"), ("--magnitudes", "nan"), ("--magnitudes", "-5"),
    ("--budget", "nan"), ("--budget", "-0.1"), ("--gate-magnitude", "nan"),
    ("--channel", "-1"), ("--channel", "8"), ("--recipe", "no-such-recipe"),
    ("--inputs", "missing.pt"), ("--seed", str(2 ** 40)),
])
def test_fp8_check_flags_are_usage_errors_not_tracebacks(
        flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a ValueError / RuntimeError / KeyError / FileNotFoundError traceback (an
    uneven head split, an empty batch, an unknown recipe, a missing file), a run where every
    case failed (a NaN or negative budget), no gating at all (a NaN gate magnitude), or an
    outlier planted silently in another channel than asked (``--channel 8`` of D=8 went to
    channel 0)."""
    if flag == "--inputs":
        value = str(tmp_path / value)
    with pytest.raises(SystemExit) as exc:
        cli_main([*FP8, flag, value])
    said = str(exc.value.code) + capsys.readouterr().err
    assert exc.value.code != 0 and flag in said and "Traceback" not in said


def _unreadable_store(tmp_path: Path) -> Path:
    """A store cut off mid-write by something else (random length)."""
    path = tmp_path / "p.json"
    ProfileStore(path, packs="off").record_attention_share(DEV, "m", random.random())
    text = path.read_text()
    path.write_text(text[: random.randrange(1, len(text) - 1)])
    return path


@pytest.mark.parametrize("argv", [
    ["profile", *SMALL, "--device", "cpu", "--repeats", "1", "--warmup", "0"],
    ["fp8-check", "--emulate", "--shape", "1,16,2,1,8", "--magnitudes", "5"],
], ids=["profile", "fp8-check"])
def test_results_are_printed_before_a_store_that_cannot_be_written(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``profile`` and ``fp8-check`` wrote the store before printing, so a store that
    could not be read or written (a truncated file, a full disk) lost the whole run's
    results behind a one-line error. As ``bench`` does: results first, then the store, and
    exit status 3 naming it; the file on disk is left exactly as it was."""
    path = _unreadable_store(tmp_path)
    before = path.read_bytes()
    assert cli_main([*argv, "--store", str(path)]) == 3
    out, err = capsys.readouterr()
    assert ("attention share" in out) if argv[0] == "profile" else ("relative error" in out)
    assert str(path) in err and "not recorded" in err
    assert path.read_bytes() == before


class _FullAfter:
    """A sequence-state store that refuses (full, or Ctrl-C) after ``n`` more sequences."""

    def __init__(self, n: int, exc: BaseException) -> None:
        self.n, self.exc, self.live = n, exc, set()

    def allocate(self, seq_id: int) -> None:
        if self.n == 0:
            raise self.exc
        self.n -= 1
        self.live.add(seq_id)

    def fork(self, src: int, dst: int) -> None:
        self.allocate(dst)

    def free(self, seq_id: int) -> None:
        self.live.remove(seq_id)


FULL = [CacheFullError("state store full"), KeyboardInterrupt()]


@pytest.mark.parametrize("exc", FULL, ids=["full", "ctrl-c"])
def test_decode_whose_forks_fail_half_way_leaks_no_fork(exc: BaseException) -> None:
    """Before: ``generate.decode`` made its forks outside the ``try`` that frees them: a fork
    refused half-way (a full state store, Ctrl-C) left the earlier forks alive, holding the
    prompt pages and state slots, and ``run --compare-decode`` went on with a cache short of
    both for every later backend."""
    from attnhub.models.generate import decode

    model = _model()
    cache = model.new_cache(batch=3, max_len=16, page_size=4, sequence_state=False)
    batch = random.randint(2, 3)
    store = _FullAfter(batch + random.randrange(1, batch), exc)
    cache.attach_state([0], store)
    seqs, first = model.prefill(cache, torch.randint(0, 32, (batch, random.randint(2, 9))))
    refs = [cache.refcount(p) for p in range(cache.num_pages)]
    with pytest.raises(type(exc)):
        decode(model, cache, seqs, first.argmax(-1), 2)
    assert cache.seq_ids == seqs and store.live == set(seqs)
    assert [cache.refcount(p) for p in range(cache.num_pages)] == refs
    cache.check_invariants()


@pytest.mark.parametrize("exc", FULL, ids=["full", "ctrl-c"])
def test_a_prefill_whose_sequences_fail_half_way_leaks_none(exc: BaseException) -> None:
    """The same in ``Decoder.prefill``: its sequences were allocated outside the ``try``
    that frees them when the step fails."""
    model = _model()
    cache = model.new_cache(batch=3, max_len=16, page_size=4, sequence_state=False)
    store = _FullAfter(random.randrange(1, 3), exc)
    cache.attach_state([0], store)
    free = cache.free_pages
    with pytest.raises(type(exc)):
        model.prefill(cache, torch.randint(0, 32, (3, random.randint(2, 9))))
    assert cache.seq_ids == [] and store.live == set() and cache.free_pages == free
    cache.check_invariants()


BENCH = ["bench", "--no-store", "--warmup", "0", "--repeats", "1", "--heads", "2:1",
         "--head-dim", "8", "--batch", "1", "--phases", "prefill", "--no-progress"]


@pytest.mark.parametrize("extra, said", [
    (["--seqlens", "16,x"], "--seqlens"), (["--seqlens", "0"], "--seqlens"),
    (["--seqlens", "-5"], "--seqlens"),
    (["--md", "{tmp}/missing/x.md"], "--md"), (["--out-json", "{tmp}"], "--out-json"),
    (["--plot", "{tmp}/missing/x.png"], "--plot"),
    (["--regret", "--cells", "no-such-cell"], "--cells"),
    (["--regret", "--cells", "decode", "--exclude", "no_such_backend"], "no_such_backend"),
    (["--from-json", "{tmp}/missing.json"], "--from-json"),
    (["--from-json", "{tmp}/cut.json"], "--from-json"),
])
def test_bench_flags_fail_before_anything_is_measured(
        extra: list[str], said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: --seqlens x (or -5) was a traceback, 0 a PagedKVCache error; an --md/--plot/
    --out-json path that cannot be written was a traceback after the whole run (--md before
    the store was written: its records lost too); --cells matching nothing timed nothing and
    exited 0; an --exclude typo timed the backend it meant to leave out; --from-json
    ("measure nothing") without --regret was ignored and a whole bench ran; a missing or cut
    --from-json report was a traceback."""
    import attnhub.benchmark
    import attnhub.regret

    (tmp_path / "cut.json").write_text('{"cells": [{"cell": "x", ')

    def measured(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("measured before the flags were checked")

    monkeypatch.setattr(attnhub.benchmark, "measure", measured)
    monkeypatch.setattr(attnhub.regret, "measure_cell", measured)
    argv = [*BENCH, *(x.replace("{tmp}", str(tmp_path)) for x in extra)]
    try:
        rc = cli_main(argv)
    except SystemExit as exc:
        rc, msg = exc.code, str(exc.code)
    else:
        msg = ""
    err = msg + capsys.readouterr().err
    assert rc not in (0, None) and said in err and "Traceback" not in err
