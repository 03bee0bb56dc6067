"""The one step of a bucket (`mixed_step`), the per-row device state it updates, and the eager reference steps.

- `DenoiseState` is the per-row state of the block in flight and `StepInputs` the per-request parameters, both
  static device buffers (`row_table.RowTable` is their one constructor; `view(b)` gives the first b rows).
- `mixed_step` is the only optimized step: one forward over every row of a bucket, each row in its own phase
  (`phases.py`: prefill chunk, denoise step, commit -- fused with the next block's first step where the cache holds
  2C block slots -- or idle), then the sampler for the stepping rows and every phase transition decided on the
  device (`finish.request_done` for the end rule), and the plan of the next iteration. Compiled per bucket size as
  one unit (`compile/generator.py`); driven by the compiled generator and the serving engine alike.
- `denoise_step` (with `commit=True`: the fused commit + first denoise step) and `encode_chunk` are the eager
  reference generator's uniform steps (`oracle.py`, the oracle every optimized path is tested against).

Numerics: each row's tokens from `mixed_step` equal its solo `generate` run's (chunks of C; commits fused or not as
the bucket's): encoder rows and denoise rows compute what the encoder / denoise passes compute (same queries,
visible keys and self-conditioning), given row-invariant GEMMs and experts (`moe_impl` "dense" eagerly; compiled,
the generator's). Commit fusion makes every row 2C tokens: a COMMIT row commits in its first half and runs its next
block's first denoise step on the start canvas in its second half; a DENOISE row holds its canvas in the first half
(the second idle and masked), so it computes what a [C] pass computes.

Legend: B rows of the buffers, C canvas, V vocab, P stability_threshold (history depth), T block tokens per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..inputs.constraint import bitmask_words
from ..model.backbone import DiffusionGemma
from ..model.config import GenerationConfig
from ..model.forwards import commit_denoise_block, denoise_block, encode_block
from ..model.kv_cache import KVCache
from ..model.plan import PlanBuffers
from . import rng
from .finish import request_done
from .phases import COMMIT, DENOISE, FREE, PREFILL, forward_mode, stepping as stepping_rows
from .rows import RowState
from .sampler import StepNoise, denoise_update, push_history, temperature_table


def _rows_view(obj, rows: int, dims: dict[str, int] | None = None):
    """A dataclass of [B, ...] tensors viewed at its first `rows` rows (`dims`: fields whose row dim is not 0)."""
    dims = dims or {}
    return dataclasses.replace(obj, **{f.name: getattr(obj, f.name).narrow(dims.get(f.name, 0), 0, rows)
                                       for f in dataclasses.fields(obj)})


@dataclass
class DenoiseState:
    """Per-row state of the block in flight.

    canvas, argmax: int64 [B, C] (argmax is what gets committed); history: int64 [P, B, C], the argmax canvases of
    the previous P steps (-1 before the first); finished: bool [B] (frozen rows); steps: int64 [B], decoder passes
    of this block; sc_embeds: [B, C, D] in the model dtype, the self-conditioning input: the soft embedding
    (`DiffusionGemma.self_conditioning_embedding`) of the previous step's softmax((logits - max) / T) (one-hot for
    greedy rows; `sampler.StepUpdate`), computed at the end of that step, meaningful where has_sc: bool [B]. D, not
    V, values per position: at the released sizes 2,816 instead of 262,144 (`sampler.SCHEME` v4).
    logprob: float32 [B, C], top_ids: int64 [B, C, K], top_logprobs: float32 [B, C, K]: log-probabilities of the
    latest step of each row (`logprobs`), K = the bucket's `max_logprobs` (0: none; None: no logprobs at all, the
    buffers [B, 0] and [B, 0, 0], and the step computes none); what a block's argmax canvas was taken from when its
    block finished in that step.
    accepted: bool [B, C] and entropy: float32 [B]: the positions the latest step of each row accepted (the others
    renoised) and the mean entropy of its scaled distribution (`sampler.StepUpdate`), written by every step for every
    row (meaningful for the rows that stepped); read by the host only for rows that asked for live canvas frames
    (`frames.py`, `driver.Driver.step`).
    """

    canvas: torch.Tensor
    argmax: torch.Tensor
    history: torch.Tensor
    finished: torch.Tensor
    steps: torch.Tensor
    sc_embeds: torch.Tensor
    has_sc: torch.Tensor
    logprob: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    accepted: torch.Tensor
    entropy: torch.Tensor

    @classmethod
    def allocate(cls, model: DiffusionGemma, rows: int, stability: int,
                 max_logprobs: int | None = None) -> "DenoiseState":
        C, D, dev = model.config.canvas_length, model.config.hidden_size, model.device
        long = dict(dtype=torch.long, device=dev)
        return cls(canvas=torch.zeros(rows, C, **long), argmax=torch.zeros(rows, C, **long),
                   history=torch.full((stability, rows, C), -1, **long),
                   finished=torch.zeros(rows, dtype=torch.bool, device=dev), steps=torch.zeros(rows, **long),
                   sc_embeds=torch.zeros(rows, C, D, dtype=model.dtype, device=dev),
                   has_sc=torch.zeros(rows, dtype=torch.bool, device=dev),
                   logprob=torch.zeros(rows, C if max_logprobs is not None else 0, dtype=torch.float32, device=dev),
                   top_ids=torch.zeros(rows, C if max_logprobs is not None else 0, max_logprobs or 0, **long),
                   top_logprobs=torch.zeros(rows, C if max_logprobs is not None else 0, max_logprobs or 0,
                                            dtype=torch.float32, device=dev),
                   accepted=torch.zeros(rows, C, dtype=torch.bool, device=dev),
                   entropy=torch.zeros(rows, dtype=torch.float32, device=dev))

    def view(self, rows: int) -> "DenoiseState":
        """The first `rows` rows (views of these buffers)."""
        return _rows_view(self, rows, {"history": 1})

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
    """Per-request parameters and per-chunk inputs as device tensors (never Python scalars, so a compiled step
    never recompiles when a value changes, and rows of one bucket may carry different values).

    seeds: int64 [B], each request's 64-bit seed as its two's-complement bit pattern (`rng.seed_tensor`); block:
    int64 [B], the block in flight; temperature: float32 [B, W] and greedy: bool [B, W], each row's temperature
    table indexed by its step counter (`sampler.temperature_table`); budget: int64 [B], denoise steps per block at
    most (max_denoising_steps); entropy_bound, confidence: float32 [B]; ids: int64 [B, T] and n_new: int64 [B],
    the encoder chunk and its real tokens per row; constrained: bool [B], the row's request has a grammar, and
    allowed: int32 [B, W] (W = ceil(V / 32)), its next-token bitmask for the canvas's first position
    (`sampler.mask_first`, inside `sampler.sample_step`; written by the host after each block: `constrain`; all ones and unconstrained by
    `set_requests` / `set_row`).
    canvas_ids: int64 [B, C], seeded: bool [B, C], pinned: bool [B, C]: the row's canvas (`canvas.py`) for its
    block in flight -- its start canvas takes `canvas_ids` where `seeded`, and its steps hold them where `pinned`
    (`sampler.pin`); written by the host when a row is admitted and when its block is finalised (`pin`); all free
    (False) by `set_requests` / `set_row`, and a row with every position free gets exactly its unpinned tokens.
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
    constrained: torch.Tensor
    allowed: torch.Tensor
    canvas_ids: torch.Tensor
    seeded: torch.Tensor
    pinned: torch.Tensor

    @classmethod
    def allocate(cls, model: DiffusionGemma, rows: int, block_size: int, width: int) -> "StepInputs":
        dev = model.device
        f32, long = dict(dtype=torch.float32, device=dev), dict(dtype=torch.long, device=dev)
        return cls(seeds=torch.zeros(rows, **long), block=torch.zeros(rows, **long),
                   temperature=torch.ones(rows, width, **f32),
                   greedy=torch.zeros(rows, width, dtype=torch.bool, device=dev), budget=torch.ones(rows, **long),
                   entropy_bound=torch.ones(rows, **f32), confidence=torch.zeros(rows, **f32),
                   ids=torch.zeros(rows, block_size, **long), n_new=torch.zeros(rows, **long),
                   constrained=torch.zeros(rows, dtype=torch.bool, device=dev),
                   allowed=torch.full((rows, bitmask_words(model.config.vocab_size)), -1, dtype=torch.int32,
                                      device=dev),
                   canvas_ids=torch.zeros(rows, block_size, **long),
                   seeded=torch.zeros(rows, block_size, dtype=torch.bool, device=dev),
                   pinned=torch.zeros(rows, block_size, dtype=torch.bool, device=dev))

    def view(self, rows: int) -> "StepInputs":
        """The first `rows` rows (views of these buffers)."""
        return _rows_view(self, rows)

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
        self.constrained.fill_(False)
        self.allowed.fill_(-1)
        self.seeded.fill_(False)
        self.pinned.fill_(False)

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
        self.constrained[row] = False
        self.allowed[row] = -1
        self.seeded[row] = False
        self.pinned[row] = False

    def constrain(self, row: int, bitmask_W: torch.Tensor) -> None:
        """Make `row` constrained with next-token bitmask `bitmask_W` (int32 [W], `constraint.RowGrammar.bitmask`)
        for its next block's first position (a host write between steps; nothing recompiles)."""
        self.constrained[row] = True
        self.allowed[row].copy_(bitmask_W)

    def pin(self, row: int, ids: Sequence[int], seeded: Sequence[bool], pinned: Sequence[bool]) -> None:
        """Write `row`'s canvas for its next block (or the block its admission begins): C token ids, which positions
        are seeded and which pinned (`canvas.Canvas.block_slice`); a host write between steps, nothing recompiles."""
        dev = self.canvas_ids.device
        self.canvas_ids[row] = torch.tensor(ids, dtype=torch.long, device=dev)
        self.seeded[row] = torch.tensor(seeded, dtype=torch.bool, device=dev)
        self.pinned[row] = torch.tensor(pinned, dtype=torch.bool, device=dev)


