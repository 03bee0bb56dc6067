"""The engine's KV memory over a `kv_cache.PagedKVCache`: a `PagePool`, an optional `PrefixCache`, and what each
row's admission and prefill mean for them.

A request is admitted when a row is free and every page it can need (its committed slots, `requests.plan_requests`:
prompt + max_new_tokens) is free or evictable; it takes them all at admission (`admit`) and gives them back when it
retires (`release`), so a running request never waits for memory and is never evicted (queued requests wait, in
order). With the prefix cache a request maps the cached full pages its prompt starts with (at most (len(prompt) - 1)
// P: the last prompt token is always encoded, the pass that fills the next block's denoise plan) and its prefill
starts after them; its own full prompt pages are registered once the encoder pass that wrote them has run
(`encoded`). Until then they are pending: a request whose prompt continues into a page another row is computing waits
for it (`computing`; the engine admits the requests behind it meanwhile) instead of computing the same page again --
so the n choices of one prompt, admitted together, encode it once.

Committed blocks: when a request's prompt length is a multiple of the encoder chunk T, each commit pass is the pass a
later prompt's prefill runs over the same tokens (`prefix_cache.py`, "Exactness"), so the full pages of its committed
tokens (prompt + generated blocks) are registered after each commit (`committed`), keyed like prompt pages by the hash
chain of every token up to the page: a later request whose prompt is this prompt + its answer + more (the next turn
of a chat) maps them. Other requests register only their prompt pages. Committed pages are never pending: a request
admitted before they are written computes them itself (the same page twice; its later registration is a no-op).

Prompts with images: their pages are keyed by the images' content and the forwards that wrote them too, a hit ends
where one of the request's own forwards does, and only their prompt pages are shared (`image_pages.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dgemma_compile.model.config import CONTEXT_LENGTH, ConfigError
from dgemma_compile.inputs.images import ImagePrompt
from dgemma_compile.model.kv_cache import PagedKVCache
from .image_pages import cut_hit, page_keys
from .pool import PagePool
from .prefix_cache import PrefixCache


@dataclass
class Admission:
    """What admitting one request takes: the prefix-cache keys of its prompt's full pages, the cached pages it
    starts with (`shared`), the fresh pages it needs (`new`), and the pages that must be free or evictable (`need`:
    `new` plus the shared pages now cached, which stop being evictable once mapped)."""

    keys: list[bytes]
    shared: list[int]
    new: int
    need: int
    images: bool = False


class PagedMemory:
    """Pages for the rows of one engine (see the module docstring). `chunk`: the encoder chunk T.

    Raises:
        ConfigError: with `prefix_cache`, a page size that is not a multiple of `chunk` (a hit must start the
            prefill on a chunk boundary, `prefix_cache.py`).
    """

    def __init__(self, cache: PagedKVCache, chunk: int, prefix_cache: bool = True):
        if prefix_cache and cache.page_size % chunk:
            raise ConfigError("prefix_cache", f"page_size {cache.page_size} must be a multiple of the encoder chunk "
                              f"{chunk}")
        self.cache, self.chunk = cache, chunk
        self.pool = PagePool(cache)
        self.prefix = PrefixCache(self.pool) if prefix_cache else None
        self._keys: list[list[bytes]] = [[] for _ in range(cache.batch_size)]
        self._cached = [0] * cache.batch_size  # leading full pages of the row found in / given to the cache
        self._images = [False] * cache.batch_size  # whether the row's prompt has images (no committed pages shared)
        self.pending: dict[bytes, int] = {}  # key of a full prompt page being computed -> the row computing it

    def check(self, slots: int) -> None:
        """Raise ConfigError when a request of `slots` committed slots could never be admitted (more pages than the
        pool)."""
        if self.pool.pages_for(slots) > self.pool.capacity:
            raise ConfigError("max_seq_len", f"this request needs {self.pool.pages_for(slots)} KV pages, more than the "
                              f"server's pool ({self.pool.capacity})", code=CONTEXT_LENGTH)

    def computing(self, prompt: Sequence[int], images: ImagePrompt | None = None) -> bool:
        """Whether the first page of `prompt` beyond its cached run (within the pages a hit may cover) is being
        computed by a running row: admitting it later maps that page instead of computing it again. `images`: the
        prompt's (its pages are keyed by their content too, `image_pages`)."""
        if self.prefix is None or not self.pending:
            return False
        salts = self._salts(images)
        for key in self.prefix.chain(prompt, (len(prompt) - 1) // self.cache.page_size, salts=salts):
            if key not in self.prefix.pages:
                return key in self.pending
        return False

    def _salts(self, images: ImagePrompt | None) -> list[bytes] | None:
        return page_keys(images, self.cache.page_size).salts if images is not None else None

    def plan(self, prompt: Sequence[int], slots: int, images: ImagePrompt | None = None) -> Admission | None:
        """What admitting a request (its prompt, its committed slots, its images) takes now, or None while its pages
        are not available. With `images` the pages are keyed by the images' content and the forwards too, and a hit
        ends where one of the request's own forwards does (`image_pages.py`)."""
        P, pool = self.cache.page_size, self.pool
        keys, shared = [], []
        if self.prefix is not None:
            pk = page_keys(images, P) if images is not None else None
            salts = pk.salts if pk is not None else None
            keys = self.prefix.chain(prompt, len(prompt) // P, salts=salts)
            shared = self.prefix.lookup(prompt, (len(prompt) - 1) // P, salts=salts)
            if pk is not None:
                shared = cut_hit(shared, P, pk.bounds)
        new = pool.pages_for(slots) - len(shared)
        need = new + sum(pool.refs[p] == 0 for p in shared)
        return Admission(keys, shared, new, need, images is not None) if need <= pool.available() else None

    def admit(self, row: int, admission: Admission) -> int:
        """Give row `row` its pages (`PagePool.assign_row`) and start it after its shared pages: sets
        `cache.lengths[row]` and returns the prompt tokens it skips (hit pages x P)."""
        self.pool.assign_row(row, admission.shared, admission.new)
        hit = len(admission.shared) * self.cache.page_size
        self.cache.lengths[row] = hit
        self._keys[row], self._cached[row] = admission.keys, len(admission.shared)
        self._images[row] = admission.images
        if self.prefix is not None:
            for key in admission.keys[len(admission.shared):]:
                if key not in self.prefix.pages and key not in self.pending:
                    self.pending[key] = row
        if self.prefix is not None:
            self.prefix.stats.hit_pages += len(admission.shared)
        return hit

    def encoded(self, row: int, prefilled: int) -> None:
        """The row's prompt is encoded up to `prefilled` tokens: register its full pages written so far."""
        if self.prefix is None:
            return
        done = min(prefilled // self.cache.page_size, len(self._keys[row]))
        for j in range(self._cached[row], done):
            key = self._keys[row][j]
            self.prefix.insert(key, self.pool.rows[row][j])
            if self.pending.get(key) == row:
                del self.pending[key]
        self._cached[row] = max(self._cached[row], done)

    def committed(self, row: int, prompt: Sequence[int], blocks: Sequence[int]) -> None:
        """The row committed a block: `blocks` are its generated tokens committed so far (whole blocks, the cache row
        holds prompt + blocks). Registers the full pages written so far when len(prompt) is a multiple of the chunk
        (see the module docstring); nothing otherwise."""
        if self.prefix is None or len(prompt) % self.chunk or self._images[row]:
            return
        tokens = [*prompt, *blocks]
        self._keys[row] = keys = self.prefix.chain(tokens, len(tokens) // self.cache.page_size, self._keys[row])
        for j in range(self._cached[row], len(keys)):
            self.prefix.insert(keys[j], self.pool.rows[row][j])
        self._cached[row] = max(self._cached[row], len(keys))

    def release(self, row: int) -> None:
        """The row's request ended: its pages go back (`PagePool.release_row`), its table is unmapped."""
        self.pool.release_row(row)
        for key in self._keys[row]:
            if self.pending.get(key) == row:  # retired before its prefill wrote the page: nobody computes it now
                del self.pending[key]
        self._keys[row], self._cached[row], self._images[row] = [], 0, False
