"""One system on one workload as a measurement session: prepared once, then timed one repeat at a time.

`Session(...)` loads the model, builds the system (compiling where it compiles; its `compile_s`) and runs one untimed
warm-up pass over the whole workload. Each `repeat()` is one timed pass over every request of the workload (one
generate call per request, each recorded by the system's `Recorder`); `result()` returns the raw measurement that
`report.py` summarises. The runner calls `repeat()` round-robin across the sessions of all systems (`runner.py`), so
one session's repeats are spread over the whole run; nothing here depends on that order.

Per repeat the session keeps the pass time (the clock around the pass: prefill, every block, every host step),
its start as epoch seconds (`repeat_started`, comparable across processes: the runner's order can be checked
from it) and the Dynamo graphs compiled during it (a recompile in a timed pass is reported, never hidden).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings

import torch

from . import models, systems, workloads
from .timing import Clock, PeakMemory, Recorder


def _counter(group: str, name: str) -> int:
    from torch._dynamo.utils import counters

    return int(counters[group][name])


class Session:
    """`system` prepared on the workload `wspec` of model `spec`; see the module docstring.

    `max_seq_len`: static committed slots of the compiled systems' caches (default: just enough for the workload).
    Raises what preparing the system raises (the worker turns it into an "n/a (reason)" row).
    """

    def __init__(self, system: str, spec: models.ModelSpec, wspec: workloads.WorkloadSpec, device: str = "cpu",
                 dtype: str | None = None, max_seq_len: int | None = None):
        if system not in systems.SYSTEMS:
            raise ValueError(f"unknown system {system!r}; choose from {systems.SYSTEMS}")
        warnings.filterwarnings("ignore")
        logging.getLogger("torch._inductor").setLevel(logging.ERROR)
        self.system, self.wspec = system, wspec
        self.device = dev = torch.device(device)
        torch.manual_seed(0)
        self.work, self.tokenizer = systems.workload_for(spec, wspec)
        self.clock, self.mem = Clock(dev), PeakMemory(dev)
        load = models.load_transformers if system.startswith("hf-") else models.load_ours
        dt = systems.DTYPES[dtype] if dtype else None
        self.ctx = systems.Context(model=load(spec, dev, dt), work=self.work, rec=Recorder(self.clock),
                                   max_seq_len=max_seq_len)
        t0 = time.perf_counter()
        cache_before = (_counter("inductor", "fxgraph_cache_hit"), _counter("inductor", "fxgraph_cache_miss"))
        self.sut = systems.make(system, self.ctx)
        self.prepare_s = time.perf_counter() - t0
        self._installed = contextlib.ExitStack()
        self._installed.enter_context(self.sut.install())
        t1 = time.perf_counter()
        self._pass(record=False)  # warm-up: excluded
        self.warm_s = time.perf_counter() - t1
        self.cache_hits = _counter("inductor", "fxgraph_cache_hit") - cache_before[0]
        self.cache_misses = _counter("inductor", "fxgraph_cache_miss") - cache_before[1]
        self.repeat_s: list[float] = []
        self.repeat_started: list[float] = []
        self.new_graphs = 0
        self.tokens = self.forwards = 0
        self.outs: list = []
        self.mem.reset()

    @property
    def compile_s(self) -> float | None:
        """The system's compile seconds (`System.compile_s`), None when it compiles nothing up front."""
        return self.sut.compile_s

    def _pass(self, record: bool) -> tuple[int, int, list]:
        rec = self.ctx.rec
        tokens = forwards = 0
        outs = []
        for req in self.work.requests:
            with rec.request() if record else contextlib.nullcontext():
                seqs, n_tok, n_fwd = self.sut.request(req)
            tokens, forwards = tokens + n_tok, forwards + n_fwd
            outs.append(seqs)
        return tokens, forwards, outs

    def repeat(self) -> dict:
        """One timed pass over the workload: {"index", "seconds", "started"} (started: epoch seconds)."""
        graphs = _counter("stats", "unique_graphs")
        started = time.time()
        t = self.clock()
        self.tokens, self.forwards, self.outs = self._pass(record=True)
        seconds = self.clock() - t
        self.new_graphs += _counter("stats", "unique_graphs") - graphs
        self.repeat_s.append(seconds)
        self.repeat_started.append(started)
        return {"index": len(self.repeat_s) - 1, "seconds": seconds, "started": started}

    def result(self) -> dict:
        """The raw measurement (lists of seconds and counts; `report.summarize` turns them into spreads and ratios).
        Ends the session's timers (transformers' step timer is removed); call it once, after the last repeat."""
        if not self.repeat_s:
            raise RuntimeError("result() before any timed repeat")
        ctx, rec = self.ctx, self.ctx.rec
        peak = self.mem.read_mb()
        self._installed.close()
        self.sut.finish()
        compile_s = self.sut.compile_s
        if self.system == "hf-compiled":
            compile_s = max(0.0, self.prepare_s + self.warm_s - min(self.repeat_s))
            ctx.notes.append("compile s = warm-up pass minus the fastest timed pass (transformers compiles lazily)")
        if len(self.repeat_s) < self.wspec.repeats:
            ctx.notes.append(f"time budget: {len(self.repeat_s)} of {self.wspec.repeats} timed repeats")
        if self.cache_hits or self.cache_misses:
            ctx.notes.append(f"Inductor FX graph cache: {self.cache_hits} hit(s), {self.cache_misses} miss(es) "
                             "(hits make compile s smaller)")
        if self.new_graphs:
            ctx.notes.append(f"WARNING: {self.new_graphs} new graph(s) compiled during the timed passes")
        if self.tokenizer is not None:
            from dgemma_compile.demo.tasks import check

            pairs = [(t, s) for req, seqs in zip(self.work.requests, self.outs) for t, s in zip(req.texts or [], seqs)]
            ctx.extra["accuracy"] = sum(check(t, self.tokenizer.decode(s, skip_special_tokens=True))
                                        for t, s in pairs) / len(pairs)
        return dict(
            system=self.system, status="ok", device=str(self.device), dtype=str(ctx.model.dtype).replace("torch.", ""),
            timing=self.sut.timing, step_s=[s for r in rec.requests for s in r.steps],
            canvas_s=[d for r in rec.requests for d in r.block_durations()],
            ttfb_s=[r.block_ends[0] - r.start for r in rec.requests if r.block_ends],
            request_s=[r.end - r.start for r in rec.requests], repeat_s=self.repeat_s,
            repeat_started=self.repeat_started, tokens=self.tokens, forwards=self.forwards, compile_s=compile_s,
            peak_mem_mb=peak, mem_kind=self.mem.kind, notes=ctx.notes, extra=ctx.extra, threads=torch.get_num_threads(),
        )
