"""`build(model)`: the compiled block-diffusion generator, with its static batch buckets.

Compile units per batch bucket (`units.CompiledUnit`, `torch.compile(fullgraph=True, dynamic=False)` over the
bucket's static buffers), each a step function the eager generator calls (`steps.py`):
- the denoise step (`steps.denoise_step`): decoder forward + the whole sampler + convergence and per-row state update,
  in place, with no host synchronisation inside;
- the encoder chunk (`steps.encode_chunk`): one causal pass over a fixed-size block, used for prefill chunks (and
  for commits without commit fusion);
- with `CompileOptions.fuse_commit` (default on CUDA), the fused commit + denoise step (`steps.denoise_step(commit=True)`):
  a block's first denoise step that also commits the previous block, one forward of 2C tokens.
Per-step scalars (temperature, bounds, lengths, flags) live in device tensors, so prompts of other lengths, other
block counts and batch sizes within a bucket reuse the same graphs. On CUDA each unit of each bucket is captured
as a CUDA graph; a failed capture is logged and that unit runs compiled without a graph (never silently).

The block loop is the eager generator's (`generate.run_block_diffusion`) and so are the host-side buffer fills
(`steps.BufferSteps`): compiled and eager differ only in whether the two step functions are compiled; tests assert
identical tokens.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..config import ConfigError, GenerationConfig
from ..generate import BlockCallback, GenerationOutput, RequestStats, StopHook, check_slots, plan, run_block_diffusion
from ..kv_cache import paged_cache
from ..model import DiffusionGemma
from ..observe import UNIT, Observer, SpanTimer
from ..ops.moe import resolve_moe_impl
from ..plan import PlanBuffers
from ..steps import BufferSteps, DenoiseState, StepInputs, denoise_step, encode_chunk
from ..stop_check import PinnedCopy, StopCheck
from ..stop_check import resolve as resolve_stop_check
from .options import CompileOptions, check_batch_invariant
from .units import CompiledUnit, CudaGraphs, ModelFingerprint, UnitFactory

log = logging.getLogger("dgemma_compile")


class Bucket:
    """One static batch size and structural config: its KV cache, `DenoiseState`, `StepInputs` and `PlanBuffers`
    buffers, and the compile units `denoise`, `encode` and (commit fusion) `commit_denoise`, zero-argument callables over them.
    `paging` (page_size, kv_pages): a `kv_cache.PagedKVCache` instead of the static cache (the serving engine's)."""

    def __init__(self, model: DiffusionGemma, factory: UnitFactory, rows: int, stability: int, stop_early: bool,
                 moe_impl: str, paging: tuple[int, int | None] | None = None):
        self.rows = rows
        C, fuse = model.config.canvas_length, factory.options.commit_fusion(model.device.type)
        S, block = factory.options.max_seq_len, 2 * C if fuse else C
        if paging is None:
            self.cache = model.new_cache(rows, S, block_size=block)
        else:
            self.cache = paged_cache(model, rows, S, block_size=block, page_size=paging[0], kv_pages=paging[1])
        self.state = DenoiseState.allocate(model, rows, stability)
        self.inputs = StepInputs.allocate(model, rows, C, factory.options.max_denoising_steps)
        kernels = factory.options.attention_kernels()
        self.plan = PlanBuffers(model, self.cache, C, kernel_options=kernels)  # the block's denoise plan, per block
        self.tag = f"B{rows}_P{stability}_{'stop' if stop_early else 'fixed'}"
        if paging is not None:
            self.tag += f"_pages{self.cache.page_size}x{self.cache.num_pages}"
        cache, state, inputs, plan = self.cache, self.state, self.inputs, self.plan
        owners = (model, cache, state, inputs, plan)  # every tensor the units read

        def step(commit: bool) -> Callable[[], None]:
            return lambda: denoise_step(model, cache, state, inputs, plan, stop_early=stop_early, moe_impl=moe_impl,
                                        commit=commit, kernel_options=kernels)

        self.denoise: CompiledUnit = factory.unit(f"denoise_step[{self.tag}]", step(False), owners)
        self.encode: CompiledUnit = factory.unit(
            f"encoder_chunk[{self.tag}]", lambda: encode_chunk(model, cache, inputs, plan, moe_impl=moe_impl,
                                                          kernel_options=kernels), owners)
        self.commit_denoise: CompiledUnit | None = (
            factory.unit(f"commit_denoise_step[{self.tag}]", step(True), owners) if fuse else None)

    @property
    def units(self) -> tuple[CompiledUnit, ...]:
        return tuple(u for u in (self.denoise, self.encode, self.commit_denoise) if u is not None)

    def steps(self, cfgs: Sequence[GenerationConfig], seeds: Sequence[int], timer: SpanTimer) -> BufferSteps:
        """A `StepRunner` for len(cfgs) <= rows requests (one resolved config and seed each) over this bucket's
        buffers and units (resets the cache); each unit call is a `UNIT` span of `timer`. Checks that the units'
        owners still hold the tensors their direct calls read (`CompiledUnit.check_owners`)."""
        for unit in self.units:
            unit.check_owners()

        def timed(unit: CompiledUnit) -> Callable[[], None]:
            def call() -> None:
                with timer.span(UNIT, unit.name):
                    unit()
            return call

        return BufferSteps(cfgs=cfgs, seeds=seeds, cache=self.cache, state=self.state, inputs=self.inputs,
                           denoise=timed(self.denoise), encode=timed(self.encode),
                           commit_denoise=timed(self.commit_denoise) if self.commit_denoise is not None else None)


@dataclass
class CompiledGenerator:
    """The compiled block-diffusion generator returned by `build`; `generate` has the eager generator's interface
    and outputs. Compiles lazily, per bucket, on first use (or `warmup`)."""

    model: DiffusionGemma
    options: CompileOptions
    graphs: CudaGraphs | None = None  # a CUDA-graph seam for tests; default: real CUDA graphs on CUDA devices
    _buckets: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.units = UnitFactory(self.options, self.model.device, self.graphs)
        # what every unit of every bucket assumes of the model; checked once per generate/warmup call
        self.fingerprint = ModelFingerprint.of(self.model)
        cfg = self.model.config
        # the routed experts' implementation in every compiled unit (`ops.moe.resolve_moe_impl`); the eager generator
        # reproduces these numerics with `generate(..., moe_impl=gen.moe_impl)`
        self.moe_impl = resolve_moe_impl(self.options.moe_impl, dtype=self.model.dtype, num_experts=cfg.num_experts,
                                         top_k=cfg.top_k_experts, compiled=True, quant=self.model.expert_quant)
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
        cuda = self.model.device.type == "cuda"
        self._copy = PinnedCopy() if cuda else None  # the deferred stop check's copy (CPU: a plain read)

    @property
    def compiles(self) -> Counter:
        """Inductor compiles per unit name "kind[bucket tag]" (above one: a recompile)."""
        return self.units.compiles

    @property
    def compile_seconds(self) -> float:
        """Seconds spent in Inductor (Dynamo tracing excluded)."""
        return self.units.compile_seconds

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets built so far."""
        return list(self._buckets.values())

    def bucket_for(self, requests: int) -> int:
        """The static batch size that runs `requests` rows (the largest bucket if more; callers split)."""
        return next((b for b in self.options.batch_buckets if b >= requests), self.options.batch_buckets[-1])

    def bucket(self, batch_size: int, config: GenerationConfig | None = None, *, page_size: int | None = None,
               kv_pages: int | None = None) -> Bucket:
        """The bucket (cache, buffers, compile units) that serves `batch_size` requests under `config` (default: the
        model's generation config). Buckets are keyed by batch size and the structural config: the stability
        history depth (none when early stopping is off) and stop_early; and by the paging: `page_size` gives a
        bucket over a `kv_cache.PagedKVCache` of `kv_pages` pages (default the static cache's memory; the serving
        engine's, never `generate`'s). Raises ValueError as `kv_cache.new_paged_cache`."""
        cfg = (config or self.model.generation_config).resolved(self.model.config)
        rows = self.bucket_for(batch_size)
        depth = cfg.stability_threshold if cfg.stop_early else 0
        paging = (page_size, kv_pages) if page_size is not None else None
        key = (rows, depth, cfg.stop_early) + ((paging,) if paging is not None else ())
        if key not in self._buckets:
            self._buckets[key] = Bucket(self.model, self.units, rows, depth, cfg.stop_early, self.moe_impl, paging)
        return self._buckets[key]

    def reset(self) -> None:
        """Drop every bucket (after `torch._dynamo.reset()`; the next call recompiles)."""
        self._buckets.clear()

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]],
                 config: GenerationConfig | Sequence[GenerationConfig] | None = None, *,
                 seed: int | Sequence[int] = 0, on_block: BlockCallback | None = None, stop: StopHook | None = None,
                 observer: Observer | None = None) -> GenerationOutput:
        """Same contract as `dgemma_compile.generate(model, ...)`; more requests than the largest bucket run in
        consecutive groups (outputs do not depend on grouping; `on_block` and `stop` always see request indices of
        the whole call, and block indices counted per request). `observer` also receives per-unit timings.

        Raises:
            ConfigError: as the eager generator; `max_seq_len` when a request needs more committed slots than
                `CompileOptions.max_seq_len`; `max_denoising_steps` above `CompileOptions.max_denoising_steps`.
            ModelChangedError: the model's parameters, buffers or attributes changed since `build()`.
        """
        self.fingerprint.check(self.model)
        cfgs, prompts, seeds, needed = plan(self.model, prompts, config, seed)
        check_slots(needed, self.options.max_seq_len, "CompileOptions.max_seq_len")
        steps = max(c.max_denoising_steps for c in cfgs)
        if steps > self.options.max_denoising_steps:
            raise ConfigError(f"max_denoising_steps: {steps} is more than this generator's temperature table holds "
                              f"(CompileOptions.max_denoising_steps={self.options.max_denoising_steps})")
        timer = SpanTimer(self.model.device, observer)
        group = self.options.batch_buckets[-1]
        sequences: list[list[int]] = []
        stats: list[RequestStats] = []
        forwards: list[int] = []
        wasted: list[int] = []
        commits = fused_commits = 0
        for start in range(0, len(prompts), group):
            ps, ss, cs = prompts[start:start + group], seeds[start:start + group], cfgs[start:start + group]
            runner = self.bucket(len(ps), cs[0]).steps(cs, ss, timer)
            check = StopCheck(resolve_stop_check(self.options.stop_check, self.model.device), k=self.options.stop_check_k,
                              copy=self._copy)
            out = run_block_diffusion(self.model, runner, ps, cs, timer=timer, stop_check=check,
                                      on_block=_global_rows(on_block, start, len(ps), len(prompts)),
                                      stop=_global_stop(stop, start, len(ps), len(prompts)))
            sequences += out.sequences
            stats += out.stats
            commits, fused_commits = commits + out.commits, fused_commits + out.fused_commits
            for b, (f, w) in enumerate(zip(out.forwards_per_block, out.wasted_forwards)):  # per block index
                if b == len(forwards):
                    forwards.append(0)
                    wasted.append(0)
                forwards[b] += f
                wasted[b] += w
        return GenerationOutput(sequences=sequences, stats=stats, forwards_per_block=forwards, wasted_forwards=wasted,
                                commits=commits, fused_commits=fused_commits,
                                fuse_commit=self.options.commit_fusion(self.model.device.type),
                                moe_impl=self.moe_impl)

    @torch.no_grad()
    def warmup(self, batch_size: int = 1, config: GenerationConfig | None = None, **paging) -> float:
        """Compile the bucket that serves `batch_size` requests (all its units; `paging`: `bucket`'s page_size and
        kv_pages) and return the seconds it took. Raises `ModelChangedError` as `generate` does."""
        self.fingerprint.check(self.model)
        start = time.perf_counter()
        bucket = self.bucket(batch_size, config, **paging)
        bucket.inputs.n_new.zero_()
        bucket.cache.reset()
        bucket.encode()
        bucket.state.finished.zero_()
        bucket.denoise()
        if bucket.commit_denoise is not None:
            bucket.commit_denoise()
            bucket.cache.reset()
        bucket.state.finished.fill_(True)
        return time.perf_counter() - start

    def explain(self, batch_size: int = 1, config: GenerationConfig | None = None,
                workload: Callable[["CompiledGenerator"], None] | None = None):
        """`explain.explain(self, ...)`: per compile unit, what `torch._dynamo.explain` reports and the compiles seen
        during a workload. Resets Dynamo: keep it out of a serving process."""
        from .explain import explain

        return explain(self, batch_size, config, workload)


def _padded(toks: list[list[int]], start: int, total: int) -> list[list[int]]:
    """A group's per-request new tokens placed at the call's request indices (empty lists elsewhere)."""
    return [[] for _ in range(start)] + toks + [[] for _ in range(total - start - len(toks))]


def _global_rows(on_block: BlockCallback | None, start: int, n: int, total: int) -> BlockCallback | None:
    """on_block of a group of n requests starting at `start`, seen with the call's request indices."""
    if on_block is None:
        return None

    def forward(block: int, toks: list[list[int]]) -> None:
        on_block(block, _padded(toks, start, total))

    return forward


def _global_stop(stop: StopHook | None, start: int, n: int, total: int) -> StopHook | None:
    """The stop hook of a group, called with the call's request indices and answering in the group's."""
    if stop is None:
        return None

    def forward(block: int, toks: list[list[int]]) -> list[int]:
        rows = list(stop(block, _padded(toks, start, total)))
        bad = [r for r in rows if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < total]
        if bad:
            raise ValueError(f"stop: returned request index {bad[0]!r}, not an integer in [0, {total})")
        return [r - start for r in rows if start <= r < start + n]

    return forward


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
