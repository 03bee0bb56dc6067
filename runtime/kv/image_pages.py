"""Prefix-cache keys for prompts with images: what each full page's hash mixes in besides its token ids, and where a
hit may end.

An image's placeholder ids are the same for every image of that size, so token ids alone would let a different image
hit (`prefix_cache.PrefixCache` keys pages by token ids). A page of a prompt with images is therefore keyed by the
hash chain of its token ids AND a salt (`PageKeys.salts[j]`, mixed into page j's hash) holding:
- the content digest (`images.digest`: sha256 of the preprocessed pixel_values and position_ids) and start of every
  image whose placeholders lie in the page: the same image in two requests gives equal keys, a different image
  (same placeholder ids) never does;
- the forwards that end in the page (their end offsets and kinds: an image-prefix forward, `images.pieces`, run
  eagerly; or a full prefill chunk of the step), and a marker that the prompt has images, so its pages never match
  a text prompt's (whose chunks run in the step, compiled).

Exactness (as `prefix_cache.py`'s for text): a page's keys/values depend on the forwards that computed them. Equal
keys for pages 0..k-1 mean equal tokens, images and forward ends over [0, kP); a hit is cut to the longest run of
pages whose end kP is a forward end of the request's own solo run (`PageKeys.bounds`), so no forward of either
request straddles it, the pages were computed by the same forwards, and the request's own forwards from kP on
(image pieces, then the step's chunks) are those of its solo run. The last chunk of a prompt (fewer than C real
tokens, padded) is never a bound. Committed (generated) blocks of a prompt with images are not registered: only
its prompt pages.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgemma_compile.inputs.images import ImagePrompt, pieces


@dataclass(frozen=True)
class PageKeys:
    """Per full prompt page j (< len(prompt) // P): `salts[j]`, bytes mixed into its hash; `bounds`: the slots where a
    prefix-cache hit may end (forward ends of the request's solo run, 0 included)."""

    salts: list[bytes]
    bounds: frozenset[int]


def page_keys(item: ImagePrompt, page_size: int) -> PageKeys:
    """The salts and bounds of a prompt with images (see the module docstring). Raises ValueError for a page size
    that is not a multiple of the prompt's encoder chunk."""
    C, N, E = item.chunk, item.length, item.prefix
    if page_size % C:
        raise ValueError(f"page_size: {page_size} is not a multiple of the encoder chunk {C}")
    ends = [(e, "p") for _, e, _ in pieces(E, item.runs, C)]
    ends += [(e, "s") for e in range(E + C, N + 1, C)]  # the step's full chunks; a last partial one is no bound
    salts = []
    for j in range(N // page_size):
        lo, hi = j * page_size, (j + 1) * page_size
        parts = [b"img;"]
        parts += [f"{e - lo}{kind},".encode() for e, kind in ends if lo < e <= hi]
        for (start, n), dig in zip(item.runs, item.digests):
            if start < hi and start + n > lo:
                parts.append(f"r{start}:{n}:".encode() + dig)
        salts.append(b"".join(parts))
    return PageKeys(salts=salts, bounds=frozenset([0, *(e for e, _ in ends)]))


def cut_hit(found: list[int], page_size: int, bounds: frozenset[int]) -> list[int]:
    """`found` (cached pages of a prompt's first pages) cut to the longest run whose end is in `bounds`."""
    k = len(found)
    while k and k * page_size not in bounds:
        k -= 1
    return found[:k]
