"""The serving engine: continuous batching of requests over the rows of one `row_table.RowTable`, a user of the one
driver (`driver.Driver`: admit, step, read the report, finalize, retire) with a thread, a queue, KV pages and events
around it; its admissions, cancellations and stop come from a schedule source (`ScheduleSource`: its own, or under
tensor parallel rank 0's, `runtime/parallel.py`).

Every iteration (`Engine.step`) runs ONE forward, the bucket's step (`mixed_step.mixed_step`), over the smallest of the
bucket's batch sizes that holds every busy row (`RowTable.size_for`: requests are admitted into the lowest free row,
so a lone request runs at batch 1 whatever `max_batch` is); each row is in its own phase (`phases.py`: prefill
chunk, denoise step, commit -- fused with the next block's first step where the bucket fuses commits -- or idle),
with the phase transitions decided on the device. An iteration:

1. retires cancelled requests and admits queued ones into free rows (`RowTable.admit`: the per-row inputs, the row
   state, the cache row; nothing is recompiled, every value is written into the bucket's static buffers); if the
   host changed any row, or the batch size changes, refills the plan of the size it runs (`Bucket.refresh`);
2. runs the step (compiled: one unit per batch size, compiled on first use with a log line; `build_engine` compiles
   the smallest before the engine starts);
3. reads the step's report (`rows.Report`, int64 [b, K]: what each row did -- prompt tokens encoded, stepped,
   committed, its block and step count, whether its block finished and whether the device ended the request) --
   the per-iteration read, chosen over learning finished requests one iteration late because the host can then
   retire a request (stop string, cancel) before the device commits its block; ~10 us on CPU
   (`EngineStats.flag_read_s`) -- and, for the rows whose block finished, their argmax canvas (one more read);
   finalises those blocks exactly as the eager block loop does (`finish.finalize`: eos, exact token budget, a
   constrained request's kept prefix), runs stop strings (`text.StopStrings`: never shown, also
   across a block boundary), emits one `BlockEvent` per finished block, and retires requests only the host can end
   (stop strings, cancellation). Rows the device ended (eos, budget) are already FREE; others go on on the device
   (COMMIT, then the next block) with no host write;
4. draft events (opt-in per request, `Request.draft_every` = k): every k-th denoise step of a block still in
   flight, the request gets its current argmax canvas as a `BlockEvent` with `draft=True` (cut at eos and at its
   token budget, text cut before a stop string; a constrained request's cut to the prefix its grammar accepts;
   nothing committed). The rows asking for one this iteration are read
   together: one more host read of [rows, C] ids, only in iterations where some row asks;
5. live canvas frames (opt-in per request, `Request.frames`): after each denoise step of the request, a
   `BlockEvent` with `frame` (`frames.CanvasFrame`: the block's argmax canvas, which positions the step accepted,
   its mean entropy), before the event of the block that step ended. The driver reads the frames of the asking
   rows in one read per iteration (`driver.Driver.step`); a request without frames costs nothing more.

Numerics: the step is per-row deterministic within a bucket (batch-invariant rows, the CPU default), so each
request's tokens equal its solo `gen.generate` run whatever its batch mates, phases, row and batch size.

KV memory: over a static cache each row owns max_seq_len committed slots. Over a `kv_cache.PagedKVCache` (a bucket
built with `page_size`) the rows draw pages from one pool (`kv.memory.PagedMemory`): a request waits in the queue
until its pages are available, holds them until it retires, and with the prefix cache (on by default) starts its
prefill after the cached full pages its prompt starts with (`EngineStats.prefix_hit_tokens`, `prefill_tokens`:
`RowState.prefilled` and the cache row's length start at the hit), waiting for those another row is computing.
Shared pages: full prompt pages, and the full pages of committed blocks of a request whose prompt length is a
multiple of the canvas C (then its commit passes are the prefill chunks a later prompt over the same tokens runs;
otherwise their chunking differs, and so would that request's numerics: `prefix_cache.py`), so the next turn of a
chat maps the previous answer. The tokens are those of the request's solo run either way (tests/runtime/test_kv_paged.py).
A request with images encodes its image prefix at admission after the pages its hit mapped (image pages are keyed
by the images' content, `image_pages.py`: the same image in a later request runs no vision encoder).

An engine owns its bucket's buffers while it runs: another engine or `gen.generate` on the same bucket overwrites
its rows.

Requests are validated at `submit` (`check_request`), so a bad request never reaches the rows. `submit` and `cancel`
are thread-safe; `step` and `run` belong to one engine thread. Events are delivered by calling the request's
`on_event` from the engine thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dgemma_compile.model.config import ConfigError, GenerationConfig
from dgemma_compile.step.row_table import RowTable
from dgemma_compile.inputs.constraint import Constraint, RowGrammar, row_grammars
from dgemma_compile.step.driver import Driver, Finished
from dgemma_compile.step.canvas import Canvas, canvas_of
from dgemma_compile.step.frames import CanvasFrame
from dgemma_compile.step.requests import STRUCTURAL, RequestStats, check_slots, plan_requests
from dgemma_compile.inputs.images import ImagePrompt
from dgemma_compile.inputs.images import prepare as prepare_images
from dgemma_compile.model.backbone import DiffusionGemma
from dgemma_compile.step.rows import RowReport
from dgemma_compile.inputs.text import StopStrings
from .kv.memory import PagedMemory

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """`Engine.submit` with `max_queue` requests already waiting."""


@dataclass
class BlockEvent:
    """One finished block of one request (or the end of a request that produced no block: cancelled, error).

    tokens: the token ids the request gained (prompt excluded, cut at eos and at the budget); text: the text to show
    now (stop strings held back or cut); finish_reason: None while the request runs, else "eos", "length", "stop"
    (a stop string), "cancelled" or "error"; completion_tokens: tokens behind the text returned so far (the whole
    sequence, or at a stop string the shortest prefix whose text covers what was shown)."""

    request: "Request"
    tokens: list[int]
    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0
    draft: bool = False
    """A draft (`Request.draft_every`): `tokens` / `text` are the block in flight's current argmax canvas after
    `step` denoise steps of block `block` (provisional, replaced by the block's own event); never a finish."""
    block: int = 0
    step: int = 0
    frame: CanvasFrame | None = None
    """A live canvas frame (`Request.frames`): the block in flight after a denoise step (`frames.CanvasFrame`),
    `text` its canvas's text (special tokens skipped); never a finish, nothing committed."""
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    """With `Request.logprobs` = k: per token of `tokens`, (its log-probability, the k most likely (id, log p)) in the
    denoise step whose argmax canvas was committed (`mixed_step.logprobs`: temperature 1); None otherwise."""


@dataclass(eq=False)
class Request:
    """A request to the engine: prompt token ids, a resolved config (`GenerationConfig.resolved`), its seed
    ([0, 2**64)), stop strings and the callback that receives its `BlockEvent`s (called from the engine thread).
    `draft_every` k > 0 asks for a draft event every k denoise steps of each block (0: none); each costs this
    request's bucket a host read of the canvas in those iterations."""

    prompt: list[int]
    config: GenerationConfig
    seed: int
    stops: tuple[str, ...] = ()
    on_event: Callable[[BlockEvent], None] = lambda e: None
    id: int = 0
    cancelled: bool = False
    sequence: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    submitted: float = 0.0
    matcher: StopStrings | None = None
    slots: int = 0  # committed slots it can need (`requests.plan_requests`)
    draft_every: int = 0
    frames: bool = False
    """A live canvas frame event after each of its denoise steps (`BlockEvent.frame`)."""
    logprobs: int | None = None
    """k >= 0: each block event carries the log-probabilities of its tokens and the k most likely alternatives
    (`BlockEvent.logprobs`; k at most the bucket's `max_logprobs`); None: none."""
    images: ImagePrompt | None = None
    """The prompt's images (`images.prepare`): its image prefix is encoded into its row at admission
    (`images.prefill_images`), after the pages a prefix-cache hit maps (keyed by the images' content,
    `image_pages.py`); None: a text prompt."""
    constraint: Constraint | None = None
    """The text's grammar (docs/constrained.md): each block keeps and commits the prefix it accepts; None: free."""
    grammar: RowGrammar | None = None  # its matcher, made at `submit` (needs the engine's tokenizer)
    compiled: Any = None
    """The constraint's xgrammar `CompiledGrammar` made before `submit` (the server's grammar workers,
    `grammars.GrammarService`); None: `submit` compiles it in the calling thread."""
    canvas: Canvas | None = None
    """Its seeded or pinned canvas (`dgemma_compile.step.canvas`): each block's slice written into its row by the driver;
    None: every position free."""


@dataclass
class Schedule:
    """One iteration's host changes, as the leader decided them: requests to queue (in order), ids to cancel, whether
    to stop (`ScheduleSource`)."""

    requests: list[Request] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)
    stop: bool = False


