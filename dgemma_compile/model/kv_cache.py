"""A static, preallocated KV cache with per-row lengths.

Each layer holds keys and values of shape [B, H_kv, S + T_blk, D_h]: S committed slots (slot index == token
position) followed by T_blk block slots that hold the keys/values of the block being processed (a prefill chunk,
a commit or a canvas). Attention reads the whole buffer under the masks of `masks.py`, so no forward
concatenates or reallocates; an encoder pass additionally copies its real tokens into the committed slots
(padded tokens of a short row land in their own block slot, never in a committed one).

Rows advance independently: `lengths[b]` counts the committed tokens of row b.

Invariant for slots a row does not own (committed slots at and beyond `lengths[b]`): they hold zeros from `reset()`
(or allocation) or finite values this request wrote. Attention does not make masked values harmless: a masked slot's
probability is an exact 0, but 0 x NaN is NaN in the value product (flex and dense alike), so a NaN or inf left in a
reused cache would reach every output. Hence `reset()` zeroes the keys and values too, and every path that starts
requests on a cache (the eager generator allocates one; the compiled generator's buckets reset theirs per batch of
requests) goes through it; no path writes a committed slot at or beyond a row's new length.

`PagedKVCache` keeps the same logical layout per row (S committed slots, then T_blk block slots) in pages of P slots
drawn from one pool that rows of different lengths share; a per-row page table (a device tensor, read by the
forward) maps logical page -> physical page. The model sees the same [B, H_kv, S + T, D_h] view either way
(`layer_kv`), so masks, plans and numerics are the static cache's; the pool's bookkeeping (which request holds
which page, the prefix cache) lives in `runtime/kv/pool.py` (`dgemma_runtime`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


class CacheFullError(ValueError):
    """An encoder pass would write past the cache's `max_seq_len`."""


