"""The serving engine over a tensor-parallel model: rank 0 decides, every rank steps (docs/parallel.md, "Serving").

Every rank holds an `Engine` over its shard of the model and the same bucket; each iteration every rank runs the
same step, whose collectives need every rank. What the step does next is decided on the host: which queued
requests are admitted into which rows, which are cancelled or retired, and every per-row input the bucket is given
(prompt, config, seed, grammar bitmask, image features). Only rank 0 receives requests (the HTTP front end), so:

1. rank 0's `submit` / `cancel` (HTTP threads) and its consumer failures (`Engine._drop`) only record the change in an
   inbox;
2. at the start of each iteration rank 0's engine thread takes the inbox and broadcasts it as one `Schedule` (new
   requests as `RequestSpec`s with their ids, cancelled ids, stop) over the host channel (`parallel.HostChannel`: one
   small header per iteration, the pickled specs only when something arrived); every rank, rank 0 included, applies
   it the same way: queue the new requests (validated again: deterministic), mark the cancelled ones;
3. every rank then runs `Engine.step` if it has work.

Why every rank then makes the same host decisions and yields the same tokens: `step`'s decisions are a function of
(the queue, the rows, the values it reads back from the device: finished flags, argmax canvases, step counts); the
queue and cancellations change only at step 2, identically everywhere; the values read back are bitwise equal on
every rank, because every tensor the sampler reads was all-reduced (gloo and nccl give every rank the same sum) and
the sampler's randomness is a pure function of (seed, block, step, position) (`rng.py`), and stop strings and
grammars run on those same tokens with the same tokenizer. So the rows, and the device state they feed, stay equal.

While idle, rank 0 broadcasts an empty schedule every `heartbeat_s` (a quarter of the channel's timeout), so the
other ranks' waits never time out on a quiet server. Any failure in an iteration (a peer died: gloo's "Connection
closed by peer", or a timeout) is fatal on a tensor-parallel rank, since the ranks can no longer agree: the engine
ends its requests with "error" and calls `on_fatal(message)` (the CLI prints it and exits 1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dgemma_compile.config import GenerationConfig
from dgemma_compile.constraint import Constraint
from dgemma_compile.images import ImagePrompt
from .engine import Engine, Request

log = logging.getLogger(__name__)


@dataclass
class RequestSpec:
    """What every rank needs of a request to admit it as rank 0 will: `Request`'s fields without its consumer."""

    id: int
    prompt: list[int]
    config: GenerationConfig
    seed: int
    stops: tuple[str, ...]
    draft_every: int
    logprobs: int | None
    images: ImagePrompt | None
    constraint: Constraint | None

    @classmethod
    def of(cls, r: Request) -> "RequestSpec":
        return cls(r.id, list(r.prompt), r.config, r.seed, tuple(r.stops), r.draft_every, r.logprobs, r.images,
                   r.constraint)

    def request(self) -> Request:
        return Request(prompt=list(self.prompt), config=self.config, seed=self.seed, stops=self.stops,
                       id=self.id, draft_every=self.draft_every, logprobs=self.logprobs, images=self.images,
                       constraint=self.constraint)


@dataclass
class Schedule:
    """One iteration's host changes, from rank 0: requests to queue (in order), ids to cancel, whether to stop."""

    requests: list[RequestSpec] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)
    stop: bool = False