class ScheduleSource(Protocol):
    """Where an engine's schedule comes from: its own submissions (`LocalSchedule`), or, under tensor parallel, rank
    0's, broadcast to every rank (`runtime.parallel.ParallelSchedule`), so that every rank admits, cancels and stops
    at the same iteration."""

    shared: bool
    """The schedule is shared by ranks: submissions and cancellations wait for the leader's next schedule (never
    applied in place), and a failed iteration is fatal (the ranks can no longer step together)."""
    leader: bool
    """This engine takes requests (`submit`) and decides the schedule; a follower receives it (`Engine.follow`)."""
    heartbeat_s: float | None
    """The longest the leader idles without sending a schedule (None: no heartbeat)."""

    def send(self, schedule: Schedule | None) -> None:
        """The leader: hand this iteration's schedule (None: nothing new) to every other rank."""

    def receive(self) -> Schedule | None:
        """A follower: the leader's next schedule (its requests rebuilt, under the leader's ids)."""

    def describe(self, error: Exception) -> str:
        """The message of a fatal iteration failure."""


class LocalSchedule:
    """The `ScheduleSource` of a lone engine: its own queue and cancellations, applied in place; nothing to send."""

    shared = False
    leader = True
    heartbeat_s = None

    def send(self, schedule: Schedule | None) -> None:
        pass

    def receive(self) -> Schedule | None:
        raise RuntimeError("a local engine has no leader to follow")

    def describe(self, error: Exception) -> str:
        return f"engine iteration failed ({type(error).__name__}: {error})"


