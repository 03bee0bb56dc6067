"""The uniform passes: every row of one forward in one mode, as the reference loop runs them (`generate.py`'s
oracle steps, `DiffusionGemma.encode` / `denoise`, tests and benchmarks). Each builds its uniform plan
(`plan.build_plan`) and runs `DiffusionGemma.forward_plan`; unchecked (no host synchronisation), like the forward.

Legend: B rows, T block tokens, C canvas, V vocab, D hidden.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from .kv_cache import KVCache
from .plan import ForwardPlan, build_plan

if TYPE_CHECKING:
    from .model import DiffusionGemma


def encode_block(model: "DiffusionGemma", ids_BT: torch.Tensor, cache: KVCache, n_new_B: torch.Tensor,
                 moe_impl: str | None = None, kernel_options: dict | None = None) -> torch.Tensor:
    """One encoder pass over T <= cache.block_size tokens, n_new_B [B] of them real per row; commits them and
    advances `cache.lengths`. Returns the final-norm hidden states [B, T, D]. `moe_impl` None: the model's;
    `kernel_options`: FlexAttention kernel options by query kind and layer type (`plan.build_plan`)."""
    plan = build_plan(model, cache, ids_BT.shape[1], mode="encoder", n_new=n_new_B, kernel_options=kernel_options)
    return model.forward_plan(ids_BT, cache, plan, moe_impl=moe_impl)


def denoise_block(model: "DiffusionGemma", canvas_BC: torch.Tensor, cache: KVCache,
                  self_conditioning_logits: torch.Tensor | None, self_conditioning_mask_B: torch.Tensor | None = None,
                  moe_impl: str | None = None, plan: ForwardPlan | None = None,
                  self_conditioning_embeds: torch.Tensor | None = None,
                  kernel_options: dict | None = None, local: bool = False) -> torch.Tensor:
    """One denoiser pass; float32 logits [B, C, V]. `self_conditioning_mask_B` (bool [B]) zeroes the
    self-conditioning signal of rows without previous logits (no Python branch). `plan`: the uniform denoise plan
    for the cache's current lengths, built once per block (`plan.PlanBuffers`); None builds it here.
    `self_conditioning_logits` [B, C, V] (the reference's form, `DiffusionGemma.denoise`) become the soft embedding
    `self_conditioning_embedding(softmax(logits))` here, the only form the forward takes; `self_conditioning_embeds`
    [B, C, D] gives that embedding directly (what the generators carry; pass None as the logits then). `kernel_options`: as `encode_block`'s, for a plan built here. `local`: the rank's vocabulary slice
    under tensor parallel (`DiffusionGemma.logits`)."""
    if plan is None:
        plan = build_plan(model, cache, canvas_BC.shape[1], mode="denoise", kernel_options=kernel_options)
    if self_conditioning_mask_B is not None:  # the rows whose input carries the signal
        plan = dataclasses.replace(plan, self_conditioning=self_conditioning_mask_B)
    if self_conditioning_embeds is None and self_conditioning_logits is not None:  # the reference's form
        probs = torch.softmax(self_conditioning_logits, dim=-1, dtype=torch.float32)
        self_conditioning_embeds = model.self_conditioning_embedding(probs)
    hidden = model.forward_plan(canvas_BC, cache, plan, self_conditioning_embeds, moe_impl=moe_impl)
    return model.logits(hidden, local=local)


def commit_denoise_block(model: "DiffusionGemma", ids_BC: torch.Tensor, canvas_BC: torch.Tensor, cache: KVCache,
                         n_new_B: torch.Tensor, moe_impl: str | None = None,
                         kernel_options: dict | None = None, local: bool = False) -> torch.Tensor:
    """Commit fusion: one forward of 2C tokens that commits `ids_BC` (the first `n_new_B[b]` of each row, as
    `encode_block` does, advancing `cache.lengths`) and runs the first denoise step of the next block's `canvas_BC`
    after them (no self-conditioning; `plan.py`, mode "commit+denoise"). Returns the canvas's float32 logits
    [B, C, V] (`local`: the rank's vocabulary slice, as `denoise_block`), equal within float32 reduction-order noise
    to `encode_block` then `denoise_block`.

    Raises:
        ValueError: ids and canvas of different shapes, or a cache with block_size < 2C."""
    C = canvas_BC.shape[1]
    if ids_BC.shape != canvas_BC.shape or cache.block_size < 2 * C:
        raise ValueError(f"commit fusion needs ids and canvas of one shape [B, C] and a cache with block_size >= "
                         f"2C; got {tuple(ids_BC.shape)}, {tuple(canvas_BC.shape)}, block_size {cache.block_size}")
    plan = build_plan(model, cache, 2 * C, mode="commit+denoise", n_new=n_new_B, kernel_options=kernel_options)
    hidden = model.forward_plan(torch.cat([ids_BC, canvas_BC], dim=1), cache, plan, moe_impl=moe_impl)
    return model.logits(hidden[:, C:], local=local)
