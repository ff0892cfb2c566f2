"""Checks of table *contents*, memoized: ``cu_seqlens`` (``thd``) and paged tables.

Reading a tensor's contents is a host copy (a sync on an accelerator), and the layers of a
model step pass the same tables: so each pair is checked once per change, not once per
layer (:class:`_Memo`), and backends read a private snapshot taken at the check, which no
later edit of the caller's tensors can make unchecked. :data:`THD` and :data:`PAGED` are the
process-wide memos :func:`~attnhub.core.contract.check_call` and the hub's hot path use;
:class:`PagedTables` also takes proofs (:meth:`~PagedTables.vouch`) from the KV cache that
built the tables, so a new step's tables need no read back.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from ..errors import ArgumentError, DeviceMismatchError, SeqlensError

log = logging.getLogger("attnhub")


def check_plain(name: str, t: torch.Tensor) -> None:
    """A dense strided tensor whose memory holds its values: kernels read memory through
    pointers and strides, so a sparse, mkldnn or nested tensor has no meaning to them, and
    one with the negative bit (``z.conj().imag``, a lazy view) would be read with its sign
    flipped."""
    if t.layout is not torch.strided or t.is_nested:
        kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
        raise ArgumentError(f"{name} is a {kind} tensor; attention takes dense strided tensors "
                            f"({name}.to_dense(), or unbind a nested tensor into a padded or "
                            "thd layout)")
    if t.is_neg() or t.is_conj():
        raise ArgumentError(f"{name} is a lazily negated view (negative bit, e.g. "
                            f"z.conj().imag); pass {name}.resolve_neg() (or .clone())")


def check_cu_seqlens_meta(name: str, cu: Any, device: torch.device) -> None:
    """Type, rank, dtype and device of cumulative lengths (no contents read)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise SeqlensError(f"{name} must be a 1-D tensor of B+1 offsets starting at 0 for "
                           f"B >= 1 documents (e.g. [0, 5, 12]), got "
                           f"{tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu)}"
                           "; for no documents at all, skip the call")
    check_plain(name, cu)
    if cu.dtype != torch.int32:
        raise SeqlensError(f"{name} is {cu.dtype}; it must be torch.int32 "
                           f"(use {name}.to(torch.int32))")
    if cu.device != device:
        raise DeviceMismatchError(f"{name} is on {cu.device} but q is on {device}; move it")


def _check_cu_contents(name: str, cu: torch.Tensor, total: int) -> int:
    """Offsets start at 0, never decrease, end at the packed length (one host copy);
    returns the longest sequence."""
    host = cu.tolist()
    if host[0] != 0:
        raise SeqlensError(f"{name}[0] is {host[0]}; offsets must start at 0")
    if any(b < a for a, b in zip(host, host[1:])):
        raise SeqlensError(f"{name} is not monotonic non-decreasing: {host[:8]}...")
    if host[-1] > total:
        raise SeqlensError(
            f"{name}[-1]={host[-1]} is past the {total} tokens of the packed tensor")
    if host[-1] < total:
        raise SeqlensError(
            f"{name}[-1]={host[-1]} but the packed tensor holds {total} tokens; the last "
            f"offset must equal the packed length (slice the tensor to [:{host[-1]}])")
    return max(b - a for a, b in zip(host, host[1:]))