@dataclass
class EngineStats:
    """Counters since the engine started. forwards: steps run (one forward each, serving every busy row);
    forwards_by_size: steps per batch size; row_passes: decoder passes summed over rows (the denominator of tokens
    per forward, as `RequestStats`); flag_reads / flag_read_s: the per-iteration reads of the step's report
    (`rows.Report`) and the seconds spent in them;
    prefill_tokens: prompt tokens run through the encoder; prefix_hit_tokens: prompt tokens mapped from the prefix
    cache instead; images_encoded: images run through the vision encoder; image_prefix_tokens: tokens of image
    prefixes encoded in their own forwards (`images.prefill_images`; prefill_tokens counts the step's); plan_refreshes / refresh_s: host refills of the plan after the host changed rows or the size."""

    iterations: int = 0
    forwards: int = 0
    forwards_by_size: Counter = field(default_factory=Counter)
    row_passes: int = 0
    tokens: int = 0
    blocks: int = 0
    requests: Counter = field(default_factory=Counter)
    flag_reads: int = 0
    flag_read_s: float = 0.0
    prefill_tokens: int = 0
    prefix_hit_tokens: int = 0
    images_encoded: int = 0
    image_prefix_tokens: int = 0
    plan_refreshes: int = 0
    refresh_s: float = 0.0


