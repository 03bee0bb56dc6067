"""What a row does in one forward of the model (`plan.ForwardPlan.mode`): the forward modes.

One set of layers runs in two modes: the causal ENCODER (a prompt chunk, or a finished block's commit, writing the KV
cache) and the bidirectional DENOISER over a canvas; COMMIT_DENOISER is a commit and its next block's first denoise
step in one row of 2C tokens (commit fusion); an IDLE row does nothing. Which mode a row runs is the step's choice
(`step.phases.forward_mode`, from the row's phase).
"""

from __future__ import annotations

import enum


class Mode(enum.IntEnum):
    """What a row does in one forward (`plan.ForwardPlan.mode`)."""

    IDLE = 0
    ENCODER = 1
    DENOISER = 2
    COMMIT_DENOISER = 3


# plain ints for tensor code (compiled graphs see constants, not enum members)
IDLE, ENCODER, DENOISER, COMMIT_DENOISER = (int(m) for m in Mode)
