"""The systems under test and where each one's steps are timed (`session.py` prepares and repeats them).

- ours-compiled: `dg.build(model).generate`, one compiled step per batch size (`mixed_step.mixed_step` over the bucket's
  rows, each row in its own phase: prefill chunk, denoise step, commit); a step is one iteration of the compiled
  driver reported to a public `dgemma_compile.Observer` (`on_step`), so prefill chunks and (unfused) commits are
  steps too, beside the denoise steps; the compiled unit alone is its `on_unit` span ("step[B{b}_...]"). Its block
  ends are marked from `generate`'s public `on_block` callback (the first call of each block index).
- ours-eager: `dg.generate(model, ...)`, the eager reference loop; steps from the same `Observer.on_step` (denoise
  steps only: its prefill and commits are not step spans).
- ours-step-eager: ours-compiled's generator with its steps deferred (`gen.defer()`, never released), so every step
  is the one step (`mixed_step.mixed_step`) run uncompiled: the step `dgemma generate` answers with while the compiled
  step compiles in the background (the same tokens). Timed as ours-compiled (`on_step`: one iteration; `on_unit`:
  the step alone).
- hf-eager: transformers `DiffusionGemmaForBlockDiffusion.generate` (dynamic cache); timed at its
  `_denoising_step` (decoder forward + sampling + acceptance + stop check, like ours).
- hf-compiled: the same with `cache_implementation="static"`, which makes transformers torch.compile its decoder
  forward, encoder and sampler pieces (`_compile_functions`); timed at `_denoising_step`.
- ar-compiled: `ar.ARBaseline`, the encoder as a causal LM, greedy, one token per forward; each forward timed.
- ours-compiled-<scheme> (`QUANT_SYSTEMS`: fp8, fp8-weight-only, nvfp4-w4a16, nvfp4): ours-compiled on the same
  model after `dg.quantize(model, scheme)`, run in the worker after loading, as part of preparing the system (never
  timed); the row carries the scheme and the weight bytes before / after from the `QuantReport`, and the report
  compares it with bf16 `ours-compiled` of the same run. Asked for by name (not in the default systems).

Our library is never patched: ours are observed through `generate(..., observer=..., on_block=...)`. transformers' model gets a
step timer on its own instance for the session (`install()`); the AR baseline wraps its own step. Blocks are marked by
`Observer.on_block_end` (ours), the streamer's `put` (transformers) or every C tokens (AR).
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field

import torch

from . import models, workloads
from .timing import Recorder, RecorderObserver, patched

QUANT_SCHEMES = ("fp8", "fp8-weight-only", "nvfp4-w4a16", "nvfp4")
"""`dgemma_compile.quant.SCHEMES` (kept literal so that listing the systems imports no quantization code); `nvfp4`
(W4A4) is refused by `dg.quantize` on every device we have, so its row reads "n/a (ConfigError ...)"."""
QUANT_SYSTEMS = tuple(f"ours-compiled-{s}" for s in QUANT_SCHEMES)
SYSTEMS = ("ours-compiled", "ours-compiled-fused", "ours-compiled-unfused", "ours-eager", "ours-step-eager", "hf-eager",
           "hf-compiled", "ar-compiled") + QUANT_SYSTEMS
"""`ours-compiled-fused` / `-unfused`: ours-compiled with commit fusion forced on / off (`CompileOptions.fuse_commit`;
ours-compiled takes the device's default). `ours-compiled-<scheme>`: ours-compiled on the model quantized to
`scheme` (`QUANT_SYSTEMS`)."""


def quant_scheme(system: str) -> str | None:
    """The quantization scheme of a system name (`ours-compiled-fp8` -> "fp8"), None for an unquantized system."""
    return system[len("ours-compiled-"):] if system in QUANT_SYSTEMS else None
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Context:
    """What every system needs: the model, the workload, the recorder, and where to leave notes."""

    model: object
    work: workloads.Workload
    rec: Recorder
    max_seq_len: int | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def cfg(self):
        return self.work.config

    @property
    def batch(self) -> int:
        return len(self.work.requests[0].prompts)

    @property
    def eos(self) -> tuple[int, ...]:
        return () if self.work.ignore_eos else tuple(self.cfg.eos_token_ids or ())

    def count(self, sequences: list[list[int]]) -> int:
        """Generated tokens: every position when eos is ignored (fixed); else those other than pad, eos included
        (transformers' `_compute_tokens_per_forward`, our `RequestStats.num_tokens`)."""
        if self.work.ignore_eos:
            return sum(len(s) for s in sequences)
        return sum(t != self.cfg.pad_token_id for s in sequences for t in s)


class System(abc.ABC):
    """Prepared in `__init__` (compile there; `compile_s` set), timed while `install()` is entered (the whole
    session); `request(req)` runs one generate call and returns (sequences, tokens, decoder forwards summed over
    rows); `finish()` adds notes and extras."""

    timing = ""
    compile_s: float | None = None

    def install(self):
        return contextlib.nullcontext()

    @abc.abstractmethod
    def request(self, req: workloads.Request):
        """Run one generate call: (sequences, generated tokens, decoder forwards summed over rows)."""

    def finish(self) -> None:
        pass


class _Ours(System):
    """Our generators, observed through the public `Observer` hook (`RecorderObserver`), never patched."""

    marks_blocks = True
    """Whether `Observer.on_block_end` marks the block ends (else `on_block`, see `OursCompiled`)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.observer = RecorderObserver(ctx.rec, live=ctx.model.device.type != "cuda", marks_blocks=self.marks_blocks)
        C = ctx.model.config.canvas_length
        need = ctx.work.max_prompt_len + (-(-ctx.cfg.max_new_tokens // C) - 1) * C
        # one cache size for eager and compiled: attention reduces over every slot
        self.max_seq_len = ctx.max_seq_len or max(need, C)

    @abc.abstractmethod
    def _generate(self, *args, **kwargs):
        """`generate` with the library's signature (eager function or compiled generator)."""

    def _on_block(self):
        """The `on_block` callback of one request (None: the observer marks the blocks)."""
        return None

    def request(self, req):
        out = self._generate(req.prompts, self.ctx.cfg, seed=req.seeds, observer=self.observer,
                             on_block=self._on_block())
        # frozen-only forwards per block: the eager loop's late stop check; always 0 for the compiled generator (a
        # finished block leaves at once)
        self.wasted = getattr(self, "wasted", []) + list(out.wasted_forwards)
        # every forward the batch ran (denoise steps, fused or not, plus separate commits, counted per request block:
        # `GenerationOutput.commits`) and the canvases it denoised; prefill excluded
        self.batch_forwards = getattr(self, "batch_forwards", 0) + sum(out.forwards_per_block) + out.commits
        self.canvases = getattr(self, "canvases", 0) + len(out.forwards_per_block)
        return out.sequences, self.ctx.count(out.sequences), sum(s.decoder_passes for s in out.stats)

    def finish(self) -> None:
        w = getattr(self, "wasted", [])
        self.ctx.extra["forwards_per_canvas"] = getattr(self, "batch_forwards", 0) / max(getattr(self, "canvases", 0), 1)
        self.ctx.extra["wasted_forwards_per_block"] = sum(w) / max(len(w), 1)
        self.ctx.notes.append(f"wasted (frozen-only) forwards per block: mean {sum(w) / max(len(w), 1):.2f}, "
                              f"max {max(w, default=0)} over {len(w)} blocks")


_SPAN = "CPU: wall time; CUDA: device time between two CUDA events"


class OursEager(_Ours):
    timing = f"per step: Observer.on_step, the block loop's step span (host-side input fills + denoise_step; {_SPAN})"

    def _generate(self, *args, **kwargs):
        import dgemma_compile as dg

        return dg.generate(self.ctx.model, *args, max_seq_len=self.max_seq_len, **kwargs)


class OursCompiled(_Ours):
    timing = (f"per step: Observer.on_step, one iteration of the compiled driver (the compiled step over every row "
              f"in its phase: prefill chunks and separate commits are steps too; {_SPAN}); the unit alone: "
              f"Observer.on_unit; block ends: generate's on_block callback")
    marks_blocks = False  # the compiled driver delivers its spans and `on_block_end` at the end of the call

    def __init__(self, ctx: Context, fuse_commit: bool | None = None, quant: str | None = None,
                 eager: bool = False):
        import dgemma_compile as dg
        from dgemma_compile.compile import CompileOptions

        _weights(ctx, quant)
        super().__init__(ctx)
        B = ctx.batch
        self.gen = dg.build(ctx.model, CompileOptions(batch_buckets=(B,), max_seq_len=self.max_seq_len,
                                                      fuse_commit=fuse_commit))
        self.eager = eager
        if eager:  # every step held uncompiled (never released): the eager one step
            self.gen.defer()
            self.timing = self.timing.replace("the compiled step", "the step run uncompiled (gen.defer())", 1)
        else:
            self.compile_s = self.gen.warmup(B, ctx.cfg)
        self.row_table = self.gen.row_table(ctx.cfg)

    def _on_block(self):
        rec, seen = self.ctx.rec, set()

        def on_block(block: int, _tokens) -> None:  # called per block index and iteration where some row's ended
            if block not in seen:
                seen.add(block)
                rec.block_end()

        return on_block

    def _generate(self, *args, **kwargs):
        return self.gen.generate(*args, **kwargs)

    def finish(self) -> None:
        super().finish()
        ctx = self.ctx
        from dgemma_compile.step.sampler import SCHEME

        ctx.notes.append(f"finished blocks: one [b] event flag read per iteration, sampling {SCHEME}, "
                         f"moe_impl {self.gen.moe_impl}, commit fusion {'on' if self.gen.fuse_commit else 'off'}"
                         + (f", steps run uncompiled (step source: {self.gen.step_source})" if self.eager else ""))
        ctx.extra.update(unit_step_s=self.observer.units, compile_units=dict(self.gen.compiles),
                         inductor_s=self.gen.compile_seconds)
        if not self.eager:
            ctx.notes.append(f"compile s = gen.warmup({ctx.batch}) wall time (Inductor {self.gen.compile_seconds:.1f} s "
                             "of it)")
        _graph_notes(ctx, [v.step for v in self.row_table.views()])


def _weights(ctx: Context, scheme: str | None) -> None:
    """Quantize the loaded model to `scheme` in place (`dg.quantize`, untimed: part of preparing the system) and
    record the weight bytes (`extra["quant"]`: scheme, bytes before / after, projections quantized, parts left out;
    for the unquantized model: its own bytes, counted as the `QuantReport` counts them)."""
    import time

    from dgemma_compile.quant.quantize import weight_bytes

    if scheme is None:
        n = weight_bytes(ctx.model)  # a checkpoint stored quantized says so (the loader sets model.checkpoint.quant_scheme)
        ctx.extra["quant"] = dict(scheme=ctx.model.checkpoint.quant_scheme or "none", bytes_before=n,
                                  bytes_after=n, quantized=0, excluded=0, seconds=0.0)
        return
    import dgemma_compile as dg

    t0 = time.perf_counter()
    rep = dg.quantize(ctx.model, scheme)
    seconds = time.perf_counter() - t0
    ctx.extra["quant"] = dict(scheme=scheme, bytes_before=rep.bytes_before, bytes_after=rep.bytes_after,
                              quantized=len(rep.quantized), excluded=len(rep.excluded), seconds=seconds)
    ctx.notes.append(f"dg.quantize(model, {scheme!r}) in {seconds:.1f} s before compiling (untimed): "
                     f"{len(rep.quantized)} projections quantized, weights {rep.bytes_before / 2**20:.2f} MiB -> "
                     f"{rep.bytes_after / 2**20:.2f} MiB, {len(rep.excluded)} part(s) left out (QuantReport.excluded)")


class _Streamer:
    """transformers streamer: the first `put` of a call is the prompt, each later one a finished canvas."""

    def __init__(self, rec: Recorder):
        self.rec, self.puts = rec, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts > 1:
            self.rec.block_end()

    def end(self) -> None:
        self.puts = 0


class Transformers(System):
    """transformers' own generate; `compiled` adds cache_implementation="static" (it then compiles lazily, so its
    compile time is estimated as the warm-up pass minus the fastest timed pass)."""

    def __init__(self, ctx: Context, compiled: bool):
        self.ctx, self.compiled = ctx, compiled
        self.kwargs = dict(ctx.work.hf_kwargs, **({"cache_implementation": "static"} if compiled else {}))
        self.streamer = _Streamer(ctx.rec)
        self.timing = ("per step: patched _denoising_step wall time (compiled decoder forward + compiled sampler "
                       "pieces)" if compiled else
                       "per step: patched DiffusionGemmaGenerationMixin._denoising_step wall time")
        if ctx.work.ignore_eos:
            ctx.notes.append("exactly N steps via stability_threshold=N; eos ignored via eos_token_id=[]")

    def install(self):
        model = self.ctx.model
        return patched(model, "_denoising_step", self.ctx.rec.timed(model._denoising_step))

    def request(self, req):
        ctx, model = self.ctx, self.ctx.model
        P = len(req.prompts[0])
        if any(len(p) != P for p in req.prompts):
            raise ValueError("transformers runs equal-length prompts only in this benchmark")
        torch.manual_seed(req.seeds[0])
        cur = ctx.rec.current
        before = len(cur.steps) if cur is not None else 0
        out = model.generate(torch.tensor(req.prompts, device=model.device), streamer=self.streamer, **self.kwargs)
        steps = len(cur.steps) - before if cur is not None else 0
        limit = ctx.cfg.max_new_tokens
        rows = [_trim(r, ctx.eos, limit) for r in out.sequences[:, P:].tolist()]
        if ctx.work.ignore_eos and any(len(r) != limit for r in rows):
            raise RuntimeError(f"transformers produced {[len(r) for r in rows]} tokens, expected {limit}")
        return rows, ctx.count(rows), steps * len(rows)


def _trim(row: list[int], eos: tuple[int, ...], limit: int) -> list[int]:
    """Generated ids up to and including the first eos (transformers pads the rest), at most `limit`."""
    row = row[:limit]
    for j, t in enumerate(row):
        if t in eos:
            return row[:j + 1]
    return row


class Autoregressive(System):
    timing = "per forward: compiled one-token step wall time"

    def __init__(self, ctx: Context):
        from .ar import ARBaseline

        self.ctx = ctx
        self.C, self.n_new = ctx.model.config.canvas_length, ctx.cfg.max_new_tokens
        P = ctx.work.max_prompt_len
        self.ar = ARBaseline(ctx.model, ctx.batch, ctx.max_seq_len or P + max(self.n_new, 4))
        self.compile_s = self.ar.warmup(P)

    def _on_token(self, i: int) -> None:
        if i % self.C == 0:
            self.ctx.rec.block_end()

    def request(self, req):
        rec = self.ctx.rec
        seqs = self.ar.generate(req.prompts, self.n_new, self.ctx.eos, timed=rec.timed, on_token=self._on_token)
        if rec.current is not None and len(rec.current.block_ends) < -(-len(seqs[0]) // self.C):
            rec.block_end()  # a last partial canvas
        return seqs, self.ctx.count(seqs), sum(len(s) for s in seqs)

    def finish(self) -> None:
        ar = self.ar
        self.ctx.notes.append(f"compile s = prefill-chunk + one-token step units ({ar.compiles} graphs, Inductor "
                              f"{ar.compile_seconds:.1f} s); greedy, eos {'stops a row' if self.ctx.eos else 'ignored'}")
        _graph_notes(self.ctx, (ar.step, ar.prefill_unit))


def _graph_notes(ctx: Context, units) -> None:
    """Say, per `CompiledUnit`, whether its CUDA graph replayed or why its capture failed (CUDA only)."""
    from dgemma_compile.compile.units import CompiledUnit

    for u in units:
        if not isinstance(u, CompiledUnit):
            continue
        if u.graph_error:
            ctx.notes.append(f"{u.name}: CUDA graph capture failed ({u.graph_error[:200]})")
        elif u.graph is not None:
            ctx.notes.append(f"{u.name}: CUDA graph replayed")


def make(system: str, ctx: Context) -> System:
    """The prepared (compiled, where it compiles) `System` named `system`."""
    if system.startswith("ours-compiled"):
        return OursCompiled(ctx, fuse_commit={"ours-compiled-fused": True, "ours-compiled-unfused": False}.get(system),
                            quant=quant_scheme(system))
    if system == "ours-eager":
        return OursEager(ctx)
    if system == "ours-step-eager":
        return OursCompiled(ctx, eager=True)
    if system in ("hf-eager", "hf-compiled"):
        return Transformers(ctx, compiled=system == "hf-compiled")
    return Autoregressive(ctx)


def workload_for(spec: models.ModelSpec, wspec: workloads.WorkloadSpec):
    """(Workload, tokenizer or None): real task prompts and a tokenizer for the demo's adaptive workload."""
    import dgemma_compile as dg
    from dgemma_compile.model.loader import load_configs

    if spec.has_checkpoint:
        mcfg, gcfg = load_configs(spec.checkpoint)
    else:
        mcfg, gcfg = models.full_config(tiny=spec.direct == "full-tiny"), dg.GenerationConfig()
    tokenizer = dg.load_tokenizer(spec.checkpoint) if spec.name == "demo" and wspec.kind == "adaptive" else None
    return workloads.build(wspec, mcfg, gcfg, tokenizer=tokenizer, demo_tasks=tokenizer is not None), tokenizer