class Engine:
    """Continuous batching over one bucket (see the module docstring).

    Args:
        model: the model the bucket's step runs.
        bucket: a `row_table.RowTable` (eager, or a compiled generator's: `gen.row_table(...)`); its rows are the engine's B.
        config: the structural config every request must share (`requests.STRUCTURAL`); default the model's.
        tokenizer: detokenizes events (`BlockEvent.text`) and matches stop strings; None: no text.
        max_queue: requests waiting for a row at most; more raise `QueueFullError`.
        compiles: returns the compile counter of the bucket's generator (`CompiledGenerator.compiles`), read by
            `recompiles` to assert admission never recompiles.
        metrics: receives per-iteration and per-block observations (`runtime.metrics.ServeMetrics`), optional.
        prefix_cache: share full prompt pages (and committed blocks of prompts of a multiple of C tokens) between
            requests (a paged cache only; see the module docstring).
        poll: called before each iteration (`CompiledGenerator.poll`: switches to the steps a background compile
            finished, between iterations); None: nothing.
        schedule: where the iteration's admissions, cancellations and stop come from (`ScheduleSource`); default
            `LocalSchedule` (this engine's own). Under tensor parallel a `runtime.parallel.ParallelSchedule`: rank 0
            serves (`start`, `submit`, `cancel`, `shutdown`), the other ranks `follow()`.
        on_fatal: called with the message when an iteration fails under a shared schedule (default: log it); the
            engine then ends every request with "error" and its loop returns (`follow` raises).
    Raises:
        ConfigError: a prefix cache whose page size is not a multiple of the encoder chunk (hits must start the
            prefill on a chunk boundary).
    """

    def __init__(self, model: DiffusionGemma, row_table: RowTable, *, config: GenerationConfig | None = None,
                 tokenizer=None, max_queue: int = 256, compiles: Callable[[], Counter] | None = None, metrics=None,
                 prefix_cache: bool = True, poll: Callable[[], None] | None = None,
                 schedule: ScheduleSource | None = None, on_fatal: Callable[[str], None] | None = None):
        self.model, self.row_table, self.tokenizer = model, row_table, tokenizer
        self.config = (config or model.generation_config).resolved(model.config)
        self.structural = {f: getattr(self.config, f) for f in STRUCTURAL}
        self.schedule = schedule or LocalSchedule()
        self.on_fatal = on_fatal or (lambda message: log.error("%s", message))
        self.fatal: str | None = None
        """Why the engine stopped (a failed iteration under a shared schedule); None while it can run."""
        self.max_queue = max_queue
        self.compiles = compiles
        self.metrics = metrics
        self.stats = EngineStats()
        self.batch_invariant = False  # whether rows are batch-invariant across buckets (`build_engine` sets it)
        self.C = model.config.canvas_length
        self._poll = poll
        self.generator = None  # the compiled generator whose bucket this is (`build_engine` sets it)
        self._queue: deque[Request] = deque()
        self._inbox: list[Request] = []  # a shared schedule's leader: submitted, not yet scheduled
        self._cancels: list[int] = []  # a shared schedule's leader: ids to cancel at the next schedule
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._baseline = Counter(compiles()) if compiles is not None else Counter()
        for view in row_table.views():
            view.unit.check_owners()
        self.driver = Driver(row_table)  # the row table's host side (clears the bucket)
        self.memory = PagedMemory(row_table.cache, self.C, prefix_cache) if row_table.paged else None

    # ----- requests ------------------------------------------------------------------------------------------------
    @property
    def max_logprobs(self) -> int | None:
        """The most alternatives per token a request may ask log-probabilities for (the bucket's; None: no
        logprobs)."""
        return self.row_table.max_logprobs

    @property
    def max_seq_len(self) -> int:
        return self.row_table.cache.max_seq_len

    def bucket_table(self) -> list[dict]:
        """The engine's batch sizes over its one row table, a row each: rows (the size); tokens per row of a forward
        (C, or 2C with commit fusion); fuse_commit (commits fused with the next block's first denoise step); kv
        ("static" or "paged"); unit (the step's name); compiled (whether it has compiled yet; eager: None); step (what
        runs it now: "compiled", "loaded" from the compile cache, "eager" -- an eager engine, or a compiled one whose
        background compile has not finished -- or null: not made or not run yet). `dgemma serve` prints it at startup
        and `/health` returns it."""
        bk = self.row_table
        out = []
        for size in bk.sizes:
            view = bk.made(size)
            unit = view.unit if view is not None else None
            if bk.unit is None:
                step = "eager"
            elif unit is None:
                step = None
            else:
                step = "eager" if unit.held else unit.source
            compiled = None if bk.unit is None else unit is not None and (bool(unit.calls) or unit.ready)
            out.append(dict(rows=size, tokens_per_row=bk.tokens_per_row, fuse_commit=bk.fuse_commit,
                            kv="paged" if bk.paged else "static", unit=bk.step_name(size), compiled=compiled,
                            step=step))
        return out

    def compile_state(self) -> dict | None:
        """The background compile of a compiled engine's steps (`dgemma serve --compile auto`): its state
        ("running", "done", "failed"; None: none started) and, when it failed, why; None for an eager engine.
        `/health` returns it."""
        gen = self.generator
        if gen is None:
            return None
        bg = gen.background
        return {"background": None if bg is None else bg.state, "error": None if bg is None else bg.error}

    def check_request(self, prompt: Sequence[int], config: GenerationConfig, seed: int,
                      images: ImagePrompt | None = None) -> GenerationConfig:
        """Validate one request against the model and this engine's bucket; returns the resolved config.

        Raises:
            ConfigError: as `requests.plan_requests` (empty prompt, ids outside the vocabulary, prompt +
                max_new_tokens beyond the model's context, bad seed); committed slots beyond the cache
                (`max_seq_len`); more denoise steps than the temperature table; a structural field different from the
                engine's; image placeholders in a prompt without `images` (as the generators refuse them).
        """
        return self._check(prompt, config, seed, images)[0]

    def _check(self, prompt: Sequence[int], config: GenerationConfig, seed: int,
               images: ImagePrompt | None = None) -> tuple[GenerationConfig, int]:
        cfgs, _, _, needed = plan_requests(self.model, [list(prompt)], config, seed)
        if images is None:
            prepare_images(self.model, [list(prompt)], None)  # raises for placeholders without their images
        cfg = cfgs[0]
        check_slots(needed, self.max_seq_len, "the server's max_seq_len")
        if self.memory is not None:
            self.memory.check(needed)
        width = self.row_table.inputs.temperature.shape[1]
        if cfg.max_denoising_steps > width:
            raise ConfigError("max_denoising_steps", f"{cfg.max_denoising_steps} is more than this server allows "
                              f"({width})")
        for name, value in self.structural.items():
            if getattr(cfg, name) != value:
                raise ConfigError(name, f"this server runs {value!r}, got {getattr(cfg, name)!r}")
        return cfg, needed

    def submit(self, request: Request) -> Request:
        """Queue a request (validated first). Thread-safe. Raises ConfigError (`check_request`;
        `draft_every` not an int >= 0; a constraint without a tokenizer, or beyond the cache: its commits are the kept
        prefixes, so it needs prompt + max_new_tokens - 1 committed slots), `constraint.ConstraintError` (a
        constraint the grammar library cannot compile; its message starts "constraint:") or QueueFullError."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: Sequence[Request]) -> list[Request]:
        """Queue `requests` (one HTTP request's choices) whole or not at all: each is validated first (as `submit`),
        then all are queued under one lock if the queue has room for all of them now. Thread-safe.

        Raises:
            ConfigError: as `submit`, for any of them; "max_queue: ..." when there are more than `max_queue`
                (they could never be queued together); nothing is queued.
            QueueFullError: the queue has room for fewer than all of them now; nothing is queued (nothing to
                cancel: the ended-requests counter is untouched).
        """
        if len(requests) > self.max_queue:
            raise ConfigError("max_queue", f"{len(requests)} requests at once can never wait in this engine's queue of "
                              f"{self.max_queue}")
        for r in requests:
            self._prepare(r)
        with self._wake:
            room = self.max_queue - self._waiting()
            if len(requests) > room:
                raise QueueFullError(f"the queue is full: room for {max(room, 0)} of these {len(requests)} requests "
                                     f"({self.max_queue} may wait)")
            for r in requests:
                self._enqueue(r)
        return list(requests)

    def _prepare(self, request: Request) -> None:
        """`submit`'s validation of one request (its config, slots, canvas, grammar and stop matcher)."""
        k = request.draft_every
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ConfigError("draft_every", f"must be an integer >= 0, got {k!r}")
        lp = request.logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or self.max_logprobs is None
                               or not 0 <= lp <= self.max_logprobs):
            raise ConfigError("top_logprobs", f"must be an integer in [0, {self.max_logprobs}] (the server's "
                              f"--max-logprobs), got {lp!r}")
        request.config, request.slots = self._check(request.prompt, request.config, request.seed, request.images)
        if request.canvas is not None:  # ids in the vocabulary, within the budget (`canvas.canvas_of`)
            if not isinstance(request.canvas, Canvas):
                raise ConfigError("canvas", f"must be a dgemma_compile.step.canvas.Canvas, got {type(request.canvas).__name__}")
            canvas_of(request.canvas, request.config, self.model.config.vocab_size)

        request.prompt = list(request.prompt)
        if request.constraint is not None:
            request.grammar = row_grammars(self.model, [request.constraint], [request.config], self.tokenizer,
                                           [request.compiled])[0]
            request.slots = max(request.slots, len(request.prompt) + request.config.max_new_tokens - 1)
            check_slots(request.slots, self.max_seq_len, "the server's max_seq_len")
            if self.memory is not None:
                self.memory.check(request.slots)
        if self.tokenizer is not None:
            request.matcher = StopStrings(self.tokenizer, request.stops)

    def _enqueue(self, request: Request) -> None:
        """Queue a validated request (the lock held): the queue-full check, its id and submit time; wakes the engine
        thread. Raises QueueFullError, or RuntimeError after a fatal failure. Under a shared schedule it waits in
        the inbox for the leader's next schedule (`run`), which hands it to every rank."""
        if self.fatal is not None:
            raise RuntimeError(self.fatal)
        if not self.schedule.leader:
            raise RuntimeError("submit: a follower takes its requests from the leader's schedule")
        if self._waiting() >= self.max_queue:
            raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting)")
        request.id = next(self._ids)
        request.submitted = time.perf_counter()
        (self._inbox if self.schedule.shared else self._queue).append(request)
        self._wake.notify()

    def _waiting(self) -> int:
        """Requests queued and not yet admitted (what `max_queue` bounds)."""
        return len(self._queue) + len(self._inbox)

    def cancel(self, request: Request) -> None:
        """Ask the engine to drop `request` (thread-safe): a queued request is dropped at admission, a running one
        frees its row at the next iteration; either gets a final event with finish_reason "cancelled". Under a shared
        schedule at the iteration of the leader's next schedule, on every rank."""
        with self._wake:
            if self.schedule.shared:
                self._cancels.append(request.id)
            else:
                request.cancelled = True
            self._wake.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self.driver.busy())

    @property
    def rows(self) -> list[Request | None]:
        """The request in each row of the bucket (None: FREE)."""
        return list(self.driver.rows)

    def idle(self) -> bool:
        return not self._queue and self.driver.idle()

    def recompiles(self) -> Counter:
        """Recompiles of the bucket's units since the engine started, per unit ({} when none): compiles beyond a
        unit's first (a batch size compiling on first use is not one)."""
        if self.compiles is None:
            return Counter()
        now = Counter(self.compiles())
        return Counter({k: n - max(self._baseline[k], 1) for k, n in now.items() if n > max(self._baseline[k], 1)})

    # ----- the loop ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Run `run` in a daemon thread."""
        self._thread = threading.Thread(target=self.run, name="dgemma-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread after its current iteration; running and queued requests get "cancelled" (under a
        shared schedule, the leader's stop ends every rank's loop)."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        for b in self.driver.busy():
            self._retire(b, "cancelled")
        while self._queue:
            self._finish(self._queue.popleft(), "cancelled", [], "")

    @torch.no_grad()
    def run(self) -> None:
        """The leader's loop (the engine thread): wait while idle (a shared schedule's leader sends an empty schedule
        every `heartbeat_s`, so the followers' waits never time out), take what arrived as this iteration's
        schedule, hand it to the other ranks (a shared schedule), apply it, step; return after `shutdown`."""
        src = self.schedule
        try:
            while True:
                with self._wake:
                    if not (self._stop or self._inbox or self._cancels) and self.idle():
                        # idle with a background compile running: wake each second to switch to its steps when it ends
                        gen = self.generator
                        waiting = self._poll is not None and gen is not None and gen.deferred and \
                            gen.background is not None
                        self._wake.wait(src.heartbeat_s or (1.0 if waiting else None))
                        if waiting:
                            self._poll()
                    mine, self._inbox = self._inbox, []
                    schedule = Schedule(mine, self._cancels, self._stop) if mine or self._cancels or self._stop \
                        else None
                    self._cancels = []
                if src.shared:
                    try:
                        src.send(schedule)
                    except Exception:
                        with self._wake:
                            self._inbox[:0] = mine  # ended with "error" by `_fail`, never lost
                        raise
                if schedule is not None and schedule.stop:
                    return
                self._apply(schedule)
                if not self.idle():
                    self._iterate()
        except Exception as e:  # noqa: BLE001 - a shared schedule's ranks cannot agree any more: fatal
            self._fail(e)

    @torch.no_grad()
    def follow(self) -> None:
        """A follower's loop (tensor-parallel ranks 1..N-1, main thread): receive each schedule of the leader, apply
        it, step as the leader does. Returns at the leader's stop; raises `dgemma_compile.parallel.ParallelError` (a
        RuntimeError, after `on_fatal`) when the leader is gone or an iteration fails: the CLI's rank runner tells it
        by its class and prints its message as it is."""
        try:
            while True:
                schedule = self.schedule.receive()
                if schedule is not None and schedule.stop:
                    return
                if schedule is not None:
                    for req in schedule.requests:  # the leader's validation again (deterministic), under its id
                        self._prepare(req)
                self._apply(schedule)
                if not self.idle():
                    self.step()
        except Exception as e:  # noqa: BLE001
            from dgemma_compile.parallel import ParallelError  # imported already: a follower is a rank

            self._fail(e)
            raise ParallelError(self.fatal) from e

    def _apply(self, schedule: Schedule | None) -> None:
        """Queue the schedule's requests (in order) and mark its cancellations (queued or running requests; one that
        already ended needs nothing)."""
        if schedule is None:
            return
        with self._wake:
            self._queue.extend(schedule.requests)
            live = list(self._queue) + [r for r in self.driver.rows if r is not None]
        cancels = set(schedule.cancels)
        for req in live:
            if req.id in cancels:
                req.cancelled = True

    def _iterate(self) -> None:
        """One iteration of the leader's loop. A lone engine survives a failed iteration (it ends the running
        requests with "error"); under a shared schedule the failure is fatal (`run`)."""
        if self.schedule.shared:
            self.step()
            return
        try:
            self.step()
        except Exception:  # noqa: BLE001 - a failed iteration ends its requests, never the server
            log.exception("engine iteration failed; ending the running requests")
            for b in self.driver.busy():
                self._retire(b, "error")
            self.driver.clear()

    def _fail(self, e: Exception) -> None:
        """A fatal failure: end every request with "error" without touching the device (which may be
        mid-collective), then `on_fatal`."""
        self.fatal = self.schedule.describe(e)
        log.error("%s", self.fatal)
        for b in self.driver.busy():
            req = self.driver.retire(b, device_done=True)  # the host side only
            self._finish(req, "error", [], "")
        with self._wake:
            queued, self._inbox = list(self._queue) + self._inbox, []
            self._queue.clear()
        for req in queued:
            self._finish(req, "error", [], "")
        self.on_fatal(self.fatal)

    @torch.no_grad()
    def step(self) -> None:
        """One iteration (see the module docstring): admit, run the driver's step, follow its report. Runs on the
        engine thread only."""
        self.stats.iterations += 1
        if self._poll is not None:
            self._poll()
        self._admit()
        it = self.driver.step()
        if it is None:
            return
        st = self.stats
        if it.refresh_s is not None:
            st.refresh_s += it.refresh_s
            st.plan_refreshes += 1
        st.forwards += 1
        st.forwards_by_size[it.size] += 1
        st.flag_read_s += it.read_s
        st.flag_reads += 1
        for b, rep in it.reports.items():  # what the step reports each row did (metrics, pages)
            if rep.encoded:
                st.prefill_tokens += rep.encoded
                if self.memory is not None:
                    self.memory.encoded(b, rep.prefilled)
            if rep.committed:  # its next block began
                self._committed(b, rep.block)
        for b, frame in it.frames.items():  # before the event of a block that this step ended
            req = self.driver.rows[b]
            text = frame.text(self.tokenizer) if self.tokenizer is not None else ""
            self._emit(req, BlockEvent(req, frame.tokens, text, None, len(req.sequence), block=frame.block,
                                       step=frame.step, frame=frame))
        asking = [f.row for f in it.finished if self.driver.rows[f.row].logprobs is not None]
        lps = dict(zip(asking, self.row_table.read_logprobs(asking, max(self.driver.rows[b].logprobs for b in asking))
                       if asking else []))
        for f in it.finished:
            self._end_block(f, logprobs=lps.get(f.row))
        denoised = [b for b, rep in it.reports.items() if rep.stepped]
        self._drafts([(b, it.reports[b]) for b in denoised if not it.reports[b].event])
        if self.metrics is not None:
            self.metrics.iteration(self.queue_depth, self.running, len(denoised), it.read_s)

    def _admit(self) -> None:
        for b in self.driver.busy():
            if self.driver.rows[b].cancelled:
                self._retire(b, "cancelled")
        free = self.driver.free()
        skipped = 0  # queued requests left waiting for prompt pages a running row is computing
        while free:
            with self._lock:
                if skipped >= len(self._queue):
                    return
                req = self._queue[skipped]
                pages = None
                if self.memory is not None and not req.cancelled:
                    if self.memory.computing(req.prompt, req.images):
                        skipped += 1
                        continue
                    pages = self.memory.plan(req.prompt, req.slots, req.images)
                    if pages is None:
                        return  # waits (in order) for running requests to give pages back
                del self._queue[skipped]
            if req.cancelled:
                self._finish(req, "cancelled", [], "")
                continue
            b = free.pop(0)  # the lowest free row: busy rows stay low, so the step runs at the smallest size
            try:
                mapped = None
                if pages is not None:
                    mapped = self.memory.admit(b, pages)
                    self.stats.prefix_hit_tokens += mapped
                before = req.images.encodes if req.images is not None else 0
                encoded = self.driver.admit(b, req, mapped=mapped)
                if req.images is not None:
                    self.stats.images_encoded += req.images.encodes - before
                    self.stats.image_prefix_tokens += encoded
            except Exception:  # noqa: BLE001 - a request that cannot be admitted ends alone; its row is freed
                log.exception("request %d: admission failed; ending it alone", req.id)
                if self.memory is not None:
                    self.memory.release(b)
                self._finish(req, "error", [], "")
                free.insert(0, b)

    def _committed(self, b: int, block: int) -> None:
        """Row b's commit pass ran and its block `block` began: its cache holds the prompt and every block before
        (`PagedMemory.committed`; not for a constrained request, whose commits are its kept prefixes, not whole
        blocks)."""
        req = self.driver.rows[b]
        if self.memory is not None and req.grammar is None:
            self.memory.committed(b, req.prompt, req.sequence[:block * self.C])

    def _drafts(self, running: list[tuple[int, RowReport]]) -> None:
        """Draft events of the rows in `running` (denoised this iteration, block still in flight, with their report)
        whose request asks for one at this step (see the module docstring)."""
        asking = []
        for b, rep in running:
            k = self.driver.rows[b].draft_every
            if k and rep.steps % k == 0:
                asking.append((b, rep))
        if not asking:
            return
        canvases = self.row_table.state.argmax[torch.tensor([b for b, _ in asking])].tolist()
        for (b, rep), canvas in zip(asking, canvases):
            req = self.driver.rows[b]
            cfg = req.config
            if req.grammar is not None:  # a constrained request's draft: the prefix its grammar accepts so far
                canvas = canvas[:req.grammar.peek(canvas)]
            eos_at = None if cfg.ignore_eos else next((i for i, t in enumerate(canvas) if t in cfg.eos_token_ids), None)
            tokens = canvas[:eos_at] if eos_at is not None else canvas
            tokens = tokens[:cfg.max_new_tokens - len(req.sequence)]
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                cut = [text.find(s) for s in req.stops if s in text]
                text = text[:min(cut)] if cut else text
            self._emit(req, BlockEvent(req, tokens, text, None, len(req.sequence), draft=True, block=rep.block,
                                       step=rep.steps))

    def _end_block(self, f: Finished, logprobs: list | None = None) -> None:
        req, st = self.driver.rows[f.row], self.stats
        before = req.stats.num_tokens
        keep, done = self.driver.finalize(f)
        steps = f.report.steps
        if logprobs is not None:  # the kept tokens' (a prefix of the canvas), alternatives cut to the request's k
            logprobs = [(t, top[:req.logprobs]) for t, top in logprobs[:len(keep)]]
        st.blocks += 1
        st.row_passes += steps
        st.tokens += req.stats.num_tokens - before
        if self.metrics is not None:
            self.metrics.block(req.stats.num_tokens - before, steps)
        text = req.matcher.push(keep) if req.matcher is not None else ""
        if req.matcher is not None and req.matcher.stopped:
            req.stats.finish_reason, done = "stop", True
        if req.cancelled:
            self._retire(f.row, "cancelled", device_done=f.report.done)
        elif done:
            self._retire(f.row, req.stats.finish_reason, keep, text, device_done=f.report.done, logprobs=logprobs)
        else:
            self._emit(req, BlockEvent(req, keep, text, None, len(req.sequence), logprobs=logprobs))

    def _retire(self, b: int, reason: str, tokens: list[int] | None = None, text: str = "",
                device_done: bool = False, logprobs: list | None = None) -> None:
        """Free row b (FREE on the device, which `device_done` says it already is) and end its request."""
        if self.memory is not None:
            self.memory.release(b)
        req = self.driver.retire(b, device_done=device_done)
        self._finish(req, reason, tokens or [], text, logprobs)

    def _finish(self, req: Request, reason: str, tokens: list[int], text: str, logprobs: list | None = None) -> None:
        req.stats.finish_reason = reason  # also "cancelled" / "error", which finalize_row never sets
        m = req.matcher
        if m is not None and reason in ("eos", "length"):
            text += m.finish()
        self.stats.requests[reason] += 1
        if self.metrics is not None:
            self.metrics.request_done(reason)
        if logprobs is None and req.logprobs is not None:
            logprobs = []  # an end without a block of its own (cancelled, error)
        self._emit(req, BlockEvent(req, tokens, text, reason, self._completion_tokens(req, reason),
                                   logprobs=logprobs))

    def _completion_tokens(self, req: Request, reason: str) -> int:
        """Tokens behind the returned text: the whole sequence, or at a stop string the shortest prefix of it whose
        text covers what was shown."""
        if reason != "stop" or req.matcher is None:
            return len(req.sequence)
        shown = len(req.matcher.text)
        for k in range(len(req.sequence) + 1):
            text = self.tokenizer.decode(req.sequence[:k], skip_special_tokens=True,
                                         clean_up_tokenization_spaces=False)
            if len(text) >= shown:
                return k
        return len(req.sequence)

    def _emit(self, req: Request, event: BlockEvent) -> None:
        try:
            req.on_event(event)
        except Exception:  # noqa: BLE001 - a failing consumer ends only its own request
            log.exception("request %d: on_event failed; cancelling it", req.id)
            self._drop(req)

    def _drop(self, req: Request) -> None:
        """The engine thread cancels `req` (its consumer failed): at once, or under a shared schedule through the
        leader's next one, so every rank drops it at the same iteration."""
        if self.schedule.shared:
            self._cancels.append(req.id)
        else:
            req.cancelled = True