@dataclass
class KVCache:
    """Per-layer key/value buffers plus per-row committed lengths.

    Attributes:
        keys, values: one tensor per layer, [B, H_kv(layer), max_seq_len + block_size, D_h(layer)].
        lengths: int64 [B], committed tokens per row (positions 0..lengths-1 are valid).
        max_seq_len: S, committed slots per row.
        block_size: T_blk, the largest block one forward may process (canvas or prefill chunk; 2C for a fused
            commit + denoise forward).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor
    max_seq_len: int
    block_size: int

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def reset(self, rows: int | None = None) -> None:
        """Forget every committed token and zero every key and value (buffers are reused, not freed): whatever a
        previous request left, NaN included, cannot reach the next one (see the module's invariant). `rows`: zero the
        keys and values of rows [0, rows) only (the caller knows the others are zero already); every row's length
        is zeroed either way."""
        self.lengths.zero_()
        for t in (*self.keys, *self.values):
            (t if rows is None else t[:rows]).zero_()

    def view(self, rows: int) -> "KVCache":
        """The first `rows` rows: views of these buffers (a bucket's smaller batch sizes run over them)."""
        return dataclasses.replace(self, keys=[k[:rows] for k in self.keys], values=[v[:rows] for v in self.values],
                                   lengths=self.lengths[:rows])

    def reset_row(self, row: int) -> None:
        """`reset()` for one row (a serving engine reuses a row for the next request while the others run)."""
        self.lengths[row] = 0
        for t in (*self.keys, *self.values):
            t[row].zero_()

    def layer_kv(self, layer: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values attention reads in a forward of T block tokens: [B, H_kv, S + T, D_h] views."""
        span = self.max_seq_len + T
        return self.keys[layer][:, :, :span], self.values[layer][:, :, :span]

    def write_block(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, slots_BT: torch.Tensor) -> None:
        """Store a block's keys/values in the block slots and each token's also at its slot `slots_BT` (int64 [B, T],
        a `ForwardPlan`'s `slots`: `commit_slots` for the static cache): committed tokens land in the committed
        slots, the others rewrite their own block slot. Does not advance `lengths` (the model does, once per
        pass)."""
        S, T = self.max_seq_len, k_BHTD.shape[2]
        kc, vc = self.keys[layer], self.values[layer]
        B = k_BHTD.shape[0]
        if not torch.compiler.is_compiling():  # eagerly: the block slots, then each token's slot (~40% less time)
            row_B1 = torch.arange(B, device=slots_BT.device)[:, None]
            for c, x in ((kc, k_BHTD), (vc, v_BHTD)):
                c[:, :, S:S + T] = x
                c.transpose(1, 2).index_put_((row_B1, slots_BT), x.transpose(1, 2))
            return
        # one index_put per buffer (block slots and `slots_BT` together), not a slice write then a scatter_: Inductor
        # writes a lone index_put into a graph input in place, whereas the pair made it copy the whole
        # [B, H, S + T, D] buffer around them (measured: ~0.3 ms a layer at the demo's B=8 on CPU). A padding token's
        # slot is its own block slot: written twice with the same value, so the result is deterministic.
        block_BT = (S + torch.arange(T, device=slots_BT.device))[None, :].expand(B, T)
        dest_B2T = torch.cat([block_BT, slots_BT], dim=1)
        row_B1 = torch.arange(B, device=slots_BT.device)[:, None]
        kc[row_B1, :, dest_B2T] = torch.cat([k_BHTD, k_BHTD], dim=2).transpose(1, 2)  # [B, 2T, H, D] at (row, :, slot)
        vc[row_B1, :, dest_B2T] = torch.cat([v_BHTD, v_BHTD], dim=2).transpose(1, 2)


def commit_slots(lengths_B: torch.Tensor, n_new_B: torch.Tensor, block_len: int, max_seq_len: int) -> torch.Tensor:
    """Destination slot of each block token [B, T]: lengths + i for real tokens, the token's own block slot
    S + i for padding (so padding never collides with a real token and never leaves the buffer)."""
    i_T = torch.arange(block_len, device=lengths_B.device)
    real = i_T[None, :] < n_new_B[:, None]
    return torch.where(real, lengths_B[:, None] + i_T[None, :], max_seq_len + i_T[None, :])


def new_cache(*, batch_size: int, max_seq_len: int, block_size: int, layer_shapes: list[tuple[int, int]],
              dtype: torch.dtype, device: torch.device | str) -> KVCache:
    """Allocate a zeroed cache. `layer_shapes` is (num_kv_heads, head_dim) per layer.

    Raises:
        ValueError: a non-positive batch_size, max_seq_len or block_size.
    """
    for name, v in (("batch_size", batch_size), ("max_seq_len", max_seq_len), ("block_size", block_size)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    shape = lambda h, d: (batch_size, h, max_seq_len + block_size, d)  # noqa: E731
    keys = [torch.zeros(shape(h, d), dtype=dtype, device=device) for h, d in layer_shapes]
    values = [torch.zeros(shape(h, d), dtype=dtype, device=device) for h, d in layer_shapes]
    lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
    return KVCache(keys=keys, values=values, lengths=lengths, max_seq_len=max_seq_len, block_size=block_size)


ZERO_PAGE = 0
"""The physical page every unmapped logical page of a `PagedKVCache` points at: zeros, never written (writes only go
to slots below a row's allocated length or to its block pages)."""


@dataclass
class PagedKVCache:
    """`KVCache`'s interface over a shared pool of pages (see the module docstring).

    Physical pages: `ZERO_PAGE` (0), then each row's private block pages (row b: pages 1 + b*nb .. (b+1)*nb, nb =
    ceil(block_size / P); they hold the row's block slots), then the committed-data pages that
    `dgemma_runtime.kv.pool` hands out (`first_pool_page` ..). Logical page j of row b is `page_table[b, j]`; slot s lives at
    (page_table[b, s // P], s % P).

    Attributes:
        keys, values: one tensor per layer, [N_pages, H_kv(layer), P, D_h(layer)].
        lengths: int64 [B], committed tokens per row.
        page_table: int64 [B, S/P + nb], physical page of each logical page (committed pages, then block pages).
        max_seq_len: S (a multiple of P). block_size: T_blk. page_size: P.

    Invariant (the static cache's, per page): every page a row's table maps holds finite values -- the zero page,
    the row's block pages, and committed pages that were zeroed when handed out (`zero_pages`) and since written
    only by the rows holding them. A page no table maps is never read, whatever it holds (NaN included).

    Cost: `layer_kv` copies each row's S + T logical slots per layer and forward (a gather), whatever the row's
    length. Reading the pool in place (FlexAttention with the block mask's kv indices mapped to physical pages, or a
    mask_mod over block tables) would avoid the copy, but its kv blocks would be pages of P slots rather than the
    static masks' 128-slot blocks (and uncompiled flex would reduce over the pool's physical order), so its numerics
    would differ from the static cache's; not done here.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor
    page_table: torch.Tensor
    max_seq_len: int
    block_size: int
    page_size: int

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def num_pages(self) -> int:
        return self.keys[0].shape[0]

    @property
    def block_pages(self) -> int:
        """Block pages per row: ceil(block_size / P)."""
        return -(-self.block_size // self.page_size)

    @property
    def first_pool_page(self) -> int:
        return 1 + self.batch_size * self.block_pages

    def reset(self) -> None:
        """Every row empty and unmapped (committed pages -> `ZERO_PAGE`), every page zeroed."""
        self.lengths.zero_()
        for t in (*self.keys, *self.values):
            t.zero_()
        for b in range(self.batch_size):
            self.unmap_row(b)

    def view(self, rows: int) -> "PagedKVCache":
        """The first `rows` rows: their page table and lengths (views), over the same page pool."""
        return dataclasses.replace(self, lengths=self.lengths[:rows], page_table=self.page_table[:rows])

    def reset_row(self, row: int) -> None:
        """Row `row` empty: length 0, committed pages unmapped (whoever handed them out takes them back), its block
        pages zeroed."""
        self.lengths[row] = 0
        self.unmap_row(row)
        self.zero_pages(self.page_table[row, self.max_seq_len // self.page_size:].tolist())

    def unmap_row(self, row: int) -> None:
        """Point row `row`'s committed logical pages at `ZERO_PAGE` and its block pages at its own block pages."""
        nc, nb = self.max_seq_len // self.page_size, self.block_pages
        self.page_table[row, :nc] = ZERO_PAGE
        first = 1 + row * nb
        self.page_table[row, nc:] = torch.arange(first, first + nb, device=self.page_table.device)

    def map_pages(self, row: int, pages: list[int]) -> None:
        """Row `row`'s first len(pages) committed logical pages -> `pages` (physical ids)."""
        self.page_table[row, :len(pages)] = torch.tensor(pages, dtype=torch.long, device=self.page_table.device)

    def zero_pages(self, pages: list[int]) -> None:
        """Zero the keys and values of `pages` in every layer."""
        if pages:
            idx = torch.tensor(pages, dtype=torch.long, device=self.page_table.device)
            for t in (*self.keys, *self.values):
                t.index_fill_(0, idx, 0)

    def fill_pages(self, pages: list[int], value: float) -> None:
        """Fill `pages` with `value` in every layer (tests poison free pages with NaN)."""
        if pages:
            idx = torch.tensor(pages, dtype=torch.long, device=self.page_table.device)
            for t in (*self.keys, *self.values):
                t.index_fill_(0, idx, value)

    def layer_kv(self, layer: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's logical slots [0, S + T) gathered through its page table: contiguous [B, H_kv, S + T, D_h]
        (the static cache's layout and values, so attention is unchanged)."""
        span, P = self.max_seq_len + T, self.page_size
        n = -(-span // P)
        table = self.page_table[:, :n]
        out = []
        for pool in (self.keys[layer], self.values[layer]):
            g = pool[table]  # [B, n, H, P, D]
            B, _, H, _, D = g.shape
            out.append(g.transpose(1, 2).reshape(B, H, n * P, D)[:, :, :span])
        return out[0], out[1]

    def read_slots(self, row: int, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s keys and values of its logical slots [0, n) in `layer`: [H_kv, n, D_h] each (copies)."""
        P = self.page_size
        pages = self.page_table[row, :-(-n // P)]
        out = []
        for pool in (self.keys[layer], self.values[layer]):
            g = pool[pages]  # [n_pages, H, P, D]
            out.append(g.transpose(0, 1).reshape(g.shape[1], -1, g.shape[3])[:, :n])
        return out[0], out[1]

    def write_slots(self, row: int, layer: int, start: int, k_HTD: torch.Tensor, v_HTD: torch.Tensor) -> None:
        """Write keys/values [H_kv, T, D_h] at row `row`'s logical slots [start, start + T) of `layer` (pages the
        row's table maps; the caller owns them). Does not change `lengths`."""
        slots = torch.arange(start, start + k_HTD.shape[1], device=self.page_table.device)
        page, off = self.page_table[row, slots // self.page_size], slots % self.page_size
        self.keys[layer][page, :, off] = k_HTD.transpose(0, 1)
        self.values[layer][page, :, off] = v_HTD.transpose(0, 1)

    def write_block(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, slots_BT: torch.Tensor) -> None:
        """`KVCache.write_block` through the page table: the block's keys/values to the row's block slots and each
        token's also at its slot `slots_BT` (logical slots, int64 [B, T])."""
        B, _, T, _ = k_BHTD.shape
        block_BT = (self.max_seq_len + torch.arange(T, device=k_BHTD.device))[None, :].expand(B, T)
        # one index_put per pool, as `KVCache.write_block` (a padding token writes its block slot twice)
        self._scatter(layer, torch.cat([block_BT, slots_BT], dim=1), torch.cat([k_BHTD, k_BHTD], dim=2),
                      torch.cat([v_BHTD, v_BHTD], dim=2))

    def _scatter(self, layer: int, slots_BT: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> None:
        P = self.page_size
        page_BT = self.page_table.gather(1, slots_BT // P)
        off_BT = slots_BT % P
        self.keys[layer][page_BT, :, off_BT] = k_BHTD.transpose(1, 2)  # [B, T, H, D] at (page, :, offset)
        self.values[layer][page_BT, :, off_BT] = v_BHTD.transpose(1, 2)


def new_paged_cache(*, batch_size: int, max_seq_len: int, block_size: int, page_size: int, pool_pages: int,
                    layer_shapes: list[tuple[int, int]], dtype: torch.dtype,
                    device: torch.device | str) -> PagedKVCache:
    """Allocate a zeroed `PagedKVCache` with `pool_pages` committed-data pages (plus the zero page and the rows'
    block pages), every row unmapped. `layer_shapes` is (num_kv_heads, head_dim) per layer.

    Raises:
        ValueError: a non-positive size, or max_seq_len not a multiple of page_size.
    """
    for name, v in (("batch_size", batch_size), ("max_seq_len", max_seq_len), ("block_size", block_size),
                    ("page_size", page_size), ("pool_pages", pool_pages)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if max_seq_len % page_size:
        raise ValueError(f"max_seq_len ({max_seq_len}) must be a multiple of page_size ({page_size})")
    nb = -(-block_size // page_size)
    n = 1 + batch_size * nb + pool_pages
    keys = [torch.zeros(n, h, page_size, d, dtype=dtype, device=device) for h, d in layer_shapes]
    values = [torch.zeros(n, h, page_size, d, dtype=dtype, device=device) for h, d in layer_shapes]
    lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
    table = torch.zeros(batch_size, max_seq_len // page_size + nb, dtype=torch.long, device=device)
    cache = PagedKVCache(keys=keys, values=values, lengths=lengths, page_table=table, max_seq_len=max_seq_len,
                         block_size=block_size, page_size=page_size)
    for b in range(batch_size):
        cache.unmap_row(b)
    return cache


def paged_cache(model, rows: int, max_seq_len: int, *, block_size: int, page_size: int,
                kv_pages: int | None = None) -> PagedKVCache:
    """A zeroed `PagedKVCache` for `model` (a `DiffusionGemma`: its layers' kv heads and head dims, dtype, device):
    `kv_pages` committed-data pages of `page_size` slots (default rows * max_seq_len / page_size, as much as a static
    cache). Raises ValueError as `new_paged_cache`."""
    cfg = model.config
    shapes = [(cfg.num_kv_heads[i], cfg.head_dims[i]) for i in range(cfg.num_layers)]
    pages = kv_pages if kv_pages is not None else rows * max_seq_len // page_size
    return new_paged_cache(batch_size=rows, max_seq_len=max_seq_len, block_size=block_size, page_size=page_size,
                           pool_pages=pages, layer_shapes=shapes, dtype=model.dtype, device=model.device)
