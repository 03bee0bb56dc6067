"""The step contract: what the block loop drives, the one per-row state it drives, and the one denoise step.

- `StepRunner` (a Protocol) is everything `generate.run_block_diffusion` needs: encode a chunk (prefill or commit),
  begin a block, run a denoise step, read the block's result.
- `DenoiseState` is the per-row state of the block in flight and `StepInputs` the per-step inputs, both static
  device buffers; "no self-conditioning yet" is the `has_sc` flag in every path.
- `denoise_step` and `encode_chunk` are the two steps, pure functions of (model, cache, buffers) that update the
  buffers in place with no host synchronisation. The eager generator calls them directly; the compiled generator
  compiles exactly these functions (`compile/generator.py`).
- `BufferSteps` implements `StepRunner` over those buffers for any pair of zero-argument step callables, so eager
  and compiled share every host-side fill; `EagerSteps` is the eager instance.

Legend: B rows of the buffers (a bucket; rows >= R are frozen padding), R requests, C canvas, V vocab,
P stability_threshold (history depth), T block tokens (encoder chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .config import GenerationConfig
from .kv_cache import KVCache
from .model import DiffusionGemma
from .sampler import StepNoise, denoise_update


class StepRunner(Protocol):
    """What the block loop drives. Tensors are [R, ...] for the R requests of the call."""

    block_size: int
    """T: tokens per encoder chunk (prefill chunks and commits are padded to it)."""

    def encode_chunk(self, ids_RT: torch.Tensor, n_new_R: torch.Tensor) -> None:
        """Causal pass over T' <= T tokens, n_new_R[r] of row r real: a prefill chunk or a commit; writes the KV."""

    def begin_block(self, canvas_RC: torch.Tensor, frozen_R: torch.Tensor) -> None:
        """Start a block from its start canvas; rows in `frozen_R` (done requests) stay frozen."""

    def step(self, temperature: float, noise: StepNoise) -> torch.Tensor:
        """One denoise step; returns the finished flags, bool [R]."""

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's argmax canvas int64 [R, C] (what gets committed) and decoder passes int64 [R]."""


@dataclass
class DenoiseState:
    """Per-row state of the block in flight.

    canvas, argmax: int64 [B, C] (argmax is what gets committed); history: int64 [P, B, C], the argmax canvases of
    the previous P steps (-1 before the first); finished: bool [B] (frozen rows); steps: int64 [B], decoder passes
    of this block; sc_logits: [B, C, V] in the model dtype, the previous step's temperature-scaled logits (the
    self-conditioning input), meaningful where has_sc: bool [B].
    """

    canvas: torch.Tensor
    argmax: torch.Tensor
    history: torch.Tensor
    finished: torch.Tensor
    steps: torch.Tensor
    sc_logits: torch.Tensor
    has_sc: torch.Tensor

    @classmethod
    def allocate(cls, model: DiffusionGemma, rows: int, stability: int) -> "DenoiseState":
        C, V, dev = model.config.canvas_length, model.config.vocab_size, model.device
        long = dict(dtype=torch.long, device=dev)
        return cls(canvas=torch.zeros(rows, C, **long), argmax=torch.zeros(rows, C, **long),
                   history=torch.full((stability, rows, C), -1, **long),
                   finished=torch.zeros(rows, dtype=torch.bool, device=dev), steps=torch.zeros(rows, **long),
                   sc_logits=torch.zeros(rows, C, V, dtype=model.dtype, device=dev),
                   has_sc=torch.zeros(rows, dtype=torch.bool, device=dev))

    def begin(self, canvas_RC: torch.Tensor, frozen_R: torch.Tensor) -> None:
        """Reset in place for a new block: the first R rows start from `canvas_RC` (frozen where `frozen_R`), the
        padding rows beyond R are frozen."""
        R = canvas_RC.shape[0]
        self.canvas.zero_()
        self.canvas[:R] = canvas_RC
        self.argmax.copy_(self.canvas)
        self.history.fill_(-1)
        self.finished.fill_(True)
        self.finished[:R] = frozen_R
        self.steps.zero_()
        self.has_sc.zero_()


@dataclass
class StepInputs:
    """Per-step and per-chunk inputs as device tensors (never Python scalars, so a compiled step never recompiles).

    temperature, entropy_bound, confidence: float32 0-d; uniform: float32 [B, C] and renoise: int64 [B, C], the
    step's random draws; ids: int64 [B, T] and n_new: int64 [B], the encoder chunk and its real tokens per row.
    """

    temperature: torch.Tensor
    entropy_bound: torch.Tensor
    confidence: torch.Tensor
    uniform: torch.Tensor
    renoise: torch.Tensor
    ids: torch.Tensor
    n_new: torch.Tensor

    @classmethod
    def allocate(cls, model: DiffusionGemma, rows: int, block_size: int) -> "StepInputs":
        C, dev = model.config.canvas_length, model.device
        f32, long = dict(dtype=torch.float32, device=dev), dict(dtype=torch.long, device=dev)
        return cls(temperature=torch.ones((), **f32), entropy_bound=torch.zeros((), **f32),
                   confidence=torch.zeros((), **f32), uniform=torch.zeros(rows, C, **f32),
                   renoise=torch.zeros(rows, C, **long), ids=torch.zeros(rows, block_size, **long),
                   n_new=torch.zeros(rows, **long))


