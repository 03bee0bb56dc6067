"""`build(model)`: the compiled block-diffusion generator, and `CompileOptions`, every compiler knob in one place.

Two compile units per batch bucket, each `torch.compile(fullgraph=True, dynamic=False)` over static buffers:
- the denoise step: decoder forward + the whole sampler + convergence and per-row state update, in place, with no
  host synchronisation inside (`_denoise_step`);
- the encoder chunk: one causal pass over a fixed-size block, used for prefill chunks and for commit
  (`_encode_chunk`).
Per-step scalars (temperature, bounds, lengths, flags) live in device tensors, so prompts of other lengths, other
block counts and batch sizes within a bucket reuse the same graphs. On CUDA each unit of each bucket is captured
as a CUDA graph; a failed capture is logged and that unit runs compiled without a graph (never silently).

The block loop itself is the eager generator's (`generate.run_block_diffusion`), so compiled and eager differ only in
the step functions; tests assert identical tokens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .config import ConfigError, GenerationConfig
from .generate import BlockCallback, GenerationOutput, RequestStats, plan, run_block_diffusion
from .kv_cache import KVCache
from .model import DiffusionGemma
from .sampler import BlockState, StepNoise, denoise_update

log = logging.getLogger("dgemma_compile")


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """Every Dynamo/Inductor setting dgemma_compile uses, each with its reason. Applied only around our own compiled
    calls by `applied()`; nothing is set at import time."""

    # Static batch shapes: a call with B requests runs in the smallest bucket >= B (padded rows are frozen).
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    # Static committed slots per row (prompt + committed blocks); the KV cache is preallocated at this size.
    max_seq_len: int = 1024
    # A graph break must be an error: a split step would run pieces eagerly and sync with the host.
    fullgraph: bool = True
    # Shapes are static per bucket; per-step scalars are tensors, so dynamic shapes would only add guards.
    dynamic: bool = False
    # Capture each bucket's units as CUDA graphs (CUDA only): one launch per step instead of hundreds.
    cuda_graphs: bool = True
    # Each unit compiles once per bucket and per structural config (stop_early, stability depth): the limit must
    # exceed that, and hitting it must fail instead of falling back to eager.
    recompile_limit: int = 32
    # Autotuning multiplies compile time; benchmarks may turn it on explicitly.
    max_autotune: bool = False
    # We capture CUDA graphs ourselves over static buffers; Inductor's cudagraph trees would add a second layer
    # with their own output-lifetime rules.
    inductor_cudagraphs: bool = False

    def __post_init__(self) -> None:
        b = self.batch_buckets
        if not b or any(not isinstance(x, int) or x <= 0 for x in b) or list(b) != sorted(set(b)):
            raise ConfigError(f"batch_buckets: must be increasing positive integers, got {b!r}")
        if not isinstance(self.max_seq_len, int) or self.max_seq_len <= 0:
            raise ConfigError(f"max_seq_len: must be a positive integer, got {self.max_seq_len!r}")
        if self.recompile_limit < 2 * len(b):
            raise ConfigError(f"recompile_limit: must be >= 2 * len(batch_buckets) = {2 * len(b)}")


@contextlib.contextmanager
def applied(options: CompileOptions):
    """Apply `options` to Dynamo and Inductor for the duration of the block (compilation happens at first call)."""
    with torch._dynamo.config.patch(recompile_limit=options.recompile_limit, cache_size_limit=options.recompile_limit,
                                    fail_on_recompile_limit_hit=True, automatic_dynamic_shapes=options.dynamic), \
            torch._inductor.config.patch({"max_autotune": options.max_autotune,
                                          "triton.cudagraphs": options.inductor_cudagraphs}):
        yield


@dataclass
class StepBuffers:
    """Static inputs/outputs of one bucket's compile units (rows >= the call's requests are frozen padding).

    ids, n_new: encoder chunk input [Bb, C] and real tokens per row [Bb]. canvas, argmax [Bb, C]; history
    [P, Bb, C]; finished [Bb]; steps [Bb] decoder passes this block; sc_logits [Bb, C, V] (model dtype) and has_sc
    [Bb]; temperature, entropy_bound, confidence (float32 scalars); uniform [Bb, C] and renoise [Bb, C] noise.
    """

    ids: torch.Tensor
    n_new: torch.Tensor
    canvas: torch.Tensor
    argmax: torch.Tensor
    history: torch.Tensor
    finished: torch.Tensor
    steps: torch.Tensor
    sc_logits: torch.Tensor
    has_sc: torch.Tensor
    temperature: torch.Tensor
    entropy_bound: torch.Tensor
    confidence: torch.Tensor
    uniform: torch.Tensor
    renoise: torch.Tensor

    @classmethod
    def allocate(cls, model: DiffusionGemma, rows: int, stability: int) -> "StepBuffers":
        C, V, dev = model.config.canvas_length, model.config.vocab_size, model.device
        long = dict(dtype=torch.long, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        return cls(ids=torch.zeros(rows, C, **long), n_new=torch.zeros(rows, **long),
                   canvas=torch.zeros(rows, C, **long), argmax=torch.zeros(rows, C, **long),
                   history=torch.full((stability, rows, C), -1, **long),
                   finished=torch.zeros(rows, dtype=torch.bool, device=dev), steps=torch.zeros(rows, **long),
                   sc_logits=torch.zeros(rows, C, V, dtype=model.dtype, device=dev),
                   has_sc=torch.zeros(rows, dtype=torch.bool, device=dev), temperature=torch.ones((), **f32),
                   entropy_bound=torch.zeros((), **f32), confidence=torch.zeros((), **f32),
                   uniform=torch.zeros(rows, C, **f32), renoise=torch.zeros(rows, C, **long))


def _denoise_step(model: DiffusionGemma, cache: KVCache, buf: StepBuffers, stop_early: bool) -> None:
    """One denoise step over the bucket, updating `buf` in place (the compile unit)."""
    buf.steps.add_((~buf.finished).long())
    logits = model.denoise_block(buf.canvas, cache, buf.sc_logits, buf.has_sc)
    state = BlockState(canvas=buf.canvas, argmax=buf.argmax, history=buf.history, finished=buf.finished)
    new, scaled = denoise_update(state, logits, buf.temperature, StepNoise(uniform=buf.uniform, renoise=buf.renoise),
                                 entropy_bound=buf.entropy_bound, confidence_threshold=buf.confidence,
                                 stop_early=stop_early)
    buf.canvas.copy_(new.canvas)
    buf.argmax.copy_(new.argmax)
    buf.history.copy_(new.history)
    buf.finished.copy_(new.finished)
    buf.sc_logits.copy_(scaled)
    buf.has_sc.fill_(True)


def _encode_chunk(model: DiffusionGemma, cache: KVCache, buf: StepBuffers) -> None:
    """One encoder pass over buf.ids with buf.n_new real tokens per row: prefill chunk or commit (the compile unit)."""
    model.encode_block(buf.ids, cache, buf.n_new)


class CompiledUnit:
    """A zero-argument step over static buffers, `torch.compile`d under `options`. With `cuda_graphs`, the third
    call onwards replays a CUDA graph captured after the second (warm) call; a failed capture is logged and the unit
    keeps running compiled without a graph (`graph_error` says why). Never a silent fallback."""

    def __init__(self, name: str, fn: Callable[[], None], options: CompileOptions, *, backend="inductor",
                 cuda_graphs: bool = False, graph_pool=None):
        self.name, self.fn, self.options = name, fn, options
        self.compiled = torch.compile(fn, fullgraph=options.fullgraph, dynamic=options.dynamic, backend=backend)
        self.cuda_graphs, self.graph_pool = cuda_graphs, graph_pool
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_error: str | None = None

    def __call__(self) -> None:
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return
        with applied(self.options):
            self.compiled()
        if self.cuda_graphs and self.graph_error is None and self.calls == 2:
            self._capture()

    def _capture(self) -> None:
        """Capture after the second warm call. Capture records the kernels without running them, so the step that
        just ran compiled is not applied twice; later calls replay the graph over the same static buffers."""
        try:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with applied(self.options), torch.cuda.graph(graph, pool=self.graph_pool):
                self.compiled()
            self.graph = graph
            log.info("captured CUDA graph for %s", self.name)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back, loudly
            self.graph_error = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph capture failed for %s (%s); running it compiled without a graph",
                        self.name, self.graph_error)


class Bucket:
    """One static batch size: its KV cache, step buffers and the two compile units (`denoise`, `encode`, each a
    zero-argument callable over the buffers)."""

    def __init__(self, gen: "CompiledGenerator", rows: int, stability: int, stop_early: bool):
        model = gen.model
        self.cache = model.new_cache(rows, gen.options.max_seq_len)
        self.buf = StepBuffers.allocate(model, rows, stability)
        tag = f"B{rows}_P{stability}_{'stop' if stop_early else 'fixed'}"

        def denoise():
            _denoise_step(model, self.cache, self.buf, stop_early)

        def encode():
            _encode_chunk(model, self.cache, self.buf)

        mk = lambda unit, fn: CompiledUnit(f"{unit}[{tag}]", fn, gen.options,  # noqa: E731
                                           backend=gen.counting_backend(f"{unit}[{tag}]"),
                                           cuda_graphs=gen.use_cuda_graphs, graph_pool=gen.graph_pool)
        self.denoise = mk("denoise_step", denoise)
        self.encode = mk("encoder_chunk", encode)


class CompiledSteps:
    """The step functions of `generate.run_block_diffusion`, run by one bucket's compiled units."""

    def __init__(self, bucket: Bucket, cfg: GenerationConfig, requests: int):
        self.b, self.cfg, self.R = bucket, cfg, requests
        buf = bucket.buf
        buf.entropy_bound.fill_(cfg.entropy_bound)
        buf.confidence.fill_(cfg.confidence_threshold)
        bucket.cache.reset()

    def _encode(self, ids_RT: torch.Tensor, n_new_R: torch.Tensor) -> None:
        buf, R = self.b.buf, self.R
        buf.ids.zero_()
        buf.ids[:R, :ids_RT.shape[1]] = ids_RT
        buf.n_new.zero_()
        buf.n_new[:R] = n_new_R
        self.b.encode()

    def prefill(self, input_ids_RT: torch.Tensor, lengths_R: torch.Tensor) -> None:
        C = self.b.buf.ids.shape[1]
        for start in range(0, input_ids_RT.shape[1], C):
            self._encode(input_ids_RT[:, start:start + C], (lengths_R - start).clamp(0, C))

    def begin_block(self, canvas_RC: torch.Tensor, frozen_R: torch.Tensor) -> None:
        buf, R = self.b.buf, self.R
        buf.canvas.zero_()
        buf.canvas[:R] = canvas_RC
        buf.argmax.copy_(buf.canvas)
        buf.history.fill_(-1)
        buf.finished.fill_(True)
        buf.finished[:R] = frozen_R
        buf.steps.zero_()
        buf.has_sc.zero_()

    def step(self, temperature_: float, noise: StepNoise) -> torch.Tensor:
        buf, R = self.b.buf, self.R
        buf.temperature.fill_(temperature_)
        buf.uniform[:R] = noise.uniform
        buf.renoise[:R] = noise.renoise
        self.b.denoise()
        return buf.finished[:R]

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.b.buf.argmax[:self.R], self.b.buf.steps[:self.R]

    def commit(self, tokens_RC: torch.Tensor, n_new_R: torch.Tensor) -> None:
        self._encode(tokens_RC, n_new_R)


