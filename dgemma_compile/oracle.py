"""The eager reference block-diffusion generator: the oracle every compiled path is tested against.

The loop of transformers' `DiffusionGemmaGenerationMixin.generate` (`generation_diffusion_gemma.py`):
prefill; per block: a uniform random canvas, denoise steps n = N..1 (temperature schedule, sampling, entropy-bound
acceptance, renoise, stable-and-confident stop with per-row frozen state), commit of the argmax canvas with an
encoder pass, eos -> pad. Deliberate differences, each tested:
- `max_new_tokens` is exact (the block that crosses it is truncated); the reference rounds up to whole canvases.
- each request draws from its own counter-based random stream (`rng.py`, Philox4x32-10 keyed by its seed) and
  sampling uses one uniform per position (a chunked inverse CDF, `sampler.SCHEME`) instead of `torch.multinomial`,
  so a request's tokens depend only on its prompt, seed and config, never on its batch mates. Rows that finished
  are frozen instead of denoised further.
- a constant temperature (t_min == t_max) is allowed, and temperatures below float32's smallest normal are greedy.
- a per-request stop hook can end requests after any block (finish_reason "stop").
- a request may carry a `constraint.Constraint` (regex, choice, JSON schema, JSON object): its text is then always
  valid (docs/constrained.md): each block keeps and commits only the prefix its grammar accepts.
- a request may carry a seeded or pinned canvas (`canvas.py`): its blocks start from its tokens, pinned positions
  hold them through every step and the commit writes them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .inputs.constraint import Constraint, RowGrammar, resolve_constraints, row_grammars
from .inputs.images import Image, ImagePrompt, prefill_images
from .inputs.images import prepare as prepare_images
from .kernels.moe.op import resolve_moe_impl
from .model.backbone import DiffusionGemma
from .model.config import DEFAULT_MAX_SEQ_LEN, ConfigError, GenerationConfig
from .model.plan import PlanBuffers
from .step import rng
from .step.canvas import Canvas, resolve_canvases
from .step.finish import finalize
from .step.frames import CanvasFrame, FrameCallback, frame_callbacks, frame_rows
from .step.mixed_step import DenoiseState, StepInputs, denoise_step, encode_chunk
from .step.observe import STEP, Observer, SpanTimer
from .step.requests import (BlockCallback, GenerationOutput, RequestStats, StopHook, check_slots,
                            constrained_slots, plan_requests)
from .step.sampler import step_scheme
from .step.stop_check import StopCheck


@torch.no_grad()
def generate(model: DiffusionGemma, prompts: Sequence[Sequence[int]],
             config: GenerationConfig | Sequence[GenerationConfig] | None = None, *,
             seed: int | Sequence[int] = 0, on_block: BlockCallback | None = None, stop: StopHook | None = None,
             observer: Observer | None = None, moe_impl: str = "auto",
             max_seq_len: int = DEFAULT_MAX_SEQ_LEN, fuse_commit: bool = False,
             images: Sequence[Sequence["Image"] | None] | None = None,
             constraint: Constraint | Sequence[Constraint | None] | None = None, tokenizer=None,
             on_frame: FrameCallback | Sequence[FrameCallback | None] | None = None,
             canvas: "str | Sequence[str | Sequence[int | None] | Canvas | None] | None" = None) -> GenerationOutput:
    """Generate continuations of `prompts` (lists of token ids) by block diffusion, eagerly.

    Args:
        model: a loaded `DiffusionGemma`.
        prompts: B token-id sequences of any lengths (>= 1).
        config: generation parameters: one for every request, or one per request (they may differ in everything but
            `STRUCTURAL`); default `model.generation_config` (or the reference defaults).
        seed: one seed for every request, or one per request. A request's output depends only on its prompt, its
            seed and the config.
        on_block: called after each finalised block (see `BlockCallback`).
        stop: per-request host stop hook, called after each finalised block (see `StopHook`).
        observer: receives per-step timings (`observe.Observer`).
        moe_impl: the routed experts' implementation: "auto" (the eager rule of `kernels.moe.op.resolve_moe_impl`: "loop",
            transformers' summation order), or "loop" | "grouped" | "dense" | "gathered" (to reproduce a compiled generator's
            numerics: pass its `moe_impl`). The output's `moe_impl` says which ran.
        max_seq_len: committed slots per row of the KV cache (as `CompileOptions.max_seq_len`). Fixed by the caller,
            never sized to the batch: attention reduces over every slot, so a cache sized to the longest prompt of
            the call would make a row's logits (and, at a near tie, its tokens) depend on its batch mates.
        fuse_commit: run each commit inside the next block's first denoise step, one forward of 2C tokens (as the
            compiled generator does with `CompileOptions.fuse_commit`); off: a separate encoder pass, the
            reference's order. The two differ only by float reduction order.
        images: per prompt, its images (`images.Image`, one per run of image placeholders, in order) or None: the
            prompt's image prefix is encoded first, in forwards of its own (`images.prefill_images`), the rest of the
            prompt in chunks as any prompt. None: no prompt has images.
        constraint: a `constraint.Constraint` for every request, or one (or None: unconstrained) per request; a
            constrained request's text is a full match of its regex / one of its choices / JSON valid under its
            schema when it ends with "eos", and a valid prefix of one when it ends with "length" (the budget ran out
            first). Unconstrained requests get exactly the tokens they get without (docs/constrained.md).
        tokenizer: the checkpoint's tokenizer (`dg.load_tokenizer`); required with a constraint.
        on_frame: live canvas frames (`frames.py`): one `frames.FrameCallback` for every request, or one (or None)
            per request; `on_frame(i, frame)` after each denoise step request i took (its block's argmax canvas,
            accepted positions, mean entropy), before the `on_block` of the block that step ended. One host read
            per step for the requests that asked; frames never change tokens.
        canvas: seeded and pinned canvases (`canvas.py`): a text template for every request (`canvas.BLANK` "_" is
            one free position, the rest pinned; needs `tokenizer`), or one per request: None, a template, token ids
            with None for free positions, or a `canvas.Canvas` (`pinned=False`: a warm start that is not held). It
            covers the request's first output positions, split over consecutive blocks; pinned positions come back
            unchanged (unless an eos before them ends the request, or a grammar rejects them), free ones are
            generated. Requests without one get exactly the tokens they get without.
    Returns:
        `GenerationOutput` with sequences and per-request statistics.
    Raises:
        ConfigError: invalid config, seed or prompts (empty, ids outside the vocabulary, longer than the context);
            `max_seq_len` not a positive integer or smaller than the committed slots a request needs; `fuse_commit`
            not a bool; images that do not fit their prompts (`images.prepare`); a constraint without a tokenizer,
            with `ignore_eos`, or malformed (`constraint.Constraint`); `on_frame` not callables; a bad `canvas`
            (`canvas.resolve_canvases`: wrong count, ids outside the vocabulary, longer than max_new_tokens, text
            without a tokenizer).
        constraint.ConstraintError: a constraint the grammar library cannot compile.
    """
    cfgs, prompts, seeds, needed = plan_requests(model, prompts, config, seed)
    frames = frame_callbacks(on_frame, len(prompts))
    grammars = row_grammars(model, resolve_constraints(constraint, len(prompts)), cfgs, tokenizer)
    canvases = resolve_canvases(canvas, len(prompts), cfgs, model.config.vocab_size, tokenizer)
    check_slots(max(needed, constrained_slots(prompts, cfgs, grammars)), max_seq_len, "max_seq_len")
    items = prepare_images(model, prompts, images)
    if not isinstance(fuse_commit, bool):
        raise ConfigError("fuse_commit", f"must be a bool, got {fuse_commit!r}")
    impl = resolve_moe_impl(moe_impl, dtype=model.dtype, num_experts=model.config.num_experts,
                            top_k=model.config.top_k_experts, compiled=False, quant=model.expert_quant)
    runner = EagerSteps(model, cfgs, seeds, max_seq_len, impl, fuse_commit)
    out = run_block_diffusion(model, runner, prompts, cfgs, on_block=on_block, stop=stop,
                              timer=SpanTimer(model.device, observer), images=items, moe_impl=impl,
                              grammars=grammars, on_frame=frames, canvases=canvases)
    out.moe_impl, out.fuse_commit = impl, fuse_commit
    return out


def run_block_diffusion(model: DiffusionGemma, runner: "EagerSteps", prompts: list[list[int]],
                        cfgs: list[GenerationConfig], *, on_block: BlockCallback | None = None,
                        stop: StopHook | None = None, timer: SpanTimer | None = None,
                        stop_check: StopCheck | None = None, images: "list[ImagePrompt | None] | None" = None,
                        moe_impl: str | None = None, grammars: Sequence[RowGrammar | None] | None = None,
                        on_frame: "Sequence[FrameCallback | None] | None" = None,
                        canvases: "Sequence[Canvas | None] | None" = None) -> GenerationOutput:
    """The block loop over validated inputs (`plan_requests`), driving `runner` (the reference steps, built for these
    requests and seeds): prefill in fixed chunks (a prompt with `images` (`images.prepare`): its image prefix first,
    `images.prefill_images` into the runner's cache with `moe_impl`, then the rest in chunks); per block: start canvases, denoise steps until every row finished
    (stopped early or ran its step budget), finalise (eos, budget, `on_block`, `stop`), commit the argmax canvas of
    rows still running (`runner.commit`: now, or fused into the next block's first step). The host reads one flag
    per step, when `stop_check` says (default: "sync", every step); everything else stays on the device.
    `grammars`: per request its `constraint.RowGrammar` (fresh) or None: a constrained request's blocks keep and
    commit the prefix its grammar accepts (`finish.finalize_constrained`), its next block's first position masked
    with the grammar's next-token bitmask; it may take up to max_new_tokens blocks. `on_frame`: per request its
    `frames.FrameCallback` or None: after each step, one host read of the asking rows' frames (`EagerSteps.frames`),
    each passed on where the row stepped. `canvases`: per request its `canvas.Canvas` or None: before each block, the
    host writes the slice of its canvas that starts at the tokens it kept so far (`EagerSteps.pin`)."""
    dev, C = model.device, model.config.canvas_length
    R = len(prompts)
    timer = timer or SpanTimer(dev, None)
    stop_check = stop_check or StopCheck("sync")
    out = GenerationOutput(sequences=[[] for _ in range(R)], stats=[RequestStats() for _ in range(R)],
                           scheme=step_scheme(model))
    sequences, stats = out.sequences, out.stats
    grammars = list(grammars) if grammars is not None else [None] * R
    num_blocks = max(c.max_new_tokens if g is not None else math.ceil(c.max_new_tokens / C)
                     for c, g in zip(cfgs, grammars))
    max_steps = max(c.max_denoising_steps for c in cfgs)
    rest = list(prompts)  # what the chunked prefill encodes: all of a prompt, or what follows its image prefix
    for r, item in enumerate(images or []):
        if item is not None:
            prefill_images(model, runner.cache, r, prompts[r], item, chunk=C, moe_impl=moe_impl)
            rest[r] = prompts[r][item.prefix:]
    lengths = torch.tensor([len(p) for p in rest], device=dev)
    input_ids = torch.full((R, int(lengths.max())), cfgs[0].pad_token_id, dtype=torch.long, device=dev)
    for r, p in enumerate(rest):
        input_ids[r, :len(p)] = torch.tensor(p, device=dev)
    prefill(runner, input_ids, lengths)
    for r, g in enumerate(grammars):
        if g is not None:
            runner.inputs.constrain(r, g.bitmask().to(dev))

    framed = [r for r, cb in enumerate(on_frame or []) if cb is not None]
    done = torch.zeros(R, dtype=torch.bool, device=dev)
    canvases = list(canvases) if canvases is not None else [None] * R
    for block in range(num_blocks):
        for r, cv in enumerate(canvases):
            if cv is not None and not bool(done[r]):
                g = grammars[r]
                runner.inputs.pin(r, *cv.block_slice(len(sequences[r]), C, g.bitmask() if g is not None else None))
        runner.begin_block(block, done)
        stop_check.begin_block()
        seen = [0] * R  # steps of this block each framed row had taken at its latest frame
        for _ in range(max_steps):
            with timer.span(STEP):
                finished = runner.step()
            for r, (steps, frame) in zip(framed, runner.frames(framed, block)):
                if steps > seen[r]:  # the row stepped (a finished row is frozen: no step, no frame)
                    seen[r] = steps
                    on_frame[r](r, frame)
            if stop_check.done(finished.all()):
                break
        argmax, block_steps = runner.result()
        live = (~done).tolist()
        out.forwards_per_block.append(stop_check.steps)
        out.wasted_forwards.append(stop_check.steps - int(block_steps.max()))
        new_tokens = _finalize_block(argmax, done, cfgs, sequences, stats, block_steps, grammars)
        timer.flush(block)
        if on_block is not None:
            on_block(block, new_tokens)
        if stop is not None:
            for r in stop(block, new_tokens):
                if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < R:
                    raise ValueError(f"stop: returned request index {r!r}, not an integer in [0, {R})")
                if live[r]:
                    stats[r].finish_reason, done[r] = "stop", True
        if bool(done.all()) or block == num_blocks - 1:
            break
        # a constrained row commits its kept prefix, its next block's first position masked by the grammar
        commit_len = [C if g is None else len(t) for g, t in zip(grammars, new_tokens)]
        for r, g in enumerate(grammars):
            if g is not None and not bool(done[r]):
                runner.inputs.constrain(r, g.bitmask().to(dev))
        runner.commit(argmax, torch.where(done, 0, torch.tensor(commit_len, device=dev)))
    out.commits, out.fused_commits = runner.commits, runner.fused_commits
    return out


def _finalize_block(argmax_BC: torch.Tensor, done_B: torch.Tensor, cfgs: list[GenerationConfig],
                    sequences: list[list[int]], stats: list[RequestStats], steps_B: torch.Tensor,
                    grammars: list[RowGrammar | None]) -> list[list[int]]:
    """Append each live row's block up to its first eos and its token budget (a constrained row: the prefix its
    grammar accepts); mark rows done (in place)."""
    new_tokens: list[list[int]] = []
    for b in range(argmax_BC.shape[0]):
        if bool(done_B[b]):
            new_tokens.append([])
            continue
        keep, done = finalize(argmax_BC[b].tolist(), cfgs[b], sequences[b], stats[b], int(steps_B[b]), grammars[b])
        if done:
            done_B[b] = True
        new_tokens.append(keep)
    return new_tokens


# ----- the reference loop's steps: uniform passes over static buffers -------------------------------------------

class EagerSteps:
    """The reference loop's steps: `mixed_step.denoise_step` and `mixed_step.encode_chunk` called eagerly over buffers of
    exactly R rows (`state`, `inputs`) and a cache of `max_seq_len` committed slots, with the routed experts run by
    `moe_impl`; every host-side fill of the block loop lives here. With `fuse_commit`, `commit` only fills the
    inputs and the next `step` runs the fused commit + first denoise step (`denoise_step(commit=True)`: one forward
    of 2C tokens, the cache holding 2C block slots). Tensors are [R, ...] for the R requests of the call."""

    def __init__(self, model: DiffusionGemma, cfgs: Sequence[GenerationConfig], seeds: Sequence[int],
                 max_seq_len: int, moe_impl: str, fuse_commit: bool = False):
        structural = cfgs[0]
        C = model.config.canvas_length
        self.R, self.fuse_commit = len(cfgs), fuse_commit
        self.cache = model.new_cache(self.R, max_seq_len, block_size=2 * C if fuse_commit else C)
        """The rows' cache (image prefixes are written into it before the chunked prefill)."""
        self.state = DenoiseState.allocate(model, self.R,
                                           structural.stability_threshold if structural.stop_early else 0)
        self.inputs = StepInputs.allocate(model, self.R, C, max(c.max_denoising_steps for c in cfgs))
        self.plan = PlanBuffers(model, self.cache, C)
        self.model, self.moe_impl, self.stop_early = model, moe_impl, structural.stop_early
        self.block_size = self.inputs.ids.shape[1]
        """T: tokens per encoder chunk (prefill chunks, and commits without fusion, are padded to it)."""
        self.vocab_size = model.config.vocab_size
        self.commit_pending = False
        self.commits = self.fused_commits = 0  # commits run as their own encoder pass / fused into a step, per request
        self.inputs.set_requests(cfgs, seeds)
        self.cache.reset()

    def encode_chunk(self, ids_RT: torch.Tensor, n_new_R: torch.Tensor) -> None:
        """Causal pass over T' <= T tokens, n_new_R[r] of row r real: a prefill chunk (or an unfused commit, through
        `commit`); writes the KV."""
        self._set_chunk(ids_RT, n_new_R)
        encode_chunk(self.model, self.cache, self.inputs, self.plan, moe_impl=self.moe_impl)

    def _set_chunk(self, ids_RT: torch.Tensor, n_new_R: torch.Tensor) -> None:
        inp, R = self.inputs, self.R
        inp.ids.zero_()
        inp.ids[:R, :ids_RT.shape[1]] = ids_RT
        inp.n_new.zero_()
        inp.n_new[:R] = n_new_R

    def commit(self, ids_RC: torch.Tensor, n_new_R: torch.Tensor) -> None:
        """Commit a finished block (its argmax canvas, n_new_R[r] tokens of row r: C, or 0 for a done row) before
        the next block begins: an encoder pass now, or (commit fusion) deferred into the next block's first `step`,
        which then runs one forward for both."""
        rows = int((n_new_R > 0).sum())  # the requests whose block this commits
        if not self.fuse_commit:
            self.encode_chunk(ids_RC, n_new_R)
            self.commits += rows
            return
        self._set_chunk(ids_RC, n_new_R)  # copied now: the next block's begin_block resets the argmax buffer
        self.commit_pending = True
        self.fused_commits += rows

    def begin_block(self, block: int, frozen_R: torch.Tensor) -> None:
        """Start block `block` (0-based, per request) from each request's start canvas (`rng.start_canvas`, its
        seeded positions' tokens where it has a canvas: `StepInputs.seeded`); rows in `frozen_R` (done requests) stay
        frozen."""
        inp, R, C = self.inputs, self.R, self.state.canvas.shape[1]
        inp.block.fill_(block)
        start = rng.start_canvas(inp.seeds[:R], inp.block[:R], C, self.vocab_size)
        self.state.begin(torch.where(inp.seeded[:R], inp.canvas_ids[:R], start), frozen_R)

    def step(self) -> torch.Tensor:
        """One denoise step (every per-step value is already on the device); returns the finished flags, bool [R].
        A row finishes when it stops early or has run its step budget."""
        denoise_step(self.model, self.cache, self.state, self.inputs, self.plan, stop_early=self.stop_early,
                     moe_impl=self.moe_impl, commit=self.commit_pending)
        self.commit_pending = False
        return self.state.finished[:self.R]

    def frames(self, rows: list[int], block: int) -> list[tuple[int, CanvasFrame]]:
        """Per row of `rows`: (its steps of block `block` so far, its live canvas frame after the latest step); one
        host read for all of them (float64: token ids are exact)."""
        if not rows:
            return []
        st, C = self.state, self.state.canvas.shape[1]
        idx = torch.tensor(rows, device=st.argmax.device)
        values = torch.cat([st.argmax[idx].double(), st.accepted[idx].double(), st.entropy[idx].double()[:, None],
                            st.steps[idx].double()[:, None]], 1).tolist()
        return [(int(v[-1]), CanvasFrame(block, int(v[-1]), tokens, accepted, entropy))
                for v, (tokens, accepted, entropy) in zip(values, frame_rows([v[:-1] for v in values], C))]

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's argmax canvas int64 [R, C] (what gets committed) and decoder passes int64 [R]."""
        return self.state.argmax[:self.R], self.state.steps[:self.R]


def prefill(runner: EagerSteps, input_ids_RT: torch.Tensor, lengths_R: torch.Tensor) -> None:
    """Encode right-padded prompts in fixed chunks of `runner.block_size` (the last one padded), so that prefill
    runs the same shapes whatever the prompt lengths."""
    T = runner.block_size
    for start in range(0, input_ids_RT.shape[1], T):
        runner.encode_chunk(input_ids_RT[:, start:start + T], (lengths_R - start).clamp(0, T))