class _Memo:
    """A one-entry memo of a checked pair of tensors: the layers of a model step pass the
    same two tensors, so their contents are read once per change, not once per layer.

    A hit needs the same tensor objects and geometry (what the check depended on). On the
    CPU the contents are then compared with the snapshot (``torch.equal``, under a
    microsecond for small tables), so every edit is seen. On an accelerator that comparison
    would be a host sync per layer, so a stamp (``_version``, data pointer) stands in for
    it. A stamp is no full proof: an edit through ``.data`` does not bump ``_version``. So
    backends always read the *snapshot* (a private copy taken when the pair was checked):
    nothing a caller does to its own tensors afterwards can make a backend read an
    unchecked value; on an accelerator an edit that bypasses ``_version`` between calls is
    not seen (the call reads the values as they were checked: in bounds, never an error).
    Normal in-place edits and new tensors are re-checked.
    """

    #: the tables a memo holds, as the caller names them (its messages say these)
    TABLES = "tables"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memo: tuple = ()

    def _hit(self, a: torch.Tensor, b: torch.Tensor, geometry: tuple) -> tuple | None:
        """``(snap_a, snap_b, *facts)`` if ``a``/``b`` are the checked pair, unchanged, for
        this ``geometry``; else None. The hot path's cost: the result tuple is built once
        at ``_store``, and whether contents or a stamp prove the pair was settled there too
        (a tensor object never changes device: ``.data`` of another device is refused)."""
        memo = self._memo  # (a, b, geometry, stamp, result, dtypes): one read, swapped whole
        if memo and memo[0] is a and memo[1] is b and memo[2] == geometry:
            return self.still(memo, a, b)
        return None

    @staticmethod
    def still(memo: tuple, a: torch.Tensor, b: torch.Tensor) -> tuple | None:
        """``memo``'s result if ``a``/``b`` are its pair, unchanged since it was stored (its
        geometry is the caller's to vouch for: the hub's per-binding shortcut); else None."""
        if memo[0] is a and memo[1] is b:
            stamp, result = memo[3], memo[4]
            if stamp is None:  # the contents themselves (CPU, inference tensors: _stamp)
                # dtypes too: ``equal`` holds across dtypes, and ``t.data = t.long()``
                # neither bumps ``_version`` nor changes the values
                if (result[0].equal(a) and result[1].equal(b)
                        and (a.dtype, b.dtype) == memo[5]):
                    return result
            elif (a._version == stamp[0] and b._version == stamp[1]
                  and a.data_ptr() == stamp[2] and b.data_ptr() == stamp[3]):
                return result
        return None

    #: The hot path's check, ``_hit`` itself (no wrapper: one call less per layer): the
    #: result of :meth:`check` (paged: ``(snap_bt, snap_sl, longest)`` for the geometry
    #: ``(k.shape, batch, device)``; thd: ``(snap_q, snap_k, max_q, max_k)`` for
    #: ``(total_q, total_k, device)``) or None, and then :meth:`check` must run, the
    #: tables' types and shapes too.
    unchanged = _hit

    def _store(self, a: torch.Tensor, b: torch.Tensor, geometry: tuple, snap_a: torch.Tensor,
               snap_b: torch.Tensor, *facts: Any) -> None:
        stamp = None if a.is_cpu else _stamp(a, b)
        if stamp is None and not a.is_cpu:
            _warn_unstamped(self.TABLES, a.device)
        memo = (a, b, geometry, stamp, (snap_a, snap_b, *facts), (a.dtype, b.dtype))
        with self._lock:
            self._memo = memo


def _stamp(a: torch.Tensor, b: torch.Tensor) -> tuple | None:
    """(versions, data pointers) of a pair; None for inference tensors (made under
    ``torch.inference_mode``), which keep no version counter and are edited in place
    unrecorded: only their contents prove them unchanged (a host sync on an accelerator)."""
    try:
        return (a._version, b._version, a.data_ptr(), b.data_ptr())
    except RuntimeError:
        return None


_warned_unstamped: set[str] = set()


