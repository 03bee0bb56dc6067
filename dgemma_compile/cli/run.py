"""What the commands share: threads and the model's load (one process or the ranks' slices: generate, serve),
quantization (generate, explain), the compile mode, the runner of one generation with its stats line, and the
background compile with its progress line."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..demo import DEMO_MODEL
from .args import GenerateArgs, ServeArgs


SLOT_ROUNDING = 256  # static cache sizes are rounded up so that nearby requests share compiled graphs


@dataclass(frozen=True)
class Loaded:
    """The model of one invocation and what its load decided: the quantization scheme the model holds (None: not
    quantized; `--quant`, or a quantized checkpoint's), the seconds the load took, and whether the model is one rank's
    shard of a tensor-parallel run."""

    model: object
    quant: str | None
    load_s: float
    tensor_parallel: bool = False


def _apply_threads(args: GenerateArgs | ServeArgs, model) -> int:
    """--threads N, else OMP_NUM_THREADS when set, else `recommended_threads(model)`; applied before any compile
    (Inductor's CPU kernels are generated for the thread count in force)."""
    import torch

    from .threads import recommended_threads

    if args.threads is not None:
        n = args.threads
    elif os.environ.get("OMP_NUM_THREADS", "").strip():
        n = torch.get_num_threads()
    else:
        n = recommended_threads(model)
    torch.set_num_threads(n)
    return n


Run = Callable[..., object]  # (prompts, config, seed=..., on_block=...) -> GenerationOutput


def _compile_mode(args: GenerateArgs, gen, rows: int, config, jobs: int, tensor_parallel: bool = False
                  ) -> tuple[str, str]:
    """--compile resolved, with the reason: "always" (compile, or load, before answering), "load" (from the compile
    cache, never compiling), "never" (the eager step), or "background" (the eager step answers while a background
    process compiles). auto (docs/cli.md): "load" when the compile cache holds the step; "never" where the cache
    cannot hold it (off, unusable, quantized weights: a background compile could not hand it over) or for a job of
    one batch (`jobs` <= `rows`: one prompt, or a prompts file no longer than --batch-size), which ends eagerly
    before a compile would; else "background"."""
    if args.compile != "auto":
        return args.compile, f"--compile {args.compile}"
    if tensor_parallel:  # every rank must take the same path: compile or load now
        return "always", "tensor parallel: every rank compiles or loads before answering"
    if gen.cached(rows, config):
        return "load", "in the compile cache"
    if not gen.cacheable(rows, config):
        return "never", ("the compile cache cannot hold this step (DGEMMA_CACHE off, an unusable directory, or "
                         "quantized weights); --compile always compiles it before answering")
    if jobs <= rows:
        return "never", "a job of one batch ends before a compile would; --compile always compiles first"
    return "background", "not in the compile cache yet"


def _runner(loaded: Loaded, args: GenerateArgs, rows: int, slots: int, config, first: tuple[list, int],
            steps: int, images: list | None = None, jobs: int = 1) -> tuple[Run, Callable[[], str]]:
    """The generate function for this invocation and a function giving its one-time cost and step source as stats
    fields: the compiled generator (one bucket of `rows`, a static cache of `slots` committed slots, a temperature
    table of at least `steps` denoise steps) per --compile (`_compile_mode`; `jobs`: the prompts to run): compiled or
    loaded now (`compile_s`, `load_s`), or eager while a background process compiles (`compile_s` of that process, if
    it finished); or, with --eager, the eager reference after an untimed run of `first` = (prompts, seeds) with one
    denoise step per block (`warmup_s`)."""
    from ..oracle import generate

    model = loaded.model
    max_seq_len = -(-slots // SLOT_ROUNDING) * SLOT_ROUNDING  # the same cache, so eager and compiled agree
    if args.eager:
        start = time.perf_counter()
        generate(model, first[0], config.replace(max_denoising_steps=1), seed=first[1], max_seq_len=max_seq_len,
                 images=images)
        warmup = (f" model_load_s={loaded.load_s:.2f} warmup_s={time.perf_counter() - start:.2f} step=oracle"
                  f" dtype={str(model.dtype).removeprefix('torch.')}")
        return (lambda *a, **kw: generate(model, *a, max_seq_len=max_seq_len, **kw)), lambda: warmup
    from .. import CompileOptions, build

    gen = build(model, CompileOptions(batch_buckets=(rows,), max_seq_len=max_seq_len,
                                      max_denoising_steps=max(256, steps)))
    mode, why = _compile_mode(args, gen, rows, config, jobs, loaded.tensor_parallel)
    row_table = gen.row_table(config)
    name = row_table.step_name(rows)
    compile_s = step_load_s = 0.0
    if mode == "load":
        start = time.perf_counter()
        if rows in gen.load_cached(row_table):
            step_load_s = time.perf_counter() - start
            print(f"dgemma: loaded {name} from the compile cache in {step_load_s:.2f} s", file=sys.stderr, flush=True)
        else:  # a damaged entry (logged, removed): as if it had not been there
            mode, why = ("never", "its cache entry was damaged") if jobs <= rows else \
                ("background", "its cache entry was damaged")
    if mode == "never":
        gen.defer(None)
        print(f"dgemma: answering with the eager step ({why})", file=sys.stderr, flush=True)
    elif mode == "background":
        gen.defer(_background(args, gen, config, [rows], dtype=args.dtype, quant=loaded.quant))
        print(f"dgemma: compiling {name} in a background process ({why}: {gen.units.store.root}); answering with "
              "the eager step meanwhile", file=sys.stderr, flush=True)
    elif mode == "always":
        cached = gen.cached(rows, config)
        verb = "loading" if cached else "compiling"
        with _Ticker(f"dgemma: {verb} {name}" + (" from the compile cache" if cached else f" before answering ({why})")):
            took = gen.warmup(rows, config)
        if cached and gen.units.store is not None and gen.units.store.loads:
            step_load_s = took
        else:
            compile_s = took

    def stats() -> str:
        bg = gen.background
        seconds = compile_s if bg is None else bg.seconds if bg.seconds is not None else \
            time.perf_counter() - bg.started  # still running: its seconds so far
        where = "" if bg is None else f" compile={bg.state} in background"
        return (f" model_load_s={loaded.load_s:.2f} compile_s={seconds:.1f} step_load_s={step_load_s:.2f} "
                f"step={gen.step_source}{where} dtype={str(model.dtype).removeprefix('torch.')}")

    return gen.generate, stats


def _background(args: GenerateArgs | ServeArgs, gen, config, sizes: list[int], paging: dict | None = None, *,
                dtype: str | None = None, quant: str | None = None):
    """A `compile.background.BackgroundCompile` of `gen`'s steps of `sizes` for this invocation's checkpoint, dtype
    (`dtype`, --dtype; default the model's), quantization (`quant`: the scheme the model holds), thread count and
    structural `config`, started now."""
    import torch

    from ..compile.background import BackgroundCompile, CompileSpec, options_fields

    # the dtype the foreground's model has (the loader may have upcast it on this CPU: compute_dtype), so that the
    # background process compiles the step the foreground looks up
    dtype = dtype or str(gen.model.dtype).removeprefix("torch.")
    spec = CompileSpec(model=str(args.model if args.model is not None else DEMO_MODEL), dtype=dtype,
                       quant=quant, options=options_fields(gen.options),
                       config={"stop_early": config.stop_early, "stability_threshold": config.stability_threshold,
                               "eos_token_ids": config.eos_token_ids},
                       sizes=list(sizes), threads=torch.get_num_threads(), cache_dir=str(gen.units.store.root),
                       paging=paging or {})
    return BackgroundCompile(spec)


class _Ticker:
    """A progress line on stderr while a foreground compile or load runs: its elapsed seconds, redrawn each second
    on a terminal; elsewhere one line at the start and one at the end."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        import threading

        self.start, self.done = time.perf_counter(), threading.Event()
        self.tty = sys.stderr.isatty()
        if self.tty:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        else:
            print(f"{self.what}...", file=sys.stderr, flush=True)
        return self

    def _run(self) -> None:
        while not self.done.wait(1.0):
            print(f"\r{self.what}... {time.perf_counter() - self.start:.0f} s", end="", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        self.done.set()
        took = time.perf_counter() - self.start
        print(f"{chr(13) if self.tty else ''}{self.what}: {took:.1f} s", file=sys.stderr, flush=True)


def _quantize(model, scheme: str | None) -> str | None:
    """`--quant`: quantize the loaded model; the report (what was quantized, what was left out and why) on stderr,
    also for a quantized checkpoint (the loader's report). Returns the model's scheme (None: not quantized)."""
    if scheme is not None:
        from ..quant import quantize

        print(quantize(model, scheme).text(), file=sys.stderr)
    elif model.checkpoint.quant_report is not None:
        print(model.checkpoint.quant_report.text(), file=sys.stderr)
    return model.checkpoint.quant_scheme


def _shared(ranks, make):
    """`make()`, or rank 0's on every rank of a tensor-parallel run (stdin and files are read once, by rank 0)."""
    return make() if ranks is None else ranks.share(make)


def _load(model_dir, ranks, *, dtype: str | None = None, quant: str | None = None, experts_split: str = "tensor"):
    """The model (`dtype`: --dtype, None: the checkpoint's); in a tensor-parallel run this rank's shard of it, read
    slice by slice from the files (`parallel.load_sharded`, on the rank's device; a compressed-tensors checkpoint
    too), or with `quant` (--quant) loaded whole, quantized as one process would and then sharded
    (`model.checkpoint.quant_report` set), so that every rank holds the one-process quantized weights' slices;
    `experts_split`: --experts-split. Raises ConfigError for a split the model's shapes refuse."""
    import torch

    from .. import load
    from ..model.config import ConfigError

    dtype = getattr(torch, dtype) if dtype else None
    if ranks is None:
        return load(model_dir, dtype=dtype)
    from ..model import compute_dtype
    from .. import parallel

    from ..model.loader import CheckpointError

    if dtype is None and ranks.device.type == "cpu":  # one decision for the group (compute_dtype.adopt)
        compute_dtype.adopt(ranks.share(lambda: {d: compute_dtype.probe(d) for d in (torch.bfloat16, torch.float16)}))

    try:  # each rank reads only its slices; with --quant it quantizes the whole model first, then shards it
        return parallel.load_sharded(model_dir, dtype=dtype, device=ranks.device, quant=quant,
                                     experts=experts_split)
    except (CheckpointError, ConfigError):  # the checkpoint's or the scheme's own error, as without ranks
        raise
    except ValueError as e:  # a split the shapes refuse (`parallel.shard`)
        raise ConfigError("tensor_parallel_size", str(e)) from None


