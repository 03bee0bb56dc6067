"""Public observation hooks: per-step and per-unit timings delivered to an `Observer`, without syncing inside a block.

The block loop times every denoise step (what `EagerSteps.step` does: host-side input fills plus the step itself);
the compiled generator also times each compile-unit call (`denoise_step[...]`, `encoder_chunk[...]`). Benchmarks
and the GPU check subscribe through `generate(..., observer=...)` instead of patching library internals.

On CPU a span is two `time.perf_counter` readings and is delivered at once. On CUDA a span records two
`torch.cuda.Event`s on the current stream and nothing else; the events are read in `SpanTimer.flush()`, which the
block loop calls after each block is finalised (a point where the host already waits for the device), so observing
never adds a synchronisation inside a block's steps. CUDA durations are device time between the two events.
"""

from __future__ import annotations

import contextlib
import time

import torch

STEP = "step"
"""Span kind of one denoise step as the block loop drives it."""
UNIT = "unit"
"""Span kind of one compile-unit call (compiled generator only); the span's name is the unit's name."""


class Observer:
    """Receives timings in seconds; override what you need (the defaults ignore everything).

    On CPU each call arrives as its span ends; on CUDA spans are delivered at the next block end. `on_block_end(b)`
    follows every step of block b (compiled: once per iteration in which some request's block b ended, after that
    iteration's spans; requests progress independently there).
    """

    def on_step(self, seconds: float) -> None:
        """One step of the whole batch: the eager block loop's denoise step (host-side input fills + the step), or
        one iteration of the compiled generator (one forward serving every row's prefill chunk, denoise step or
        commit)."""

    def on_unit(self, name: str, seconds: float) -> None:
        """One call of compile unit `name` (e.g. "step[B1_P1_stop]")."""

    def on_block_end(self, block: int) -> None:
        """Block `block` was finalised (its timings above are complete)."""


class SpanTimer:
    """Times spans for an `Observer` on `device`; a `SpanTimer(device, None)` times nothing and costs nothing."""

    def __init__(self, device: torch.device | str, observer: Observer | None):
        self.observer = observer
        self.cuda = torch.device(device).type == "cuda"
        self._pending: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def span(self, kind: str, name: str = ""):
        """Time the body as one span of `kind` (`STEP` or `UNIT`) named `name`."""
        if self.observer is None:
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((kind, name, start, end))
            return
        t0 = time.perf_counter()
        yield
        self._deliver(kind, name, time.perf_counter() - t0)

    def flush(self, block: int) -> None:
        """Deliver the block's pending CUDA spans (waits for the last event), then `on_block_end(block)`."""
        if self.observer is None:
            return
        if self._pending:
            self._pending[-1][3].synchronize()
            for kind, name, start, end in self._pending:
                self._deliver(kind, name, start.elapsed_time(end) / 1e3)
            self._pending.clear()
        self.observer.on_block_end(block)

    def _deliver(self, kind: str, name: str, seconds: float) -> None:
        if kind == STEP:
            self.observer.on_step(seconds)
        else:
            self.observer.on_unit(name, seconds)