def denoise_step(model: DiffusionGemma, cache: KVCache, state: DenoiseState, inputs: StepInputs, *,
                 stop_early: bool) -> None:
    """One denoise step over all rows, in place: count the pass for live rows, decoder forward with
    self-conditioning where `has_sc`, then `sampler.denoise_update` (sampling, entropy-bound acceptance, renoise,
    stable-and-confident stop, frozen rows), and keep the scaled logits (cast to the model dtype) for the next step."""
    state.steps.add_((~state.finished).long())
    logits = model.denoise_block(state.canvas, cache, state.sc_logits, state.has_sc)
    new = denoise_update(state.canvas, state.argmax, state.history, state.finished, logits, inputs.temperature,
                         StepNoise(uniform=inputs.uniform, renoise=inputs.renoise),
                         entropy_bound=inputs.entropy_bound, confidence_threshold=inputs.confidence,
                         stop_early=stop_early)
    state.canvas.copy_(new.canvas)
    state.argmax.copy_(new.argmax)
    state.history.copy_(new.history)
    state.finished.copy_(new.finished)
    state.sc_logits.copy_(new.scaled)
    state.has_sc.fill_(True)


def encode_chunk(model: DiffusionGemma, cache: KVCache, inputs: StepInputs) -> None:
    """One causal encoder pass over `inputs.ids` with `inputs.n_new` real tokens per row (prefill chunk or commit);
    writes their keys/values and advances `cache.lengths`."""
    model.encode_block(inputs.ids, cache, inputs.n_new)


def prefill(runner: StepRunner, input_ids_RT: torch.Tensor, lengths_R: torch.Tensor) -> None:
    """Encode right-padded prompts in fixed chunks of `runner.block_size` (the last one padded), so that prefill
    runs the same shapes whatever the prompt lengths."""
    T = runner.block_size
    for start in range(0, input_ids_RT.shape[1], T):
        runner.encode_chunk(input_ids_RT[:, start:start + T], (lengths_R - start).clamp(0, T))


class BufferSteps:
    """`StepRunner` over static buffers: every host-side fill lives here, the steps are the callables `denoise` and
    `encode` (zero-argument, over `state`, `inputs` and `cache`): eager functions or compiled units."""

    def __init__(self, *, cfg: GenerationConfig, requests: int, cache: KVCache, state: DenoiseState,
                 inputs: StepInputs, denoise: Callable[[], None], encode: Callable[[], None]):
        self.R, self.cache, self.state, self.inputs = requests, cache, state, inputs
        self.denoise, self.encode = denoise, encode
        self.block_size = inputs.ids.shape[1]
        inputs.entropy_bound.fill_(cfg.entropy_bound)
        inputs.confidence.fill_(cfg.confidence_threshold)
        cache.reset()

    def encode_chunk(self, ids_RT: torch.Tensor, n_new_R: torch.Tensor) -> None:
        inp, R = self.inputs, self.R
        inp.ids.zero_()
        inp.ids[:R, :ids_RT.shape[1]] = ids_RT
        inp.n_new.zero_()
        inp.n_new[:R] = n_new_R
        self.encode()

    def begin_block(self, canvas_RC: torch.Tensor, frozen_R: torch.Tensor) -> None:
        self.state.begin(canvas_RC, frozen_R)

    def step(self, temperature: float, noise: StepNoise) -> torch.Tensor:
        inp, R = self.inputs, self.R
        inp.temperature.fill_(temperature)
        inp.uniform[:R] = noise.uniform
        inp.renoise[:R] = noise.renoise
        self.denoise()
        return self.state.finished[:R]

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.state.argmax[:self.R], self.state.steps[:self.R]


class EagerSteps(BufferSteps):
    """The reference `StepRunner`: `denoise_step` and `encode_chunk` called eagerly over buffers of exactly R rows
    and a cache of `max_seq_len` committed slots."""

    def __init__(self, model: DiffusionGemma, cfg: GenerationConfig, requests: int, max_seq_len: int):
        cache = model.new_cache(requests, max_seq_len)
        state = DenoiseState.allocate(model, requests, cfg.stability_threshold if cfg.stop_early else 0)
        inputs = StepInputs.allocate(model, requests, cache.block_size)
        super().__init__(cfg=cfg, requests=requests, cache=cache, state=state, inputs=inputs,
                         denoise=lambda: denoise_step(model, cache, state, inputs, stop_early=cfg.stop_early),
                         encode=lambda: encode_chunk(model, cache, inputs))

