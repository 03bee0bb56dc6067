"""The step contract: what the block loop drives, the one per-row state it drives, and the one denoise step.

- `StepRunner` (a Protocol) is everything `generate.run_block_diffusion` needs: encode a prefill chunk, commit a
  block (now, or fused into the next block's first step), begin a block, run a denoise step, read the block's result.
- `DenoiseState` is the per-row state of the block in flight and `StepInputs` the per-step inputs, both static
  device buffers; "no self-conditioning yet" is the `has_sc` flag in every path.
- `denoise_step` (with `commit=True`: the fused commit + first denoise step) and `encode_chunk` are the steps, pure
  functions of (model, cache, buffers) that update the buffers in place with no host synchronisation; the denoise step draws its own noise from the request's
  counter-based stream (`rng.py`) and reads its temperature from a per-row table. The eager generator calls them directly; the compiled generator
  compiles exactly these functions (`compile/generator.py`).
- `BufferSteps` implements `StepRunner` over those buffers for any zero-argument step callables (denoise, encode,
  and optionally the fused commit + denoise), so eager and compiled share every host-side fill; `EagerSteps` is the eager instance.

Legend: B rows of the buffers (a bucket; rows >= R are frozen padding), R requests, C canvas, V vocab,
P stability_threshold (history depth), T block tokens (encoder chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .config import GenerationConfig
from .kv_cache import KVCache
from .model import DiffusionGemma
from .plan import PlanBuffers
from . import rng
from .sampler import StepNoise, denoise_update, temperature_table


class StepRunner(Protocol):
    """What the block loop drives. Tensors are [R, ...] for the R requests of the call."""

    block_size: int
    """T: tokens per encoder chunk (prefill chunks, and commits without fusion, are padded to it)."""
    commits: int
    """Commits run so far as their own encoder pass."""
    fused_commits: int
    """Commits run so far inside the next block's first denoise step (commit fusion)."""

    def encode_chunk(self, ids_RT: torch.Tensor, n_new_R: torch.Tensor) -> None:
        """Causal pass over T' <= T tokens, n_new_R[r] of row r real: a prefill chunk (or an unfused commit, through
        `commit`); writes the KV."""

    def commit(self, ids_RC: torch.Tensor, n_new_R: torch.Tensor) -> None:
        """Commit a finished block (its argmax canvas, n_new_R[r] tokens of row r: C, or 0 for a done row) before
        the next block begins. Either an encoder pass now, or (commit fusion) deferred into the next block's first
        `step`, which then runs one forward for both."""

    def begin_block(self, block: int, frozen_R: torch.Tensor) -> None:
        """Start block `block` (0-based, per request) from each request's start canvas (`rng.start_canvas`); rows in
        `frozen_R` (done requests) stay frozen."""

    def step(self) -> torch.Tensor:
        """One denoise step (every per-step value is already on the device); returns the finished flags, bool [R].
        A row finishes when it stops early or has run its step budget."""

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's argmax canvas int64 [R, C] (what gets committed) and decoder passes int64 [R]."""


