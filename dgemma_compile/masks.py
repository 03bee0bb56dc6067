"""Attention masks for a block of new tokens over a static KV cache.

Layout (one layer's keys, per row b): slots [0, S) hold committed tokens at absolute positions 0..lengths[b]-1
(slot index == position); slots [S, S+T) hold the T tokens of the current block (prefill chunk, commit or
canvas), the j-th at position lengths[b] + j, of which only the first n_new[b] are real. Queries are the block's
tokens: query i sits at position lengths[b] + i.

Per row, `causal[b]` picks the mode: encoder rows (prefill / commit) attend causally, denoise rows attend
bidirectionally over the whole block (the canvas) plus visible context.

Sliding windows of W (`sliding_window`):
- "anchored" (the reference, transformers DiffusionGemma): encoder queries see keys with q_pos - k_pos < W
  (W keys including themselves, `sliding_window_overlay`); denoise queries all see the same last W-1 committed
  tokens (the DynamicSlidingWindowLayer keeps W-1) plus the whole canvas.
- "symmetric" (the seed article, vLLM's kernels): denoise queries see keys with |q_pos - k_pos| <= W (2W+1
  keys); encoder rows keep the anchored causal window.

Padded keys (committed slots >= lengths[b], block slots >= n_new[b]) are never visible. Padded queries
(i >= n_new[b]) see exactly their own block slot, so no row of scores is all masked (no NaN).

Legend: B batch, T block length, S committed slots.
"""

from __future__ import annotations

import torch

WINDOW_KINDS = ("anchored", "symmetric")


def dense_block_mask(
    lengths_B: torch.Tensor,
    n_new_B: torch.Tensor,
    causal_B: torch.Tensor,
    *,
    block_len: int,
    cache_slots: int,
    sliding_window: int | None = None,
    window_kind: str = "anchored",
) -> torch.Tensor:
    """The dense boolean mask [B, T, S+T] (True = visible) for the layout above.

    Args:
        lengths_B: int64 [B], committed tokens per row (0 <= lengths <= S).
        n_new_B: int64 [B], real tokens of the block per row (0 <= n_new <= T).
        causal_B: bool [B], True for encoder rows, False for denoise rows.
        block_len: T. cache_slots: S.
        sliding_window: W, or None for a full-attention layer.
        window_kind: "anchored" (reference) or "symmetric".
    Raises:
        ValueError: unknown `window_kind` or a non-positive `sliding_window`.
    """
    if window_kind not in WINDOW_KINDS:
        raise ValueError(f"window_kind must be one of {WINDOW_KINDS}, got {window_kind!r}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    dev = lengths_B.device
    T, S = block_len, cache_slots
    L = lengths_B.view(-1, 1, 1)
    n = n_new_B.view(-1, 1, 1)
    causal = causal_B.view(-1, 1, 1)
    i = torch.arange(T, device=dev).view(1, T, 1)  # query index in the block
    kv = torch.arange(S + T, device=dev).view(1, 1, S + T)
    in_cache = kv < S
    j = kv - S  # block index of a block key
    q_pos = L + i
    k_pos = torch.where(in_cache, kv, L + j)

    real_key = torch.where(in_cache, kv < L, j < n)
    order_ok = in_cache | ~causal | (j <= i)
    visible = real_key & order_ok
    if sliding_window is not None:
        W = sliding_window
        enc_window = (q_pos - k_pos) < W
        if window_kind == "anchored":
            den_window = ~in_cache | (kv >= L - (W - 1))
        else:
            den_window = (q_pos - k_pos).abs() <= W
        visible = visible & torch.where(causal, enc_window, den_window)
    real_query = i < n
    own_slot = ~in_cache & (j == i)
    return torch.where(real_query, visible, own_slot)
