"""A paged KV cache: fixed-size pages from a free list, a block table per sequence.

Layout is the one the ``paged`` attention layout reads: per layer, k/v caches of shape
``(num_pages, page_size, Hkv, D)``; a sequence is a list of page indices plus a length, handed
to kernels as ``block_table`` (B, P) int32 and ``seqlens`` (B,) int32.

Pages are reference-counted so that ``fork`` shares a prefix without copying. A page is only
ever written while exactly one sequence owns it: appending to a sequence whose partially
filled last page is shared copies that page first (copy-on-write). Every mutation is planned
and checked before anything changes, so a full cache raises ``CacheFullError`` and leaves all
sequences exactly as they were. Layers bound to a stateful backend (a linear layer's
recurrent state) keep their per-sequence state beside the pages (``attach_state``, see
``core.seqstate``): allocated, forked and freed with each sequence.
"""

from __future__ import annotations

import functools
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..errors import CacheFullError, InputError
from .contract import canonical_device
from .kvquant import FP8_MAX, PageScales, is_fp8
from .seqstate import SequenceStates, SequenceStore
from .tables import PAGED

#: A block table's entry past a sequence's pages: no page (the paged check refuses it within
#: a length, and no backend reads a table past a sequence's length).
PAD_PAGE = -1


@dataclass
class _Seq:
    pages: list[int]
    length: int
    #: its length when it was last forked (or made by a fork): the tokens before it are also
    #: a fork's, so a write to one (reserved before the fork) is refused, since the fork
    #: would keep zeros for it once either copies the page (copy-on-write)
    shared: int = 0
    #: the sequences it was forked from or to, directly or through one since freed, and the
    #: tokens each holds of it: ``shared`` is the most any live one holds (a write to those
    #: would leave that one zeros)
    links: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheStep:
    """One model step's view of the cache, shared by every layer of that step.

    ``slots`` are flat indices (page * page_size + offset) of the new tokens, sequence-major
    (B * new_tokens,); ``block_table``/``seqlens`` already include the new tokens.
    ``context_lens`` are the host-side lengths before the step (0 for a fresh prefill).

    A step is a transaction over the layers: ``abort()`` (or leaving ``with cache.step(...)
    as step:`` by an exception) gives the reserved slots back and restores the sequences as
    they were, so a layer whose write or attention fails half-way leaves no token that some
    layers wrote and others read as zeros. A Ctrl-C that lands before the ``with`` block is
    entered leaves no name to abort: ``PagedKVCache.abort_unentered_steps`` finds the step.
    """

    cache: PagedKVCache
    seq_ids: tuple[int, ...]
    new_tokens: int
    slots: torch.Tensor
    block_table: torch.Tensor
    seqlens: torch.Tensor
    context_lens: tuple[int, ...]
    #: the cache as it was before the step (``PagedKVCache._undo_point``) and its version
    #: right after the reservation; [True] once aborted (the undo's own "done" cell, so an
    #: undo the cache finished by itself, after a Ctrl-C cut it short, aborts the step too)
    _undo: Any = field(default=None, repr=False, compare=False)
    _version: int = field(default=-1, repr=False, compare=False)
    _aborted: list[bool] = field(default_factory=lambda: [False], repr=False, compare=False)
    #: per sequence, the pages that hold this step's slots (what ``write`` needs to still own)
    _owned: tuple[tuple[int, tuple[int, ...]], ...] = field(default=(), repr=False,
                                                             compare=False)

    def __enter__(self) -> CacheStep:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None or self._aborted[0]:
            self._forget()  # finished: no longer ``abort_unentered_steps``' to undo
            return
        try:
            self.abort()
        except BaseException as refused:  # noqa: BLE001 - the caller's exception (Ctrl-C,
            # OOM) goes on, said; an undo cut short (a second Ctrl-C in it) is said too
            if not hasattr(exc, "add_note"):
                return
            if isinstance(refused, InputError):  # the cache changed since: no undo
                how = (f"could not be undone ({refused}); its {self.new_tokens} tokens per "
                       "sequence stay reserved, some layers unwritten: free those sequences "
                       "(cache.free) before reading them again")
            elif self._aborted[0]:  # cut short once, finished by the abort itself
                how = f"was undone, though {refused!r} landed in the undo"
            elif any(u is self._undo for u in self.cache._undos):  # begun, cut short
                how = (f"was not fully undone ({refused}); the cache finishes the undo before "
                       "its next operation, or call step.abort() again to finish it now")
            else:
                how = f"was not undone ({refused}); call step.abort() again to undo it"
            exc.add_note(f"attnhub: the KV cache step of sequences {list(self.seq_ids)} {how}")
        finally:
            self.cache._settle(self)

    def _forget(self) -> None:
        """Drop this step from this thread's record of the step ``step()`` handed out last
        (``PagedKVCache.abort_unentered_steps``). Attribute reads and one store, no call: a
        Ctrl-C cannot land between the store and the caller going on."""
        local = self.cache._unfinished
        last = local.last
        if last is not None and last[1] is self:
            local.last = None

    def abort(self) -> None:
        """Undo this step's reservation: every sequence back to its length and pages before
        the step, pages taken for it back on the free list. Only while the cache has not
        changed since (another reserve, free or fork would be undone with it). Layers bound
        to a stateful backend keep what they wrote to ``cache.states``; the hybrid plugin's
        linear layers see that their state is ahead of the context on the retry and rebuild
        it from the cached keys (other stores: free the sequences of a failed step)."""
        if self._aborted[0]:
            return
        cache = self.cache
        with cache._lock:
            cache._finish_undos()  # one cut short (this step's, by a Ctrl-C) first
            if self._aborted[0]:
                return
            if self._undo is None or cache._version != self._version:
                raise InputError("CacheStep.abort: the cache changed after this step (another "
                                 "step, append, fork or free); abort a step before the next "
                                 "one")
            cache._rollback(self._undo)

    @property
    def fresh(self) -> bool:
        """True when no sequence had context before this step (a prefill from scratch)."""
        return not any(self.context_lens)

    @property
    def max_seqlen(self) -> int:
        return max(self.context_lens, default=0) + self.new_tokens

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's k/v (B, new_tokens, Hkv, D) for ``layer``."""
        if self._aborted[0]:
            raise InputError(_ABORTED)
        if self.cache._version != self._version:
            self._check_still_owned()
        want = (len(self.seq_ids), self.new_tokens)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[:2]) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(f"CacheStep.write: {name} is {got}; this step needs "
                                 f"(B={want[0]}, new_tokens={want[1]}, Hkv, D)")
        self.cache._write(layer, self.slots, k.reshape(-1, *k.shape[2:]),
                          v.reshape(-1, *v.shape[2:]), check_slots=False)

    def _check_still_owned(self) -> None:
        """The cache changed since this step: its slots must still lie in pages each sequence
        holds alone (not freed and handed on, moved by copy-on-write, or shared by a fork),
        else the write would land in what another sequence reads; nor may a sequence have
        been forked since (a fork that copied the page keeps zeros for this layer). Under the
        cache's lock, after an undo a Ctrl-C cut short is finished (this step's own, say:
        then it is aborted)."""
        cache = self.cache
        with cache._lock:
            cache._finish_undos()
            if self._aborted[0]:
                raise InputError(_ABORTED)
            for (sid, pages), context in zip(self._owned, self.context_lens):
                seq = cache._seqs.get(sid)
                holds = seq is not None and set(pages) <= set(seq.pages)
                alone = holds and all(cache._refs[p] == 1 for p in pages)
                if alone and seq.shared <= context:
                    continue
                why = ("was freed" if seq is None else "was forked since (the fork holds the "
                       "step's tokens without this layer)" if alone
                       else "shares them with a fork" if holds
                       else "moved to a copy of them (copy-on-write after a fork)")
                raise InputError(
                    f"CacheStep.write: the cache changed under this step: sequence {sid} "
                    f"{why}, and the step's slots lie in pages {list(pages)}, which another "
                    "sequence may read; write every layer of a step before freeing or forking "
                    "its sequences, and start a new step with cache.step(...)")

    def positions(self) -> torch.Tensor:
        """Absolute positions (B, new_tokens) of the new tokens, for rotary embeddings."""
        start = torch.tensor(self.context_lens, device=self.slots.device).view(-1, 1)
        return start + torch.arange(self.new_tokens, device=self.slots.device).view(1, -1)


