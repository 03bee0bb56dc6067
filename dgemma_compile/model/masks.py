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

Image groups (`groups_BT`, int64 [B, T], optional): the encoder's bidirectional image-group overlay of transformers'
DiffusionGemma (`use_bidirectional_attention == "vision"`: `get_block_sequence_ids_for_mask` -> `blockwise_overlay`,
OR'ed onto the causal mask of every layer type, windowed or not). groups[b, i] >= 0 names the contiguous run of image
soft tokens block token i belongs to, -1 a text token; on encoder rows a real query of group g also sees every real
block key of group g (later ones included, and beyond the sliding window). Groups are block-local: an image group is
encoded whole in one forward (`images.py`), so a committed key never shares a query's group. Denoise rows ignore them.

Padded keys (committed slots >= lengths[b], block slots >= n_new[b]) are never visible. Padded queries
(i >= n_new[b]) see exactly their own block slot, so no row of scores is all masked (no NaN).

`dense_block_mask` is the dense reference (the eager model's mask and the test oracle); `block_mask_mod` is the same
mask as a FlexAttention mask_mod, with `make_block_mask` and `flex_block_attention` around it.

Legend: B batch, T block length, S committed slots.
"""

from __future__ import annotations

import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

WINDOW_KINDS = ("anchored", "symmetric")


def dense_block_mask(
    lengths_B: torch.Tensor,
    n_new_B: torch.Tensor | None,
    causal_B: torch.Tensor | bool,
    *,
    block_len: int,
    cache_slots: int,
    sliding_window: int | None = None,
    window_kind: str = "anchored",
    groups_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense boolean mask [B, T, S+T] (True = visible) for the layout above.

    Args:
        lengths_B: int64 [B], committed tokens per row (0 <= lengths <= S).
        n_new_B: int64 [B], real tokens of the block per row (0 <= n_new <= T), or None for all T.
        causal_B: bool [B], True for encoder rows, False for denoise rows; or one bool for every row.
        block_len: T. cache_slots: S.
        sliding_window: W, or None for a full-attention layer.
        window_kind: "anchored" (reference) or "symmetric".
        groups_BT: int64 [B, T] image group of each block token (-1: text), or None: the image-group overlay
            (`dense_image_group_mask`) OR'ed in on encoder rows.
    Raises:
        ValueError: unknown `window_kind`, a non-positive `sliding_window`, or `groups_BT` not int64 [B, T].
    """
    if window_kind not in WINDOW_KINDS:
        raise ValueError(f"window_kind must be one of {WINDOW_KINDS}, got {window_kind!r}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    dev = lengths_B.device
    T, S = block_len, cache_slots
    if n_new_B is None:
        n_new_B = torch.full_like(lengths_B, T)
    if isinstance(causal_B, bool):
        causal_B = torch.full(lengths_B.shape, causal_B, dtype=torch.bool, device=dev)
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
    if groups_BT is not None:
        _check_groups(groups_BT, lengths_B.shape[0], T)
        visible = visible | (causal & real_key & dense_image_group_mask(groups_BT, cache_slots=S))
    real_query = i < n
    own_slot = ~in_cache & (j == i)
    return torch.where(real_query, visible, own_slot)


def _check_groups(groups_BT: torch.Tensor, B: int, T: int | None) -> None:
    if (not isinstance(groups_BT, torch.Tensor) or groups_BT.dtype != torch.int64 or groups_BT.dim() != 2
            or groups_BT.shape[0] != B or (T is not None and groups_BT.shape[1] != T)):
        got = f"{groups_BT.dtype} {tuple(groups_BT.shape)}" if isinstance(groups_BT, torch.Tensor) else repr(groups_BT)
        raise ValueError(f"groups_BT must be an int64 tensor [B={B}, T{'' if T is None else '=' + str(T)}], got {got}")


def dense_image_group_mask(groups_BT: torch.Tensor, *, cache_slots: int) -> torch.Tensor:
    """The image-group overlay alone, dense bool [B, T, S+T]: True where query i and block key j belong to the same
    image group (groups_BT[b, i] == groups_BT[b, j] >= 0); committed keys never (groups are block-local).
    `image_group_mask_mod` is checked against it; `dense_block_mask(groups_BT=...)` ORs it in on encoder rows."""
    B, T = groups_BT.shape
    same = (groups_BT[:, :, None] == groups_BT[:, None, :]) & (groups_BT[:, :, None] >= 0)
    return torch.cat([torch.zeros(B, T, cache_slots, dtype=torch.bool, device=groups_BT.device), same], dim=-1)


# --- FlexAttention ---------------------------------------------------------------------------------------------------


def _and(a, b):
    """a & b as torch.where: Inductor 2.13's vectorized C++ for `&`/`|` between a mask derived from a per-row tensor
    and an index-only mask does not compile (VecMask<int> vs VecMask<float>); `where` does."""
    return torch.where(a, b, False)


def _visible(L, n, causal, q_idx, kv_idx, S: int, W: int | None, window_kind: str):
    """The mask at (q_idx, kv_idx) of one row with L committed tokens and n real block tokens (None: all), in the
    layout above; `causal` a Python bool (a constant of the mask) or a bool scalar tensor. Index math only, so
    `L` and `n` may be computed from captured tensors (the captured tensors themselves must be graph inputs)."""
    in_cache = kv_idx < S
    j = kv_idx - S  # block index of a block key
    q_pos = L + q_idx
    k_pos = torch.where(in_cache, kv_idx, L + j)
    n_ok = (j < n) if n is not None else True
    real_key = torch.where(in_cache, kv_idx < L, n_ok)
    order_ok = torch.where(in_cache, True, j <= q_idx)  # causal order among block keys
    if W is not None:  # a Python constant: resolved when the factory runs, not per call
        enc_ok = _and(order_ok, (q_pos - k_pos) < W)
        if window_kind == "anchored":
            den_ok = torch.where(in_cache, kv_idx >= L - (W - 1), True)
        else:
            den_ok = (q_pos - k_pos).abs() <= W
    else:
        enc_ok, den_ok = order_ok, True
    mode_ok = (enc_ok if causal else den_ok) if isinstance(causal, bool) else torch.where(causal, enc_ok, den_ok)
    visible = _and(real_key, mode_ok)
    if n is None:
        return visible
    return torch.where(q_idx < n, visible, _and(~in_cache, j == q_idx))


def _same_group(groups_BT: torch.Tensor, b, q_idx, kv_idx, S: int):
    """The image-group overlay at (q_idx, kv_idx) of row b: a block key in the query's image group (index math and
    reads of the captured `groups_BT` only)."""
    j = torch.where(kv_idx < S, 0, kv_idx - S)  # a valid index for committed keys too (masked out below)
    g_q = groups_BT[b, q_idx]
    return _and(kv_idx >= S, _and(g_q >= 0, g_q == groups_BT[b, j]))


def image_group_mask_mod(groups_BT: torch.Tensor, *, cache_slots: int):
    """The FlexAttention mask_mod of `dense_image_group_mask` (Q_LEN = T, KV_LEN = S + T), capturing `groups_BT`
    (int64 [B, T]; a graph input when compiled). On its own it is the overlay, not a whole mask: `block_mask_mod`
    takes `groups_BT` to compose it with causality, windows and padding.

    Raises:
        ValueError: `groups_BT` not an int64 [B, T] tensor.
    """
    _check_groups(groups_BT, groups_BT.shape[0] if isinstance(groups_BT, torch.Tensor) else -1, None)
    S = cache_slots

    def mask_mod(b, h, q_idx, kv_idx):
        return _same_group(groups_BT, b, q_idx, kv_idx, S)

    mask_mod.__name__ = mask_mod.__qualname__ = f"image_groups_S{S}"
    return mask_mod


def block_mask_mod(
    lengths_B: torch.Tensor,
    n_new_B: torch.Tensor | None,
    causal_B: torch.Tensor | bool,
    *,
    cache_slots: int,
    sliding_window: int | None = None,
    window_kind: str = "anchored",
    groups_BT: torch.Tensor | None = None,
):
    """A FlexAttention mask_mod for the layout above: `mask_mod(b, h, q_idx, kv_idx)` equals
    `dense_block_mask(lengths_B, n_new_B, causal_B, block_len=T, cache_slots=S, ...)[b, q_idx, kv_idx]`.

    Per-row state is captured only as tensors (read at call time, so in-place updates are seen and new tensors of
    the same shape do not recompile); `cache_slots` and `sliding_window` are per-model constants baked into the
    function. No Python control flow on tensor values, so it is vmap- and `fullgraph=True`-friendly.
    After changing the captured tensors, rebuild the BlockMask (`make_block_mask`): its block sparsity is data.

    A pass whose rows all share one mode passes `causal_B` as a Python bool, and a pass whose blocks are all real
    passes `n_new_B=None`: both then become constants of the mask. (Inductor's CPU flex template rejects captured
    tensors computed inside the compiled graph, so per-row tensors must be graph inputs such as cache or step
    buffers.)

    Args:
        lengths_B: int64 [B], committed tokens per row (0 <= lengths <= S).
        n_new_B: int64 [B], real tokens of the block per row (0 <= n_new <= T), or None for all T.
        causal_B: bool [B], True for encoder rows, False for denoise rows; or one bool for every row.
        cache_slots: S. sliding_window: W, or None for a full-attention layer.
        window_kind: "anchored" (reference) or "symmetric".
        groups_BT: int64 [B, T] image group per block token (-1: text), or None: the image-group overlay OR'ed in
            on encoder rows (`dense_block_mask`'s; a captured tensor like the others).
    Returns:
        mask_mod with `__name__` like `block_mask_S64_W16_anchored_causal` (`..._full_...` without a window;
        `_mixed` when causality is per row; `_groups` with the image-group overlay).
    Raises:
        ValueError: unknown `window_kind`, non-positive `sliding_window`, `causal_B` not bool, per-row tensors
        that are not 1-D of one length, or `groups_BT` not int64 [B, ...].
    """
    if window_kind not in WINDOW_KINDS:
        raise ValueError(f"window_kind must be one of {WINDOW_KINDS}, got {window_kind!r}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    per_row = [t for t in (lengths_B, n_new_B, causal_B) if isinstance(t, torch.Tensor)]
    if isinstance(causal_B, torch.Tensor) and causal_B.dtype != torch.bool:
        raise ValueError(f"causal_B must be bool, got {causal_B.dtype}")
    if not isinstance(causal_B, (bool, torch.Tensor)):
        raise ValueError(f"causal_B must be a bool tensor or a bool, got {type(causal_B).__name__}")
    if any(t.dim() != 1 or t.shape != lengths_B.shape for t in per_row):
        raise ValueError(f"per-row tensors must be 1-D of one length, got {[tuple(t.shape) for t in per_row]}")
    if groups_BT is not None:
        _check_groups(groups_BT, lengths_B.shape[0], None)
    S, W = cache_slots, sliding_window
    static_mode = isinstance(causal_B, bool)

    def mask_mod(b, h, q_idx, kv_idx):
        n = n_new_B[b] if n_new_B is not None else None
        causal = causal_B if static_mode else causal_B[b]
        visible = _visible(lengths_B[b], n, causal, q_idx, kv_idx, S, W, window_kind)
        if groups_BT is None or causal is False:  # Python constants: resolved when the factory runs
            return visible
        overlay = _same_group(groups_BT, b, q_idx, kv_idx, S)
        if n is not None:  # real queries and keys only (padded tokens carry -1 by contract; not relied on)
            overlay = _and(_and(q_idx < n, kv_idx - S < n), overlay)
        if causal is not True:
            overlay = _and(causal, overlay)
        return torch.where(overlay, True, visible)

    mode = ("causal" if causal_B else "bidir") if static_mode else "mixed"
    mask_mod.__name__ = (f"block_mask_S{S}_" + ("full" if W is None else f"W{W}_{window_kind}") + f"_{mode}"
                         + ("_groups" if groups_BT is not None else ""))
    mask_mod.__qualname__ = mask_mod.__name__
    return mask_mod



# --- commit fusion: a block's commit and the next block's first denoise step in one forward ----------------------


def dense_commit_denoise_mask(lengths_B: torch.Tensor, n_new_B: torch.Tensor, *, canvas: int, cache_slots: int,
                              sliding_window: int | None = None, window_kind: str = "anchored") -> torch.Tensor:
    """The dense mask [B, 2C, S+2C] of a fused commit + denoise forward over 2C block tokens: tokens [0, C) are a
    commit (encoder mode, `n_new_B[b]` real, at positions lengths + i, their keys also written to the committed
    slots lengths..lengths+n_new-1 before attention), tokens [C, 2C) the next block's canvas (denoise mode, at
    positions lengths + n_new + i - C). Each half is `dense_block_mask` of its own unfused pass: the commit sees
    what an encoder pass over `lengths_B` sees in its block slots [0, C); the canvas sees what a denoise pass over
    `lengths_B + n_new_B` committed tokens sees, its block keys being slots [C, 2C). Neither sees the other half's
    block slots. The reference `commit_denoise_mask_mod` is checked against."""
    C, S = canvas, cache_slots
    kw = dict(block_len=C, cache_slots=S, sliding_window=sliding_window, window_kind=window_kind)
    enc = dense_block_mask(lengths_B, n_new_B, True, **kw)
    den = dense_block_mask(lengths_B + n_new_B, None, False, **kw)
    hidden = torch.zeros_like(enc[..., S:])
    return torch.cat([torch.cat([enc, hidden], dim=-1),
                      torch.cat([den[..., :S], hidden, den[..., S:]], dim=-1)], dim=1)


def commit_denoise_mask_mod(lengths_B: torch.Tensor, n_new_B: torch.Tensor, *, canvas: int, cache_slots: int,
                            sliding_window: int | None = None, window_kind: str = "anchored"):
    """The FlexAttention mask_mod of `dense_commit_denoise_mask` (same arguments; Q_LEN = 2C, KV_LEN = S + 2C).
    Captures only `lengths_B` and `n_new_B` (graph inputs in a compiled step); the canvas half's context length
    lengths + n_new is index math inside the mask.

    Raises:
        ValueError: as `block_mask_mod`, or a non-positive `canvas`.
    """
    if window_kind not in WINDOW_KINDS:
        raise ValueError(f"window_kind must be one of {WINDOW_KINDS}, got {window_kind!r}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if canvas <= 0:
        raise ValueError(f"canvas must be positive, got {canvas}")
    if lengths_B.dim() != 1 or n_new_B.shape != lengths_B.shape:
        raise ValueError(f"per-row tensors must be 1-D of one length, got {tuple(lengths_B.shape)} and "
                         f"{tuple(n_new_B.shape)}")
    C, S, W = canvas, cache_slots, sliding_window

    def mask_mod(b, h, q_idx, kv_idx):
        L, n = lengths_B[b], n_new_B[b]
        in_cache = kv_idx < S
        first_half_key = kv_idx < S + C
        commit = _and(first_half_key, _visible(L, n, True, q_idx, kv_idx, S, W, window_kind))
        canvas_kv = torch.where(in_cache, kv_idx, kv_idx - C)
        denoise = _and(~first_half_key | in_cache, _visible(L + n, None, False, q_idx - C, canvas_kv, S, W,
                                                             window_kind))
        return torch.where(q_idx < C, commit, denoise)

    mask_mod.__name__ = f"commit_denoise_mask_S{S}_C{C}_" + ("full" if W is None else f"W{W}_{window_kind}")
    mask_mod.__qualname__ = mask_mod.__name__
    return mask_mod


def select_mask_mod(rows_B: torch.Tensor, if_true, if_false):
    """The mask_mod that is `if_true`'s on rows where `rows_B` (bool [B], a captured tensor: a graph input when
    compiled) and `if_false`'s elsewhere: how a fused mixed plan gives its commit + denoise rows
    `commit_denoise_mask_mod` and its other rows `block_mask_mod`. Both are evaluated (no control flow on values).

    Raises:
        ValueError: `rows_B` not a 1-D bool tensor.
    """
    if rows_B.dim() != 1 or rows_B.dtype != torch.bool:
        raise ValueError(f"rows_B must be a 1-D bool tensor, got {rows_B.dtype} {tuple(rows_B.shape)}")

    def mask_mod(b, h, q_idx, kv_idx):
        return torch.where(rows_B[b], if_true(b, h, q_idx, kv_idx), if_false(b, h, q_idx, kv_idx))

    mask_mod.__name__ = f"select_{if_true.__name__}_else_{if_false.__name__}"
    mask_mod.__qualname__ = mask_mod.__name__
    return mask_mod


def make_block_mask(mask_mod, B: int, T: int, cache_slots: int, device,
                    block_size: int | tuple[int, int] = 128) -> BlockMask:
    """The BlockMask `create_block_mask(mask_mod, B, None, Q_LEN=T, KV_LEN=S+T)` makes (one mask for all heads),
    from `block_sparsity` (its partial and full blocks, tensor for tensor; tests/model/test_masks.py) and
    `BlockMask.from_kv_blocks`: create_block_mask evaluates `mask_mod` through vmap, whose index transform imports
    Dynamo (0.5-1.4 s of a CLI start on a 2-core CPU), and a step loaded from the compile cache imports no compiler.

    T and S+T need not be multiples of `block_size` (the last block is partial; checked for T < 128 on CPU).
    Rebuild it whenever the tensors captured by `mask_mod` change. Runs eagerly; compile it from outside if wanted.
    """
    bs = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    kv_len = cache_slots + T
    return BlockMask.from_kv_blocks(*block_sparsity(mask_mod, B, T, kv_len, bs, device), BLOCK_SIZE=bs,
                                    mask_mod=mask_mod, seq_lengths=(T, kv_len))


def block_sparsity(mask_mod, B: int, q_len: int, kv_len: int, block_size: tuple[int, int], device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block sparsity `create_block_mask(mask_mod, B, None, q_len, kv_len, BLOCK_SIZE=block_size)` computes,
    from tensor ops only: `mask_mod` is evaluated once over broadcast index tensors (b [B, 1, 1], q [1, Q, 1],
    kv [1, 1, K]) instead of through vmap, so a compiled step can refill a mask's sparsity in place (Inductor fuses
    the evaluation and the per-block reductions into one loop nest) and the eager path pays a few dozen small ops
    instead of create_block_mask's vmap (~20 ms a fill at the demo's B=8).

    Same rules as create_block_mask: the mask is padded with False to whole blocks (a block that crosses q_len or
    kv_len is never full), a block with every element visible is full (its mask_mod is skipped by the kernel), one
    with some visible is partial, and each row lists its blocks in ascending order first, then the others.
    `mask_mod` must be broadcastable: index math and reads of captured tensors by `b` / `q_idx` / `kv_idx` (every
    mask_mod of this module is); `h` is passed as 0 (these masks are the same for every head).

    Returns:
        (kv_num_blocks int32 [B, 1, Qb], kv_indices int32 [B, 1, Qb, Kb], full_kv_num_blocks int32 [B, 1, Qb],
        full_kv_indices int32 [B, 1, Qb, Kb]) with Qb = ceil(q_len / block_size[0]), Kb = ceil(kv_len /
        block_size[1]); tests/model/test_masks.py checks them equal to create_block_mask's.
    """
    return sparsity_of(_evaluate(mask_mod, B, q_len, kv_len, device), block_size)


def sparsity_of(visible: torch.Tensor, block_size: tuple[int, int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`block_sparsity` of a dense bool mask `visible` [B, q_len, kv_len] (the mask_mod already evaluated: the
    eager plan fill keeps it as the step's dense mask, `plan.PlanBuffers.eager_plan`)."""
    B, q_len, kv_len = visible.shape
    bq, bk = block_size
    Qb, Kb = -(-q_len // bq), -(-kv_len // bk)
    padded = torch.nn.functional.pad(visible, (0, Kb * bk - kv_len, 0, Qb * bq - q_len))
    count = padded.view(B, Qb, bq, Kb, bk).sum((2, 4), dtype=torch.int32)  # visible elements per block
    full, partial = count == bq * bk, (count > 0) & (count < bq * bk)

    def ordered(blocks_BQK):  # (number, indices) as create_block_mask's: its blocks ascending, then the others
        num = blocks_BQK.sum(-1, dtype=torch.int32)
        idx = torch.sort((~blocks_BQK).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return num[:, None], idx[:, None]

    return (*ordered(partial), *ordered(full))


def dense_mask(block_mask: BlockMask) -> torch.Tensor:
    """The dense bool mask [B, Q_LEN, KV_LEN] a block mask of this module stands for: its mask_mod evaluated once
    over broadcast index tensors (as `block_sparsity` does; h = 0, every mask here is the same for all heads). Equal
    to what FlexAttention sees through the block mask whenever its sparsity was computed from the same mask_mod and
    captured tensors (`make_block_mask`, `block_sparsity`): a key block it skips is one with nothing visible, and a
    full block one with everything visible (FlexAttention's eager path itself evaluates the mask_mod everywhere).
    For the eager step (`mixed_step.mixed_step` run uncompiled), whose attention then runs FlexAttention's eager math on
    the dense mask (`model.eager_attention`, bitwise) instead of FlexAttention's eager path, which vmaps the mask_mod
    and costs ~9 ms a call at the demo's sizes on this CPU. A few dozen small tensor ops, no host synchronisation."""
    q_len, kv_len = block_mask.seq_lengths
    return _evaluate(block_mask.mask_mod, block_mask.kv_num_blocks.shape[0], q_len, kv_len,
                     block_mask.kv_num_blocks.device)


def _evaluate(mask_mod, B: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """`mask_mod` over every (b, q, kv) at once, bool [B, q_len, kv_len] (b [B, 1, 1], q [1, Q, 1], kv [1, 1, K]
    index tensors; h = 0)."""
    b = torch.arange(B, device=device)[:, None, None]
    q = torch.arange(q_len, device=device)[None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, :]
    h = torch.zeros((), dtype=torch.long, device=device)
    return torch.broadcast_to(mask_mod(b, h, q, kv), (B, q_len, kv_len))


def flex_block_attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, block_mask: BlockMask,
                         scale: float = 1.0, kernel_options: dict | None = None) -> torch.Tensor:
    """FlexAttention over the block mask; q [B, H, T, Dh], k/v [B, Hkv, S+T, Dh] with H a multiple of Hkv (GQA).

    Scale 1.0 by default (Gemma4 q/k are RMS-normed). Matches `model.dense_attention` under the dense mask.
    `kernel_options`: passed to `flex_attention` as they are (which kernel and tile sizes a compiled call uses;
    values do not change).
    Inference only when compiled on CPU (inputs requiring grad raise): call under `torch.no_grad()`.
    """
    kw = dict(block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options=kernel_options or None)
    if torch.compiler.is_compiling():
        return flex_attention(q_BHTD, k_BHSD, v_BHSD, **kw)
    with warnings.catch_warnings():  # uncompiled flex is the eager reference path here, on purpose
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q_BHTD, k_BHSD, v_BHSD, **kw)
