"""The mixed-phase step: one forward per serving iteration over a bucket of rows in different phases.

Every row of a bucket is in one phase, held on the device (`RowState.phase`, int64 [B]):
- FREE: no request; the row is idle in the forward (`plan.IDLE`).
- PREFILL: its next prompt chunk (up to C tokens, gathered on the device from `RowState.prompt`) is an encoder row.
- DENOISE: its canvas is a denoise row; the sampler and the per-row state update apply to it only.
- COMMIT: its finished block (the argmax canvas, C tokens) is an encoder row that writes the cache (with commit
  fusion, followed in the same row by its next block's first denoise step).

`mixed_step` runs the forward of all rows under the plan held in `plan.PlanBuffers(mixed=True)` (built before the
call: Inductor's CPU flex template rejects masks computed inside the graph that uses them), samples, and then decides
every phase transition on the device: a prefill row whose prompt is encoded and a commit row begin their next block
(its start canvas from the request's own stream, `rng.start_canvas`; fused, the commit row has already taken that
block's first step in the commit's own iteration); a denoise row whose block finished (stopped early or ran its
budget) raises `RowState.event`, and becomes COMMIT, or FREE when the request ended on the device (an eos inside
its token budget, or the budget reached: `generate.finalize_row`'s rule). Last, it fills the plan for the next
iteration from the new phases (`refresh_plan`, in the graph). The host reads `event` once per iteration (a [B] flag
read) and the finished rows' tokens; it changes the device state only to admit a request, or to retire one the
device did not (stop strings, cancellation), after which it calls `refresh_plan` once before the next step.

Numerics: each row's tokens equal its solo `generate` run's (chunks of C; commits fused or not as the bucket's):
encoder rows and denoise rows compute what the encoder / denoise passes compute (same queries, visible keys and
self-conditioning), given row-invariant GEMMs and experts (`moe_impl` "dense" eagerly; compiled, the bucket's).

KV memory: the cache is a static `KVCache` or a `kv_cache.PagedKVCache` (`MixedBucket(page_size=...)` eagerly, the
cache of `gen.bucket(B, page_size=...)` compiled); the step is the same either way (the model reads and writes through
the cache's `layer_kv` / `write_block`; the page table is a graph input, so page changes never recompile). The engine
maps a row's pages before it admits the request (`runtime/kv_memory.py`); a prefix-cache hit of h tokens starts the
row with `cache.lengths` = `RowState.prefilled` = h, so its prefill chunks are those after the hit.

Commit fusion (`MixedBucket.fuse_commit`: a cache of 2C block slots) makes every row 2C tokens (`plan.build_plan`
with `canvas=C`): a COMMIT row is a `COMMIT_DENOISE` row that commits its finished block in the first half and runs
its next block's first denoise step on the start canvas in the second half (as `steps.denoise_step(commit=True)`); a
DENOISE row holds its canvas in the first half, a PREFILL row its chunk (up to C tokens, as the fused generator's
prefill), the second half idle. A commit then costs no iteration of its own: the iteration after a block's last
step is the next block's first. Each row's tokens equal its solo `generate(fuse_commit=True)` run (bitwise, CPU):
a [2C] row with an idle second half computes what a [C] pass computes (the same queries and visible keys, the idle
keys masked: tests/test_serve.py checks tokens and step counts bitwise). The cost: every row of every iteration is
2C tokens (twice the work of an unfused iteration for denoise rows), so fusion pays where a forward is bound by
reading the weights (a GPU at small batch), not where it is bound by compute (bench/results/mixed_step_*.md).

Legend: B rows, C canvas (the block of every row), V vocab, S committed slots, P stability history.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .. import rng
from ..kv_cache import KVCache, paged_cache
from ..model import DiffusionGemma
from ..plan import DENOISE as DENOISE_MODE
from ..plan import COMMIT_DENOISE, ENCODER, IDLE, PlanBuffers
from ..sampler import StepNoise, denoise_update
from ..steps import DenoiseState, StepInputs

FREE, PREFILL, DENOISE, COMMIT = 0, 1, 2, 3
"""Device phase codes of `RowState.phase` (the values of `engine.Phase`)."""


@dataclass
class RowState:
    """Per-row request state on the device (preallocated; the engine writes a row at admission only).

    phase: int64 [B] (FREE / PREFILL / DENOISE / COMMIT); prompt: int64 [B, S] prompt ids (zero beyond the prompt);
    prompt_len, prefilled: int64 [B], prompt tokens in all / encoded so far; emitted: int64 [B], tokens the request
    gained from its finished blocks (C per block, the exact count being the host's); max_new: int64 [B], the
    request's token budget; event: bool [B], the row's block finished in the latest step; done: bool [B], the
    request ended on the device with that block (eos or budget); eos: int64 [E], the eos ids (shared by all rows).
    """

    phase: torch.Tensor
    prompt: torch.Tensor
    prompt_len: torch.Tensor
    prefilled: torch.Tensor
    emitted: torch.Tensor
    max_new: torch.Tensor
    event: torch.Tensor
    done: torch.Tensor
    eos: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, max_seq_len: int, eos_ids, device) -> "RowState":
        """Every row FREE. `eos_ids`: the structural eos ids (non-empty)."""
        long = dict(dtype=torch.long, device=device)
        return cls(phase=torch.zeros(rows, **long), prompt=torch.zeros(rows, max_seq_len, **long),
                   prompt_len=torch.zeros(rows, **long), prefilled=torch.zeros(rows, **long),
                   emitted=torch.zeros(rows, **long), max_new=torch.ones(rows, **long),
                   event=torch.zeros(rows, dtype=torch.bool, device=device),
                   done=torch.zeros(rows, dtype=torch.bool, device=device),
                   eos=torch.tensor(sorted(eos_ids), **long))

    def admit(self, row: int, prompt: list[int], max_new_tokens: int, prefilled: int = 0) -> None:
        """Put a request into `row` in phase PREFILL (host writes; refresh the plan before the next step).
        `prefilled`: prompt tokens already in the row's cache (a prefix-cache hit; the cache row's length must equal
        it), < len(prompt). Raises ValueError for a prompt longer than the buffer (S)."""
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
        self.phase[row] = PREFILL


def refresh_plan(rows: RowState, state: DenoiseState, plan: PlanBuffers) -> None:
    """Fill the mixed plan from the rows' phases and the cache's lengths: PREFILL rows encode their next chunk
    (min(C, prompt tokens left) real), COMMIT rows encode C tokens (with commit fusion: a `COMMIT_DENOISE` row, the
    commit and its next block's first denoise step), DENOISE rows denoise (self-conditioned where `state.has_sc`),
    FREE rows are idle. Tensor ops only (no host synchronisation): eager between iterations, or inside the compiled
    step."""
    C, ph = state.canvas.shape[1], rows.phase
    commit_mode = COMMIT_DENOISE if plan.T != C else ENCODER
    mode = torch.where(ph == PREFILL, ENCODER, torch.where(ph == COMMIT, commit_mode,
                                                           torch.where(ph == DENOISE, DENOISE_MODE, IDLE)))
    n_new = torch.where(ph == PREFILL, (rows.prompt_len - rows.prefilled).clamp(0, C), torch.where(ph == COMMIT, C, 0))
    plan.fill(mode=mode, n_new=n_new, self_conditioning=state.has_sc & (ph == DENOISE))


def mixed_step(model: DiffusionGemma, cache: KVCache, state: DenoiseState, inputs: StepInputs, rows: RowState,
               plan: PlanBuffers, *, stop_early: bool, moe_impl: str) -> None:
    """One iteration over every row, in place, no host synchronisation (see the module docstring).

    Reads the plan that `refresh_plan` filled for the current phases (T = `plan.T` tokens per row: C, or 2C with
    commit fusion). The forward's ids per row, int64 [B, T]: the next prompt chunk (PREFILL), the argmax canvas
    (COMMIT; fused: followed by the next block's start canvas), the canvas (DENOISE; fused: in the first half) or
    zeros (FREE). Stepping rows (DENOISE; fused: COMMIT too, on its next block): temperature and noise as
    `steps.denoise_step`, `sampler.denoise_update`, step count, finished flags. Then the transitions, `RowState.event`
    / `done`, and the plan for the next iteration. `inputs.block` advances on commit."""
    C, V, T = state.canvas.shape[1], model.config.vocab_size, plan.T
    fused = T != C
    ph = rows.phase
    prefill, denoising, commit = ph == PREFILL, ph == DENOISE, ph == COMMIT
    i_C = torch.arange(C, device=ph.device)
    # a commit begins the row's next block: with fusion in this very forward (its first step), else after it
    block = inputs.block + commit.long()
    start = rng.start_canvas(inputs.seeds, block, C, V)
    if fused:
        first = commit[:, None]
        canvas, argmax = torch.where(first, start, state.canvas), torch.where(first, start, state.argmax)
        history = torch.where(commit[None, :, None], -1, state.history)
        steps_in = torch.where(commit, 0, state.steps)
        stepping = denoising | commit
    else:
        canvas, argmax, history, steps_in, stepping = state.canvas, state.argmax, state.history, state.steps, denoising
    # the forward's ids
    at = (rows.prefilled[:, None] + i_C[None, :]).clamp(max=rows.prompt.shape[1] - 1)
    chunk = torch.where(i_C[None, :] < plan.n_new[:, None], rows.prompt.gather(1, at), 0)
    ids = torch.where(prefill[:, None], chunk, torch.where(commit[:, None], state.argmax,
                                                           torch.where(denoising[:, None], canvas, 0)))
    if fused:  # [B, 2C]: the second half is a commit row's new canvas, idle otherwise
        ids = torch.cat([ids, torch.where(commit[:, None], canvas, 0)], dim=1)
    # stepping rows: as `steps.denoise_step`, every other row frozen
    k_B1 = steps_in.clamp(max=inputs.temperature.shape[1] - 1)[:, None]
    uniform, renoise = rng.step_noise(inputs.seeds, block, inputs.budget - steps_in, C, V)
    steps = steps_in + stepping.long()
    hidden = model.forward_plan(ids, cache, plan.plan, moe_impl=moe_impl, self_conditioning_probs=state.sc_probs)
    if fused:  # each row's canvas: the second half of a commit + denoise row, the first half of the others
        hidden = torch.where(commit[:, None, None], hidden[:, C:], hidden[:, :C])
    logits = model.logits(hidden)
    new = denoise_update(canvas, argmax, history, ~stepping, logits,
                         inputs.temperature.gather(1, k_B1)[:, 0], inputs.greedy.gather(1, k_B1)[:, 0],
                         StepNoise(uniform=uniform, renoise=renoise), entropy_bound_B=inputs.entropy_bound,
                         confidence_B=inputs.confidence, stop_early=stop_early)
    ended = stepping & (new.finished | (steps >= inputs.budget))
    # the request ends on the device where `generate.finalize_row` would end it: eos inside the budget, or budget
    room = rows.max_new - rows.emitted
    eos_at = torch.where((new.argmax[..., None] == rows.eos).any(-1), i_C, C).amin(dim=-1)  # C: no eos
    request_done = ended & (((eos_at < C) & (eos_at < room)) | (room <= C))
    # transitions: a row whose prompt is encoded (and, unfused, a commit row) begins its next block
    prefilled = rows.prefilled + torch.where(prefill, plan.n_new, 0)
    begin = (prefill & (prefilled >= rows.prompt_len)) | (commit & (not fused))
    begin_BC = begin[:, None]
    state.canvas.copy_(torch.where(begin_BC, start, new.canvas))
    state.argmax.copy_(torch.where(begin_BC, start, new.argmax))
    state.history.copy_(torch.where(begin[None, :, None], -1, new.history))
    state.steps.copy_(torch.where(begin, 0, steps))
    state.sc_probs.copy_(new.sc_probs.to(state.sc_probs.dtype))
    state.has_sc.copy_(torch.where(begin, False, state.has_sc | stepping))
    inputs.block.copy_(block)
    rows.prefilled.copy_(prefilled)
    rows.emitted.add_(torch.where(ended, C, 0))
    rows.event.copy_(ended)
    rows.done.copy_(request_done)
    phase = torch.where(begin, DENOISE, torch.where(ended, torch.where(request_done, FREE, COMMIT),
                                                    torch.where(commit, DENOISE, ph)))
    rows.phase.copy_(phase)
    state.finished.copy_(phase != DENOISE)
    refresh_plan(rows, state, plan)


class MixedBucket:
    """B rows served by one mixed-phase step per iteration: the KV cache, `DenoiseState`, `StepInputs` (of a
    compiled `Bucket` when given, else allocated here), a `RowState`, a mixed `PlanBuffers`, and the callables
    `step` (`mixed_step`: compiled as the unit "mixed_step[tag]" of the generator's `UnitFactory`, or eager) and
    `refresh` (`refresh_plan`, eager: run by the engine only after the host changed a row).

    Args:
        model: the model.
        rows: B.
        max_seq_len, max_denoising_steps: the cache's committed slots and the temperature table's width (eager).
        config: the structural config (stability history, stop_early, eos ids); default the model's.
        moe_impl: the experts' implementation of the eager step ("dense": batch-invariant rows).
        fuse_commit: commit fusion in the eager step (rows of 2C tokens, a commit fused with its next block's first
            denoise step; the tokens of `generate(fuse_commit=True)`). Compiled, the generator's
            `CompileOptions.fuse_commit` decides.
        generator, bucket: a `CompiledGenerator` and one of its buckets (`gen.bucket(B)`, static or paged:
            `gen.bucket(B, page_size=...)`) whose buffers and unit factory the compiled step uses.
        page_size, kv_pages: the eager step's cache is a `kv_cache.PagedKVCache` of `kv_pages` pages of `page_size`
            slots (default: the static cache's memory), as `EagerBucket`'s; None: a static cache.
    Raises:
        ConfigError: `page_size` with a compiled bucket (its cache is given).
        ValueError: `kv_cache.new_paged_cache`'s (max_seq_len not a multiple of page_size, a non-positive size).
    """

    units: tuple = ()

    def __init__(self, model: DiffusionGemma, rows: int, *, max_seq_len: int = 256, max_denoising_steps: int = 64,
                 config=None, moe_impl: str = "dense", fuse_commit: bool = False, generator=None, bucket=None,
                 page_size: int | None = None, kv_pages: int | None = None):
        from ..config import ConfigError

        cfg = (config or model.generation_config).resolved(model.config)
        C = model.config.canvas_length
        self.rows = rows
        kernels = None
        if bucket is not None:
            if page_size is not None:
                raise ConfigError("page_size: a compiled bucket brings its cache; pass gen.bucket(B, page_size=...)")
            self.cache, self.state, self.inputs = bucket.cache, bucket.state, bucket.inputs
            kernels = generator.options.attention_kernels()
            moe_impl = generator.moe_impl
            tag = bucket.tag
        else:
            block = 2 * C if fuse_commit else C
            self.cache = (model.new_cache(rows, max_seq_len, block_size=block) if page_size is None else
                          paged_cache(model, rows, max_seq_len, block_size=block, page_size=page_size,
                                      kv_pages=kv_pages))
            self.state = DenoiseState.allocate(model, rows, cfg.stability_threshold if cfg.stop_early else 0)
            self.inputs = StepInputs.allocate(model, rows, C, max_denoising_steps)
        self.fuse_commit = self.cache.block_size == 2 * C
        """Commits run fused with the next block's first denoise step: every row of the forward is [2C] tokens."""
        T = 2 * C if self.fuse_commit else C
        self.plan = PlanBuffers(model, self.cache, T, mixed=True, kernel_options=kernels, static_sparsity=True,
                                canvas=C)
        self.row_state = RowState.allocate(rows, self.cache.max_seq_len, cfg.eos_token_ids, model.device)
        cache, state, inputs, plan, row_state = self.cache, self.state, self.inputs, self.plan, self.row_state

        def step() -> None:
            mixed_step(model, cache, state, inputs, row_state, plan, stop_early=cfg.stop_early, moe_impl=moe_impl)

        self.refresh = lambda: refresh_plan(row_state, state, plan)
        if generator is None:
            self.step = step
        else:
            # the plan's per-token flags are views ([B, 1]) that the graph takes as inputs: own them too, so that
            # the unit may call its graph directly (`units.CompiledUnit._go_direct`)
            views = SimpleNamespace(encoder_tokens=plan.plan.encoder_tokens, denoise_tokens=plan.plan.denoise_tokens)
            owners = (model, cache, state, inputs, plan, row_state, views)
            self.step = generator.units.unit(f"mixed_step[{tag}]", step, owners)
            self.units = (self.step,)
