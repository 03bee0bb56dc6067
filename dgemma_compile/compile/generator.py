"""`build(model)`: the compiled block-diffusion generator over one bucket of rows and its batch sizes.

The generator drives the one step (`mixed_step.mixed_step`) over a `row_table.RowTable` through the one driver
(`driver.Driver`, which the serving engine uses too): it queues the call's requests and admits them into the lowest
free rows (more requests than rows wait and take rows as earlier ones end), runs each iteration at the smallest batch
size that holds the live rows (`RowTable.size_for`), reads the step's per-row report (one [b, K] read per iteration,
then the canvases of the rows whose block finished), finalises those blocks on the host (`finish.finalize`,
`on_block`, `stop`) and retires rows only the host can end (the `stop` hook). Each batch size is one compile unit
(`units.CompiledUnit`, `torch.compile(fullgraph=True, dynamic=False)` over the bucket's static buffers: prefill
chunks, denoise steps, commits and commit fusion in one graph), compiled on first use or by `warmup`; on CUDA
captured as one CUDA graph. Per-step scalars (temperature, bounds, lengths, phases) live in device tensors, so
prompts of other lengths, other block counts and other requests reuse the same graphs.

Numerics: a request's tokens equal its eager `generate(..., moe_impl=gen.moe_impl, fuse_commit=...)` run, whatever
its batch mates, row and batch size, where rows are batch-invariant (`CompileOptions.batch_invariant`, the CPU
default; tests/compile/test_compile.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..inputs.constraint import Constraint, RowGrammar, resolve_constraints, row_grammars
from ..inputs.images import ImagePrompt
from ..inputs.images import prepare as prepare_images
from ..kernels.moe.op import resolve_moe_impl
from ..model.backbone import DiffusionGemma
from ..model.config import ConfigError, GenerationConfig
from ..step.canvas import Canvas, resolve_canvases
from ..step.driver import Driver, Finished
from ..step.frames import FrameCallback, frame_callbacks
from ..step.observe import STEP, UNIT, Observer, SpanTimer
from ..step.phases import Phase
from ..step.requests import (BlockCallback, GenerationOutput, RequestStats, StopHook, check_slots, constrained_slots,
                             plan_requests)
from ..step.row_table import RowTable
from ..step.sampler import step_scheme
from .artifacts import ArtifactStore
from .options import CompileOptions, check_batch_invariant
from .units import CompiledUnit, CudaGraphs, ModelFingerprint, UnitFactory

if TYPE_CHECKING:
    from .background import BackgroundCompile

log = logging.getLogger("dgemma_compile")


@dataclass
class CompiledGenerator:
    """The compiled block-diffusion generator returned by `build`; `generate` has the eager generator's interface
    and outputs. Compiles lazily, per batch size, on first use (or `warmup`)."""

    model: DiffusionGemma
    options: CompileOptions
    graphs: CudaGraphs | None = None  # a CUDA-graph seam for tests; default: real CUDA graphs on CUDA devices
    _row_tables: dict = field(default_factory=dict)
    deferred: bool = False  # steps run eagerly until released (`defer`)
    background: "BackgroundCompile | None" = None

    def __post_init__(self) -> None:
        # the compile cache (`artifacts.ArtifactStore`: steps compiled once load in later processes), unless off
        store = ArtifactStore.default() if self.options.artifact_cache else None
        self.units = UnitFactory(self.options, self.model.device, self.graphs, store=store)
        # what every unit of every bucket assumes of the model; checked once per generate/warmup call
        self.fingerprint = ModelFingerprint.of(self.model)
        cfg = self.model.config
        # the routed experts' implementation in every compiled unit (`kernels.moe.op.resolve_moe_impl`); the eager generator
        # reproduces these numerics with `generate(..., moe_impl=gen.moe_impl)`
        self.moe_impl = resolve_moe_impl(self.options.moe_impl, dtype=self.model.dtype, num_experts=cfg.num_experts,
                                         top_k=cfg.top_k_experts, compiled=True, quant=self.model.expert_quant,
                                         device_type=self.model.device.type, canvas_length=cfg.canvas_length)
        # batch-invariant rows (`CompileOptions.batch_invariant`), checked before anything compiles: asked for
        # (True) and not possible raises; by default (None) a model that cannot have them runs without, logged
        self.batch_invariant = self.options.batch_invariance(self.model.device.type)
        if self.batch_invariant:
            try:
                check_batch_invariant(cfg.canvas_length, self.model.dtype, self.moe_impl)
            except ConfigError as e:
                if self.options.batch_invariant:
                    raise
                log.info("batch-invariant rows off: %s", e)
                self.batch_invariant = False
        self.fuse_commit = self.options.commit_fusion(self.model.device.type)
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        subclass_weights = any(is_traceable_wrapper_subclass(p) for p in self.model.parameters())
        self.skip_idle_vocabulary = self.options.idle_vocabulary_skip(self.model.device.type, subclass_weights)

    @property
    def compiles(self) -> Counter:
        """Inductor compiles per unit name "step[B{b}_{tag}]" (above one: a recompile)."""
        return self.units.compiles

    @property
    def loads(self) -> Counter:
        """Steps loaded from the compile cache per unit name (each instead of a compile)."""
        return self.units.loads

    @property
    def ready(self) -> Counter:
        """Per unit name, how many times its step was made: compiled or loaded (above one: a recompile)."""
        return self.units.compiles + self.units.loads

    @property
    def compile_seconds(self) -> float:
        """Seconds spent in Inductor (Dynamo tracing excluded)."""
        return self.units.compile_seconds

    @property
    def row_tables(self) -> list[RowTable]:
        """The buckets built so far."""
        return list(self._row_tables.values())

    def bucket_for(self, requests: int) -> int:
        """The batch size that runs `requests` rows at once (the largest if more: the rest wait for rows)."""
        return next((b for b in self.options.batch_buckets if b >= requests), self.options.batch_buckets[-1])

    def row_table(self, config: GenerationConfig | None = None, *, page_size: int | None = None,
               kv_pages: int | None = None) -> RowTable:
        """The bucket (its `CompileOptions.batch_buckets` sizes over one row table, their compiled steps) that serves
        requests under `config` (default: the model's generation config). Buckets are keyed by the structural config
        (the stability history depth, none when early stopping is off; stop_early; eos ids) and by the paging:
        `page_size` gives a bucket over a `kv_cache.PagedKVCache` of `kv_pages` pages (default the static cache's
        memory; the serving engine's, never `generate`'s). Raises ValueError as `kv_cache.new_paged_cache`."""
        cfg = (config or self.model.generation_config).resolved(self.model.config)
        depth = cfg.stability_threshold if cfg.stop_early else 0
        key = (depth, cfg.stop_early, tuple(sorted(cfg.eos_token_ids)), page_size, kv_pages)
        if key not in self._row_tables:
            model = self.model

            # what decides a step's graph besides the options and the model: the compile cache's key holds it
            structure = {"bucket": [depth, cfg.stop_early, sorted(cfg.eos_token_ids), page_size, kv_pages],
                         "moe_impl": self.moe_impl, "fuse_commit": self.fuse_commit,
                         "batch_invariant": self.batch_invariant,
                         "skip_idle_vocabulary": self.skip_idle_vocabulary}

            def unit(name: str, fn: Callable[[], None], tensors: list[torch.Tensor]) -> CompiledUnit:
                made = self.units.unit(name, fn, owners=(model, *tensors), structure=structure)
                made.held = self.deferred
                return made

            o = self.options
            self._row_tables[key] = RowTable(model, o.batch_buckets, max_seq_len=o.max_seq_len,
                                        max_denoising_steps=o.max_denoising_steps, config=cfg,
                                        fuse_commit=self.fuse_commit, moe_impl=self.moe_impl, page_size=page_size,
                                        kv_pages=kv_pages, kernel_options=o.attention_kernels(), unit=unit,
                                        max_logprobs=o.max_logprobs,
                                        skip_idle_vocabulary=self.skip_idle_vocabulary)
        return self._row_tables[key]

    def units_made(self) -> list[CompiledUnit]:
        """Every compiled unit of every bucket made so far."""
        return [v.unit for bk in self._row_tables.values() for v in bk.views() if isinstance(v.unit, CompiledUnit)]

    def cached(self, batch_size: int = 1, config: GenerationConfig | None = None, **paging) -> bool:
        """Whether the compile cache holds the step that serves `batch_size` requests (then `warmup` loads it in about
        a second instead of compiling). Makes the bucket and its view, compiles nothing."""
        unit = self._unit_for(batch_size, config, **paging)
        return isinstance(unit, CompiledUnit) and (unit.strategy is not None or (
            unit.artifact is not None and unit.artifact.store.has(unit.artifact.key)))

    def cacheable(self, batch_size: int = 1, config: GenerationConfig | None = None, **paging) -> bool:
        """Whether the compile cache can hold the step that serves `batch_size` requests (it is on, and the model's
        weights are plain tensors: `UnitFactory.slot`)."""
        unit = self._unit_for(batch_size, config, **paging)
        return isinstance(unit, CompiledUnit) and unit.cacheable

    def _unit_for(self, batch_size: int, config: GenerationConfig | None, **paging):
        """The step (a `CompiledUnit`, or the eager step) that serves `batch_size` requests; makes its bucket and view."""
        row_table = self.row_table(config, **paging)
        return row_table.view(row_table.size_for(self.bucket_for(batch_size))).unit

    def load_cached(self, row_table: RowTable) -> list[int]:
        """Load (never compile) every size of `bucket` whose step the compile cache holds, now; returns the sizes
        loaded (a damaged entry is logged and removed, and its size left uncompiled). Call with no busy rows (before
        an engine starts): on CUDA each load captures its graph with one idle call (`CompiledUnit.prepare`)."""
        loaded = []
        for size in row_table.sizes:
            view = row_table.view(size)
            unit = view.unit
            if not isinstance(unit, CompiledUnit):
                continue
            if unit.strategy is None and unit.key is not None and self.units.store.has(unit.key):
                held, unit.held = unit.held, False
                if unit.preload():  # a damaged entry is removed and logged: the size stays as it was, uncompiled
                    if unit.graphs is not None:
                        view.refresh()
                        unit.prepare()  # CUDA: captured now, with every row idle
                else:
                    unit.held = held
            if unit.source == "loaded":
                loaded.append(size)
        return loaded

    def defer(self, background: "BackgroundCompile | None" = None) -> None:
        """Run every step eagerly (the one step, `mixed_step.mixed_step`, uncompiled: the tokens of the compiled step) until
        `background` (a `background.BackgroundCompile` filling the compile cache with these steps) finishes; `poll`,
        called between iterations by the driver and the engine, then switches each step whose artifact is cached to
        it. None: eager until `release()`."""
        self.deferred, self.background = True, background
        for unit in self.units_made():
            unit.held = unit.strategy is None

    def release(self) -> list[str]:
        """Stop deferring: each held step with a cached artifact loads it now (no compile; `CompiledUnit.preload`) and
        runs it from its next call; one without stays eager, logged. Returns the names of the steps switched."""
        self.deferred = False
        switched = []
        for unit in self.units_made():
            if not unit.held:
                continue
            slot = unit.artifact
            if slot is not None and slot.store.has(slot.key):
                unit.held = False
                unit.preload()  # loaded now, between iterations: ready at its next call
                switched.append(unit.name)
            else:
                log.warning("%s: no compile-cache entry after the background compile; it stays eager", unit.name)
        return switched

    def poll(self) -> None:
        """Between iterations: if the background compile has ended, switch to its steps (done) or log why not
        (failed), once. Cheap while it runs (a non-blocking process poll)."""
        bg = self.background
        if bg is None or not self.deferred:
            return
        state = bg.poll()
        if state == "done":
            switched = self.release()
            log.warning("background compile finished in %.1f s; switching %s to the compiled step",
                        bg.seconds, ", ".join(switched) or "nothing")
        elif state == "failed":
            self.deferred = False
            log.warning("background compile failed (%s); the steps stay eager", bg.error)

    @property
    def step_source(self) -> str:
        """Where the steps that ran came from: "loaded" (the compile cache), "compiled" (this process), "eager"
        (held while a background compile ran, or never compiled), or a "+"-joined mix in that order."""
        seen = {u.source or "eager" for u in self.units_made() if u.calls or u.held or u.source}
        return "+".join(x for x in ("eager", "compiled", "loaded") if x in seen) or "none"

    def reset(self) -> None:
        """Drop every bucket (after `torch._dynamo.reset()`; the next call recompiles)."""
        self._row_tables.clear()

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]],
                 config: GenerationConfig | Sequence[GenerationConfig] | None = None, *,
                 seed: int | Sequence[int] = 0, on_block: BlockCallback | None = None, stop: StopHook | None = None,
                 observer: Observer | None = None, images: Sequence | None = None,
                 constraint: Constraint | Sequence[Constraint | None] | None = None, tokenizer=None,
                 on_frame: FrameCallback | Sequence[FrameCallback | None] | None = None,
                 canvas=None) -> GenerationOutput:
        """Same contract as `dgemma_compile.generate(model, ...)` (`images` included: a request's image prefix is
        encoded by `images.prefill_images` into its row when it is admitted, eagerly and outside the compiled step,
        which then prefills the rest of the prompt as any prompt's, so the step's graphs are those of text-only
        requests: no recompile when a request with images follows one without; `constraint` and `tokenizer` too: a
        grammar is data in the bucket's buffers, never a recompile); requests progress independently here, so `on_block`
        and `stop` are called once per block index and iteration for the requests whose block ended in it (the
        others' entries empty; `stop`'s verdict applies to those requests only). `observer` also receives per-unit
        timings. `on_frame` too: the driver reads the live canvas frames of the requests that asked in one read per
        iteration and nothing for the others; `on_frame(i, frame)` runs before the `on_block` of the block that step
        ended. `canvas` too: a request's canvas is data in its row (`RowTable.pin`), never a recompile.

        Raises:
            ConfigError: as the eager generator; `max_seq_len` when a request needs more committed slots than
                `CompileOptions.max_seq_len`; `max_denoising_steps` above `CompileOptions.max_denoising_steps`.
            ModelChangedError: the model's parameters, buffers or attributes changed since `build()`.
            ValueError: `stop` returned an index outside the call.
        """
        self.fingerprint.check(self.model)
        cfgs, prompts, seeds, needed = plan_requests(self.model, prompts, config, seed)
        frames = frame_callbacks(on_frame, len(prompts))
        grammars = row_grammars(self.model, resolve_constraints(constraint, len(prompts)), cfgs, tokenizer)
        canvases = resolve_canvases(canvas, len(prompts), cfgs, self.model.config.vocab_size, tokenizer)
        check_slots(max(needed, constrained_slots(prompts, cfgs, grammars)), self.options.max_seq_len,
                    "CompileOptions.max_seq_len")
        items = prepare_images(self.model, prompts, images)
        steps = max(c.max_denoising_steps for c in cfgs)
        if steps > self.options.max_denoising_steps:
            raise ConfigError("max_denoising_steps", f"{steps} is more than this generator's temperature table holds "
                              f"(CompileOptions.max_denoising_steps={self.options.max_denoising_steps})")
        row_table = self.row_table(cfgs[0])
        for view in row_table.views():
            view.unit.check_owners()
        return _Call(self, row_table, prompts, cfgs, seeds, SpanTimer(self.model.device, observer),
                     grammars, items, frames, canvases).run(on_block, stop)

    @torch.no_grad()
    def warmup(self, batch_size: int = 1, config: GenerationConfig | None = None, **paging) -> float:
        """Compile the step of the batch size that serves `batch_size` requests (`paging`: `bucket`'s page_size and
        kv_pages), decide how it is called and, on CUDA, capture its graph (`CompiledUnit.prepare`: one call with
        every row FREE, idle, which changes no row); return the seconds it took. Raises `ModelChangedError` as
        `generate` does; ConfigError when an engine has busy rows in the bucket."""
        self.fingerprint.check(self.model)
        start = time.perf_counter()
        row_table = self.row_table(config, **paging)
        view = row_table.view(row_table.size_for(self.bucket_for(batch_size)))
        if not view.unit.ready:
            busy = row_table.row_state.phase[:view.rows].ne(int(Phase.FREE)).any()
            if bool(busy):
                raise ConfigError("warmup", "the bucket has busy rows (an engine is running on it)")
            view.refresh()
            view.unit.prepare()  # compiles; on CUDA captures its graph here, not inside a request
        return time.perf_counter() - start

    def explain(self, batch_size: int = 1, config: GenerationConfig | None = None,
                workload: Callable[["CompiledGenerator"], None] | None = None):
        """`explain.explain(self, ...)`: per compile unit, what `torch._dynamo.explain` reports and the compiles seen
        during a workload. Resets Dynamo: keep it out of a serving process."""
        from .explain import explain

        return explain(self, batch_size, config, workload)


@dataclass(eq=False)
class _Request:
    """One request of a `generate` call in a row (`driver.RowRequest`): its index in the call and its output."""

    index: int
    prompt: list[int]
    config: GenerationConfig
    seed: int
    images: ImagePrompt | None
    grammar: RowGrammar | None
    sequence: list[int]
    stats: RequestStats
    on_frame: FrameCallback | None = None
    canvas: Canvas | None = None

    @property
    def frames(self) -> bool:
        return self.on_frame is not None


class _Call:
    """One `generate` call over a bucket, as a user of the one driver (`driver.Driver`): queue every request, admit
    into free rows, step until idle, finalise the finished blocks by block index (`on_block`, then `stop`)."""

    def __init__(self, gen: CompiledGenerator, row_table: RowTable, prompts: list[list[int]],
                 cfgs: list[GenerationConfig], seeds: list[int], timer: SpanTimer, grammars: list,
                 images: "list[ImagePrompt | None] | None" = None,
                 frames: "list[FrameCallback | None] | None" = None,
                 canvases: "list[Canvas | None] | None" = None):
        self.gen, self.timer = gen, timer
        R = len(prompts)
        self.out = GenerationOutput(sequences=[[] for _ in range(R)], stats=[RequestStats() for _ in range(R)],
                                    fuse_commit=row_table.fuse_commit, moe_impl=gen.moe_impl,
                                    scheme=step_scheme(gen.model))
        images, frames, canvases = images or [None] * R, frames or [None] * R, canvases or [None] * R
        self.queue = deque(_Request(r, prompts[r], cfgs[r], seeds[r], images[r], grammars[r], self.out.sequences[r],
                                    self.out.stats[r], frames[r], canvases[r]) for r in range(R))
        self.R = R
        self.driver = Driver(row_table, span=self._span)

    def _span(self, name: str):
        spans = contextlib.ExitStack()
        spans.enter_context(self.timer.span(STEP))
        spans.enter_context(self.timer.span(UNIT, name))
        return spans

    def run(self, on_block: BlockCallback | None, stop: StopHook | None) -> GenerationOutput:
        out, driver = self.out, self.driver
        while True:
            self.gen.poll()  # a background compile that finished: its steps from this iteration on
            for b in driver.free():
                if not self.queue:
                    break
                driver.admit(b, self.queue.popleft())
            it = driver.step()
            if it is None:
                break
            blocks = set()  # block indices some row stepped in this iteration
            for rep in it.reports.values():
                if rep.committed and self.driver.row_table.fuse_commit:
                    out.fused_commits += 1
                elif rep.committed:
                    out.commits += 1
                if rep.stepped:
                    blocks.add(rep.block)
            for blk in blocks:
                while len(out.forwards_per_block) <= blk:
                    out.forwards_per_block.append(0)
                    out.wasted_forwards.append(0)  # never a frozen-only forward: a finished block leaves at once
                out.forwards_per_block[blk] += 1
            for b, frame in it.frames.items():  # before the on_block of a block this step ended
                req = driver.rows[b]
                req.on_frame(req.index, frame)
            self._finalize(it.finished, on_block, stop)
        return out

    def _finalize(self, finished: list[Finished], on_block: BlockCallback | None, stop: StopHook | None) -> None:
        """Finalise the blocks that ended in this iteration, by block index (`on_block`, then `stop`); retire the
        rows whose request ended."""
        out, R, driver = self.out, self.R, self.driver
        by_block: dict[int, list[tuple[Finished, bool, list[int]]]] = {}
        for f in finished:
            keep, done = driver.finalize(f)
            by_block.setdefault(f.report.block, []).append((f, done, keep))
        for blk in sorted(by_block):
            self.timer.flush(blk)  # the spans so far, then on_block_end(blk) (the host already waited for the step)
            toks: list[list[int]] = [[] for _ in range(R)]
            for f, _, keep in by_block[blk]:
                toks[driver.rows[f.row].index] = keep
            if on_block is not None:
                on_block(blk, toks)
            stopped: set[int] = set()
            if stop is not None:
                for r in stop(blk, toks):
                    if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < R:
                        raise ValueError(f"stop: returned request index {r!r}, not an integer in [0, {R})")
                    stopped.add(r)
            for f, done, _ in by_block[blk]:
                r = driver.rows[f.row].index
                if r in stopped:
                    out.stats[r].finish_reason = "stop"
                if done or f.report.done or r in stopped:  # the device's done implies done (tests/step/test_finish.py)
                    driver.retire(f.row, device_done=f.report.done)


def build(model: DiffusionGemma, options: CompileOptions | None = None, *, graphs: CudaGraphs | None = None
          ) -> CompiledGenerator:
    """A compiled generator for `model` (same `generate` interface and outputs as the eager one).

    Nothing compiles until first use; call `warmup(batch_size)` to compile ahead and time it. `graphs` replaces the
    CUDA-graph calls (tests run the capture logic on CPU with a fake).

    Raises:
        TypeError: `model` is not a dgemma_compile `DiffusionGemma`.
    """
    if not isinstance(model, DiffusionGemma):
        raise TypeError(f"build() takes a dgemma_compile DiffusionGemma, got {type(model).__name__}")
    model.requires_grad_(False)
    return CompiledGenerator(model=model, options=options or CompileOptions(), graphs=graphs)
