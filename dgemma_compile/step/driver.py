"""`Driver`: the host side of a bucket's row table, the one loop over rows that the compiled generator and the serving
engine share: admit a request into a row -> step -> read the step's report -> finalize the finished blocks -> retire.

Shaped as nano-vllm's `LLMEngine.step` (schedule -> run -> postprocess) over vLLM's persistent batch: a request takes
the lowest free row; each iteration runs the smallest batch size that holds every busy row (`RowTable.size_for`,
preferring sizes whose step is ready: `RowTable.warm`), refreshing the plan first when the host changed a row or the
size changed; the device owns every transition of a row and reports what each row did (`rows.Report`), which the
host reads once per iteration (`Bucket.report`) and then, only for the rows whose block finished, their argmax
canvases (`RowTable.read_blocks`), and only for the rows that stepped and whose request asked for live canvas frames
(`RowRequest.frames`), their frames (`RowTable.read_frames`: one read for all of them; `frames.py`). Nothing on the
host replays a device transition.

Users: `CompiledGenerator.generate` (queue every request of the call, step until idle: `compile/generator.py`) and
`runtime/engine.py`'s `Engine` (a thread, a queue, KV pages and events around it). The eager reference generator
(`oracle.py`) is not one: it stays a separate, readable block loop, the oracle.

Legend: B rows of the bucket, b the batch size of an iteration, C canvas.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from ..inputs.constraint import RowGrammar
from ..inputs.images import ImagePrompt, prefill_images
from ..model.config import GenerationConfig
from .canvas import Canvas
from .finish import finalize
from .frames import CanvasFrame
from .row_table import RowTable
from .rows import RowReport

log = logging.getLogger("dgemma_compile")


class RowRequest(Protocol):
    """What the driver reads and writes of a request in a row (the engine's `Request`, the generator's `_Call`
    entries): its prompt ids, resolved config and seed, images (`images.prepare`) and grammar (`constraint.py`), and
    the output it accumulates (`sequence`, its `requests.RequestStats`); `frames`: it asked for a live canvas frame
    after each of its denoise steps (`frames.py`; a request without costs nothing more); `canvas`: its seeded or
    pinned canvas (`canvas.py`) or None, whose slice for each block the driver writes into the row (`RowTable.pin`)."""

    prompt: list[int]
    config: GenerationConfig
    seed: int
    images: ImagePrompt | None
    grammar: RowGrammar | None
    sequence: list[int]
    stats: object
    frames: bool
    canvas: Canvas | None


@dataclass
class Finished:
    """A row whose block finished in the iteration: its report (`block`, `steps`, `done`: the device ended the
    request, so the row is FREE already) and the block's argmax canvas (C ids)."""

    row: int
    report: RowReport
    argmax: list[int]


@dataclass
class Iteration:
    """One step of the driver: the batch size it ran, the busy rows and what each did (`rows.RowReport`), the rows
    whose block finished (canvases read), the frames of the rows that stepped and asked for them (row -> its
    `frames.CanvasFrame`; empty when none asked), and the host's seconds in the plan refresh (None: none), the report
    read and the frames read (0.0: none read)."""

    size: int
    busy: list[int]
    reports: dict[int, RowReport]
    finished: list[Finished]
    refresh_s: float | None
    read_s: float
    frames: dict[int, CanvasFrame] = field(default_factory=dict)
    frames_s: float = 0.0


