"""Hostile policy files, fourth round: names that only look right (a Cyrillic 'а' in a
backend name, a trailing space, a no-break space), names of a million characters, YAML 1.1
flags where a name goes, bidirectional overrides, and case differences lint did not suggest
a fix for. Each was refused without saying which character was wrong, or echoed megabytes."""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path

import pytest

from attnhub.core.registry import Registry
from attnhub.errors import PolicyError
from attnhub.policy import load_policy
from attnhub.policy.lint import lint_policy
from attnhub.policy.schema import MAX_NAME

BACKENDS = ["torch_sdpa", "reference"]
#: Latin letter -> a character that renders the same (Cyrillic, Greek) or a space look-alike
LOOKALIKES = {"a": "\u0430", "e": "\u0435", "o": "\u03bf", "p": "\u0440", "c": "\u0441",
              "r": "\u0433", "_": "\uff3f", "s": "\u0455"}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ATTNHUB_POLICY", raising=False)


def _problems(text: str) -> list[str]:
    Path("p.yaml").write_text(text, encoding="utf-8")
    with pytest.raises(PolicyError) as exc:
        load_policy("p.yaml")
    return exc.value.problems


def _rule(use: str, name: str = "r") -> str:
    return f"name: p\nrules:\n  - name: {name}\n    use: [{use}]\n"


@pytest.mark.parametrize("seed", range(6))
def test_a_lookalike_character_in_a_name_is_pointed_at(seed: int) -> None:
    """``use: [triton]`` with a Cyrillic 'а' read "got 'triton', expected a name made of
    letters, digits and _": it *is* made of letters, and the message shows the name as
    written, so nobody could see what was wrong."""
    rng = random.Random(seed)
    backend = rng.choice(BACKENDS)
    spots = [i for i, c in enumerate(backend) if c in LOOKALIKES]
    i = rng.choice(spots)
    odd = LOOKALIKES[backend[i]] if seed % 3 else rng.choice(["\u00a0", "\u200b", " "])
    bad = backend[:i] + odd + backend[i + 1:] if odd.strip() else backend + odd
    at = i if odd.strip() else len(backend)
    (line,) = _problems(_rule(f"'{bad}'"))
    assert line.startswith("p.yaml:4:11 rules[0].use[0]: got "), line
    assert (f"character {at + 1} is U+{ord(odd):04X} {unicodedata.name(odd)}, not an ASCII "
            "letter or digit (retype the name)") in line, line
    (line,) = _problems(_rule("torch_sdpa", name=f"'r{odd}x'"))  # the same for rule names
    assert "rules[0].name: got " in line and f"character 2 is U+{ord(odd):04X}" in line, line


@pytest.mark.parametrize("where", ["use", "rule"])
def test_a_name_of_megabytes_is_refused_in_one_short_line(where: str) -> None:
    """A generated 2 MB backend name loaded; ``attnhub policy check`` then echoed it in five
    findings (10 MB of output) and every decision record carried it."""
    n = random.randrange(MAX_NAME + 1, 2 * 10**6)
    long = "b" * n
    text = _rule(long) if where == "use" else _rule("torch_sdpa", name=long)
    (line,) = _problems(text)
    assert f"got a name of {n} characters" in line and f"of at most {MAX_NAME}" in line
    assert len(line) < 300, len(line)
    Path("ok.yaml").write_text(_rule("x" * MAX_NAME))  # the longest name allowed still loads
    assert load_policy("ok.yaml").rules[0].rule.use.names == ["x" * MAX_NAME]


@pytest.mark.parametrize("word", ["yes", "No", "on", "OFF", "true", "~", "null"])
def test_a_yaml_flag_where_a_name_goes_says_to_quote_it(word: str) -> None:
    """``use: [on]`` read "got True, expected a name": YAML 1.1 turned the word into a flag
    and the message did not say so, nor how to keep it a name."""
    (line,) = _problems(_rule(word))
    assert "(YAML reads unquoted yes/no/on/off/true/false as a flag and an empty value or ~ " \
           "as null)" in line and line.endswith("(quote it)"), line


@pytest.mark.parametrize("char", ["\u202e", "\u202a", "\u2066", "\u2069"])
@pytest.mark.parametrize("key", ["name", "description"])
def test_a_bidirectional_override_is_refused(char: str, key: str) -> None:
    """A policy name or description with U+202E shows reversed in ``explain`` and lockfiles
    ("Trojan Source"): what a reviewer reads is not what is there."""
    text = _rule("torch_sdpa").replace("name: p\n", f"name: p\n{key}: 'a{char}b'\n", 1) \
        if key == "description" else _rule("torch_sdpa").replace("name: p", f"name: 'p{char}q'")
    (line,) = _problems(text)
    assert f"character U+{ord(char):04X} (a control character" in line, line


@pytest.mark.parametrize("seed", range(4))
def test_lint_suggests_the_backend_a_case_difference_hides(seed: int) -> None:
    """``use: [Torch_SDPA]`` linted "unknown backend" with no suggestion (difflib compares
    case-sensitively); at run time the decision record did not suggest one either."""
    rng = random.Random(seed)
    backend = rng.choice(BACKENDS)
    flipped = "".join(c.upper() if rng.random() < 0.6 else c for c in backend)
    flipped = flipped if flipped != backend else backend.upper()
    Path("p.yaml").write_text(_rule(flipped))
    reg = Registry.load(entry_points=False, modules=[])
    (finding,) = [f for f in lint_policy(load_policy("p.yaml"), reg, ("cpu",))
                  if f.message.startswith("unknown backend")]
    assert finding.message.endswith(f"(did you mean {backend!r}?)"), finding.message
    assert reg.missing_reason(flipped).endswith(f"(did you mean {backend!r}?)")


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n...\n", "~\n", "null"])
def test_an_empty_policy_says_it_is_empty(text: str) -> None:
    """An empty policy file (a failed download, a truncated write) read "got NoneType,
    expected a mapping": a Python type name for a file with nothing in it."""
    (line,) = _problems(text * random.randrange(1, 4) if text in ("\n\n", "# only a comment\n")
                        else text)
    assert "(document): got no value (an empty file, only comments, or null), expected a " \
           "mapping with name, rules" in line, line