def denoise_step(model: DiffusionGemma, cache: KVCache, state: DenoiseState, inputs: StepInputs,
                 plan: PlanBuffers | None = None, *, stop_early: bool, moe_impl: str, commit: bool = False,
                 kernel_options: dict | None = None) -> None:
    """One denoise step over all rows, in place: each row's temperature from its table at its step counter k and
    its noise from `rng.step_noise` at step n = budget - k (drawn here, inside the step); count the pass for live
    rows; decoder forward with self-conditioning where `has_sc`; `sampler.denoise_update` (sampling, entropy-bound
    acceptance, renoise, stable-and-confident stop, frozen rows); a row that ran its budget finishes; keep the
    self-conditioning logits (cast to the model dtype, finite) for the next step. `moe_impl`: the routed experts'
    implementation (`kernels.moe.op.resolve_moe_impl`).

    `plan`: the block's denoise plan (masks, RoPE), filled once per block by whatever changed the cache's lengths
    (`encode_chunk`, or this step with `commit`); None: built inside the step.

    `commit=True` (commit fusion, a block's first step only): the forward also commits the previous block, the
    first `inputs.n_new` tokens of `inputs.ids[:, :C]` (`forwards.commit_denoise_block`; the cache needs
    2C block slots), instead of a separate `encode_chunk` before the step; then it fills `plan` for the block's
    later steps.

    `kernel_options`: FlexAttention kernel options by query kind and layer type (`plan.build_plan`) for the plans
    built here (a plan given in `plan` carries its own)."""
    C, V = state.canvas.shape[1], model.config.vocab_size
    k_B1 = state.steps.clamp(max=inputs.temperature.shape[1] - 1)[:, None]
    uniform, renoise = rng.step_noise(inputs.seeds, inputs.block, inputs.budget - state.steps, C, V)
    state.steps.add_((~state.finished).long())
    if commit:
        logits = commit_denoise_block(model, inputs.ids[:, :C], state.canvas, cache, inputs.n_new, moe_impl=moe_impl,
                                      kernel_options=kernel_options, local=True)
        if plan is not None:
            plan.fill()
    else:
        logits = denoise_block(model, state.canvas, cache, None, state.has_sc, moe_impl=moe_impl,
                                     plan=plan.plan if plan is not None else None,
                                     self_conditioning_embeds=state.sc_embeds, kernel_options=kernel_options,
                                     local=True)
    new = denoise_update(state.canvas, state.argmax, state.history, state.finished, logits,
                         inputs.temperature.gather(1, k_B1)[:, 0], inputs.greedy.gather(1, k_B1)[:, 0],
                         StepNoise(uniform=uniform, renoise=renoise), entropy_bound_B=inputs.entropy_bound,
                         confidence_B=inputs.confidence, stop_early=stop_early, allowed_BW=inputs.allowed,
                         constrained_B=inputs.constrained, vocab_shard=model.vocab_shard,
                         pinned_BC=inputs.pinned, pin_ids_BC=inputs.canvas_ids)
    state.canvas.copy_(new.canvas)
    state.argmax.copy_(new.argmax)
    state.history.copy_(new.history)
    state.finished.copy_(new.finished | (state.steps >= inputs.budget))
    state.sc_embeds.copy_(_self_conditioning(model, new, inputs))
    state.has_sc.fill_(True)
    _keep_frame(state, new)
    _keep_logprobs(state, logits, new.argmax, model.vocab_shard)


