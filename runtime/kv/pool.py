"""The page pool of a `kv_cache.PagedKVCache`: which request holds which page, reference counts, and the pages a
prefix cache keeps after their requests ended (evicted least recently used first).

A page is in exactly one of three states:
- held: reference count >= 1 (mapped by the page tables of that many rows; a shared prefix page by several);
- cached: count 0 but registered in a `PrefixCache` (its keys/values stay valid, a later request may map it again);
  evictable, least recently released first;
- free: count 0, unregistered; its contents are garbage (tests fill them with NaN) and no table maps it.

`allocate` hands out free pages first, then evicts cached ones, and zeroes every page it hands out, so a row never
reads a value it or the zero page did not put there (the cache's invariant). Held pages are never evicted: a running
request keeps everything it was admitted with (the engine admits a request only when all the pages it can need are
available, so it never runs out mid-request).

Host-side bookkeeping only (Python lists and dicts); the one device write per change is the row's page table.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from dgemma_compile.model.kv_cache import ZERO_PAGE, PagedKVCache


class OutOfPagesError(RuntimeError):
    """`PagePool.allocate` asked for more pages than are free or evictable."""


@dataclass
class PoolStats:
    """Counters since the pool was made: pages handed out (`allocated`), cached pages evicted to do so
    (`evicted`)."""

    allocated: int = 0
    evicted: int = 0


class PagePool:
    """Reference-counted pages of `cache` (its committed-data pages, `cache.first_pool_page` ..), per-row page lists,
    and an LRU of cached pages. `on_evict(page)` is called when a cached page is evicted (the prefix cache forgets
    it)."""

    def __init__(self, cache: PagedKVCache, on_evict=lambda page: None):
        self.cache = cache
        self.on_evict = on_evict
        self.refs = [0] * cache.num_pages
        self.free: deque[int] = deque(range(cache.first_pool_page, cache.num_pages))
        self.cached: OrderedDict[int, None] = OrderedDict()  # count-0 registered pages, oldest first
        self.registered: set[int] = set()
        self.rows: list[list[int]] = [[] for _ in range(cache.batch_size)]
        self.stats = PoolStats()

    @property
    def capacity(self) -> int:
        """Committed-data pages in the pool."""
        return self.cache.num_pages - self.cache.first_pool_page

    def available(self) -> int:
        """Pages `allocate` can hand out now (free + cached)."""
        return len(self.free) + len(self.cached)

    def pages_for(self, slots: int) -> int:
        """Pages that hold `slots` committed slots."""
        return -(-slots // self.cache.page_size)

    def allocate(self, n: int) -> list[int]:
        """n zeroed pages, each held once. Raises OutOfPagesError when fewer than n are free or cached (nothing
        changes then)."""
        if n > self.available():
            raise OutOfPagesError(f"{n} pages asked, {self.available()} free or evictable of {self.capacity}")
        pages = []
        for _ in range(n):
            if self.free:
                page = self.free.popleft()
            else:
                page, _ = self.cached.popitem(last=False)
                self.registered.discard(page)
                self.on_evict(page)
                self.stats.evicted += 1
            self.refs[page] = 1
            pages.append(page)
        self.cache.zero_pages(pages)
        self.stats.allocated += n
        return pages

    def retain(self, page: int) -> None:
        """One more holder of `page` (held or cached)."""
        if self.refs[page] == 0:
            if page not in self.cached:
                raise ValueError(f"page {page} is free: only held or cached pages can be retained")
            del self.cached[page]
        self.refs[page] += 1

    def release(self, page: int) -> None:
        """One holder fewer; at zero the page becomes cached (registered) or free."""
        if self.refs[page] <= 0:
            raise ValueError(f"page {page} is not held")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self.registered:
                self.cached[page] = None
            else:
                self.free.append(page)

    def register(self, page: int) -> None:
        """`page` (held) is in a prefix cache: at count 0 it is kept (cached) rather than freed."""
        self.registered.add(page)

    def assign_row(self, row: int, shared: list[int], new: int) -> list[int]:
        """Row `row`'s pages: the (held or cached) `shared` ones retained, then `new` fresh ones; maps them in the
        row's page table and returns them. Raises OutOfPagesError (nothing changes) when `new` are not available."""
        if self.rows[row]:
            raise ValueError(f"row {row} still holds pages; release_row first")
        for page in shared:  # first: a cached shared page must not be evicted for this row's own new pages
            self.retain(page)
        try:
            fresh = self.allocate(new)
        except OutOfPagesError:
            for page in shared:
                self.release(page)
            raise
        self.rows[row] = pages = list(shared) + fresh
        self.cache.map_pages(row, pages)
        return pages

    def release_row(self, row: int) -> None:
        """Release every page of row `row` and unmap them from its table (`PagedKVCache.reset_row`)."""
        for page in self.rows[row]:
            self.release(page)
        self.rows[row] = []
        self.cache.reset_row(row)

    def check(self) -> None:
        """Assert the bookkeeping and the page tables agree (tests): each row's table maps exactly its pages (the
        rest of its committed pages -> `ZERO_PAGE`), counts equal the number of rows mapping each page, and no row
        maps a free page."""
        cache = self.cache
        nc = cache.max_seq_len // cache.page_size
        table = cache.page_table[:, :nc].tolist()
        counts = [0] * cache.num_pages
        for b, pages in enumerate(self.rows):
            assert table[b][:len(pages)] == pages, (b, table[b], pages)
            assert all(p == ZERO_PAGE for p in table[b][len(pages):]), (b, table[b])
            for p in pages:
                counts[p] += 1
        assert counts[cache.first_pool_page:] == self.refs[cache.first_pool_page:]
        free = set(self.free)
        assert not free & set(self.cached) and not free & {p for r in self.rows for p in r}
        assert len(free) + len(self.cached) + sum(r > 0 for r in self.refs) == self.capacity
