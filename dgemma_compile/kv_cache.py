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
"""

from __future__ import annotations

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

    def reset(self) -> None:
        """Forget every committed token and zero every key and value (buffers are reused, not freed): whatever a
        previous request left, NaN included, cannot reach the next one (see the module's invariant)."""
        self.lengths.zero_()
        for t in (*self.keys, *self.values):
            t.zero_()

    def reset_row(self, row: int) -> None:
        """`reset()` for one row (a serving engine reuses a row for the next request while the others run)."""
        self.lengths[row] = 0
        for t in (*self.keys, *self.values):
            t[row].zero_()

    def write_block(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, slots_BT: torch.Tensor | None) -> None:
        """Store a block's keys/values in the block slots and, with `slots_BT` (int64 [B, T], a `ForwardPlan`'s
        `slots`: `commit_slots` for the static cache), each token's also at its slot: committed tokens land in the
        committed slots, the others rewrite their own block slot. Does not advance `lengths` (the model does, once
        per pass)."""
        S, T = self.max_seq_len, k_BHTD.shape[2]
        kc, vc = self.keys[layer], self.values[layer]
        kc[:, :, S:S + T] = k_BHTD
        vc[:, :, S:S + T] = v_BHTD
        if slots_BT is not None:
            idx = slots_BT[:, None, :, None].expand_as(k_BHTD)
            kc.scatter_(2, idx, k_BHTD)
            vc.scatter_(2, idx, v_BHTD)


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
