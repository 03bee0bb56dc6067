"""The serving engine's schedule under tensor parallel: rank 0 decides, every rank steps (docs/parallel.md,
"Serving").

Every rank holds an `Engine` over its shard of the model and the same bucket, given a `ParallelSchedule` as its
schedule source (`engine.ScheduleSource`); each iteration every rank runs the same step, whose collectives need
every rank. What the step does next is decided on the host: which queued requests are admitted into which rows,
which are cancelled or retired, and every per-row input the bucket is given (prompt, config, seed, grammar bitmask,
image features). Only rank 0 receives requests (the HTTP front end), so:

1. rank 0's `submit` / `cancel` (HTTP threads) and its consumer failures only record the change in the engine's
   inbox (a shared schedule is never applied in place);
2. at the start of each iteration rank 0's engine thread (`Engine.run`) takes the inbox and sends it as one
   `engine.Schedule` (new requests, cancelled ids, stop) over the host channel (`parallel.HostChannel`: one small
   header per iteration, the pickled `RequestSpec`s only when something arrived); every rank, rank 0 included,
   applies it the same way: queue the new requests (validated again on the followers: deterministic), mark the
   cancelled ones;
3. every rank then runs `Engine.step` if it has work (the followers in `Engine.follow`).

Why every rank then makes the same host decisions and yields the same tokens: `step`'s decisions are a function of
(the queue, the rows, the values it reads back from the device: the step's report, argmax canvases); the queue and
cancellations change only at step 2, identically everywhere; the values read back are bitwise equal on every rank,
because every tensor the sampler reads was all-reduced (gloo and nccl give every rank the same sum) and the
sampler's randomness is a pure function of (seed, block, step, position) (`rng.py`), and stop strings and grammars
run on those same tokens with the same tokenizer. So the rows, and the device state they feed, stay equal.

While idle, rank 0 sends an empty schedule every `heartbeat_s` (a quarter of the channel's timeout), so the other
ranks' waits never time out on a quiet server. Any failure in an iteration (a peer died: gloo's "Connection closed
by peer", or a timeout) is fatal on a tensor-parallel rank, since the ranks can no longer agree: the engine ends its
requests with "error" and calls `on_fatal(message)` (the CLI prints it and exits 1).

This module imports the engine's types; the engine never imports it (the schedule is passed in).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dgemma_compile.model.config import GenerationConfig
from dgemma_compile.step.canvas import Canvas
from dgemma_compile.inputs.constraint import Constraint
from dgemma_compile.inputs.images import ImagePrompt
from .engine import Request, Schedule

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
    frames: bool = False
    canvas: Canvas | None = None

    @classmethod
    def of(cls, r: Request) -> "RequestSpec":
        return cls(r.id, list(r.prompt), r.config, r.seed, tuple(r.stops), r.draft_every, r.logprobs, r.images,
                   r.constraint, r.frames, r.canvas)

    def request(self) -> Request:
        return Request(prompt=list(self.prompt), config=self.config, seed=self.seed, stops=self.stops,
                       id=self.id, draft_every=self.draft_every, logprobs=self.logprobs, images=self.images,
                       constraint=self.constraint, frames=self.frames, canvas=self.canvas)


@dataclass
class _Wire:
    """A schedule as sent: the requests as specs (no consumer, nothing unpicklable)."""

    requests: list[RequestSpec]
    cancels: list[int]
    stop: bool


class ParallelSchedule:
    """The `engine.ScheduleSource` of one tensor-parallel rank (module docstring): `channel`'s rank 0 leads (takes
    requests, sends each iteration's schedule), the others follow (receive it)."""

    shared = True

    def __init__(self, channel):
        self.channel = channel
        self.leader = channel.leader
        self.heartbeat_s = channel.timeout_s / 4

    def send(self, schedule: Schedule | None) -> None:
        self.channel.send(None if schedule is None else
                          _Wire([RequestSpec.of(r) for r in schedule.requests], list(schedule.cancels), schedule.stop))

    def receive(self) -> Schedule | None:
        wire = self.channel.receive()
        if wire is None:
            return None
        return Schedule([spec.request() for spec in wire.requests], list(wire.cancels), wire.stop)

    def describe(self, error: Exception) -> str:
        c = self.channel
        return (f"tensor parallel: rank {c.rank} of {c.world_size}: an engine iteration failed, the ranks can no "
                f"longer step together ({type(error).__name__}: {str(error).strip()[:300]}); a rank died or stalled "
                f"past the group timeout ({c.timeout_s:.0f} s)?")