@dataclass
class UnitReport:
    """What `torch._dynamo.explain` says of one compile unit, plus compiles seen during a workload."""

    unit: str
    graph_count: int
    graph_break_count: int
    break_reasons: list[dict]
    ops_per_graph: list[int]
    guard_count: int
    compiles_in_workload: int = 0
    recompiles_in_workload: int = 0

    def text(self) -> str:
        lines = [f"{self.unit}: graphs={self.graph_count} graph_breaks={self.graph_break_count} "
                 f"ops_per_graph={self.ops_per_graph} guards={self.guard_count} "
                 f"compiles_in_workload={self.compiles_in_workload} recompiles={self.recompiles_in_workload}"]
        for r in self.break_reasons:
            lines.append(f"  break: {r['reason']}\n    at: {r['user_stack']}")
        return "\n".join(lines)


@dataclass
class CompiledGenerator:
    """The compiled block-diffusion generator returned by `build`; `generate` has the eager generator's interface
    and outputs. Compiles lazily, per bucket, on first use (or `warmup`)."""

    model: DiffusionGemma
    options: CompileOptions
    compiles: Counter = field(default_factory=Counter)  # per compile unit name "kind[bucket tag]"
    compile_seconds: float = 0.0  # seconds spent in Inductor (Dynamo tracing excluded), for benchmarks
    _buckets: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.use_cuda_graphs = self.options.cuda_graphs and self.model.device.type == "cuda"
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None

    def counting_backend(self, unit: str):
        """Inductor, counting compiles of `unit` and their seconds (recompiles show up as counts above one)."""
        from torch._inductor.compile_fx import compile_fx

        def backend(gm: torch.fx.GraphModule, example_inputs):
            start = time.perf_counter()
            self.compiles[unit] += 1
            out = compile_fx(gm, example_inputs)
            self.compile_seconds += time.perf_counter() - start
            return out

        return backend

    def bucket_for(self, requests: int) -> int:
        """The static batch size that runs `requests` rows (the largest bucket if more; callers split)."""
        return next((b for b in self.options.batch_buckets if b >= requests), self.options.batch_buckets[-1])

    def bucket(self, batch_size: int, config: GenerationConfig | None = None) -> Bucket:
        """The bucket (cache, buffers, compile units) that serves `batch_size` requests under `config` (default: the
        model's generation config); for benchmarks and checks that time the units directly."""
        return self._bucket(self.bucket_for(batch_size), (config or self.model.generation_config).resolved(self.model.config))

    def _bucket(self, rows: int, cfg: GenerationConfig) -> Bucket:
        """Buckets are keyed by batch size and the structural config: the stability history depth (none when
        early stopping is off) and stop_early."""
        depth = cfg.stability_threshold if cfg.stop_early else 0
        key = (rows, depth, cfg.stop_early)
        if key not in self._buckets:
            self._buckets[key] = Bucket(self, rows, depth, cfg.stop_early)
        return self._buckets[key]

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig | None = None, *,
                 seed: int | Sequence[int] = 0, on_block: BlockCallback | None = None) -> GenerationOutput:
        """Same contract as `dgemma_compile.generate(model, ...)`; more requests than the largest bucket run in
        consecutive groups (outputs do not depend on grouping).

        Raises:
            ConfigError: as the eager generator, and `max_seq_len` when a request needs more committed slots than
                `CompileOptions.max_seq_len`.
        """
        cfg, prompts, seeds, needed = plan(self.model, prompts, config, seed)
        if needed > self.options.max_seq_len:
            raise ConfigError(f"max_seq_len: these requests need {needed} committed slots per row, more than "
                              f"CompileOptions.max_seq_len={self.options.max_seq_len}")
        group = self.options.batch_buckets[-1]
        sequences: list[list[int]] = []
        stats: list[RequestStats] = []
        for start in range(0, len(prompts), group):
            ps, ss = prompts[start:start + group], seeds[start:start + group]
            steps = CompiledSteps(self._bucket(self.bucket_for(len(ps)), cfg), cfg, len(ps))
            offset = start

            def forward(i, toks, _o=offset, _n=len(ps)):
                if on_block is not None:
                    on_block(i, [[] for _ in range(_o)] + toks + [[] for _ in range(len(prompts) - _o - _n)])

            out = run_block_diffusion(self.model, steps, ps, cfg, ss, forward if on_block else None)
            sequences += out.sequences
            stats += out.stats
        return GenerationOutput(sequences=sequences, stats=stats)

    @torch.no_grad()
    def warmup(self, batch_size: int = 1, config: GenerationConfig | None = None) -> float:
        """Compile the bucket that serves `batch_size` requests (both units) and return the seconds it took."""
        start = time.perf_counter()
        bucket = self.bucket(batch_size, config)
        bucket.buf.n_new.zero_()
        bucket.cache.reset()
        bucket.encode()
        bucket.buf.finished.zero_()
        bucket.denoise()
        return time.perf_counter() - start

    def explain(self, batch_size: int = 1, config: GenerationConfig | None = None,
                workload: Callable[["CompiledGenerator"], None] | None = None) -> list[UnitReport]:
        """Per compile unit: `torch._dynamo.explain` of the bucket serving `batch_size`, then the compiles seen while
        `workload(self)` runs (default: a mixed short workload). `torch._dynamo.explain` resets Dynamo: compiled
        state is dropped and rebuilt, so keep this out of a serving process."""
        bucket = self.bucket(batch_size, config)
        reports = []
        with torch.no_grad(), applied(self.options):
            for unit in (bucket.denoise, bucket.encode):
                bucket.buf.n_new.zero_()
                ex = torch._dynamo.explain(unit.fn)()
                reports.append(UnitReport(
                    unit=unit.name, graph_count=ex.graph_count, graph_break_count=ex.graph_break_count,
                    break_reasons=[{"reason": str(b.reason), "user_stack": [str(f) for f in b.user_stack]}
                                   for b in ex.break_reasons],
                    ops_per_graph=[len(ops) for ops in ex.ops_per_graph], guard_count=len(ex.out_guards)))
        self._buckets.clear()  # explain reset Dynamo; start from fresh compiled units
        before = Counter(self.compiles)
        (workload or _default_workload)(self)
        for r in reports:
            kind = r.unit.split("[")[0]
            seen = {name: n - before[name] for name, n in self.compiles.items() if name.startswith(kind + "[")}
            r.compiles_in_workload = sum(seen.values())
            r.recompiles_in_workload = sum(max(0, n - 1) for n in seen.values())
        return reports


def _default_workload(gen: CompiledGenerator) -> None:
    """Prompts of different lengths, block counts and batch sizes within the first bucket that holds two rows."""
    cfg = gen.model.generation_config.replace(max_denoising_steps=3)
    C = gen.model.config.canvas_length
    bos = gen.model.config.bos_token_id
    gen.generate([[bos] + [3] * 4], cfg.replace(max_new_tokens=C), seed=1)
    gen.generate([[bos] + [4] * (C + 3), [bos, 5]], cfg.replace(max_new_tokens=2 * C), seed=[2, 3])


def build(model: DiffusionGemma, options: CompileOptions | None = None) -> CompiledGenerator:
    """A compiled generator for `model` (same `generate` interface and outputs as the eager one).

    Nothing compiles until first use; call `warmup(batch_size)` to compile ahead and time it.
    """
    if not isinstance(model, DiffusionGemma):
        raise TypeError(f"build() takes a dgemma_compile DiffusionGemma, got {type(model).__name__}")
    model.requires_grad_(False)
    return CompiledGenerator(model=model, options=options or CompileOptions())


__all__ = ["Bucket", "CompileOptions", "CompiledGenerator", "CompiledUnit", "StepBuffers", "UnitReport", "applied",
           "build"]
