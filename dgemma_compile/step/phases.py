"""The row lifecycle of a row table (`Phase`) and its mapping to the forward modes (`model.modes.Mode`).

Phases are what a row's request is doing, modes what its forward does (causal ENCODER, bidirectional DENOISER): the
two vocabularies have distinct names, and the model knows only the modes.

A row of a bucket is in one phase, held on the device (`rows.RowState.phase`, int64 [B]); the host never mirrors it:
it learns what a row did from the step's report (`rows.Report`):
- FREE: no request; the row is IDLE in the forward.
- PREFILL: its next prompt chunk (up to C tokens) is an ENCODER row.
- DENOISE: its canvas is a DENOISER row; the sampler and the per-row state update apply to it.
- COMMIT: its finished block (the argmax canvas, C tokens) is an ENCODER row that writes the cache; with commit
  fusion a COMMIT_DENOISER row: the commit, then its next block's first denoise step, in one row of 2C tokens.

`forward_mode` maps phases to modes (what `plan.build_plan` reads); `stepping` says which rows the sampler advances.
Both are tensor functions (no host synchronisation): they run inside the compiled step.
"""

from __future__ import annotations

import enum

import torch

from ..model.modes import COMMIT_DENOISER, DENOISER, ENCODER, IDLE


class Phase(enum.IntEnum):
    """Row lifecycle: FREE -> PREFILL -> DENOISE <-> COMMIT -> ... -> FREE."""

    FREE = 0
    PREFILL = 1
    DENOISE = 2
    COMMIT = 3


# plain ints for tensor code (compiled graphs see constants, not enum members)
FREE, PREFILL, DENOISE, COMMIT = (int(p) for p in Phase)


def forward_mode(phase_B: torch.Tensor, *, fused: bool) -> torch.Tensor:
    """int64 [B] `Mode` per row for `Phase` codes `phase_B` (int64 [B]): PREFILL -> ENCODER, COMMIT -> ENCODER
    (`fused`: COMMIT_DENOISER), DENOISE -> DENOISE, FREE -> IDLE."""
    commit = COMMIT_DENOISER if fused else ENCODER
    return torch.where(phase_B == PREFILL, ENCODER,
                       torch.where(phase_B == COMMIT, commit, torch.where(phase_B == DENOISE, DENOISER, IDLE)))


def stepping(phase_B: torch.Tensor, *, fused: bool) -> torch.Tensor:
    """bool [B]: the rows whose canvas the step samples -- DENOISE rows, and with commit fusion COMMIT rows too (the
    first step of their next block)."""
    out = phase_B == DENOISE
    return out | (phase_B == COMMIT) if fused else out
