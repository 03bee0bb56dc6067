"""`RowState`: the per-row request state of a bucket on the device (phase, prompt, budgets), and the step's per-row
report (`Report` columns, `RowReport` on the host): what each row did in the latest step.

The device owns every transition of a row (`mixed_step.mixed_step`); the host learns what a row did only from the report
the step writes (one host read per iteration, `Bucket.report`), never by replaying the transitions.

Legend: B rows, S committed slots (the prompt buffer's width), E eos ids, K report columns.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .phases import FREE, PREFILL


class Report(enum.IntEnum):
    """The columns of `RowState.report` (int64 [B, K]), written by every step for every row (FREE rows: zeros but
    `block` and `prefilled`)."""

    ENCODED = 0
    """Prompt tokens the step encoded for the row (a prefill chunk: up to C)."""
    PREFILLED = 1
    """Prompt tokens in the row's cache after the step."""
    STEPPED = 2
    """1: the step sampled the row's canvas (a denoise step; with commit fusion also a commit row's first step)."""
    COMMITTED = 3
    """1: the step committed the row's finished block; its next block began (fused: and took its first step)."""
    BLOCK = 4
    """The row's block in flight after the step, 0-based: the block an event belongs to."""
    STEPS = 5
    """Denoise steps of that block so far (the block's decoder passes when it ended)."""
    EVENT = 6
    """1: the row's block finished in this step (stopped early or ran its budget)."""
    DONE = 7
    """1: that block ended the request on the device (`finish.request_done`): the row is FREE already."""


class RowReport(NamedTuple):
    """One row of the report on the host (`Report` columns, as Python ints and bools)."""

    encoded: int
    prefilled: int
    stepped: bool
    committed: bool
    block: int
    steps: int
    event: bool
    done: bool

    @classmethod
    def of(cls, values: list[int]) -> "RowReport":
        encoded, prefilled, stepped, committed, block, steps, event, done = values
        return cls(encoded, prefilled, bool(stepped), bool(committed), block, steps, bool(event), bool(done))


@dataclass
class RowState:
    """Per-row request state on the device (preallocated; a driver writes a row at admission and retirement only).

    phase: int64 [B] (`phases.Phase` codes); prompt: int64 [B, S] prompt ids (zero beyond the prompt); prompt_len,
    prefilled: int64 [B], prompt tokens in all / encoded so far; emitted: int64 [B], tokens the request gained from its
    finished blocks (C per block; the exact count is the host's); max_new: int64 [B], the request's token budget;
    report: int64 [B, K], what each row did in the latest step (`Report` columns; `event` and `done` are its views);
    ignore_eos: bool [B], the request runs to its budget
    (`GenerationConfig.ignore_eos`); commit_len: int64 [B], tokens its commit writes (C; for a constrained row the
    host writes the kept prefix of the block before the commit runs, `constraint.py`); eos: int64 [E], the eos ids
    (shared by all rows).
    """

    phase: torch.Tensor
    prompt: torch.Tensor
    prompt_len: torch.Tensor
    prefilled: torch.Tensor
    emitted: torch.Tensor
    max_new: torch.Tensor
    report: torch.Tensor
    ignore_eos: torch.Tensor
    commit_len: torch.Tensor
    eos: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, max_seq_len: int, eos_ids, device, canvas: int) -> "RowState":
        """Every row FREE. `eos_ids`: the structural eos ids (non-empty); `canvas`: C."""
        long = dict(dtype=torch.long, device=device)
        return cls(phase=torch.full((rows,), FREE, **long), prompt=torch.zeros(rows, max_seq_len, **long),
                   prompt_len=torch.zeros(rows, **long), prefilled=torch.zeros(rows, **long),
                   emitted=torch.zeros(rows, **long), max_new=torch.ones(rows, **long),
                   report=torch.zeros(rows, len(Report), **long),
                   ignore_eos=torch.zeros(rows, dtype=torch.bool, device=device),
                   commit_len=torch.full((rows,), canvas, **long), eos=torch.tensor(sorted(eos_ids), **long))

    @property
    def event(self) -> torch.Tensor:
        """int64 [B] (a view of `report`): 1 where the row's block finished in the latest step."""
        return self.report[:, Report.EVENT]

    @property
    def done(self) -> torch.Tensor:
        """int64 [B] (a view of `report`): 1 where that block ended the request on the device."""
        return self.report[:, Report.DONE]

    def view(self, rows: int) -> "RowState":
        """The first `rows` rows (views of these buffers; the eos ids shared)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[:rows] for f in dataclasses.fields(self)
                                            if f.name != "eos"})

    def admit(self, row: int, prompt: list[int], max_new_tokens: int, prefilled: int = 0,
              ignore_eos: bool = False, *, canvas: int) -> None:
        """Put a request into `row` in phase PREFILL (host writes; refresh the plan before the next step).
        `prefilled`: prompt tokens already in the row's cache (a prefix-cache hit; the cache row's length must equal
        it), < len(prompt); `canvas`: C, what each commit writes until the host says otherwise. Raises ValueError
        for a prompt longer than the buffer (S)."""
        if len(prompt) > self.prompt.shape[1]:
            raise ValueError(f"prompt: {len(prompt)} tokens, more than the {self.prompt.shape[1]} slots")
        self.prompt[row].zero_()
        self.prompt[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self.prompt_len[row] = len(prompt)
        self.prefilled[row] = prefilled
        self.emitted[row] = 0
        self.max_new[row] = max_new_tokens
        self.report[row] = 0
        self.ignore_eos[row] = ignore_eos
        self.commit_len[row] = canvas
        self.phase[row] = PREFILL
