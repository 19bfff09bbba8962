"""Host-side page allocator for OscarKVCache: admit, extend, finish, with scoped prefix sharing.

Two pools: BF16 pages (sink and recent tiers) and INT2 pages (history). Page 0 of each pool is a
reserved scratch page, never handed out: padded page-table entries point at it and masked
writes land in it, so no live page is ever touched by padding.

Prefix sharing. A full sink page and an INT2 history page depend only on the tokens up to their
last position (rotations are fixed), so they are registered under a key of
`(namespace, tokens[:page_end])`: a chain of SHA-256 digests, one link per page (the key of page k
hashes the key of page k − 1 with the page's own tokens), so each page's key is computed once, from
its own tokens, however long the prompt (hashing every prefix anew cost O(length²) per chunk). A later request in the same namespace whose prompt
starts with those tokens reuses them (reference counted) instead of recomputing them; recent
pages are always private. Namespaces keep tenants apart: prefix hits across users are a timing
side channel, so a request only ever sees pages registered under its own namespace.

Pages whose reference count drops to zero stay registered (a later request may hit them) until
the pool needs them back; a page with a live reference is never reclaimed. When nothing can be
reclaimed, allocation raises PoolExhausted.

A token may be appended before its value is known (`extend(seq_id, None)`: a serving engine that
launches the next decode step while the previous step's sampled tokens are still on the device);
`set_token` fills it in. An unknown token is never hashed into a key: a sink page it completes is
registered when its value arrives.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

from shared_math.spec import OscarConfig
from shared_math.tiers import demotes_on_append, tier_split

UNKNOWN_TOKEN = -1  # a token appended before its value is known (`PageAllocator.set_token`)

SCRATCH_PAGE = 0  # reserved in both pools
BF16, INT2 = "bf16", "int2"


class PoolExhausted(RuntimeError):
    """No free or reclaimable page is left in a pool."""


def _namespace_key(namespace: str | None) -> bytes:
    """The root of a namespace's key chain (the key of the empty prefix)."""
    return hashlib.sha256(repr(namespace).encode()).digest()


def _chained_key(previous: bytes, tokens) -> bytes:
    """The key of a prefix: the key of the prefix before one page, and that page's tokens."""
    h = hashlib.sha256(previous)
    h.update(np.asarray(tokens, np.int64).tobytes())
    return h.digest()


class _Pool:
    """Free list + reference counts + an LRU of unreferenced but registered (cached) pages."""

    def __init__(self, name: str, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"{name} pool needs at least 2 pages (page 0 is scratch), got {num_pages=}")
        self.name = name
        self.num_pages = num_pages
        self.free = collections.deque(range(1, num_pages))
        self.refs = np.zeros(num_pages, np.int64)
        self.cached: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # page → key
        self.key_of: dict[int, bytes] = {}
        self.registry: dict[bytes, int] = {}

    def allocate(self) -> int:
        if self.free:
            page = self.free.popleft()
        elif self.cached:
            page, key = self.cached.popitem(last=False)  # least recently released
            del self.registry[key], self.key_of[page]
        else:
            live = int(np.count_nonzero(self.refs))
            raise PoolExhausted(f"{self.name} page pool exhausted: all {self.num_pages - 1} pages are live "
                                f"({live} referenced); finish a sequence or create a larger cache")
        self.refs[page] = 1
        return page

    def acquire(self, page: int) -> None:
        if self.refs[page] == 0:
            self.cached.pop(page, None)
        self.refs[page] += 1

    def release(self, page: int) -> None:
        assert self.refs[page] > 0, f"double release of {self.name} page {page}"
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self.key_of:
                self.cached[page] = self.key_of[page]
            else:
                self.free.append(page)

    def register(self, key: bytes, page: int) -> None:
        if key not in self.registry and page not in self.key_of:
            self.registry[key] = page
            self.key_of[page] = key

    def lookup(self, key: bytes) -> int | None:
        return self.registry.get(key)

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.cached)


def _token(token) -> int:
    value = int(token)
    if value < 0:
        raise ValueError(f"token id {token!r} is negative")
    return value


