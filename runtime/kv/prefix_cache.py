"""A prefix cache over a `PagePool`: full pages of a row's committed tokens keyed by a hash of every token up to
the page's end, so a request whose prompt starts with the same pages maps the pages already computed instead of
encoding them again.

Key of page j of a token sequence: sha256 over the key of page j-1 and the page's P token ids (a chain: equal keys
mean an equal prefix, positions included). A page is registered once the encoder pass that wrote its last slot has
run: full prompt pages always, and full pages of committed (generated) blocks when the request's prompt length is a
multiple of the encoder chunk T (`kv.memory.PagedMemory.committed`), so that a later prompt that continues a
conversation (prompt + answer + ...) maps them.

Exactness: a page's keys/values depend on the chunk boundaries of the encoder passes that computed them (attention
and GEMM reduction orders: a chunk's own keys sit in the block slots, its context in the committed slots). A later
request encodes its prompt in chunks [kT, kT + T) (`mixed_step.prefill`, the engine's prefill), so a cached page is its
solo run's only if it was computed in chunks on those boundaries:
- prompt pages are (a prefill runs its chunks from 0); a hit of k pages starts the request's prefill at k*P, which
  must be a multiple of T so its remaining chunks are the ones a solo run encodes: the engine requires P to be a
  multiple of T;
- a committed block of a prompt of L tokens is one commit over [L + kC, L + (k+1)C) (T = C): an encoder row of
  [B, C] (the two-unit body's encoder pass, an ENCODER row of the mixed forward, or with commit fusion the first
  half of a COMMIT_DENOISER row, whose queries see only the committed context and their own half: plain embedding,
  no self-conditioning) whose ids are the block's C tokens (its argmax canvas, which is what the request appended: a
  committed block holds no eos and fits the budget), n_new = C, positions and the causal mask from the row's
  length, over the committed context -- the computation of a full prefill chunk over the same tokens in every
  body (tested bitwise, fused too). It is the chunk a later prompt's prefill runs exactly when L is a multiple of T
  (then, P being a multiple of T, a full page is whole chunks); otherwise each block straddles two of that
  prefill's chunks (different numerics) and is not registered.
A hit leaves at least one prompt token to encode (the pass that fills the next block's plan). Bitwise equality holds
for batch-invariant rows (`tests/step/test_batch_invariance.py`), as every same-tokens claim of the engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from .pool import PagePool


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

    def chain(self, tokens: Sequence[int], n: int, known: Sequence[bytes] = (),
              salts: Sequence[bytes] | None = None) -> list[bytes]:
        """The keys of the first n full pages of `tokens` (n <= len(tokens) // P); `known`: keys of its first pages
        computed before (not hashed again); `salts[j]`: bytes mixed into page j's hash (a prompt with images:
        `image_pages.page_keys`; None: token ids only)."""
        P, out = self.page_size, list(known[:n])
        key = out[-1] if out else b""
        for j in range(len(out), n):
            h = hashlib.sha256(key)
            h.update(",".join(map(str, tokens[j * P:(j + 1) * P])).encode())
            if salts is not None:
                h.update(b"|" + salts[j])
            key = h.digest()
            out.append(key)
        return out

    def lookup(self, prompt: Sequence[int], max_pages: int, salts: Sequence[bytes] | None = None) -> list[int]:
        """The physical pages of the longest cached run of the prompt's first pages, at most `max_pages` (neither
        retained nor reordered: `PagePool.assign_row` retains them)."""
        found = []
        for key in self.chain(prompt, max_pages, salts=salts):
            page = self.pages.get(key)
            if page is None:
                break
            found.append(page)
        return found

    def insert(self, key: bytes, page: int) -> bool:
        """Register `page` (held, holding the full page `key`); False when the key is cached already (another row
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