def encode_chunk(model: DiffusionGemma, cache: KVCache, inputs: StepInputs, plan: PlanBuffers | None = None, *,
                 moe_impl: str, kernel_options: dict | None = None) -> None:
    """One causal encoder pass over `inputs.ids` with `inputs.n_new` real tokens per row (prefill chunk or commit);
    writes their keys/values and advances `cache.lengths`; then fills `plan` (if given), the denoise plan for the
    new lengths, which the next block's steps read. `kernel_options` as in `denoise_step`."""
    encode_block(model, inputs.ids, cache, inputs.n_new, moe_impl=moe_impl, kernel_options=kernel_options)
    if plan is not None:
        plan.fill()




def logprobs(logits_BCV: torch.Tensor, tokens_BC: torch.Tensor, k: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of one step at temperature 1 (the model's own distribution, softcapped: vLLM's default
    "raw" logprobs; the temperature schedule only shapes sampling): (log p(tokens) float32 [B, C], the k most
    likely ids int64 [B, C, k], their log p float32 [B, C, k], in descending order). Tensor ops only."""
    lse = torch.logsumexp(logits_BCV, dim=-1, keepdim=True)
    token = (logits_BCV.gather(-1, tokens_BC[..., None]) - lse)[..., 0]
    if k == 0:
        empty = logits_BCV.new_zeros(*tokens_BC.shape, 0)
        return token, empty.long(), empty
    top, ids = logits_BCV.topk(k, dim=-1)
    return token, ids, top - lse


def refresh_plan(rows: RowState, state: DenoiseState, plan: PlanBuffers) -> None:
    """Fill the mixed plan from the rows' phases and the cache's lengths (`phases.forward_mode`): PREFILL rows encode
    their next chunk (min(C, prompt tokens left) real), COMMIT rows encode `rows.commit_len` tokens (C, or a
    constrained row's kept prefix; with commit fusion: the commit and its next block's first denoise step), DENOISE rows denoise (self-conditioned where `state.has_sc`), FREE
    rows are idle. Tensor ops only: run inside the compiled step for the next iteration, and eagerly by a driver
    after it changed a row (admission, retirement) or the bucket size."""
    C, ph = state.canvas.shape[1], rows.phase
    mode = forward_mode(ph, fused=plan.T != C)
    n_new = torch.where(ph == PREFILL, (rows.prompt_len - rows.prefilled).clamp(0, C),
                        torch.where(ph == COMMIT, rows.commit_len, 0))
    plan.fill(mode=mode, n_new=n_new, self_conditioning=state.has_sc & (ph == DENOISE))


def mixed_step(model: DiffusionGemma, cache: KVCache, state: DenoiseState, inputs: StepInputs, rows: RowState,
               plan: PlanBuffers, *, stop_early: bool, moe_impl: str, skip_idle_vocabulary: bool = False) -> None:
    """One iteration over every row, in place, no host synchronisation (see the module docstring) -- but one host
    read of "some row steps" with `skip_idle_vocabulary` (below; on CPU only by default).

    Reads the plan `refresh_plan` filled for the current phases (T = `plan.T` tokens per row: C, or 2C with commit
    fusion). The forward's ids per row, int64 [B, T]: the next prompt chunk (PREFILL), the argmax canvas (COMMIT;
    fused: followed by the next block's start canvas), the canvas (DENOISE; fused: in the first half) or zeros
    (FREE). Stepping rows (`phases.stepping`): temperature from the row's table at its step counter k, noise from
    `rng.step_noise` at step n = budget - k, `sampler.denoise_update`, step count, finished flags. Transitions: a
    row whose prompt is encoded and (unfused) a commit row begin their next block (start canvas from the request's
    own stream, `rng.start_canvas`); a stepping row whose block finished (stopped early or ran its budget) becomes
    COMMIT, or FREE when the request ended on the device (`finish.request_done`). `inputs.block` advances on commit.
    Then the report (`rows.RowState.report`, int64 [B, K], `rows.Report` columns: prompt tokens encoded, prefilled,
    stepped, committed, block, steps, event, done): what each row did, the host's only view of the transitions.
    Last, the plan of the next iteration.

    `skip_idle_vocabulary` (`CompileOptions.skip_idle_vocabulary`): where no row steps, the vocabulary region (the
    lm_head, `sampler.denoise_update`, the self-conditioning product, logprobs) is skipped -- `torch.cond` compiled,
    a Python branch eagerly -- and the state keeps its values there (read only for rows that stepped): the same
    tokens.

    Run uncompiled (an eager bucket, or a compiled one's step held while it compiles), attention reads the plan's
    dense masks (`PlanBuffers.eager_plan`) instead of FlexAttention's slow eager path; the start canvas and the noise
    come from one `rng.step_streams` call either way (the same bits as `rng.start_canvas` and `rng.step_noise`)."""
    C, V, T = state.canvas.shape[1], model.config.vocab_size, plan.T
    fused = T != C
    ph = rows.phase
    prefill, denoising, commit = ph == PREFILL, ph == DENOISE, ph == COMMIT
    stepping = stepping_rows(ph, fused=fused)
    i_C = torch.arange(C, device=ph.device)
    # a commit begins the row's next block: with fusion in this very forward (its first step), else after it
    block = inputs.block + commit.long()
    steps_in = torch.where(commit, 0, state.steps) if fused else state.steps
    # the start canvas of a block that begins and the noise of a stepping row's step n = budget - k, in one draw
    start, uniform, renoise = rng.step_streams(inputs.seeds, block, inputs.budget - steps_in, C, V)
    start = torch.where(inputs.seeded, inputs.canvas_ids, start)  # a seeded canvas (`canvas.py`): its tokens
    if fused:
        first = commit[:, None]
        canvas, argmax = torch.where(first, start, state.canvas), torch.where(first, start, state.argmax)
        history = torch.where(commit[None, :, None], -1, state.history)
    else:
        canvas, argmax, history = state.canvas, state.argmax, state.history
    # the forward's ids
    at = (rows.prefilled[:, None] + i_C[None, :]).clamp(max=rows.prompt.shape[1] - 1)
    chunk = torch.where(i_C[None, :] < plan.n_new[:, None], rows.prompt.gather(1, at), 0)
    ids = torch.where(prefill[:, None], chunk, torch.where(commit[:, None], state.argmax,
                                                           torch.where(denoising[:, None], canvas, 0)))
    if fused:  # [B, 2C]: the second half is a commit row's new canvas, idle otherwise
        ids = torch.cat([ids, torch.where(commit[:, None], canvas, 0)], dim=1)
    # stepping rows: as `denoise_step`, every other row frozen
    k_B1 = steps_in.clamp(max=inputs.temperature.shape[1] - 1)[:, None]
    steps = steps_in + stepping.long()
    # run uncompiled (a driver's eager step), attention reads dense masks instead of FlexAttention's eager path
    fplan = plan.plan if torch.compiler.is_compiling() else plan.eager_plan()
    hidden = model.forward_plan(ids, cache, fplan, state.sc_embeds, moe_impl=moe_impl)
    if fused:  # each row's canvas: the second half of a commit + denoise row, the first half of the others
        hidden = torch.where(commit[:, None, None], hidden[:, C:], hidden[:, :C])
    temperature_B, greedy_B = inputs.temperature.gather(1, k_B1)[:, 0], inputs.greedy.gather(1, k_B1)[:, 0]
    noise = StepNoise(uniform=uniform, renoise=renoise)

    def sample() -> tuple[torch.Tensor, ...]:  # the vocabulary region: the lm_head, the sampler, self-conditioning
        logits = model.logits(hidden, local=True)  # under tensor parallel the rank's vocabulary slice, never gathered
        new = denoise_update(canvas, argmax, history, ~stepping, logits, temperature_B, greedy_B, noise,
                             entropy_bound_B=inputs.entropy_bound, confidence_B=inputs.confidence,
                             stop_early=stop_early, allowed_BW=inputs.allowed, constrained_B=inputs.constrained,
                             vocab_shard=model.vocab_shard, pinned_BC=inputs.pinned, pin_ids_BC=inputs.canvas_ids)
        # torch 2.13's rules and bugs for a `torch.cond` branch shape this: no input among the outputs (finished may
        # be the input unchanged, hence the copy); the history, a view of the argmax when P = 1, is pushed after the
        # branch (Inductor's C++ wrapper moves a branch output before taking a view of it: a crash); the accepted
        # mask crosses as float32 (a vectorized bool [B, C] output of a branch was stored as int32 lanes, past its
        # end: tests/step/test_frames.py caught it)
        return (new.canvas, new.argmax, new.finished.clone(), _self_conditioning(model, new, inputs),
                new.accepted.float(), new.entropy.mean(dim=-1),
                *_logprobs_of(state, logits, new.argmax, model.vocab_shard))

    def hold() -> tuple[torch.Tensor, ...]:  # no row samples: what `sample` gives them, and the state's own values
        kept = (state.logprob, state.top_ids, state.top_logprobs) if state.logprob.shape[1] else ()
        return (canvas.clone(), argmax.clone(), ~stepping, state.sc_embeds.clone(), state.accepted.float(),
                state.entropy.clone(), *(t.clone() for t in kept))

    if not skip_idle_vocabulary:
        region = sample()
    elif torch.compiler.is_compiling():
        region = torch.cond(stepping.any(), sample, hold)
    else:
        region = sample() if bool(stepping.any()) else hold()
    (new_canvas, new_argmax, new_finished, sc_embeds, accepted, entropy, *kept) = region
    new_history = push_history(history, new_argmax) if stop_early else history  # as `denoise_update`'s
    ended = stepping & (new_finished | (steps >= inputs.budget))
    # a constrained row's end is the host's (its grammar decides what of the block is kept: `finish.py`)
    done = ended & ~inputs.constrained & request_done(new_argmax, rows.emitted, rows.max_new, rows.eos,
                                                      rows.ignore_eos)
    # transitions: a row whose prompt is encoded (and, unfused, a commit row) begins its next block
    prefilled = rows.prefilled + torch.where(prefill, plan.n_new, 0)
    begin = (prefill & (prefilled >= rows.prompt_len)) | (commit & (not fused))
    begin_BC = begin[:, None]
    state.canvas.copy_(torch.where(begin_BC, start, new_canvas))
    state.argmax.copy_(torch.where(begin_BC, start, new_argmax))
    state.history.copy_(torch.where(begin[None, :, None], -1, new_history))
    state.steps.copy_(torch.where(begin, 0, steps))
    state.sc_embeds.copy_(sc_embeds)
    state.accepted.copy_(accepted != 0)
    state.entropy.copy_(entropy)
    for dst, src in zip((state.logprob, state.top_ids, state.top_logprobs), kept):
        dst.copy_(src)
    state.has_sc.copy_(torch.where(begin, False, state.has_sc | stepping))
    inputs.block.copy_(block)
    rows.prefilled.copy_(prefilled)
    rows.emitted.add_(torch.where(ended, C, 0))
    # what each row did, for the host (`rows.Report` columns): its one read per iteration
    rows.report.copy_(torch.stack([torch.where(prefill, plan.n_new, 0), prefilled, stepping.long(), commit.long(),
                                   block, state.steps, ended.long(), done.long()], dim=1))
    phase = torch.where(begin, DENOISE, torch.where(ended, torch.where(done, FREE, COMMIT),
                                                    torch.where(commit, DENOISE, ph)))
    rows.phase.copy_(phase)
    state.finished.copy_(phase != DENOISE)
    refresh_plan(rows, state, plan)


def _self_conditioning(model: DiffusionGemma, new, inputs: StepInputs) -> torch.Tensor:
    """The next step's self-conditioning embeddings [B, C, D]: the soft embedding of the step's probabilities
    (`sampler.StepUpdate.sc_probs`; under tensor parallel this rank's slice), pinned positions their token's row
    (`DiffusionGemma.self_conditioning_embedding`: at D width, not a one-hot over the vocabulary)."""
    return model.self_conditioning_embedding(new.sc_probs, local=True, pinned_BT=inputs.pinned,
                                             ids_BT=inputs.canvas_ids)


def _keep_frame(state: DenoiseState, new) -> None:
    """The step's acceptance mask and mean entropy into the state (every row; the host reads a row's only when its
    request asked for live canvas frames: `frames.py`). Values of the step already computed: no token depends on
    them."""
    state.accepted.copy_(new.accepted)
    state.entropy.copy_(new.entropy.mean(dim=-1))


def _logprobs_of(state: DenoiseState, logits_BCV: torch.Tensor, argmax_BC: torch.Tensor, vocab_shard=None
                 ) -> tuple[torch.Tensor, ...]:
    """The step's `logprobs` of its argmax canvas for the state's buffers (logprob, top_ids, top_logprobs), or ()
    when the state keeps none (a static shape: no branch at run time). `vocab_shard`: under tensor parallel, the
    logits are the rank's slice and its `logprobs` computes them."""
    if state.logprob.shape[1] == 0:
        return ()
    of = logprobs if vocab_shard is None else vocab_shard.logprobs
    return of(logits_BCV, argmax_BC, state.top_ids.shape[-1])


def _keep_logprobs(state: DenoiseState, logits_BCV: torch.Tensor, argmax_BC: torch.Tensor, vocab_shard=None) -> None:
    """The step's `logprobs` of its argmax canvas into the state (every row: the host reads a row's only in the
    iteration its block finished); nothing when the state keeps none."""
    for dst, src in zip((state.logprob, state.top_ids, state.top_logprobs),
                        _logprobs_of(state, logits_BCV, argmax_BC, vocab_shard)):
        dst.copy_(src)