class Driver:
    """The host side of `bucket`'s row table (see the module docstring). `rows[b]` is the request in row b (None:
    FREE). `span(name)`: a context around each run of a step named `name` (the generator's timer spans); default
    none. Clears the bucket: a driver owns its rows while it runs (another driver on the same bucket overwrites
    them)."""

    def __init__(self, row_table: RowTable, *, span: Callable[[str], AbstractContextManager] | None = None):
        self.row_table = row_table
        self.rows: list[RowRequest | None] = [None] * row_table.rows
        self._span = span or (lambda name: contextlib.nullcontext())
        self._dirty = True  # the host changed a row (or the size) since the plan was filled
        self._size = 0  # the batch size of the latest step
        row_table.clear()

    # ----- the rows ------------------------------------------------------------------------------------------------
    def free(self) -> list[int]:
        """The FREE rows, lowest first (admitting there keeps busy rows low, so steps run at small sizes)."""
        return [b for b, r in enumerate(self.rows) if r is None]

    def busy(self) -> list[int]:
        return [b for b, r in enumerate(self.rows) if r is not None]

    def idle(self) -> bool:
        return all(r is None for r in self.rows)

    def admit(self, b: int, request: RowRequest, *, mapped: int | None = None) -> int:
        """Put `request` into FREE row `b` (`RowTable.admit`): its image prefix first, in forwards of its own
        (`images.prefill_images`, after the `mapped` tokens), its grammar's first mask (`RowTable.constrain`), its
        canvas's first block (`RowTable.pin`).
        `mapped`: prompt tokens a prefix-cache hit mapped into the row (a paged cache whose row the caller set up);
        None: the row starts empty. Returns the image-prefix tokens encoded here. On an exception the row stays
        FREE on the host (the caller ends the request)."""
        bk, start = self.row_table, mapped or 0
        item, encoded = request.images, 0
        self._dirty = True
        try:
            if item is not None:
                if mapped is None:
                    bk.cache.reset_row(b)
                if start < item.prefix:
                    prefill_images(bk.model, bk.cache, b, request.prompt, item, chunk=bk.model.config.canvas_length,
                                   moe_impl=bk.moe_impl, start=start)
                    encoded, start = item.prefix - start, item.prefix
            bk.admit(b, request.prompt, request.config, request.seed,
                     prefilled=start if mapped is not None or item is not None else None)
            if request.grammar is not None:
                bk.constrain(b, request.grammar.bitmask())
            if request.canvas is not None:
                bk.pin(b, request.canvas.block_slice(len(request.sequence), bk.model.config.canvas_length,
                                                     request.grammar.bitmask() if request.grammar else None))
        except BaseException:
            bk.retire(b)  # FREE on the device too, whatever was written
            raise
        self.rows[b] = request
        return encoded

    def retire(self, b: int, *, device_done: bool = False) -> RowRequest:
        """Free row `b` and return its request; `device_done`: the device already ended it (FREE there), else the
        host frees the row on the device too (a stop the host decided, a cancellation)."""
        request, self.rows[b] = self.rows[b], None
        if not device_done:
            self.row_table.retire(b)
            self._dirty = True
        return request

    def clear(self) -> None:
        """Every row FREE on both sides (after a failed iteration), the cache zeroed."""
        self.rows = [None] * self.row_table.rows
        self.row_table.clear()
        self._dirty = True

    # ----- one iteration --------------------------------------------------------------------------------------------
    def step(self) -> Iteration | None:
        """Run the step once over the busy rows and read what it did; None when no row is busy."""
        busy, bk = self.busy(), self.row_table
        if not busy:
            return None
        size = bk.size_for(busy[-1] + 1, bk.warm)
        view = bk.view(size)
        refresh_s = None
        if self._dirty or size != self._size:
            if not bk.warm(size) and not view.unit.held:
                log.info("batch size %d is used for the first time (compiles now, or loads from the compile cache)",
                         size)
            t0 = time.perf_counter()
            view.refresh()
            refresh_s = time.perf_counter() - t0
            self._dirty, self._size = False, size
        with self._span(view.name):
            view.step()
        t0 = time.perf_counter()
        report = view.report()  # the iteration's one read (the host's only view of the transitions)
        read_s = time.perf_counter() - t0
        reports = {b: report[b] for b in busy}
        ended = [b for b in busy if reports[b].event]
        finished = [Finished(b, reports[b], argmax) for b, argmax in zip(ended, bk.read_blocks(ended))]
        framed = [b for b in busy if reports[b].stepped and self.rows[b].frames]
        frames, frames_s = {}, 0.0
        if framed:  # only rows that asked: a request without frames adds no read
            t0 = time.perf_counter()
            for b, (tokens, accepted, entropy) in zip(framed, bk.read_frames(framed)):
                frames[b] = CanvasFrame(block=reports[b].block, step=reports[b].steps, tokens=tokens,
                                        accepted=accepted, mean_entropy=entropy)
            frames_s = time.perf_counter() - t0
        return Iteration(size=size, busy=busy, reports=reports, finished=finished, refresh_s=refresh_s, read_s=read_s,
                         frames=frames, frames_s=frames_s)

    def finalize(self, f: Finished) -> tuple[list[int], bool]:
        """The one finalize of a finished block (`finish.finalize`: eos, the exact budget; a constrained request's
        kept prefix): append to the request's sequence and stats; returns (the tokens appended, done). A constrained
        request that goes on commits its kept prefix, its next block's first position masked by its grammar (host
        writes, then the plan refreshes). A request with a canvas gets its next block's slice (`RowTable.pin`: the
        positions after the tokens it kept). The caller retires a done request (`retire`, `device_done=f.report.done`)."""
        req = self.rows[f.row]
        keep, done = finalize(f.argmax, req.config, req.sequence, req.stats, f.report.steps, req.grammar)
        if req.grammar is not None and not done:
            self.row_table.constrain(f.row, req.grammar.bitmask(), commit_len=len(keep))
            self._dirty = True  # the commit's length is in the plan
        if req.canvas is not None and not done:
            self.row_table.pin(f.row, req.canvas.block_slice(len(req.sequence), self.row_table.model.config.canvas_length,
                                                          req.grammar.bitmask() if req.grammar else None))
        return keep, done