def _warn_unstamped(tables: str, device: torch.device) -> None:
    """Once per pair of tables: tables on an accelerator made under ``torch.inference_mode``
    carry no version counter, so every call proves them unchanged by reading them (a host
    sync per call, per layer). Said, never silent."""
    if tables in _warned_unstamped:
        return
    _warned_unstamped.add(tables)
    log.warning(
        "attnhub: %s on %s are inference tensors (made under torch.inference_mode): they "
        "keep no version counter, so each call compares their contents with the checked "
        "copy, a host sync per call. Build them outside inference_mode (PagedKVCache."
        "block_table/seqlens do), or as t = x.clone() under torch.inference_mode(False).",
        tables, device)


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A private copy backends read, with a version counter even when the caller's tensor
    was made under ``torch.inference_mode`` (backends may stamp the tables they get)."""
    with torch.inference_mode(False):
        return t.clone()


class CuSeqlens(_Memo):
    """Checks ``cu_seqlens_q``/``cu_seqlens_k`` of a ``thd`` call once per change (a host
    copy then) and hands backends a private snapshot (see :class:`_Memo`)."""

    TABLES = "cu_seqlens_q/cu_seqlens_k"

    def check(self, q: torch.Tensor, k: torch.Tensor, cu_q: Any,
              cu_k: Any) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Validate; returns the snapshots backends must read and the longest lengths."""
        if cu_q is None or cu_k is None:
            raise SeqlensError("layout='thd' needs cu_seqlens_q and cu_seqlens_k "
                               "(int32, B+1 offsets into the packed tokens)")
        check_cu_seqlens_meta("cu_seqlens_q", cu_q, q.device)
        check_cu_seqlens_meta("cu_seqlens_k", cu_k, q.device)
        if cu_q.numel() != cu_k.numel():
            raise SeqlensError(f"cu_seqlens_q has {cu_q.numel()} entries and "
                               f"cu_seqlens_k {cu_k.numel()}; both must be B+1 long")
        return self.values(cu_q, cu_k, q.shape[0], k.shape[0], q.device)

    def values(self, cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """The contents check alone (types and shapes already checked)."""
        # what the check depended on: the packed lengths, and q's device (the hot path
        # leaves the offsets' device to this memo)
        geometry = (total_q, total_k, device)
        hit = self._hit(cu_q, cu_k, geometry)
        if hit is not None:
            return hit  # type: ignore[return-value]
        snap_q, snap_k = _snapshot(cu_q), _snapshot(cu_k)
        mq = _check_cu_contents("cu_seqlens_q", snap_q, total_q)
        mk = _check_cu_contents("cu_seqlens_k", snap_k, total_k)
        self._store(cu_q, cu_k, geometry, snap_q, snap_k, mq, mk)
        return snap_q, snap_k, mq, mk


#: The process-wide varlen check (one memo: the layers of a step share their offsets).
THD = CuSeqlens()


class PagedTables(_Memo):
    """Checks ``block_table``/``seqlens_k`` of a paged call, reading their contents once per
    change, and hands backends a private snapshot that a stale check cannot outlive (see
    :class:`_Memo`).

    Tables built by :class:`~attnhub.core.kvcache.PagedKVCache` come with a proof
    (:meth:`vouch`): the cache built them from host lists it knows, so a new step's tables
    are taken without reading them back (no host sync on an accelerator).
    """

    TABLES = "block_table/seqlens_k"

    def __init__(self) -> None:
        super().__init__()
        self._vouched: dict[int, tuple] = {}
        #: tables their cache has taken back (``revoke``): id -> (weakref, why)
        self._revoked: dict[int, tuple] = {}

    def check(self, q: torch.Tensor, k: torch.Tensor, block_table: Any,
              seqlens_k: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Validate; returns the snapshot (block_table, seqlens_k) backends must read and
        the longest length."""
        if block_table is None or seqlens_k is None:
            raise SeqlensError("layout='paged' needs block_table (B, pages) int32 and "
                               "seqlens_k (B,) int32")
        batch = q.shape[0]
        for name, t, rank in (("block_table", block_table, 2), ("seqlens_k", seqlens_k, 1)):
            if not isinstance(t, torch.Tensor):
                raise SeqlensError(f"{name} must be an int32 tensor, got {type(t).__name__}")
            check_plain(name, t)
            if t.dtype != torch.int32:
                raise SeqlensError(f"{name} is {t.dtype}; it must be torch.int32 "
                                   f"(use {name}.to(torch.int32))")
            if t.device != q.device:
                raise DeviceMismatchError(f"{name} is on {t.device} but q is on {q.device}; "
                                          f"move it ({name}.to(q.device))")
            if t.dim() != rank or t.shape[0] != batch:
                want = f"(B={batch}, pages)" if rank == 2 else f"(B={batch},)"
                raise SeqlensError(f"{name} must be {want} for q of batch {batch}, got "
                                   f"{tuple(t.shape)}")
        return self.values(q, k, block_table, seqlens_k)

    def values(self, q: torch.Tensor, k: torch.Tensor, block_table: torch.Tensor,
               seqlens_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The contents check alone (types and shapes already checked)."""
        if self._revoked:
            self._refuse_revoked(block_table)
        # what the check depended on: the cache's (pages, page_size, ...), q's batch (the
        # tables' rows) and device (the snapshots')
        geometry = (k.shape, q.shape[0], q.device)
        hit = self._hit(block_table, seqlens_k, geometry)
        if hit is not None:
            return hit  # type: ignore[return-value]
        proof = self._proof(block_table, seqlens_k, k.shape[0], k.shape[1])
        if proof is not None:
            snap_bt, snap_sl, max_len = proof
        else:
            snap_bt, snap_sl = _snapshot(block_table), _snapshot(seqlens_k)
            max_len = _check_paged_contents(snap_bt, snap_sl, k.shape[0], k.shape[1])
        self._store(block_table, seqlens_k, geometry, snap_bt, snap_sl, max_len)
        return snap_bt, snap_sl, max_len

    def vouch(self, t: torch.Tensor, snapshot: torch.Tensor,
              fact: tuple[int, tuple[int, ...]]) -> None:
        """Record a proof for a table the caller built from host data it checked:
        ``fact`` is, for a block table, (the number of pages every used entry is below, the
        pages each row holds), for lengths (the longest length, each row's length; all
        >= 0). A table and lengths vouched apart (a table kept from an earlier step, the
        lengths of this one) prove a call only if each row's length fits its row's pages.
        ``snapshot`` is a private copy of ``t``
        (same values) that backends will read. The proof holds while ``t`` is unchanged
        (stamp as in :class:`_Memo`); only the last few proofs are kept."""
        if t.is_inference():  # no version counter to hold the proof: checked by reading
            return
        entry = (weakref.ref(t), t._version, t.data_ptr(), tuple(t.shape), snapshot, fact)
        with self._lock:
            self._vouched[id(t)] = entry
            while len(self._vouched) > 8:
                del self._vouched[next(iter(self._vouched))]

    def revoke(self, t: torch.Tensor, why: str) -> None:
        """Take back a block table its cache built: some page it names went back to the free
        list (``why`` says how), so it may point at another sequence's tokens. Every later
        check of ``t`` raises; the memo that held it is dropped, so the hub's per-layer
        shortcut cannot take it either (no cost on the hot path)."""
        with self._lock:
            self._vouched.pop(id(t), None)
            if self._memo and self._memo[0] is t:
                self._memo = ()
            self._revoked[id(t)] = (weakref.ref(t), why, _version(t))
            if len(self._revoked) > 64:  # the tables themselves are gone: forget them
                self._revoked = {i: e for i, e in self._revoked.items() if e[0]() is not None}

    def unrevoke(self, t: torch.Tensor) -> None:
        """Take back a revocation whose cause was undone (a rolled-back step)."""
        with self._lock:
            self._revoked.pop(id(t), None)

    def _refuse_revoked(self, bt: torch.Tensor) -> None:
        entry = self._revoked.get(id(bt))
        # refreshed in place since (a static buffer, CUDA graphs): checked as any table
        if entry is not None and entry[0]() is bt and entry[2] in (None, _version(bt)):
            raise SeqlensError(
                f"block_table was built by a PagedKVCache that has since taken back a page "
                f"it names ({entry[1]}): it may point at another sequence's tokens. Build the "
                "tables again from the cache (cache.step(...) or cache.block_table(...))")

    def _proof(self, bt: torch.Tensor, sl: torch.Tensor, num_pages: int,
               page: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Snapshots and longest length from two vouched tables, if both still hold and fit
        this call's cache (every page id < num_pages, longest <= the table's capacity)."""
        pa, pb = self._vouched.get(id(bt)), self._vouched.get(id(sl))
        if pa is None or pb is None:
            return None
        for t, (ref, version, ptr, shape, _, _) in ((bt, pa), (sl, pb)):
            if ref() is not t or t._version != version or t.data_ptr() != ptr or (
                    tuple(t.shape) != shape):
                return None
        (below, pages), (longest, lens) = pa[5], pb[5]
        if below > num_pages or longest > bt.shape[1] * page or len(pages) != len(lens) or any(
                n > p * page for n, p in zip(lens, pages)):
            return None
        if bt.is_cpu and not (torch.equal(pa[4], bt) and torch.equal(pb[4], sl)):
            return None  # edited through .data since it was vouched: check it the long way
        return pa[4], pb[4], longest


def _check_paged_contents(bt: torch.Tensor, sl: torch.Tensor, num_pages: int,
                          page: int) -> int:
    """Lengths in [0, capacity], every page a sequence uses in [0, num_pages); returns the
    longest length. One host copy of each table."""
    lens = sl.cpu().to(torch.int64)
    if lens.numel() and int(lens.min()) < 0:
        raise SeqlensError(f"seqlens_k has a negative length: {lens.tolist()[:8]}; lengths "
                           "count the cached tokens of each sequence (>= 0)")
    cap = bt.shape[1] * page
    longest = int(lens.max()) if lens.numel() else 0
    if longest > cap:
        raise SeqlensError(f"seqlens_k max {longest} exceeds block_table capacity {cap} "
                           f"({bt.shape[1]} pages x {page}); add pages to the table")
    used = torch.arange(bt.shape[1], device=lens.device).view(1, -1) < (
        (lens + page - 1) // page).view(-1, 1)  # on the host, as lens: not the default device
    ids = bt.cpu()[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
        hint = (" (-1 is a PagedKVCache table's padding past a sequence's pages: a table "
                "built before the sequence grew; build the tables again from the cache)"
                if int(ids.min()) == -1 else "")
        raise SeqlensError(f"block_table refers to a page outside 0..{num_pages - 1} (the k/v "
                           f"caches hold that many pages) for a token within seqlens_k{hint}")
    return longest


#: The process-wide paged check (one memo: the layers of a step share their tables).
PAGED = PagedTables()


def _forget_tables() -> None:
    """Drop the paged and varlen memos and proofs (their snapshots may have been written)."""
    for memo in (PAGED, THD):
        with memo._lock:
            memo._memo = ()
    with PAGED._lock:
        PAGED._vouched.clear()


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter; None for an inference tensor (it keeps none)."""
    try:
        return t._version
    except RuntimeError:
        return None