def build_engine(model: DiffusionGemma, *, max_batch: int = 8, max_seq_len: int | None = None,
                 max_denoising_steps: int = 256, eager: bool = False, tokenizer=None, max_queue: int = 256,
                 metrics=None, generator=None, page_size: int | None = None, kv_pages: int | None = None,
                 prefix_cache: bool = True, batch_invariant: bool | None = None, fuse_commit: bool | None = None,
                 batch_sizes: Sequence[int] | None = None, max_logprobs: int = 20,
                 schedule: ScheduleSource | None = None, on_fatal: Callable[[str], None] | None = None,
                 defer_compile: bool = False) -> Engine:
    """An engine over one bucket of `max_batch` rows, stepping at batch sizes `batch_sizes` (default: the powers of
    two below `max_batch`, and `max_batch`) over them: compiled (a generator whose `CompileOptions.batch_buckets` are
    those sizes, a cache of `max_seq_len` committed slots -- default the model's context, at most
    `config.DEFAULT_MAX_SEQ_LEN`; the smallest size compiles here, the others on first use, logged) or, with `eager`,
    the eager step. `generator`: reuse a compiled generator (tests share one with `gen.generate`); its
    `batch_buckets` are the sizes, its `fuse_commit` decides fusion. `fuse_commit`: commit fusion (rows of 2C tokens,
    see `mixed_step.py`; the tokens of `generate(fuse_commit=True)`); None: `CompileOptions.fuse_commit`'s default (on for
    CUDA, off for CPU, where the doubled rows cost more than the forward they save). `page_size` (a multiple of the
    canvas length with the prefix cache): a paged KV cache of `kv_pages` pages (default: the static cache's memory)
    shared by the rows, with a prefix cache unless `prefix_cache` is False (see the module docstring, "KV memory").
    `batch_invariant`: `CompileOptions.batch_invariant` (None: on for CPU); eagerly, on means moe "dense"
    (batch-invariant), off "loop" (transformers' order); `Engine.batch_invariant` tells which ran. `max_logprobs`: the
    most alternatives per token a request's logprobs may ask for (each step keeps that many per position:
    `mixed_step.logprobs`; vLLM's default 20; compiled, `CompileOptions.max_logprobs`, a given generator's). The engine is
    not started (`Engine.start`). `schedule`: the engine's `ScheduleSource` (default its own); under tensor parallel
    (the model sharded by `parallel.shard`) a `runtime.parallel.ParallelSchedule` over the ranks' host channel, every
    rank building its engine the same way, rank 0 serving and the others `follow()`ing its schedule; `on_fatal`
    receives the message when the ranks can no longer step together.
    `defer_compile`: compile nothing here; every size runs the eager step until `engine.generator.poll()` (called
    before each iteration) finds the background compile given to `engine.generator.defer(...)` finished, or
    `engine.generator.release()` is called (`dgemma serve --compile auto`). `engine.generator`: the compiled generator
    (None for an eager engine).

    Raises:
        ConfigError: `batch_invariant=True` where it cannot hold (`compile.check_batch_invariant`); `fuse_commit`
            disagreeing with the given `generator`; `batch_sizes` not increasing up to `max_batch`; with the prefix
            cache, a `page_size` that is not a multiple of the canvas length.
        ValueError: `kv_cache.new_paged_cache`'s (max_seq_len not a multiple of page_size)."""
    from dgemma_compile.compile import CompileOptions, build
    from dgemma_compile.model.config import DEFAULT_MAX_SEQ_LEN

    if max_seq_len is None:
        max_seq_len = min(model.config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    config = model.generation_config
    if generator is not None:
        gen_fuses = generator.fuse_commit
        if fuse_commit is not None and fuse_commit != gen_fuses:
            raise ConfigError("fuse_commit", f"{fuse_commit}, but the given generator was built with commit fusion "
                              f"{'on' if gen_fuses else 'off'}")
        fuse_commit = gen_fuses
        batch_sizes = generator.options.batch_buckets
    if batch_sizes is None:
        batch_sizes = tuple(sorted({1 << k for k in range(max_batch.bit_length()) if 1 << k < max_batch} | {max_batch}))
    batch_sizes = tuple(batch_sizes)
    if batch_sizes[-1:] != (max_batch,) and generator is None:
        raise ConfigError("batch_sizes", f"must end at max_batch={max_batch}, got {batch_sizes!r}")
    fuse = CompileOptions(fuse_commit=fuse_commit).commit_fusion(model.device.type)
    paging = dict(page_size=page_size, kv_pages=kv_pages) if page_size is not None else {}
    if eager:
        on = CompileOptions(batch_invariant=batch_invariant).batch_invariance(model.device.type)
        row_table = RowTable(model, batch_sizes, max_seq_len=max_seq_len, max_denoising_steps=max_denoising_steps,
                        config=config, fuse_commit=fuse, moe_impl="dense" if on else "loop", max_logprobs=max_logprobs,
                        skip_idle_vocabulary=CompileOptions().idle_vocabulary_skip(model.device.type), **paging)
        engine = Engine(model, row_table, tokenizer=tokenizer, max_queue=max_queue, metrics=metrics,
                        prefix_cache=prefix_cache, schedule=schedule, on_fatal=on_fatal)
        engine.batch_invariant = on
        return engine
    gen = generator or build(model, CompileOptions(batch_buckets=batch_sizes, max_seq_len=max_seq_len,
                                                   max_denoising_steps=max_denoising_steps, fuse_commit=fuse,
                                                   batch_invariant=batch_invariant, max_logprobs=max_logprobs))
    if defer_compile:
        gen.defer(None)
    else:
        gen.warmup(1, config, **paging)  # the smallest size: a lone first request never waits for a compile
    engine = Engine(model, gen.row_table(config, **paging), config=config, tokenizer=tokenizer, max_queue=max_queue,
                    compiles=lambda: gen.compiles, metrics=metrics, prefix_cache=prefix_cache, poll=gen.poll,
                    schedule=schedule, on_fatal=on_fatal)
    engine.batch_invariant = gen.batch_invariant
    engine.generator = gen
    return engine