class TensorParallelEngine(Engine):
    """An `Engine` whose host decisions come from rank 0's schedule (module docstring).

    Args (beyond `Engine`'s):
        channel: the `parallel.HostChannel`; its rank 0 is the leader (takes requests), the others follow.
        on_fatal: called with a message when an iteration fails (default: log it); the engine thread then returns.
    Rank 0 runs `start()` / `submit` / `cancel` / `shutdown()` as any engine; the others call `follow()` in their
    main thread, which returns when rank 0 shuts down (or raises after a fatal failure).
    """

    def __init__(self, *args, channel, on_fatal: Callable[[str], None] | None = None, **kw):
        super().__init__(*args, **kw)
        self.channel = channel
        self.on_fatal = on_fatal or (lambda message: log.error("%s", message))
        self.heartbeat_s = channel.timeout_s / 4
        self._inbox: list[Request] = []
        self._cancels: list[int] = []
        self.fatal: str | None = None

    # ----- rank 0: the HTTP threads only fill the inbox --------------------------------------------------------------
    def _enqueue(self, request: Request) -> None:
        if not self.channel.leader:  # a follower queues what rank 0 scheduled, under rank 0's id
            self._queue.append(request)
            return
        if self.fatal is not None:
            raise RuntimeError(self.fatal)
        self._stamp_and_queue(request)  # into the inbox: rank 0's next schedule hands it to every rank

    def _waiting(self) -> int:
        return len(self._queue) + len(self._inbox)

    def _new_requests(self) -> list[Request]:
        return self._inbox

    def cancel(self, request: Request) -> None:
        with self._wake:
            self._cancels.append(request.id)
            self._wake.notify()

    def _drop(self, req: Request) -> None:
        self._cancels.append(req.id)  # engine thread; applied on every rank at the next schedule

    # ----- every rank: apply a schedule ------------------------------------------------------------------------------
    def _apply(self, schedule: Schedule | None, mine: list[Request]) -> None:
        """Queue the schedule's requests (rank 0: its own objects `mine`, the others: built from the specs) and mark
        its cancellations."""
        if schedule is None:
            return
        if self.channel.leader:
            with self._wake:
                self._queue.extend(mine)
        else:
            for spec in schedule.requests:
                self.submit(spec.request())  # the same validation as on rank 0 (deterministic), queued under its id
        if schedule.cancels:
            cancels = set(schedule.cancels)
            with self._wake:
                live = list(self._queue) + [row.request for row in self.rows if row.request is not None]
            for req in live:  # queued or running; a request that already ended needs nothing
                if req.id in cancels:
                    req.cancelled = True

    # ----- the loops -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self) -> None:
        """Rank 0's engine thread: take the inbox, broadcast it, apply it, step; an empty schedule every
        `heartbeat_s` while idle; a stop schedule after `shutdown`."""
        try:
            while True:
                with self._wake:
                    if not (self._stop or self._inbox or self._cancels) and self.idle():
                        self._wake.wait(self.heartbeat_s)
                    mine, self._inbox = self._inbox, []
                    schedule = None
                    if mine or self._cancels or self._stop:
                        schedule = Schedule([RequestSpec.of(r) for r in mine], self._cancels, self._stop)
                    self._cancels = []
                try:
                    self.channel.send(schedule)
                except Exception:
                    with self._wake:
                        self._inbox[:0] = mine  # ended with "error" by `_fail`, never lost
                    raise
                if schedule is not None and schedule.stop:
                    return
                self._apply(schedule, mine)
                if not self.idle():
                    self.step()
        except Exception as e:  # noqa: BLE001 - fatal: the ranks cannot agree any more
            self._fail(e)

    @torch.no_grad()
    def follow(self) -> None:
        """A follower's loop (ranks 1..N-1, main thread): receive each schedule, apply it, step as rank 0 does.
        Returns at rank 0's stop; raises RuntimeError (after `on_fatal`) when rank 0 is gone or an iteration
        fails."""
        try:
            while True:
                schedule = self.channel.receive()
                if schedule is not None and schedule.stop:
                    return
                self._apply(schedule, [])
                if not self.idle():
                    self.step()
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            raise RuntimeError(self.fatal) from e

    def _fail(self, e: Exception) -> None:
        self.fatal = (f"tensor parallel: rank {self.channel.rank} of {self.channel.world_size}: an engine iteration "
                      f"failed, the ranks can no longer step together ({type(e).__name__}: {str(e).strip()[:300]}); "
                      f"a rank died or stalled past the group timeout ({self.channel.timeout_s:.0f} s)?")
        log.error("%s", self.fatal)
        for row in self.rows:
            if row.request is not None:
                self._retire_quietly(row)
        with self._wake:
            queued, self._inbox = list(self._queue) + self._inbox, []
            self._queue.clear()
        for req in queued:
            self._finish(req, "error", [], "")
        self.on_fatal(self.fatal)

    def _retire_quietly(self, row) -> None:
        """End a row's request with "error" without touching the device (which may be mid-collective)."""
        req = row.request
        self.rows[self.rows.index(row)] = type(row)()
        self._finish(req, "error", [], "")
