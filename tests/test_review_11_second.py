"""Review round 11, second pass over the registry/process-state hardening and the atomic
writers (2bf3795), and the window trim by the lengths' bucket (e578dcb).

The registry and process-state tests of this pass live in test_adversarial_plugins_11.py
(one set of plugin helpers); here: the atomic writers and the window trim.

- A setting the host itself had left unreadable (``logging.getLogger("attnhub").filters =
  None``) was blamed on every plugin that loaded, as "changed ... not put back".
- One backend object registered by two plugins under one name went to the first loaded
  (the second was told to register a new instance, which would have been a conflict):
  load order decided who serves the name.
- The ``plugin`` attribute check compared with ``!=`` (a descriptor's own ``__ne__`` passed
  it, crediting the core) and read a ``__slots__`` entry as its descriptor (refused).
- An undecorated ``classmethod`` hook was reported as "no attnhub hook".
- The atomic writers' cleanup removed another writer's temporary file when a name was
  taken, and a write turned a file made private (``chmod 600``) into 0644.
- The window trim (e578dcb) was checked exact against a dense reference; the fast path's
  memos keep a binding's normalised window to its lengths' bucket: pinned below.
"""

from __future__ import annotations

import itertools
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import attnhub
from attnhub.cli._common import write_text_atomic
from attnhub.policy.profile import write_json_atomic


# -- atomic writers -----------------------------------------------------------------------
_WRITERS: list[Callable[[Path], None]] = [
    lambda p: write_text_atomic(p, "new\n"),
    lambda p: write_json_atomic(p, {"new": 1}),
]


@pytest.mark.parametrize("write", _WRITERS, ids=["text", "json"])
def test_a_taken_temporary_name_is_left_alone_and_another_drawn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: Callable[[Path], None]) -> None:
    """Another writer's temporary file under the drawn name: removed by the cleanup (its
    write then failed too), and this write failed with FileExistsError."""
    target = tmp_path / "out.json"
    taken = "0" * 16
    for suffix in (".json", ".tmp"):
        (tmp_path / f".out.json.{taken}{suffix}").write_text("another writer's")
    draws = iter([taken])
    real = secrets.token_hex
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: next(draws, None) or real(n))
    write(target)
    assert target.read_text().startswith(("new", "{"))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([f".out.json.{taken}.json", f".out.json.{taken}.tmp", "out.json"])


@pytest.mark.parametrize("write", _WRITERS, ids=["text", "json"])
@pytest.mark.parametrize("mode", [0o600, 0o664, 0o444])
def test_a_replaced_file_keeps_its_mode(tmp_path: Path, write: Callable[[Path], None],
                                        mode: int) -> None:
    target = tmp_path / "store file.json"
    target.write_text("old")
    os.chmod(target, mode)
    write(target)
    assert stat.S_IMODE(target.stat().st_mode) == mode
    assert sorted(os.listdir(tmp_path)) == ["store file.json"]


@pytest.mark.parametrize("write", _WRITERS, ids=["text", "json"])
def test_a_failed_create_leaves_nothing_and_raises_its_own_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: Callable[[Path], None]) -> None:
    import errno

    target = tmp_path / "out.json"
    target.write_text("old")
    real = os.open

    def full(path: Any, *args: Any) -> int:
        if ".out.json." in os.fspath(path):
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(path))
        return real(path, *args)

    monkeypatch.setattr(os, "open", full)
    with pytest.raises(OSError) as info:
        write(target)
    assert info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == ["out.json"] and target.read_text() == "old"


# -- the window trim (e578dcb): exact, and a memo never shares it across buckets -----------
def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           window: tuple[int, int]) -> torch.Tensor:
    """One sequence (S, H, D), bottom-right aligned, fp64; the window as given."""
    sq, sk = q.shape[0], k.shape[0]
    qi, kj = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None]
    m = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        m &= kj <= qi
    left, right = window
    if left >= 0:
        m &= kj >= qi - left
    if right >= 0:
        m &= kj <= qi + right
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~m, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v.double())


@pytest.mark.parametrize("window", [(20, 0), (3, 20)])
def test_one_hub_across_length_buckets_of_one_key_answers_exactly(
        window: tuple[int, int]) -> None:
    """Same shapes, flags and window (one fast-path key); the lengths (table and cu_seqlens
    contents, edited in place too) move between buckets 16 and 64, where the edge 20 is
    unbounded and bounded: each call is normalised for its own bucket."""
    torch.manual_seed(0)
    hub = attnhub.Hub(hardware="cpu")
    kc, vc = torch.randn(40, 4, 2, 8), torch.randn(40, 4, 2, 8)
    table = torch.randint(0, 40, (2, 16), dtype=torch.int32)
    sl = torch.zeros(2, dtype=torch.int32)
    for lens, sq, causal in itertools.product(([9, 12], [40, 60], [9, 12], [3, 61]), (1, 2),
                                              (False, True)):
        sl.copy_(torch.tensor(lens))
        q = torch.randn(2, sq, 2, 8)
        out = hub.attention(q, kc, vc, layout="paged", block_table=table, seqlens_k=sl,
                            window=window, causal=causal)
        ref = torch.stack([_dense(q[b], kc[table[b].long()].flatten(0, 1)[:n],
                                  vc[table[b].long()].flatten(0, 1)[:n], causal, window)
                           for b, n in enumerate(lens)])
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    for lk, causal in itertools.product(([10, 30], [20, 20], [39, 1], [10, 30]), (False, True)):
        cq = torch.tensor([0, 4, 8], dtype=torch.int32)
        ck = torch.tensor([0, lk[0], 40], dtype=torch.int32)
        q, k, v = torch.randn(8, 2, 8), torch.randn(40, 2, 8), torch.randn(40, 2, 8)
        out = hub.attention(q, k, v, layout="thd", cu_seqlens_q=cq, cu_seqlens_k=ck,
                            window=window, causal=causal)
        ref = torch.cat([_dense(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]],
                                causal, window) for i in range(2)])
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
