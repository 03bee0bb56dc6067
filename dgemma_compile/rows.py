"""`RowState`: the per-row request state of a bucket on the device (phase, prompt, budgets, events).

Legend: B rows, S committed slots (the prompt buffer's width), E eos ids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .phases import FREE, PREFILL


@dataclass
class RowState:
    """Per-row request state on the device (preallocated; a driver writes a row at admission and retirement only).

    phase: int64 [B] (`phases.Phase` codes); prompt: int64 [B, S] prompt ids (zero beyond the prompt); prompt_len,
    prefilled: int64 [B], prompt tokens in all / encoded so far; emitted: int64 [B], tokens the request gained from its
    finished blocks (C per block; the exact count is the host's); max_new: int64 [B], the request's token budget;
    event: bool [B], the row's block finished in the latest step; done: bool [B], the request ended on the device with
    that block (`finish.request_done`); ignore_eos: bool [B], the request runs to its budget
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
    event: torch.Tensor
    done: torch.Tensor
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
                   event=torch.zeros(rows, dtype=torch.bool, device=device),
                   done=torch.zeros(rows, dtype=torch.bool, device=device),
                   ignore_eos=torch.zeros(rows, dtype=torch.bool, device=device),
                   commit_len=torch.full((rows,), canvas, **long), eos=torch.tensor(sorted(eos_ids), **long))

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
        self.event[row] = False
        self.done[row] = False
        self.ignore_eos[row] = ignore_eos
        self.commit_len[row] = canvas
        self.phase[row] = PREFILL
