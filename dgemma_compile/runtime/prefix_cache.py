"""A prefix cache over a `PagePool`: full prompt pages keyed by a hash of every token up to the page's end, so a
request whose prompt starts with the same pages maps the pages already computed instead of encoding them again.

Key of page j of a prompt: sha256 over the key of page j-1 and the page's P token ids (a chain: equal keys mean an
equal prefix, positions included). Only pages whose every slot is a prompt token are registered, and only once the
encoder pass that wrote them has run. Committed (generated) blocks are not registered: their keys/values were
computed by commit passes whose chunk boundaries (len(prompt) + k*C) differ from a later prompt's prefill chunks,
so reusing them would change that request's numerics (see `Engine`).

Exactness: a prompt's keys/values depend on the chunk boundaries of the encoder passes that computed them (attention
and GEMM reduction orders). A hit of k pages therefore starts the request's prefill at k*P, which must be a multiple
of the encoder chunk T so its remaining chunks are the ones a solo run encodes; the engine requires P to be a
multiple of T. A hit leaves at least one prompt token to encode (the pass that fills the next block's plan).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from .kv_pool import PagePool


@dataclass
class PrefixStats:
    """Counters: pages mapped from the cache into admitted requests (`hit_pages`), pages registered, registered
    pages evicted."""

    hit_pages: int = 0
    registered: int = 0
    evicted: int = 0


class PrefixCache:
    """hash chain -> physical page, over `pool` (which calls `forget` when it evicts a page)."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        pool.on_evict = self.forget
        self.page_size = pool.cache.page_size
        self.pages: dict[bytes, int] = {}
        self.keys: dict[int, bytes] = {}
        self.stats = PrefixStats()

    def chain(self, prompt: Sequence[int], n: int) -> list[bytes]:
        """The keys of the prompt's first n full pages (n <= len(prompt) // P)."""
        P, key, out = self.page_size, b"", []
        for j in range(n):
            h = hashlib.sha256(key)
            h.update(",".join(map(str, prompt[j * P:(j + 1) * P])).encode())
            key = h.digest()
            out.append(key)
        return out

    def lookup(self, prompt: Sequence[int], max_pages: int) -> list[int]:
        """The physical pages of the longest cached run of the prompt's first pages, at most `max_pages` (neither
        retained nor reordered: `PagePool.assign_row` retains them)."""
        found = []
        for key in self.chain(prompt, max_pages):
            page = self.pages.get(key)
            if page is None:
                break
            found.append(page)
        return found

    def insert(self, key: bytes, page: int) -> bool:
        """Register `page` (held, holding the prompt page `key`); False when the key is cached already (another row
        computed the same prefix at the same time: this page stays private and is freed with its row)."""
        if key in self.pages:
            return False
        self.pages[key] = page
        self.keys[page] = key
        self.pool.register(page)
        self.stats.registered += 1
        return True

    def forget(self, page: int) -> None:
        key = self.keys.pop(page, None)
        if key is not None:
            del self.pages[key]
            self.stats.evicted += 1