@dataclass
class DenoiseState:
    """Per-row state of the block in flight.

    canvas, argmax: int64 [B, C] (argmax is what gets committed); history: int64 [P, B, C], the argmax canvases of
    the previous P steps (-1 before the first); finished: bool [B] (frozen rows); steps: int64 [B], decoder passes
    of this block; sc_probs: [B, C, V] in the model dtype, the self-conditioning input: the previous step's
    softmax((logits - max) / T) (one-hot for greedy rows; `sampler.StepUpdate`), meaningful where has_sc: bool [B].
    """

    canvas: torch.Tensor
    argmax: torch.Tensor
    history: torch.Tensor
    finished: torch.Tensor
    steps: torch.Tensor
    sc_probs: torch.Tensor
    has_sc: torch.Tensor

    @classmethod
    def allocate(cls, model: DiffusionGemma, rows: int, stability: int) -> "DenoiseState":
        C, V, dev = model.config.canvas_length, model.config.vocab_size, model.device
        long = dict(dtype=torch.long, device=dev)
        return cls(canvas=torch.zeros(rows, C, **long), argmax=torch.zeros(rows, C, **long),
                   history=torch.full((stability, rows, C), -1, **long),
                   finished=torch.zeros(rows, dtype=torch.bool, device=dev), steps=torch.zeros(rows, **long),
                   sc_probs=torch.zeros(rows, C, V, dtype=model.dtype, device=dev),
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

    def begin_row(self, row: int, canvas_C: torch.Tensor) -> None:
        """Reset one row in place for a new block from `canvas_C` (int64 [C]), live; the other rows are untouched
        (a serving engine starts rows' blocks at different times)."""
        self.canvas[row] = canvas_C
        self.argmax[row] = canvas_C
        self.history[:, row] = -1
        self.finished[row] = False
        self.steps[row] = 0
        self.has_sc[row] = False


@dataclass
class StepInputs:
    """Per-request parameters and per-chunk inputs as device tensors (never Python scalars, so a compiled step
    never recompiles when a value changes, and rows of one bucket may carry different values).

    seeds: int64 [B], each request's 64-bit seed as its two's-complement bit pattern (`rng.seed_tensor`); block:
    int64 [B], the block in flight; temperature: float32 [B, W] and greedy: bool [B, W], each row's temperature
    table indexed by its step counter (`sampler.temperature_table`); budget: int64 [B], denoise steps per block at
    most (max_denoising_steps); entropy_bound, confidence: float32 [B]; ids: int64 [B, T] and n_new: int64 [B],
    the encoder chunk and its real tokens per row.
    """

    seeds: torch.Tensor
    block: torch.Tensor
    temperature: torch.Tensor
    greedy: torch.Tensor
    budget: torch.Tensor
    entropy_bound: torch.Tensor
    confidence: torch.Tensor
    ids: torch.Tensor
    n_new: torch.Tensor

    @classmethod
    def allocate(cls, model: DiffusionGemma, rows: int, block_size: int, width: int) -> "StepInputs":
        dev = model.device
        f32, long = dict(dtype=torch.float32, device=dev), dict(dtype=torch.long, device=dev)
        return cls(seeds=torch.zeros(rows, **long), block=torch.zeros(rows, **long),
                   temperature=torch.ones(rows, width, **f32),
                   greedy=torch.zeros(rows, width, dtype=torch.bool, device=dev), budget=torch.ones(rows, **long),
                   entropy_bound=torch.ones(rows, **f32), confidence=torch.zeros(rows, **f32),
                   ids=torch.zeros(rows, block_size, **long), n_new=torch.zeros(rows, **long))

    def set_requests(self, cfgs: Sequence[GenerationConfig], seeds: Sequence[int]) -> None:
        """Fill the per-request rows from one resolved config and seed per request; padding rows get harmless
        values (they stay frozen). Raises ValueError when a config asks more steps than the table width W."""
        R, dev = len(cfgs), self.seeds.device
        T, greedy = temperature_table([(c.t_min, c.t_max, c.max_denoising_steps) for c in cfgs],
                                      self.temperature.shape[1])
        self.seeds.zero_()
        self.seeds[:R] = rng.seed_tensor(seeds, device=dev)
        self.temperature.fill_(1.0)
        self.temperature[:R] = T.to(dev)
        self.greedy.fill_(False)
        self.greedy[:R] = greedy.to(dev)
        self.budget.fill_(1)
        self.budget[:R] = torch.tensor([c.max_denoising_steps for c in cfgs], device=dev)
        self.entropy_bound.fill_(1.0)
        self.entropy_bound[:R] = torch.tensor([c.entropy_bound for c in cfgs], dtype=torch.float32, device=dev)
        self.confidence.zero_()
        self.confidence[:R] = torch.tensor([c.confidence_threshold for c in cfgs], dtype=torch.float32, device=dev)

    def set_row(self, row: int, cfg: GenerationConfig, seed: int) -> None:
        """Fill one row from a resolved config and seed, leaving the other rows as they are (a serving engine admits
        requests into free rows while the others run). Raises ValueError as `set_requests`."""
        dev = self.seeds.device
        T, greedy = temperature_table([(cfg.t_min, cfg.t_max, cfg.max_denoising_steps)], self.temperature.shape[1])
        self.seeds[row] = rng.seed_tensor([seed], device=dev)[0]
        self.temperature[row] = T[0].to(dev)
        self.greedy[row] = greedy[0].to(dev)
        self.budget[row] = cfg.max_denoising_steps
        self.entropy_bound[row] = cfg.entropy_bound
        self.confidence[row] = cfg.confidence_threshold


def denoise_step(model: DiffusionGemma, cache: KVCache, state: DenoiseState, inputs: StepInputs,
                 plan: PlanBuffers | None = None, *, stop_early: bool, moe_impl: str, commit: bool = False,
                 kernel_options: dict | None = None) -> None:
    """One denoise step over all rows, in place: each row's temperature from its table at its step counter k and
    its noise from `rng.step_noise` at step n = budget - k (drawn here, inside the step); count the pass for live
    rows; decoder forward with self-conditioning where `has_sc`; `sampler.denoise_update` (sampling, entropy-bound
    acceptance, renoise, stable-and-confident stop, frozen rows); a row that ran its budget finishes; keep the
    self-conditioning logits (cast to the model dtype, finite) for the next step. `moe_impl`: the routed experts'
    implementation (`ops.moe.resolve_moe_impl`).

    `plan`: the block's denoise plan (masks, RoPE), filled once per block by whatever changed the cache's lengths
    (`encode_chunk`, or this step with `commit`); None: built inside the step.

    `commit=True` (commit fusion, a block's first step only): the forward also commits the previous block, the
    first `inputs.n_new` tokens of `inputs.ids[:, :C]` (`DiffusionGemma.commit_denoise_block`; the cache needs
    2C block slots), instead of a separate `encode_chunk` before the step; then it fills `plan` for the block's
    later steps.

    `kernel_options`: FlexAttention kernel options by query kind and layer type (`plan.build_plan`) for the plans
    built here (a plan given in `plan` carries its own)."""
    C, V = state.canvas.shape[1], model.config.vocab_size
    k_B1 = state.steps.clamp(max=inputs.temperature.shape[1] - 1)[:, None]
    uniform, renoise = rng.step_noise(inputs.seeds, inputs.block, inputs.budget - state.steps, C, V)
    state.steps.add_((~state.finished).long())
    if commit:
        logits = model.commit_denoise_block(inputs.ids[:, :C], state.canvas, cache, inputs.n_new, moe_impl=moe_impl,
                                            kernel_options=kernel_options)
        if plan is not None:
            plan.fill()
    else:
        logits = model.denoise_block(state.canvas, cache, None, state.has_sc, moe_impl=moe_impl,
                                     plan=plan.plan if plan is not None else None,
                                     self_conditioning_probs=state.sc_probs, kernel_options=kernel_options)
    new = denoise_update(state.canvas, state.argmax, state.history, state.finished, logits,
                         inputs.temperature.gather(1, k_B1)[:, 0], inputs.greedy.gather(1, k_B1)[:, 0],
                         StepNoise(uniform=uniform, renoise=renoise), entropy_bound_B=inputs.entropy_bound,
                         confidence_B=inputs.confidence, stop_early=stop_early)
    state.canvas.copy_(new.canvas)
    state.argmax.copy_(new.argmax)
    state.history.copy_(new.history)
    state.finished.copy_(new.finished | (state.steps >= inputs.budget))
    state.sc_probs.copy_(new.sc_probs)
    state.has_sc.fill_(True)


def encode_chunk(model: DiffusionGemma, cache: KVCache, inputs: StepInputs, plan: PlanBuffers | None = None, *,
                 moe_impl: str, kernel_options: dict | None = None) -> None:
    """One causal encoder pass over `inputs.ids` with `inputs.n_new` real tokens per row (prefill chunk or commit);
    writes their keys/values and advances `cache.lengths`; then fills `plan` (if given), the denoise plan for the
    new lengths, which the next block's steps read. `kernel_options` as in `denoise_step`."""
    model.encode_block(inputs.ids, cache, inputs.n_new, moe_impl=moe_impl, kernel_options=kernel_options)
    if plan is not None:
        plan.fill()


def prefill(runner: StepRunner, input_ids_RT: torch.Tensor, lengths_R: torch.Tensor) -> None:
    """Encode right-padded prompts in fixed chunks of `runner.block_size` (the last one padded), so that prefill
    runs the same shapes whatever the prompt lengths."""
    T = runner.block_size
    for start in range(0, input_ids_RT.shape[1], T):
        runner.encode_chunk(input_ids_RT[:, start:start + T], (lengths_R - start).clamp(0, T))


class BufferSteps:
    """`StepRunner` over static buffers: every host-side fill lives here, the steps are the callables `denoise`,
    `encode` and, for commit fusion, `commit_denoise` (zero-argument, over `state`, `inputs` and `cache`): eager
    functions or compiled units. With `commit_denoise`, `commit` only fills the inputs and the next `step` runs
    `commit_denoise` (`denoise_step(commit=True)`) instead of `denoise`."""

    def __init__(self, *, cfgs: Sequence[GenerationConfig], seeds: Sequence[int], cache: KVCache,
                 state: DenoiseState, inputs: StepInputs, denoise: Callable[[], None], encode: Callable[[], None],
                 commit_denoise: Callable[[], None] | None = None):
        self.R, self.cache, self.state, self.inputs = len(cfgs), cache, state, inputs
        self.denoise, self.encode, self.commit_denoise = denoise, encode, commit_denoise
        self.block_size = inputs.ids.shape[1]
        self.vocab_size = state.sc_probs.shape[-1]
        self.commit_pending = False
        self.commits = self.fused_commits = 0  # commits run as their own encoder pass / fused into a step
        inputs.set_requests(cfgs, seeds)
        cache.reset()

    def encode_chunk(self, ids_RT: torch.Tensor, n_new_R: torch.Tensor) -> None:
        self._set_chunk(ids_RT, n_new_R)
        self.encode()

    def _set_chunk(self, ids_RT: torch.Tensor, n_new_R: torch.Tensor) -> None:
        inp, R = self.inputs, self.R
        inp.ids.zero_()
        inp.ids[:R, :ids_RT.shape[1]] = ids_RT
        inp.n_new.zero_()
        inp.n_new[:R] = n_new_R

    def commit(self, ids_RC: torch.Tensor, n_new_R: torch.Tensor) -> None:
        if self.commit_denoise is None:
            self.encode_chunk(ids_RC, n_new_R)
            self.commits += 1
            return
        self._set_chunk(ids_RC, n_new_R)  # copied now: the next block's begin_block resets the argmax buffer
        self.commit_pending = True

    def begin_block(self, block: int, frozen_R: torch.Tensor) -> None:
        inp, R, C = self.inputs, self.R, self.state.canvas.shape[1]
        inp.block.fill_(block)
        self.state.begin(rng.start_canvas(inp.seeds[:R], inp.block[:R], C, self.vocab_size), frozen_R)

    def step(self) -> torch.Tensor:
        if self.commit_pending:
            self.commit_denoise()
            self.commit_pending = False
            self.fused_commits += 1
        else:
            self.denoise()
        return self.state.finished[:self.R]

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.state.argmax[:self.R], self.state.steps[:self.R]


class EagerSteps(BufferSteps):
    """The reference `StepRunner`: `denoise_step` and `encode_chunk` called eagerly over buffers of exactly R rows
    and a cache of `max_seq_len` committed slots, with the routed experts run by `moe_impl`; with `fuse_commit`,
    commits are fused into the next block's first step (`denoise_step(commit=True)`)."""

    def __init__(self, model: DiffusionGemma, cfgs: Sequence[GenerationConfig], seeds: Sequence[int],
                 max_seq_len: int, moe_impl: str, fuse_commit: bool = False):
        structural = cfgs[0]
        C = model.config.canvas_length
        cache = model.new_cache(len(cfgs), max_seq_len, block_size=2 * C if fuse_commit else C)
        state = DenoiseState.allocate(model, len(cfgs), structural.stability_threshold if structural.stop_early else 0)
        inputs = StepInputs.allocate(model, len(cfgs), C, max(c.max_denoising_steps for c in cfgs))
        plan = PlanBuffers(model, cache, C)

        def denoise(commit: bool) -> Callable[[], None]:
            return lambda: denoise_step(model, cache, state, inputs, plan, stop_early=structural.stop_early,
                                        moe_impl=moe_impl, commit=commit)

        super().__init__(cfgs=cfgs, seeds=seeds, cache=cache, state=state, inputs=inputs, denoise=denoise(False),
                         encode=lambda: encode_chunk(model, cache, inputs, plan, moe_impl=moe_impl),
                         commit_denoise=denoise(True) if fuse_commit else None)
