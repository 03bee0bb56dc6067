"""The uniform passes: every row of one forward in one mode, as the reference loop runs them (`oracle.py`'s
oracle steps, tests and benchmarks). `encode` and `denoise` are the checked public passes (`dgemma_compile.encode` /
`dgemma_compile.denoise`: they validate their inputs on the host); `encode_block`, `denoise_block` and
`commit_denoise_block` are unchecked (no host synchronisation), like the forward. Each builds its uniform plan
(`plan.build_plan` with every row one mode code, `plan.every_row`) and runs `DiffusionGemma.forward_plan`: the model is only its forward, and this module is its
caller (the model imports nothing from here).

Legend: B rows, T block tokens, C canvas, V vocab, D hidden.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..kernels import MOE_IMPLS
from .kv_cache import CacheFullError, KVCache
from .modes import COMMIT_DENOISER, DENOISER, ENCODER
from .plan import ForwardPlan, build_plan, every_row

if TYPE_CHECKING:
    from .backbone import DiffusionGemma


def encode_block(model: "DiffusionGemma", ids_BT: torch.Tensor, cache: KVCache, n_new_B: torch.Tensor,
                 moe_impl: str | None = None, kernel_options: dict | None = None) -> torch.Tensor:
    """One encoder pass over T <= cache.block_size tokens, n_new_B [B] of them real per row; commits them and
    advances `cache.lengths`. Returns the final-norm hidden states [B, T, D]. `moe_impl` None: the model's;
    `kernel_options`: FlexAttention kernel options by query kind and layer type (`plan.QUERY_KINDS`; this pass's
    queries are "encoder")."""
    plan = build_plan(model, cache, ids_BT.shape[1], mode=every_row(cache, ENCODER), n_new=n_new_B,
                      check_values=False, kernel_options=(kernel_options or {}).get("encoder"))
    return model.forward_plan(ids_BT, cache, plan, moe_impl=moe_impl)


def denoise_block(model: "DiffusionGemma", canvas_BC: torch.Tensor, cache: KVCache,
                  self_conditioning_logits: torch.Tensor | None, self_conditioning_mask_B: torch.Tensor | None = None,
                  moe_impl: str | None = None, plan: ForwardPlan | None = None,
                  self_conditioning_embeds: torch.Tensor | None = None,
                  kernel_options: dict | None = None, local: bool = False) -> torch.Tensor:
    """One denoiser pass; float32 logits [B, C, V]. `self_conditioning_mask_B` (bool [B]) zeroes the
    self-conditioning signal of rows without previous logits (no Python branch). `plan`: the uniform denoise plan
    for the cache's current lengths, built once per block (`plan.PlanBuffers`); None builds it here.
    `self_conditioning_logits` [B, C, V] (the reference's form, `denoise`) become the soft embedding
    `self_conditioning_embedding(softmax(logits))` here, the only form the forward takes; `self_conditioning_embeds`
    [B, C, D] gives that embedding directly (what the generators carry; pass None as the logits then). `kernel_options`: as `encode_block`'s, for a plan built here. `local`: the rank's vocabulary slice
    under tensor parallel (`DiffusionGemma.logits`)."""
    if plan is None:
        plan = build_plan(model, cache, canvas_BC.shape[1], mode=every_row(cache, DENOISER), check_values=False,
                          kernel_options=(kernel_options or {}).get("canvas"))
    if self_conditioning_embeds is None and self_conditioning_logits is not None:  # the reference's form
        probs = torch.softmax(self_conditioning_logits, dim=-1, dtype=torch.float32)
        self_conditioning_embeds = model.self_conditioning_embedding(probs)
    if self_conditioning_embeds is not None:  # the rows whose input carries the signal: the given ones, else all
        rows = self_conditioning_mask_B
        if rows is None:
            rows = torch.ones(canvas_BC.shape[0], dtype=torch.bool, device=canvas_BC.device)
        plan = dataclasses.replace(plan, self_conditioning=rows)
    hidden = model.forward_plan(canvas_BC, cache, plan, self_conditioning_embeds, moe_impl=moe_impl)
    return model.logits(hidden, local=local)


def commit_denoise_block(model: "DiffusionGemma", ids_BC: torch.Tensor, canvas_BC: torch.Tensor, cache: KVCache,
                         n_new_B: torch.Tensor, moe_impl: str | None = None,
                         kernel_options: dict | None = None, local: bool = False) -> torch.Tensor:
    """Commit fusion: one forward of 2C tokens that commits `ids_BC` (the first `n_new_B[b]` of each row, as
    `encode_block` does, advancing `cache.lengths`) and runs the first denoise step of the next block's `canvas_BC`
    after them (no self-conditioning; `plan.py`, every row COMMIT_DENOISER). Returns the canvas's float32 logits
    [B, C, V] (`local`: the rank's vocabulary slice, as `denoise_block`), equal within float32 reduction-order noise
    to `encode_block` then `denoise_block`.

    Raises:
        ValueError: ids and canvas of different shapes, or a cache with block_size < 2C."""
    C = canvas_BC.shape[1]
    if ids_BC.shape != canvas_BC.shape or cache.block_size < 2 * C:
        raise ValueError(f"commit fusion needs ids and canvas of one shape [B, C] and a cache with block_size >= "
                         f"2C; got {tuple(ids_BC.shape)}, {tuple(canvas_BC.shape)}, block_size {cache.block_size}")
    plan = build_plan(model, cache, 2 * C, mode=every_row(cache, COMMIT_DENOISER), n_new=n_new_B, canvas=C,
                      check_values=False, kernel_options=(kernel_options or {}).get("canvas"))
    hidden = model.forward_plan(torch.cat([ids_BC, canvas_BC], dim=1), cache, plan, moe_impl=moe_impl)
    return model.logits(hidden[:, C:], local=local)


@torch.no_grad()
def encode(model: "DiffusionGemma", input_ids: torch.Tensor, cache: KVCache, input_lengths: torch.Tensor | None = None,
           moe_impl: str | None = None) -> torch.Tensor:
    """Causal encoder pass (prefill or commit) over `input_ids` placed right after what each row of the cache
    holds; writes their keys/values and advances `cache.lengths`.

    Args:
        model: the `DiffusionGemma` that runs the pass.
        input_ids: int64 [B, T]. Rows may be right-padded: `input_lengths` [B] (int64, default all T) gives each
            row's real tokens; padding positions are ignored (their outputs are meaningless).
        cache: from `model.new_cache`, batch size B. T > cache.block_size is encoded in chunks of block_size.
        moe_impl: the experts' implementation (`kernels.MOE_IMPLS`); None: `model.moe_impl`.
    Returns:
        Final-norm hidden states [B, T, D] in the model dtype (`model.logits()` turns them into float32 logits).
    Raises:
        ValueError: shapes or ids out of range, an unknown moe_impl, a cache made for another model.
        CacheFullError: a row would exceed `cache.max_seq_len`. Nothing is written when an error is raised.
    """
    _check_moe_impl(moe_impl)
    B, T = _check_ids(model, input_ids, cache, "input_ids")
    n_B = torch.full((B,), T, dtype=torch.long, device=input_ids.device) if input_lengths is None else input_lengths
    if (not isinstance(n_B, torch.Tensor) or n_B.dtype not in (torch.int64, torch.int32) or n_B.shape != (B,)
            or bool(((n_B < 0) | (n_B > T)).any())):
        got = f"{n_B.dtype} {list(n_B.shape)} {n_B.tolist()}" if isinstance(n_B, torch.Tensor) else repr(n_B)
        raise ValueError(f"input_lengths must be an integer tensor [B={B}] with values in [0, {T}], got {got}")
    n_B = n_B.to(device=cache.lengths.device, dtype=torch.long)
    over = cache.lengths + n_B > cache.max_seq_len
    if bool(over.any()):
        rows = over.nonzero().flatten().tolist()
        raise CacheFullError(f"cache: rows {rows} would hold {(cache.lengths + n_B)[over].tolist()} tokens, "
                             f"more than max_seq_len={cache.max_seq_len}")
    outs = []
    for start in range(0, T, cache.block_size):
        chunk = input_ids[:, start:start + cache.block_size]
        outs.append(encode_block(model, chunk, cache, (n_B - start).clamp(0, chunk.shape[1]), moe_impl))
    return torch.cat(outs, dim=1)


@torch.no_grad()
def denoise(model: "DiffusionGemma", canvas: torch.Tensor, cache: KVCache,
            self_conditioning_logits: torch.Tensor | None = None, moe_impl: str | None = None) -> torch.Tensor:
    """Bidirectional denoiser pass over `canvas` placed right after each row's cached tokens. Reads the committed
    cache and never changes it (the canvas keys/values only pass through the cache's block slots, scratch space).
    With nothing committed yet, the canvas attends only to itself.

    Args:
        model: the `DiffusionGemma` that runs the pass.
        canvas: int64 [B, C] token ids, C <= cache.block_size.
        cache: from `model.new_cache`, batch size B.
        self_conditioning_logits: [B, C, V] logits of the previous step (the generator passes the
            temperature-scaled ones), or None on a block's first step (the soft embedding is then zero, not
            uniform).
        moe_impl: the experts' implementation (`kernels.MOE_IMPLS`); None: `model.moe_impl`.
    Returns:
        float32 logits [B, C, V], soft-capped.
    Raises:
        ValueError: shapes or ids out of range, self-conditioning logits not floating point [B, C, V], an unknown
        moe_impl, a cache made for another model.
    """
    _check_moe_impl(moe_impl)
    B, C = _check_ids(model, canvas, cache, "canvas")
    V = model.config.vocab_size
    sc = self_conditioning_logits
    if sc is not None and (sc.shape != (B, C, V) or not sc.is_floating_point()):
        raise ValueError(f"self_conditioning_logits must be floating point [B={B}, C={C}, V={V}], "
                         f"got {sc.dtype} {tuple(sc.shape)}")
    return denoise_block(model, canvas, cache, self_conditioning_logits, moe_impl=moe_impl)


def _check_ids(model: "DiffusionGemma", ids: torch.Tensor, cache: KVCache, name: str) -> tuple[int, int]:
    _check_cache(model, cache)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be an integer tensor [B, T], got {got}")
    B, T = ids.shape
    if B != cache.batch_size:
        raise ValueError(f"{name} has batch {B} but the cache was made for batch {cache.batch_size}")
    if T == 0:
        raise ValueError(f"{name} is empty")
    if name == "canvas" and T > cache.block_size:
        raise ValueError(f"canvas length {T} exceeds the cache's block_size {cache.block_size}")
    if bool(((ids < 0) | (ids >= model.config.vocab_size)).any()):
        raise ValueError(f"{name} holds token ids outside [0, {model.config.vocab_size})")
    return B, T


def _check_moe_impl(moe_impl: str | None) -> None:
    if moe_impl is not None and moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {moe_impl!r}")


def _check_cache(model: "DiffusionGemma", cache: KVCache) -> None:
    shapes = [(model.config.num_kv_heads[i], model.config.head_dims[i]) for i in range(model.config.num_layers)]
    got = [(k.shape[1], k.shape[3]) for k in cache.keys]
    k0 = cache.keys[0] if cache.keys else None
    if got != shapes or k0.dtype != model.dtype or k0.device != model.device:
        raise ValueError(f"cache: made for another model (layers (kv heads, head dim) {got}, "
                         f"{k0.dtype if k0 is not None else None} on {k0.device if k0 is not None else None}); "
                         f"use this model's new_cache()")
