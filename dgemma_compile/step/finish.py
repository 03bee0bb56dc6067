"""The end rule of a request's block, on the host (`finalize`: `finalize_row`, or `finalize_constrained` for a
constrained request) beside its device twin (`request_done`).

A finished block ends its request when it holds an eos id inside the request's token budget ("eos"), or when the
budget is reached ("length"); transformers' loop ends on eos and counts whole canvases, ours truncates exactly
(transformers' `generation_diffusion_gemma.py`). The host appends the tokens and decides the finish reason; the
device decides the same "done" inside the compiled step (so a row the device ends is FREE before the host reads it)
from what it holds: the argmax canvas, the tokens the request gained so far (C per earlier block: only a request
that is not done gains a block, and such a block is kept whole) and the budget. tests/step/test_finish.py checks with
Hypothesis that the two agree over budgets and eos positions. A request with `GenerationConfig.ignore_eos` (vLLM's
extension) ends on its budget only, its eos ids kept as ordinary tokens, on both sides. Ends only the host can
decide (a stop string, a cancellation, the `stop` hook) are the host's: it retires the row (FREE) before the next
step, and the device takes that as it is."""

from __future__ import annotations

import torch

from ..model.config import GenerationConfig


def finalize_row(row: list[int], cfg: GenerationConfig, sequence: list[int], stats, steps: int
                 ) -> tuple[list[int], bool]:
    """One live request's finished block: append `row` (its argmax canvas, C token ids) to `sequence` up to the first
    eos (included) and the request's token budget, record `steps` (its decoder passes in the block) and the non-pad
    tokens in `stats` (a `requests.RequestStats`), set `stats.finish_reason` ("eos" or "length") when the request is
    done. Returns (the tokens appended, done). `cfg` is resolved (eos and pad ids set); with `cfg.ignore_eos` an eos
    id is an ordinary token."""
    stats.steps_per_block.append(steps)
    eos_at = None if cfg.ignore_eos else next((i for i, t in enumerate(row) if t in cfg.eos_token_ids), None)
    keep = row[:eos_at + 1] if eos_at is not None else row
    room = cfg.max_new_tokens - len(sequence)
    keep = keep[:room]
    sequence.extend(keep)
    stats.num_tokens += sum(t != cfg.pad_token_id for t in keep)
    if eos_at is not None and eos_at < room:
        stats.finish_reason = "eos"
        return keep, True
    if len(sequence) >= cfg.max_new_tokens:
        stats.finish_reason = "length"
        return keep, True
    return keep, False


def finalize(row: list[int], cfg: GenerationConfig, sequence: list[int], stats, steps: int, grammar=None
             ) -> tuple[list[int], bool]:
    """One live request's finished block, whatever the request: `finalize_row`, or `finalize_constrained` when it has
    a `grammar` (its `constraint.RowGrammar`). Returns (the tokens appended, done); raises as those."""
    if grammar is None:
        return finalize_row(row, cfg, sequence, stats, steps)
    return finalize_constrained(row, cfg, sequence, stats, steps, grammar)


def request_done(argmax_BC: torch.Tensor, emitted_B: torch.Tensor, max_new_B: torch.Tensor, eos_E: torch.Tensor,
                 ignore_eos_B: torch.Tensor) -> torch.Tensor:
    """The device twin of `finalize_row`'s "done", for every row: bool [B], the block `argmax_BC` (int64 [B, C]) ends
    its request -- an eos id (`eos_E`, int64 [E]) at an index below the room left (max_new_B - emitted_B, int64 [B])
    unless the row ignores eos (`ignore_eos_B`, bool [B]), or a room of at most C tokens. Tensor ops only; the caller
    masks the rows whose block did not finish."""
    C = argmax_BC.shape[1]
    i_C = torch.arange(C, device=argmax_BC.device)
    room = max_new_B - emitted_B
    is_eos = (argmax_BC[..., None] == eos_E).any(-1) & ~ignore_eos_B[:, None]
    eos_at = torch.where(is_eos, i_C, C).amin(dim=-1)  # C: no eos
    return ((eos_at < C) & (eos_at < room)) | (room <= C)


def finalize_constrained(row: list[int], cfg: GenerationConfig, sequence: list[int], stats, steps: int, grammar
                         ) -> tuple[list[int], bool]:
    """`finalize_row` for a constrained request (`grammar`: its `constraint.RowGrammar`): append the longest prefix of
    `row` the grammar accepts (up to and including the eos that completes it), cut at the token budget; done with
    "eos" when the grammar completed inside the budget, "length" at the budget or at a dead end of the grammar (no id
    of the vocabulary continues it); the text is then a valid prefix. Returns (the tokens appended, done): the
    appended tokens are also what gets committed (at least one, by the first-position mask `sampler.mask_first`); the
    rest of the canvas is denoised again as the next block. The device never ends a constrained row
    (`mixed_step.mixed_step`): the host decides here and retires it.

    Raises: RuntimeError when the grammar rejects the block's first token (the device mask was not applied)."""
    stats.steps_per_block.append(steps)
    accepted = row[:grammar.accept(row)]
    if not accepted:  # the first position is masked to allowed tokens: an empty prefix is a broken mask
        raise RuntimeError("constrained row: the block's first token is not one the grammar allows (mask not applied)")
    grammar.bitmask()  # the next block's mask (cached for the driver), timed with the accepts
    stats.grammar_s = grammar.host_seconds
    room = cfg.max_new_tokens - len(sequence)
    keep = accepted[:room]
    sequence.extend(keep)
    stats.num_tokens += sum(t != cfg.pad_token_id for t in keep)
    if grammar.terminated and len(accepted) <= room:
        stats.finish_reason = "eos"
        return keep, True
    if len(sequence) >= cfg.max_new_tokens or grammar.dead_end:
        stats.finish_reason = "length"
        return keep, True
    return keep, False
