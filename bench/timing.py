"""Clocks, per-request timing records, the `Observer` that feeds them, temporary patches (transformers only) and
peak-memory probes shared by every system.

CPU: `time.perf_counter`. CUDA: the clock synchronises the device before reading `perf_counter`, so a mark means
"everything launched so far has finished" (the generators measured here synchronise with the host every step anyway,
to test for a finished block).
Our generators are timed through their public `dgemma_compile.Observer` hook (`RecorderObserver`): step and unit
durations are the library's spans (CPU: wall time; CUDA: device time between two events, read after each block).
Peak memory: CPU resident-set high-water mark (Linux `VmHWM`, reset through /proc/self/clear_refs so that it covers
only the timed runs; `ru_maxrss` of the whole process when that is unavailable); CUDA `max_memory_allocated`.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from dataclasses import dataclass, field

import torch

from dgemma_compile import Observer


class Clock:
    """Wall-clock seconds; on CUDA every reading first waits for the device."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


@dataclass
class RequestTimes:
    """Marks of one generate call (seconds from the clock). `steps` are durations of denoise steps (AR: decode
    forwards); `block_ends` are the instants each block (AR: each canvas' worth of tokens) became final."""

    start: float = 0.0
    end: float = 0.0
    first_step: float | None = None
    steps: list[float] = field(default_factory=list)
    block_ends: list[float] = field(default_factory=list)

    def block_durations(self) -> list[float]:
        """Per-canvas wall time: block 0 from its first step, block i > 0 from the end of block i-1 (so it holds the
        commit of the previous block and its own steps: 17 forwards at 16 steps, or 16 with commit fusion, where
        the commit runs inside the block's first step)."""
        begin = self.first_step if self.first_step is not None else self.start
        out, prev = [], begin
        for t in self.block_ends:
            out.append(t - prev)
            prev = t
        return out


class Recorder:
    """Collects `RequestTimes` of the current request; systems call `step`-wrapped functions and `block_end`."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.requests: list[RequestTimes] = []
        self.current: RequestTimes | None = None

    @contextlib.contextmanager
    def request(self):
        self.current = RequestTimes(start=self.clock())
        try:
            yield self.current
        finally:
            self.current.end = self.clock()
            self.requests.append(self.current)
            self.current = None

    def add_step(self, start: float, seconds: float) -> None:
        """One step of the current request (ignored outside a recorded request) that began at clock time `start`."""
        if self.current is not None:
            if self.current.first_step is None:
                self.current.first_step = start
            self.current.steps.append(seconds)

    def timed(self, fn):
        """`fn` wrapped so that each call's duration is appended to the current request's steps."""
        def wrapper(*args, **kwargs):
            t0 = self.clock()
            out = fn(*args, **kwargs)
            self.add_step(t0, self.clock() - t0)
            return out
        return wrapper

    def block_end(self, *_args) -> None:
        if self.current is not None:
            self.current.block_ends.append(self.clock())


class RecorderObserver(Observer):
    """Feeds a `dgemma_compile.Observer`'s timings into `rec` while a request is recorded: each `on_step` is a step,
    `on_unit` durations of units whose name starts with `unit_prefix` are kept in `units` (the compiled step alone,
    "step[B{b}_...]"), each `on_block_end` marks a block end (clock time) unless `marks_blocks` is False (the system
    marks its block ends itself, `Recorder.block_end`).

    The first step's start instant (block 0 of `RequestTimes.block_durations`): with `live` spans (CPU, delivered
    as each step ends) it is the clock at delivery minus the step's duration; on CUDA spans arrive only after the
    block, so it is the block end minus the summed device time of the block's steps (the host gaps between steps
    of block 0 are then left out); without `marks_blocks`, on CUDA, it is the request's start.
    """

    def __init__(self, rec: Recorder, *, live: bool, unit_prefix: str = "step[", marks_blocks: bool = True):
        self.rec, self.live, self.unit_prefix, self.marks_blocks = rec, live, unit_prefix, marks_blocks
        self.units: list[float] = []
        self._block_steps = 0.0

    def on_step(self, seconds: float) -> None:
        cur = self.rec.current
        if cur is None:
            return
        cur.steps.append(seconds)
        if cur.first_step is None:
            if self.live:
                cur.first_step = self.rec.clock() - seconds
            else:
                self._block_steps += seconds

    def on_unit(self, name: str, seconds: float) -> None:
        if self.rec.current is not None and name.startswith(self.unit_prefix):
            self.units.append(seconds)

    def on_block_end(self, block: int) -> None:
        cur = self.rec.current
        if cur is None or not self.marks_blocks:  # not marking: on CUDA block 0 then counts from the request start
            return
        now = self.rec.clock()
        if cur.first_step is None:
            cur.first_step = now - self._block_steps
        self._block_steps = 0.0
        cur.block_ends.append(now)


@contextlib.contextmanager
def patched(obj, name: str, value):
    """Temporarily replace attribute `name` of `obj` (a class or an instance). Only for transformers' model: our
    library is observed through its public `Observer` hook, never patched (tests/bench/test_bench.py checks)."""
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> tuple[float, float, float]:
    """(min, median, p90) of `xs` (NaNs when empty)."""
    return (min(xs) if xs else float("nan")), median(xs), p90(xs)


def p90(xs: list[float]) -> float:
    """90th percentile, nearest-rank (the value at least 90% of samples do not exceed)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, -(-9 * len(s) // 10) - 1))]


class PeakMemory:
    """Peak memory over a phase: `reset()` before it, `read_mb()` after. `kind` names what is measured."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.kind = "cuda max_memory_allocated" if self.cuda else "RSS high-water (VmHWM)"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        except OSError:
            self.kind = "RSS high-water of the whole process (ru_maxrss; could not reset)"

    def read_mb(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