@dataclasses.dataclass
class Sequence:
    namespace: str | None
    tokens: list[int]
    sink_pages: list[int]
    history_pages: list[int]
    recent_pages: list[int]
    # The prefix keys of tokens[:page_size·(k + 1)], k = 0, 1, …, as far as computed
    # (PageAllocator._page_end_key); tokens are only ever appended, so they stay valid.
    page_keys: list[bytes] = dataclasses.field(default_factory=list, repr=False, compare=False)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class AdmitPlan:
    """What the device must compute for an admitted prompt."""

    seq_id: int
    reused_tokens: int  # tokens [0, reused_tokens) are already in shared pages
    length: int


@dataclasses.dataclass(frozen=True)
class Demotion:
    seq_id: int
    src_bf16_page: int  # the oldest recent page, freed once demoted
    dst_int2_page: int


class PageAllocator:
    """Pages and page tables for a set of live sequences (host side, numpy)."""

    def __init__(self, config: OscarConfig, *, num_bf16_pages: int, num_int2_pages: int):
        self.config = config
        self.bf16 = _Pool(BF16, num_bf16_pages)
        self.int2 = _Pool(INT2, num_int2_pages)
        self.sequences: dict[int, Sequence] = {}
        self._pending: dict[int, Demotion] = {}
        self._next_id = 0

    # ------------------------------------------------------------------ pages per position

    def _page_end_key(self, seq: Sequence, end: int) -> bytes:
        """The registry key of the page holding tokens up to `end` (a page boundary ≤ length)."""
        page, keys = self.config.page_size, seq.page_keys
        if end % page or not 0 < end <= seq.length:
            raise ValueError(f"page end {end} must be a multiple of page_size={page} in (0, {seq.length}]")
        while len(keys) < end // page:
            first = len(keys) * page
            if UNKNOWN_TOKEN in seq.tokens[first : first + page]:
                raise RuntimeError(f"the page ending at {first + page} holds a token whose value is not known yet "
                                   "(set_token first)")
            keys.append(_chained_key(keys[-1] if keys else _namespace_key(seq.namespace),
                                     seq.tokens[first : first + page]))
        return keys[end // page - 1]

    def _need_pages(self, seq: Sequence) -> None:
        """Allocate pages so every position < seq.length has a home."""
        cfg, page = self.config, self.config.page_size
        split = tier_split(seq.length, cfg)
        while len(seq.sink_pages) < split.sink_pages:
            seq.sink_pages.append(self.bf16.allocate())
        while len(seq.history_pages) < split.history_pages:
            seq.history_pages.append(self.int2.allocate())
        while len(seq.recent_pages) < split.recent_pages:
            seq.recent_pages.append(self.bf16.allocate())
        assert split.recent_tokens == 0 or split.recent_start % page == 0

    def _register_full_pages(self, seq: Sequence) -> None:
        page = self.config.page_size
        split = tier_split(seq.length, self.config)
        for j, p in enumerate(seq.sink_pages):
            if (j + 1) * page <= split.sink_tokens:
                self.bf16.register(self._page_end_key(seq, (j + 1) * page), p)
        for j, p in enumerate(seq.history_pages):
            self.int2.register(self._page_end_key(seq, split.history_start + (j + 1) * page), p)

    # ------------------------------------------------------------------ public API

    def admit(self, tokens, *, namespace: str | None = None, share_prefix: bool = True) -> AdmitPlan:
        """Admit a prompt; reuse registered sink / INT2 pages of the same namespace and prefix."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("cannot admit an empty prompt")
        cfg, page = self.config, self.config.page_size
        seq = Sequence(namespace, tokens, [], [], [])
        final = tier_split(len(tokens), cfg)
        reused = 0
        if share_prefix:
            # Full sink pages, then history pages inside this prompt's own history range, in order.
            # A hit never covers the last token: its logits must be computed.
            for j in range(min(final.sink_tokens, len(tokens) - 1) // page):
                hit = self.bf16.lookup(self._page_end_key(seq, (j + 1) * page))
                if hit is None:
                    break
                seq.sink_pages.append(hit)
                reused = (j + 1) * page
            if reused == cfg.sink and final.sink_tokens == cfg.sink:
                for j in range(min(final.history_pages, (len(tokens) - 1 - cfg.sink) // page)):
                    hit = self.int2.lookup(self._page_end_key(seq, cfg.sink + (j + 1) * page))
                    if hit is None:
                        break
                    seq.history_pages.append(hit)
                    reused = cfg.sink + (j + 1) * page
        for p in seq.sink_pages:
            self.bf16.acquire(p)
        for p in seq.history_pages:
            self.int2.acquire(p)
        try:
            self._need_pages(seq)
        except PoolExhausted:
            self._release_all(seq)
            raise
        seq_id = self._next_id
        self._next_id += 1
        self.sequences[seq_id] = seq
        self._register_full_pages(seq)
        return AdmitPlan(seq_id, reused, len(tokens))

    def extend(self, seq_id: int, token: int | None) -> Demotion | None:
        """Append one token (None: its value is not known yet, `set_token` gives it later).
        Returns the demotion the device must run after this step, if any.

        Until `demoted()` is called the page tables keep the pre-demotion view (the source page
        is still the oldest recent page), which is what this step's attention must read.
        """
        seq = self._seq(seq_id)
        if seq_id in self._pending:
            raise RuntimeError(f"sequence {seq_id} has a demotion pending: call demoted() first")
        cfg = self.config
        demote = demotes_on_append(seq.length, cfg)
        seq.tokens.append(UNKNOWN_TOKEN if token is None else _token(token))
        split = tier_split(seq.length, cfg)  # the split after this step's demotion
        taken: list[tuple[_Pool, int]] = []
        try:
            if len(seq.sink_pages) < split.sink_pages:
                taken.append((self.bf16, self.bf16.allocate()))
                seq.sink_pages.append(taken[-1][1])
            while len(seq.recent_pages) < split.recent_pages + demote:
                taken.append((self.bf16, self.bf16.allocate()))
                seq.recent_pages.append(taken[-1][1])
            if demote:
                taken.append((self.int2, self.int2.allocate()))
        except PoolExhausted:
            seq.tokens.pop()
            for pool, page in taken:
                pool.release(page)
                for pages in (seq.sink_pages, seq.recent_pages):
                    if page in pages and pool is self.bf16:
                        pages.remove(page)
            raise
        if seq.length % cfg.page_size == 0 and seq.length <= split.sink_tokens and token is not None:
            self._register_full_pages(seq)  # a sink page just filled up
        if not demote:
            return None
        demotion = Demotion(seq_id, seq.recent_pages[0], taken[-1][1])
        self._pending[seq_id] = demotion
        return demotion

    def set_token(self, seq_id: int, position: int, token: int) -> None:
        """Give the value of a token appended as unknown (`extend(seq_id, None)`)."""
        seq = self._seq(seq_id)
        if not 0 <= position < seq.length or seq.tokens[position] != UNKNOWN_TOKEN:
            raise ValueError(f"position {position} of sequence {seq_id} holds no unknown token "
                             f"(length {seq.length})")
        seq.tokens[position] = _token(token)
        end = position + 1
        if end % self.config.page_size == 0 and end <= tier_split(seq.length, self.config).sink_tokens:
            self._register_full_pages(seq)  # the sink page this token completed

    def demoted(self, demotion: Demotion) -> None:
        """The device has quantized the page: move it from the recent to the history tier."""
        seq = self._seq(demotion.seq_id)
        if self._pending.pop(demotion.seq_id, None) != demotion:
            raise RuntimeError(f"{demotion} is not the pending demotion of sequence {demotion.seq_id}")
        assert seq.recent_pages[0] == demotion.src_bf16_page
        seq.recent_pages.pop(0)
        seq.history_pages.append(demotion.dst_int2_page)
        self.bf16.release(demotion.src_bf16_page)
        end = self.config.sink + len(seq.history_pages) * self.config.page_size
        self.int2.register(self._page_end_key(seq, end), demotion.dst_int2_page)

    def finish(self, seq_id: int) -> None:
        """Release a sequence's pages (registered ones stay cached for later prefix hits)."""
        seq = self._seq(seq_id)
        if seq_id in self._pending:
            raise RuntimeError(f"sequence {seq_id} has a demotion pending: call demoted() first")
        self._release_all(self.sequences.pop(seq_id))

    def _release_all(self, seq: Sequence) -> None:
        for p in seq.sink_pages + seq.recent_pages:
            self.bf16.release(p)
        for p in seq.history_pages:
            self.int2.release(p)
        seq.sink_pages, seq.recent_pages, seq.history_pages = [], [], []

    def _seq(self, seq_id: int) -> Sequence:
        if seq_id not in self.sequences:
            raise KeyError(f"unknown or finished sequence {seq_id=}")
        return self.sequences[seq_id]

    # ------------------------------------------------------------------ page tables

    @property
    def sink_slots(self) -> int:
        return self.config.sink // self.config.page_size

    @property
    def recent_slots(self) -> int:
        return self.config.recent // self.config.page_size + 1

    def tables(self, seq_ids: list[int], history_slots: int) -> dict[str, np.ndarray]:
        """int32 page tables and token counts for a batch (padding → the scratch page)."""
        b = len(seq_ids)
        bf16_table = np.full((b, self.sink_slots + self.recent_slots), SCRATCH_PAGE, np.int32)
        hist_table = np.full((b, history_slots), SCRATCH_PAGE, np.int32)
        counts = {name: np.zeros(b, np.int32) for name in ("lengths", "sink_tokens", "history_tokens", "recent_tokens")}
        for i, sid in enumerate(seq_ids):
            seq = self._seq(sid)
            sink_tokens = min(seq.length, self.config.sink)
            history_tokens = len(seq.history_pages) * self.config.page_size  # pre-demotion view
            if len(seq.history_pages) > history_slots:
                raise ValueError(f"sequence {sid} has {len(seq.history_pages)} history pages > {history_slots=}")
            bf16_table[i, : len(seq.sink_pages)] = seq.sink_pages
            bf16_table[i, self.sink_slots : self.sink_slots + len(seq.recent_pages)] = seq.recent_pages
            hist_table[i, : len(seq.history_pages)] = seq.history_pages
            counts["lengths"][i] = seq.length
            counts["sink_tokens"][i] = sink_tokens
            counts["history_tokens"][i] = history_tokens
            counts["recent_tokens"][i] = seq.length - sink_tokens - history_tokens
        return {"bf16_page_table": bf16_table, "history_page_table": hist_table, **counts}

    def check_invariants(self) -> None:
        """No leak, no double use: every page is free, cached, or referenced exactly as counted."""
        for pool, pages_of in ((self.bf16, lambda s: s.sink_pages + s.recent_pages),
                               (self.int2, lambda s: s.history_pages)):
            counted = np.zeros(pool.num_pages, np.int64)
            for seq in self.sequences.values():
                for p in pages_of(seq):
                    counted[p] += 1
            assert np.all(pool.refs >= counted), f"{pool.name}: a page is used more often than referenced"
            if pool is self.int2:  # a pending demotion's destination is allocated but not yet history
                for d in self._pending.values():
                    counted[d.dst_int2_page] += 1
            assert np.array_equal(pool.refs, counted), f"{pool.name}: reference counts disagree with the tables"
            free, cached = set(pool.free), set(pool.cached)
            assert SCRATCH_PAGE not in free | cached and pool.refs[SCRATCH_PAGE] == 0
            assert not free & cached
            for p in range(1, pool.num_pages):
                assert (pool.refs[p] > 0) + (p in free) + (p in cached) == 1, f"{pool.name} page {p} leaked or doubly owned"
            # private (unshared) pages are referenced once
            for seq in self.sequences.values():
                if pool is self.bf16:
                    for p in seq.recent_pages:
                        assert pool.refs[p] == 1 and p not in pool.key_of, f"recent page {p} is shared"