_ABORTED = "CacheStep.write: this step was aborted; start a new one with cache.step(...)"


class _Unfinished(threading.local):
    """Per thread: the last step ``PagedKVCache.step`` handed out there, with its number,
    until a ``with`` block's exit finishes with it (or it is aborted): the one step a Ctrl-C
    can leave reserved with no name bound to it (``abort_unentered_steps``)."""

    last: tuple[int, CacheStep] | None = None
    #: how to take back what this thread's ``allocate``/``fork``/``reserve`` did, from the
    #: moment it is done until the call returned its result (``_hands_out``): plain data
    #: (``PagedKVCache._take_back``), never a closure over the cache, since it stays here
    #: after the call returned: such a cycle kept a cache its owner let go of alive, pages
    #: and all (GPU memory), until the garbage collector found it
    take_back: tuple[Any, ...] | None = None


_T = TypeVar("_T")


#: (k/v dtype, cache dtype) pairs whose every value the cache holds exactly: written cast,
#: with no check (nothing rounds, nothing overflows), so no host read either.
_EXACT_WIDENING = frozenset({(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                             (torch.float16, torch.float64), (torch.bfloat16, torch.float64),
                             (torch.float32, torch.float64)})


def _to_the_end(apply: Callable[[], Any]) -> None:
    """Run ``apply`` (idempotent: running it again finishes what a cut-short run began); if
    anything cuts it short (a Ctrl-C after one of its C calls), run it once more before the
    exception goes on. A second Ctrl-C there leaves it to whoever runs it next."""
    try:
        apply()
    except BaseException:
        apply()
        raise


def _locked(fn: Any) -> Any:
    """Run a method under the cache's lock: threads serving different sequences of one
    cache (a server's request threads) allocate, reserve and free without handing one id
    or page to two of them. An undo a Ctrl-C cut short is finished first: no operation
    sees a half-restored cache (a ``free`` then released a page a fork still held)."""
    @functools.wraps(fn)
    def run(self: PagedKVCache, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            depth = self._depth
            if self._undos and not depth:  # not inside an operation whose own is pending
                self._finish_undos()
            self._depth = depth + 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                self._depth = depth
    return run


def _hands_out(fn: Any) -> Any:
    """``_locked`` for the mutators whose result the caller needs (``allocate``/``fork``: the
    id; ``reserve``: the slots): a Ctrl-C delivered as the call releases the cache's lock
    (after that C call returns: the change made, the result not yet given back) would leave a
    live sequence (and its state slots) under an id the caller never got, or tokens reserved
    at slots it never got. The change records per thread how to take it back, with no call
    between the change and the record (``_atomically``); such a call takes it back before
    the interrupt goes on (a retry of a take-back cut short by a second Ctrl-C is the
    caller's, as for ``free``)."""
    locked = _locked(fn)

    @functools.wraps(fn)
    def run(self: PagedKVCache, *args: Any, **kwargs: Any) -> Any:
        local = self._unfinished
        local.take_back = None  # one a call before left (it returned) is never run
        try:
            return locked(self, *args, **kwargs)
        except BaseException:
            take_back, local.take_back = local.take_back, None
            if take_back is not None:
                with self._lock:
                    self._take_back(take_back)
            raise
    return run


class PagedKVCache:
    """Paged K/V storage for ``num_layers`` layers, shared by many sequences.

    Sequence ids are small integers handed out by ``allocate``/``fork`` and never reused.
    Thread-safe for threads that each serve their own sequences: the bookkeeping (ids,
    pages, lengths, tables) changes under one lock; the k/v writes of a step go to the
    slots it reserved, which no other sequence holds.
    """

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, head_dim_v: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        sizes = {"num_layers": num_layers, "num_pages": num_pages, "page_size": page_size,
                 "num_kv_heads": num_kv_heads, "head_dim": head_dim, "head_dim_v": head_dim_v}
        for name, n in sizes.items():  # a bool passes for 1; 0 for head_dim_v is no "default"
            if (n is not None or name != "head_dim_v") and (
                    isinstance(n, bool) or not isinstance(n, int) or n <= 0):
                raise InputError(f"PagedKVCache: {name}={n!r}; num_layers, num_pages, "
                                 "page_size, num_kv_heads and head_dim (and head_dim_v if "
                                 "given) must be positive ints")
        if not isinstance(dtype, torch.dtype) or not (
                is_fp8(dtype) or (dtype.is_floating_point and dtype.itemsize > 1)):
            raise InputError(f"PagedKVCache: dtype={dtype!r}; the cache stores float16, "
                             "bfloat16 or float32 (float64) values, or FP8 "
                             f"{', '.join(map(str, FP8_MAX))} with page descales")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        #: canonical (``"cuda"`` -> ``cuda:<current>``): tensors report their index
        self.device = canonical_device(device)
        dv = head_dim_v or head_dim
        # zeros, not empty: kernels may read a whole page past a sequence's end (masked), and
        # uninitialised memory could hold NaN, which survives a multiplication by zero.
        # Ordinary tensors even when built under torch.inference_mode: an inference tensor
        # refuses in-place writes outside that mode, half-way through an append.
        with torch.inference_mode(False):
            self._k = torch.zeros(num_layers, num_pages, page_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=self.device)
            self._v = torch.zeros(num_layers, num_pages, page_size, num_kv_heads, dv,
                                  dtype=dtype, device=self.device)
            #: FP8 (e4m3) cache: per (layer, page, KV head) descales (``core.kvquant``).
            self.scales = (PageScales(num_layers, num_pages, num_kv_heads, dtype, self.device)
                           if is_fp8(dtype) else None)
        self._lock = threading.RLock()
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives page 0 first
        #: pages ever handed out: only those can hold stale data (the rest are still zeros)
        self._dirty = bytearray(num_pages)
        self._refs: list[int] = [0] * num_pages
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        #: bumped by every change of the sequences (a step may abort only while unchanged)
        self._version = 0
        #: Per-sequence state of layers bound to stateful backends (``attach_state``).
        self.states = SequenceStates()
        #: block tables handed out, the pages and the sequences they name: revoked when one
        #: of those pages is freed, or one of those sequences moves off it (copy-on-write)
        self._tables: list[tuple[weakref.ref, frozenset[int], frozenset[int]]] = []
        #: tables revoked by copy-on-write, numbered in order (dead ones dropped as tables
        #: are built): a rolled-back step takes back those after its undo point's number
        self._moved: dict[int, tuple[weakref.ref, frozenset[int], frozenset[int]]] = {}
        self._moves = 0
        #: records of the mutations under way (``_atomically``): undo points and roll-forward
        #: records; one a Ctrl-C left unfinished is finished before the next operation
        #: (``_locked``)
        self._undos: list[Any] = []
        #: how deep this thread is in the cache's locked operations (pending undos are
        #: finished at the outermost entry only: an inner call must not undo its caller)
        self._depth = 0
        #: steps handed out so far (``steps_taken``), and per thread the last one that no
        #: ``with`` block finished yet (``abort_unentered_steps``)
        self._steps = 0
        self._unfinished = _Unfinished()

    # -- storage ----------------------------------------------------------------------------
    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys, (num_pages, page_size, Hkv, D): the paged layout's k."""
        layer = self._check_layer(layer)
        return self._k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        layer = self._check_layer(layer)
        return self._v[layer]

    @property
    def dtype(self) -> torch.dtype:
        return self._k.dtype

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    @_locked
    def length(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    @_locked
    def pages(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._seq(seq_id).pages)

    def refcount(self, page: int) -> int:
        index = _int(page)
        if index is None or not 0 <= index < self.num_pages:
            raise InputError(f"refcount: page={page!r}; pass a page index in "
                             f"0..{self.num_pages - 1}")
        return self._refs[index]

    # -- sequences --------------------------------------------------------------------------
    @_locked
    def attach_state(self, layers: Iterable[int], store: SequenceStore) -> None:
        """Keep ``store`` (the per-sequence state of ``layers``, see ``core.seqstate``) beside
        the pages: allocate, fork and free then do the same to it. Only on an empty cache,
        since sequences already live would have no state."""
        if self._seqs:
            raise InputError(f"attach_state: the cache already holds sequences "
                             f"{sorted(self._seqs)}; attach state stores before allocating")
        self.states.attach(layers, store)

    # every mutator is all or nothing under a Ctrl-C too (which lands at a call's entry or
    # return, or a loop's back edge): everything is planned first, then the change runs as
    # one record (``_atomically``), rolled back or finished if anything cuts it short; one
    # delivered as the lock is released takes back an id or slots never returned
    # (``_hands_out``)
    @_hands_out
    def allocate(self) -> int:
        """A new, empty sequence; pages are taken only when tokens are appended."""
        return self._add(_Seq([], 0), lambda sid: self.states.allocate(sid))

    @_hands_out
    def fork(self, seq_id: int) -> int:
        """A new sequence sharing ``seq_id``'s tokens (no copy; pages are reference-counted)
        and starting from a copy of its state (never shared). Write every layer of a step (or
        ``reserve``) before forking its sequence: a later write of those tokens is refused."""
        src = self._seq(seq_id)
        refs = list(self._refs)
        for p in src.pages:
            refs[p] += 1
        return self._add(_Seq(list(src.pages), src.length, src.length, {seq_id: src.length}),
                         lambda sid: self.states.fork(seq_id, sid), refs, src)

    def _add(self, seq: _Seq, states: Any, refs: list[int] | None = None,
             src: _Seq | None = None) -> int:
        """Register ``seq`` under a new id once ``states(id)`` gave it its state, forked from
        ``src``. The id is taken first: one a cut-short call touched is skipped, never handed
        out twice. Anything raised from the stores' call on (a Ctrl-C as it returns, out of
        memory) frees what they hold for the id (``SequenceStates.free`` frees exactly that),
        and the sequence once registered (``_hands_out``)."""
        sid = self._next_id
        self._next_id = sid + 1
        version, local, give_back = self._version + 1, self._unfinished, ("free", sid)

        def register() -> None:  # plain stores: run again, it finishes a cut-short run
            self._seqs[sid] = seq
            if src is not None:
                self._refs, src.shared = refs, src.length
                src.links[sid] = src.length
            self._version, local.take_back = version, give_back

        try:
            states(sid)
            self._atomically(register)
        except BaseException:
            if sid not in self._seqs:
                self.states.free(sid)
            raise
        return sid

    def _atomically(self, apply: Callable[[], _T], undo: tuple[Any, ...] | None = None) -> _T:
        """Run one mutation all or nothing, even if a Ctrl-C (or any exception) cuts it short
        anywhere: ``apply`` changes the cache, pending in ``_undos`` until it returns. With
        ``undo`` (an ``_undo_point`` taken before), a cut-short ``apply`` is rolled back to it
        (a change that writes values or may run out of memory); without, ``apply`` itself is
        the record, idempotent, and a cut-short run is finished by running it again (a change
        that cannot be undone: a store's free). Either way before the exception goes on, or,
        cut short again by a second Ctrl-C, before the cache's next operation (``_locked``).
        An ``Exception`` from a roll-forward ``apply`` itself (a store refusing its free) is
        its caller's: nothing after it ran, and the call can be retried."""
        record: Any = apply if undo is None else undo
        try:
            self._undos.append(record)
            out = apply()
            self._undos.pop()
            return out
        except Exception:
            if undo is None and self._undos and self._undos[-1] is record:
                self._undos.pop()  # refused by its own work: the caller retries, or not
                raise
            _to_the_end(self._finish_undos)
            raise
        except BaseException:
            _to_the_end(self._finish_undos)
            raise

    @_locked
    def free(self, seq_id: int) -> None:
        """Release a finished sequence; pages no other sequence holds return to the free list.
        All or nothing: planned first, then finished even if a Ctrl-C cuts it short (its
        state stores' frees cannot be undone); a store refusing its free leaves the sequence
        live, and a retry finishes it."""
        seq_id = self._check_id(seq_id)
        seq = self._seqs[seq_id]
        refs = list(self._refs)
        for p in seq.pages:
            refs[p] -= 1
        released = [p for p in reversed(seq.pages) if not refs[p]]
        free, version = self._free + released, self._version + 1
        relatives = []  # its relatives stay linked through it, by the tokens both held of it;
        for rid, held in seq.links.items():  # each one's ``shared`` is what its live
            rel = self._seqs.get(rid)  # relatives still hold
            if rel is not None:
                links = {**rel.links, **{o: max(rel.links.get(o, 0), min(held, n))
                                         for o, n in seq.links.items() if o != rid}}
                links.pop(seq_id, None)
                shared = max((n for o, n in links.items() if o in self._seqs),
                             default=0)
                relatives.append((rel, links, shared))

        def release() -> None:  # idempotent: run again, it finishes a cut-short run
            # the stores first: one that refuses its free leaves the sequence live with its
            # tables valid (revoked, they could not be given back). The tables naming the
            # pages are revoked before any page is released: an interrupt between the two
            # left a freed page readable through them
            self.states.free(seq_id)  # frees only the stores still holding it
            self._revoke_tables(released, f"sequence {seq_id} was freed")
            self._seqs.pop(seq_id, None)
            self._refs, self._free, self._version = refs, free, version
            for rel, links, shared in relatives:
                rel.links, rel.shared = links, shared

        self._atomically(release)

    def _revoke_tables(self, pages: Iterable[int], why: str, seq_id: int | None = None
                       ) -> list[tuple[weakref.ref, frozenset[int], frozenset[int]]]:
        """Revoke the block tables handed out that name any of ``pages`` (back on the free
        list): a call that passes one would read whatever the page's next owner writes.
        With ``seq_id``, only those built for that sequence too. Returns the revoked."""
        gone = set(pages)
        if not gone:
            return []
        live, revoked = [], []
        for entry in self._tables:
            t = entry[0]()
            if t is None:
                continue
            if entry[1] & gone and (seq_id is None or seq_id in entry[2]):
                PAGED.revoke(t, why)
                revoked.append(entry)
            else:
                live.append(entry)
        self._tables = live
        return revoked

    # -- appending --------------------------------------------------------------------------
    @_hands_out
    def reserve(self, seq_ids: Sequence[int], num_tokens: int | Sequence[int]) -> torch.Tensor:
        """Make room for ``num_tokens`` more tokens in each sequence; returns their slots.

        All or nothing: the pages needed (new pages plus copies of shared, partially filled
        last pages) are counted first, and ``CacheFullError`` is raised before any change;
        anything raised after that (Ctrl-C in a copy, out of memory, or as the lock is
        released, the slots never returned) puts the sequences, the free list and the
        refcounts back before it propagates.
        Slots are flat indices into ``(num_pages * page_size)``, sequence-major.
        """
        seq_ids = self._check_ids("reserve", seq_ids)
        if _int(num_tokens) is not None:
            counts = [num_tokens] * len(seq_ids)
        elif isinstance(num_tokens, Sequence) and not isinstance(num_tokens, (str, bytes)):
            counts = list(num_tokens)
        else:
            raise InputError(f"reserve: num_tokens={num_tokens!r}; pass an int or one int per "
                             "sequence")
        if any(_int(n) is None for n in counts):
            raise InputError(f"reserve: token counts must be ints, got {counts}")
        counts = [operator.index(n) for n in counts]
        if len(counts) != len(seq_ids):
            raise InputError(f"reserve: {len(seq_ids)} sequences but {len(counts)} token counts")
        seq_ids = [self._check_id(s) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise InputError(f"reserve: sequence ids repeat in {list(seq_ids)}; each sequence "
                             "appends once per call")
        if any(n < 0 for n in counts):
            raise InputError(f"reserve: negative token count in {counts}")
        seqs = [self._seq(s) for s in seq_ids]
        copies, new_pages = self._plan(seqs, counts)
        need = len(copies) + sum(new_pages)
        if need > len(self._free):
            raise CacheFullError(
                f"paged KV cache is full: appending {sum(counts)} tokens to sequences "
                f"{list(seq_ids)} needs {need} free pages, {len(self._free)} of "
                f"{self.num_pages} are free (page_size {self.page_size}); free finished "
                "sequences or build the cache with more num_pages. No sequence was changed.")
        undo = ([(seq, list(seq.pages), seq.length) for seq in seqs], list(self._free),
                list(self._refs), [], self._moves, [False])
        local = self._unfinished

        def take() -> torch.Tensor:
            for i in copies:
                self._copy_on_write(seq_ids[i], seqs[i])
            fresh = []
            for seq, n in zip(seqs, new_pages):
                for _ in range(n):
                    p = self._free.pop()
                    self._refs[p] = 1
                    if self.scales is not None:
                        self.scales.reset_page(p)
                    seq.pages.append(p)
                    fresh.append(p)
            self._clear(fresh)
            slots = self._slots(seqs, counts)
            version = self._version + 1
            self._version, local.take_back = version, ("rollback", undo, version)
            return slots

        return self._atomically(take, undo)

    def _take_back(self, record: tuple[Any, ...]) -> None:
        """Take back what a call whose result never reached its caller did (``_hands_out``):
        ``("free", id)`` frees the sequence of an ``allocate``/``fork``; ``("rollback", undo,
        version)`` undoes a reservation, unless the cache changed since (another thread's
        call took the lock in between): the tokens then stay reserved, the cache as right
        after the call."""
        if record[0] == "free":
            if record[1] in self._seqs:
                self.free(record[1])
        elif self._version == record[2]:
            self._rollback(record[1])

    def _clear(self, pages: list[int]) -> None:
        """Zero pages taken from the free list: they may hold a freed sequence's keys, which
        a slot reserved but never written (a step whose layer write failed) or a kernel
        reading a page past a sequence's end (masked; NaN survives that) would hand to the
        new owner. Bit pattern 0 is +0.0 in every float format (FP8 included)."""
        stale = [p for p in pages if self._dirty[p]]
        for p in pages:
            self._dirty[p] = 1
        if not stale:  # a page's first use: zeros since the cache was built
            return
        idx = torch.tensor(stale, dtype=torch.int64, device=self.device)
        for t in (self._k, self._v):
            (t.view(torch.uint8) if t.element_size() == 1 else t).index_fill_(1, idx, 0)

    def _plan(self, seqs: list[_Seq], counts: list[int]) -> tuple[list[int], list[int]]:
        """Which sequences copy their shared last page, and how many new pages each needs."""
        pending = {}  # page -> references dropped by earlier copies in this same call
        copies, new_pages = [], []
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            if n and seq.length % self.page_size:
                last = seq.pages[-1]
                if self._refs[last] - pending.get(last, 0) > 1:
                    copies.append(i)
                    pending[last] = pending.get(last, 0) + 1
            total = -(-(seq.length + n) // self.page_size)
            new_pages.append(total - len(seq.pages))
        return copies, new_pages

    def _copy_on_write(self, seq_id: int, seq: _Seq) -> None:
        """Move ``seq`` off the last page it shares with a fork, before writing into it. The
        tables built for ``seq`` still name the old page, which the fork goes on writing:
        they are revoked (the fork's own tables stay valid)."""
        old = seq.pages[-1]
        new = self._free.pop()
        self._dirty[new] = 1  # the copy fills it; stale once freed
        self._k[:, new] = self._k[:, old]
        self._v[:, new] = self._v[:, old]
        if self.scales is not None:
            self.scales.copy_page(old, new)
        self._refs[old] -= 1
        self._refs[new] = 1
        seq.pages[-1] = new
        for entry in self._revoke_tables(
                [old], f"sequence {seq_id} moved off page {old}, which a fork shares and "
                "writes, on copy-on-write", seq_id):
            self._moves += 1
            self._moved[self._moves] = entry

    def _slots(self, seqs: list[_Seq], counts: list[int]) -> torch.Tensor:
        out = []
        for seq, n in zip(seqs, counts):
            # host arithmetic (device="cpu": not torch's default device), one copy at the end
            pos = torch.arange(seq.length, seq.length + n, device="cpu")
            pages = torch.tensor(seq.pages, dtype=torch.int64, device="cpu")
            out.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
            seq.length += n
        slots = torch.cat(out) if out else torch.empty(0, dtype=torch.int64, device="cpu")
        return slots.to(self.device)

    @_locked
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v (N, Hkv, D) at ``slots`` (N,) returned by ``reserve`` for ``layer``.

        All checks come first (a rejected write changes nothing); slots are range-checked
        (a host read of ``slots``) against the live sequences, under the cache's lock (another
        thread allocating or freeing its own sequences changes them)."""
        self._write(layer, slots, k, v, check_slots=True)

    def _write(self, layer: int, slots: Any, k: Any, v: Any, *, check_slots: bool) -> None:
        layer = self._check_layer(layer)
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype != torch.int64:
            raise InputError(f"write: slots must be the (N,) int64 tensor reserve() returned, "
                             f"got {_describe(slots)}")
        if slots.device != self.device:
            raise InputError(f"write: slots are on {slots.device}, the cache on {self.device}")
        n = self._check_kv("write", k, v, slots.numel())
        if check_slots and n:
            self._check_slots(slots)
        # values, never autograd history: a k/v that requires grad would otherwise make the
        # whole cache part of its graph, kept alive (and growing) step after step. k and v
        # land together: a Ctrl-C between the two copies finishes the second (both
        # idempotent; an FP8 page's descale, once grown, stays), never one without the other
        with torch.no_grad():
            if self.scales is not None:  # FP8: quantized per page, descales grown as needed
                scales = self.scales
                _to_the_end(lambda: scales.write(self._k[layer], self._v[layer], layer, slots,
                                                 k, v))
                return
            kf = self._k[layer].view(-1, *self._k.shape[3:])
            vf = self._v[layer].view(-1, *self._v.shape[3:])
            k, v = k.to(self.dtype), v.to(self.dtype)  # as is, or widened exactly
            _to_the_end(lambda: (kf.index_copy_(0, slots, k), vf.index_copy_(0, slots, v)))

    def _check_slots(self, slots: torch.Tensor) -> None:
        """Every slot is a token a live sequence reserved, in a page no other sequence holds,
        and not forked since: a slot past the cache, in a free page, past its sequence's
        length (kept from before a ``free``) or in a page a later ``fork`` shares would
        overwrite what another sequence reads, and a fork that copied the page since keeps
        zeros for it. One host read of ``slots``."""
        host = slots.cpu()
        last = self.num_pages * self.page_size - 1
        if int(host.min()) < 0 or int(host.max()) > last:
            raise InputError(f"write: a slot is outside 0..{last}; pass the slots reserve() "
                             "returned")
        if host.unique().numel() != host.numel():  # which copy lands there is undefined
            raise InputError("write: a slot repeats in slots; each token is written once per "
                             "call (pass the slots reserve() returned, once)")
        size = self.page_size
        filled = [0] * self.num_pages  # reserved tokens per page
        forked = [0] * self.num_pages  # of those, tokens a fork holds too
        for seq in self._seqs.values():
            for i, p in enumerate(seq.pages):
                filled[p] = min(size, seq.length - i * size)
                forked[p] = min(size, max(0, seq.shared - i * size))
        # host tensors beside ``host`` (device="cpu", whatever torch's default device)
        refs = torch.tensor(self._refs, dtype=torch.int64, device="cpu")
        filled_t, forked_t = (torch.tensor(x, dtype=torch.int64, device="cpu")
                              for x in (filled, forked))
        page, offset = host // size, host % size
        refused = (
            (offset >= filled_t[page], lambda bad: (
                f"slot {bad} (page {bad // size}) is no token a live sequence reserved: a free "
                "page or past its sequence's end (slots kept from before a free?); write the "
                "slots reserve() returned before freeing their sequence")),
            (refs[page] > 1, lambda bad: (
                f"slot {bad} lies in page {bad // size}, which {int(refs[bad // size])} "
                "sequences share (forked after reserve): writing it would change the fork "
                "too; write before forking")),
            (offset < forked_t[page], lambda bad: (
                f"slot {bad} (page {bad // size}) was reserved before its sequence was "
                "forked: the fork holds that token, and keeps zeros for this layer (it "
                "copied the page since); write every layer of reserved slots before forking")))
        for hit, why in refused:
            if bool(hit.any()):
                raise InputError(f"write: {why(int(host[hit][0]))}")

    @_locked
    def append(self, seq_id: int, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> None:
        """Append tokens to one sequence for every layer: ks[l]/vs[l] are (n, Hkv, D).

        Atomic: every layer's k and v is checked (type, shape, dtype, device, one token count
        for all) before a page is reserved, so a rejected append leaves the cache as it was; a
        write failing after the reservation (out of memory, say) undoes it."""
        seq_id = self._check_id(seq_id)
        if (not isinstance(ks, Sequence) or not isinstance(vs, Sequence)
                or len(ks) != self.num_layers or len(vs) != self.num_layers):
            raise InputError(f"append: expected lists of k and v for {self.num_layers} layers, "
                             f"got {_describe(ks)} and {_describe(vs)}")
        n = self._check_kv("append layer 0", ks[0], vs[0], None)
        for layer in range(1, self.num_layers):
            self._check_kv(f"append layer {layer}", ks[layer], vs[layer], n)

        def put() -> None:  # a write the checks could not foresee (out of memory, ...) or a
            slots = self.reserve([seq_id], n)  # Ctrl-C rolls it all back
            for layer, (k, v) in enumerate(zip(ks, vs)):
                self._write(layer, slots, k, v, check_slots=False)

        self._atomically(put, self._undo_point([seq_id]))

    def _undo_point(self, seq_ids: Sequence[int]) -> tuple[Any, ...]:
        """What ``_rollback`` needs to put the cache back as it is now, before tokens are
        appended to ``seq_ids``: their pages and lengths, the free list and refcounts, and each
        partly filled last page: FP8, a copy with its descales (a write may requantize that
        page in place); otherwise the first slot past the sequence's end, zeroed again on
        rollback (a kernel may read a page past a sequence's end, masked; NaN survives
        that). New pages go back to the free list, marked stale, and are zeroed when taken
        again; a page's descales are reset when it is taken."""
        seqs = [(self._seqs[s], list(self._seqs[s].pages), self._seqs[s].length)
                for s in dict.fromkeys(seq_ids)]
        tails = []
        for seq, pages, length in seqs:
            if length % self.page_size:
                p = pages[-1]
                if self.scales is not None:
                    tails.append((p, length % self.page_size, self._k[:, p].clone(),
                                  self._v[:, p].clone(), self.scales.k[:, p].clone(),
                                  self.scales.v[:, p].clone()))
                else:
                    tails.append((p, length % self.page_size))
        return seqs, list(self._free), list(self._refs), tails, self._moves, [False]

    def _rollback(self, undo: tuple[Any, ...]) -> None:
        """Put the cache back as it was at ``undo``. Pending first: an operation records its
        undo before it changes anything (``reserve``, ``append``, ``step``) and drops it as
        it returns, so a Ctrl-C anywhere between, even as this rollback starts, or one that
        cuts the undo short (a shared page counted once, say), leaves it to be finished
        before the cache's next operation (``_locked``) or by ``step.abort()``, never
        half-done under a ``free``."""
        def finish() -> None:  # registered inside: a Ctrl-C as it is, undone now, not later
            if not self._undos or self._undos[-1] is not undo:
                self._undos.append(undo)
            self._finish_undos()

        with self._lock:
            _to_the_end(finish)

    def _finish_undos(self) -> None:
        """Finish the pending records, innermost (last begun) first, as nested operations
        unwind: undo points are rolled back, a roll-forward record (``_atomically``) is run
        again; each can be run again, and once done does nothing."""
        while self._undos:
            record = self._undos[-1]
            if not callable(record):
                self._undo(record)
            else:
                try:
                    record()
                except Exception:  # refused by its own work (a store's free): its call's
                    self._undos.pop()  # to retry, never the cache's to fail on for good
                    raise
            self._undos.pop()

    def _undo(self, undo: tuple[Any, ...]) -> None:
        """Restore one undo point; safe to run again after a Ctrl-C, a no-op once done."""
        seqs, free, refs, tails, moved, done = undo
        if done[0]:
            return
        if (self._free == free and self._refs == refs and self._moves == moved
                and all(seq.pages == pages and seq.length == length
                        for seq, pages, length in seqs)):
            done[0] = True  # refused before any change (full): the cache's version stands,
            return  # so an earlier step can still be aborted
        self._version += 1  # first: a step's write sees the change and finds itself aborted
        # the tables naming the pages the step took are revoked before those pages go back
        # on the free list (as in ``free``: an interrupt between the two left a table a
        # retried abort no longer saw, reading the page's next owner)
        back = [n for n in self._moved if n > moved]
        released = set(free) - set(self._free)
        self._revoke_tables(released, "the step that took them was aborted")
        for seq, pages, length in seqs:
            seq.pages[:], seq.length = pages, length
        self._free[:], self._refs[:] = free, refs
        for n in back:  # the step's copies-on-write are undone: its sequences are back on
            entry = self._moved.pop(n)  # the pages those tables name
            t = entry[0]()
            if t is not None:
                PAGED.unrevoke(t)
                self._tables.append(entry)
        with torch.no_grad():
            for tail in tails:
                p, off = tail[:2]
                if len(tail) > 2 and self.scales is not None:
                    self._k[:, p], self._v[:, p] = tail[2], tail[3]
                    self.scales.k[:, p], self.scales.v[:, p] = tail[4], tail[5]
                else:
                    self._k[:, p, off:] = 0
                    self._v[:, p, off:] = 0
        done[0] = True

    def _check_kv(self, where: str, k: Any, v: Any, n: int | None) -> int:
        """k (n, Hkv, D) and v (n, Hkv, Dv) fit this cache; returns n. The cache's own dtype,
        or one it widens exactly (fp16/bf16 into fp32, any into fp64: prefill under autocast
        into an fp32 cache); a narrowing one is refused, never cast; an FP8 cache takes
        finite fp16/bf16/fp32 values."""
        dv = self._v.shape[-1]
        for name, t, d in (("k", k, self.head_dim), ("v", v, dv)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{where}: {name} must be a tensor (n, Hkv, D), got "
                                 f"{type(t).__name__}")
            if not t.is_floating_point() or (self.scales is not None and is_fp8(t.dtype)):
                raise InputError(f"{where}: {name} is {t.dtype}; the cache takes fp16/bf16/fp32 "
                                 f"k/v (cast explicitly, e.g. {name}.float()); integers are "
                                 "refused, not cast, and an FP8 cache quantizes by itself")
            if self.scales is None and t.dtype != self.dtype \
                    and (t.dtype, self.dtype) not in _EXACT_WIDENING:
                # never cast here: refusing the values a narrower dtype rounds to inf would
                # cost a host read (a device sync) per write; the hub refuses reading this
                # cache with queries of another dtype anyway
                raise InputError(f"{where}: {name} is {t.dtype}, the cache stores "
                                 f"{self.dtype}; pass {name}.to(cache.dtype) (values past "
                                 f"{self.dtype}'s range become inf) or build the cache with "
                                 f"dtype={t.dtype}")
            if t.device != self.device:
                raise InputError(f"{where}: {name} is on {t.device}, the cache on "
                                 f"{self.device}; move it ({name}.to(cache.device))")
            if t.dim() != 3 or t.shape[1] != self.num_kv_heads or t.shape[2] != d:
                raise InputError(f"{where}: {name} is {tuple(t.shape)}; the cache takes "
                                 f"(n, Hkv={self.num_kv_heads}, {'Dv' if name == 'v' else 'D'}"
                                 f"={d})")
            if n is None:
                n = t.shape[0]
            elif t.shape[0] != n:
                raise InputError(f"{where}: {name} has {t.shape[0]} tokens, expected {n} "
                                 "(k and v of every layer carry the same tokens)")
        if self.scales is not None and n and not bool(
                torch.isfinite(_as_f32(k)).all() & torch.isfinite(_as_f32(v)).all()):
            # in float32, where the descales are computed: a float64 1e300 is finite there
            raise InputError(f"{where}: k/v hold NaN, inf or values beyond the float32 range, "
                             "which an FP8 cache cannot store with a finite page descale")
        return n

    def _check_layer(self, layer: Any) -> int:
        index = _int(layer)
        if index is None or not 0 <= index < self.num_layers:
            raise InputError(f"layer={layer!r}; pass an index in 0..{self.num_layers - 1} "
                             "(negative indices are refused, not counted from the end)")
        return index

    @_locked
    def step(self, seq_ids: Sequence[int], new_tokens: int) -> CacheStep:
        """Reserve ``new_tokens`` per sequence and build the tables every layer of a step uses."""
        seq_ids = self._check_ids("step", seq_ids)
        count = _int(new_tokens)
        if count is None or count < 0:
            raise InputError(f"step: new_tokens={new_tokens!r}; pass one int >= 0, the tokens "
                             "each sequence appends in this step (per-sequence counts: "
                             "reserve)")
        new_tokens = count
        context = tuple(self._seqs[s].length for s in seq_ids)
        undo = self._undo_point(seq_ids)

        def take() -> CacheStep:
            slots = self.reserve(seq_ids, new_tokens)
            owned = tuple((s, tuple(self._seqs[s].pages[c // self.page_size:]))
                          for s, c in zip(seq_ids, context) if new_tokens)
            step = CacheStep(self, tuple(seq_ids), new_tokens, slots, self.block_table(seq_ids),
                             self.seqlens(seq_ids), context, undo, self._version,
                             _aborted=undo[-1], _owned=owned)
            # recorded before the undo is dropped: from here until a ``with`` block's exit
            # is done with it, a Ctrl-C that leaves ``step`` unbound leaves it findable
            self._steps, self._unfinished.last = self._steps + 1, (self._steps + 1, step)
            return step

        return self._atomically(take, undo)

    @property
    def steps_taken(self) -> int:
        """How many steps ``step()`` has handed out: read it before a step and pass it to
        ``abort_unentered_steps(since=...)``, so that only that step can be undone."""
        return self._steps

    def abort_unentered_steps(self, since: int = 0,
                              exc: BaseException | None = None) -> bool:
        """Abort the step this thread last took from ``step()`` (numbered past ``since``)
        if no ``with`` block finished it; True if one was pending.

        Python delivers a Ctrl-C as a call returns or a function is entered, so one can land
        after ``step()`` reserved its tokens but before ``with cache.step(...) as step:``
        entered the block (the name ``step`` is never bound, and no ``__exit__`` runs), or as
        that block's exit starts: the step stays reserved (its layers unwritten, or its
        caller's result lost with the exception). Call this on the except path of such a
        block (``Decoder.prefill``/``decode`` do), with ``since`` read from ``steps_taken``
        before the step: an older step of this thread, taken without ``with`` and still in
        use, is then never touched. With ``exc`` (the exception being handled) a refused
        abort (the cache changed since) is a note on ``exc``, as leaving the ``with`` block
        would have said, not an error of its own."""
        last = self._unfinished.last
        if last is None or last[0] <= since:
            return False
        step = last[1]
        pending = not step._aborted[0]
        try:
            if exc is None:
                step.abort()
            else:
                step.__exit__(type(exc), exc, exc.__traceback__)
        finally:
            self._settle(step)
        return pending

    def _settle(self, step: CacheStep) -> None:
        """Forget ``step`` as this thread's unfinished one once nothing is left to abort:
        aborted, or refused for good (the cache changed since; an undo a second Ctrl-C cut
        short changed it too, and the cache finishes that undo by itself)."""
        if step._aborted[0] or step._undo is None or self._version != step._version:
            step._forget()

    # -- reading ----------------------------------------------------------------------------
    @_locked
    def block_table(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """(B, P) int32 page indices, P the most pages any of them holds; padded with -1
        (no page: a length that grew past a row's pages without a new table is refused,
        never read from page 0, which another sequence owns)."""
        ids = self._check_ids("block_table", seq_ids)
        seqs = [self._seq(s) for s in ids]
        width = max((len(s.pages) for s in seqs), default=0) or 1
        rows = [s.pages + [PAD_PAGE] * (width - len(s.pages)) for s in seqs]
        host = torch.tensor(rows, dtype=torch.int32, device="cpu").view(len(seqs), width)
        # every entry a sequence uses is a page id of this cache, row i holds len(pages) pages
        t = self._vouched(host, (self.num_pages, tuple(len(s.pages) for s in seqs)))
        self._tables = [e for e in self._tables if e[0]() is not None]
        self._moved = {n: e for n, e in self._moved.items() if e[0]() is not None}
        self._tables.append((weakref.ref(t), frozenset(p for s in seqs for p in s.pages),
                             frozenset(ids)))
        return t

    @_locked
    def seqlens(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """(B,) int32 token counts."""
        lens = [self._seqs[s].length for s in self._check_ids("seqlens", seq_ids)]
        return self._vouched(torch.tensor(lens, dtype=torch.int32, device="cpu"),
                             (max(lens, default=0), tuple(lens)))

    def _vouched(self, host: torch.Tensor, fact: tuple[int, tuple[int, ...]]) -> torch.Tensor:
        """``host`` on the cache's device, with a proof for the hub's paged check (see
        ``PagedTables.vouch``): the tables a step hands every layer are checked from these
        host values, so the hub reads nothing back (no host sync on an accelerator). The
        snapshot backends read is one device copy (asynchronous on an accelerator)."""
        with torch.inference_mode(False):  # a version counter for the proof, even when the
            t = host.to(self.device, copy=True)  # step runs under torch.inference_mode
            PAGED.vouch(t, t.clone(), fact)
        return t

    @_locked
    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A contiguous copy of one sequence's k/v for ``layer``: (length, Hkv, D) each
        (an FP8 cache gives the dequantized values, fp32)."""
        layer = self._check_layer(layer)
        seq = self._seq(seq_id)
        idx = torch.tensor(seq.pages, dtype=torch.int64, device=self.device)
        k, v = self._k[layer].index_select(0, idx), self._v[layer].index_select(0, idx)
        if self.scales is not None:
            k, v = self.scales.dequantize(layer, idx, k, v)
        return k.flatten(0, 1)[: seq.length], v.flatten(0, 1)[: seq.length]

    @_locked
    def gather(self, layer: int, seq_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v of equal-length sequences as contiguous (B, S, Hkv, D), for backends that do
        not read block tables."""
        seq_ids = self._check_ids("gather", seq_ids)
        if not seq_ids:
            raise InputError("gather: no sequence ids; pass the ids of the sequences to read")
        lens = {self.length(s) for s in seq_ids}
        if len(lens) > 1:
            raise InputError(f"gather: sequences {list(seq_ids)} have different lengths "
                             f"{sorted(lens)}; use a paged or varlen (thd) backend")
        pairs = [self.read(layer, s) for s in seq_ids]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    # -- invariants -------------------------------------------------------------------------
    @_locked
    def check_invariants(self) -> None:
        """Raise AssertionError unless page ownership is consistent (tests call this).

        Each page's reference count equals the number of sequences holding it, no sequence
        holds a page twice, free pages are held by nobody, and every page is either free or
        held.
        """
        held: dict[int, int] = {}
        for sid, seq in self._seqs.items():
            assert len(set(seq.pages)) == len(seq.pages), f"sequence {sid} holds a page twice"
            assert len(seq.pages) == -(-seq.length // self.page_size), (
                f"sequence {sid}: {len(seq.pages)} pages for {seq.length} tokens")
            for p in seq.pages:
                held[p] = held.get(p, 0) + 1
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & set(held), f"pages both free and held: {sorted(free & set(held))}"
        assert free | set(held) == set(range(self.num_pages)), "a page is lost"
        for p in range(self.num_pages):
            assert self._refs[p] == held.get(p, 0), (
                f"page {p}: refcount {self._refs[p]} but held by {held.get(p, 0)} sequences")

    # -- helpers ----------------------------------------------------------------------------
    def _check_id(self, seq_id: Any) -> int:
        # a bool or float would pass for the int it hashes like (True is sequence 1)
        if isinstance(seq_id, bool) or not hasattr(type(seq_id), "__index__"):
            raise InputError(f"sequence id {seq_id!r} ({type(seq_id).__name__}); pass the int "
                             "allocate() or fork() returned")
        sid = operator.index(seq_id)
        if sid not in self._seqs:
            raise InputError(f"unknown sequence id {sid} (live: {sorted(self._seqs)}); "
                             "it was never allocated or was already freed")
        return sid

    def _check_ids(self, where: str, seq_ids: Any) -> list[int]:
        """``seq_ids`` as a list of live ids (ints); a tensor, a string or None is refused."""
        if isinstance(seq_ids, (str, bytes, torch.Tensor)) or not isinstance(seq_ids, Sequence):
            raise InputError(f"{where}: seq_ids={seq_ids!r}; pass a list of the ints "
                             "allocate() or fork() returned (a tensor: .tolist())")
        return [self._check_id(s) for s in seq_ids]

    def _seq(self, seq_id: int) -> _Seq:
        return self._seqs[self._check_id(seq_id)]

    @classmethod
    def for_sequences(cls, *, num_layers: int, batch: int, max_len: int, page_size: int,
                      num_kv_heads: int, head_dim: int, spare: int = 0,
                      dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> PagedKVCache:
        """A cache with just enough pages for ``batch`` sequences of ``max_len`` tokens, plus
        ``spare`` pages (forks append into copies of shared pages)."""
        pages = batch * -(-max_len // page_size) + spare
        return cls(num_layers=num_layers, num_pages=pages, page_size=page_size,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device)


def _as_f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` where float32 computes its descale: float64 cast (1e300 is finite there, not in
    float32), narrower floats as they are (no copy)."""
    return t.float() if t.dtype == torch.float64 else t


def _int(value: Any) -> int | None:
    """``value`` as an int where it is one (a Python, numpy or torch integer, as sequence ids
    are taken), else None: a bool or float is never an int here (True passed for 1, a count
    2.0 was refused where ``numpy.int64(2)`` was not taken either)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__") or (
            isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.dim())):
        return None
    return operator.index(value)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {x.dtype}"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__} of {len(x)}"
    return type(x).__name__


def free_all(cache: PagedKVCache, seq_ids: Iterable[int]) -> None:
    """Free several sequences (a finished batch)."""
    for s in seq_ids:
        cache.free(s)
