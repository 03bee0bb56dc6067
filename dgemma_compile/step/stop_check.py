"""When the host learns that every row of a block finished: the one host read of the denoise loop.

A block's steps run until all rows finished (stopped early or ran their budget). Reading that flag is the only
device-to-host transfer inside a block. Three policies (`CompileOptions.stop_check`):

| mode       | the host reads                                           | wasted forwards per block |
|------------|----------------------------------------------------------|---------------------------|
| "sync"     | the flag of the step just run (waits for it)              | 0                         |
| "deferred" | the flag of the previous step, copied without blocking    | <= 1                      |
| "every_k"  | the flag of every k-th step (waits for it)                | <= k - 1                  |

Default by device: "sync" on CPU (the host is the device: a late check only wastes a forward), "deferred" on CUDA
(the GPU runs step n+1 while the copy of step n's flag lands in pinned memory, so the host never waits on a step in
flight). Steps after every row finished are frozen-only forwards: they change no token and no statistic, so every
policy gives the oracle's tokens and stats.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

STOP_CHECKS = ("auto", "sync", "deferred", "every_k")

Reader = Callable[[], bool]
Copy = Callable[[torch.Tensor], Reader]
"""copy(flag) starts copying a 0-d bool device tensor to the host and returns a reader of the copied value."""


def blocking_copy(flag: torch.Tensor) -> Reader:
    """Copy now (waits for the device); the reader returns the value."""
    value = bool(flag)
    return lambda: value


class PinnedCopy:
    """Non-blocking copies into two alternating pinned host buffers, each followed by a CUDA event; a reader waits
    only for its own copy's event (recorded before any later step was launched)."""

    def __init__(self) -> None:
        self.buffers = [torch.empty((), dtype=torch.bool, pin_memory=True) for _ in range(2)]
        self.turn = 0

    def __call__(self, flag: torch.Tensor) -> Reader:
        host = self.buffers[self.turn]
        self.turn ^= 1
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()

        def read() -> bool:
            event.synchronize()
            return bool(host)

        return read


def resolve(mode: str, device: torch.device | str) -> str:
    """"auto" -> "sync" on CPU, "deferred" on CUDA; other modes as given. Raises ValueError for an unknown mode."""
    if mode not in STOP_CHECKS:
        raise ValueError(f"stop_check: must be one of {STOP_CHECKS}, got {mode!r}")
    if mode == "auto":
        return "deferred" if torch.device(device).type == "cuda" else "sync"
    return mode


class StopCheck:
    """The block loop's stop test under one policy. `done(flag)` is called after every step with the step's
    all-rows-finished flag (a 0-d bool device tensor) and says whether the loop may stop now."""

    def __init__(self, mode: str, *, k: int = 1, copy: Copy | None = None):
        if mode not in STOP_CHECKS[1:]:
            raise ValueError(f"stop_check: must be one of {STOP_CHECKS[1:]} once resolved, got {mode!r}")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"stop_check_k: must be a positive integer, got {k!r}")
        self.mode, self.k = mode, k
        self.copy = copy or blocking_copy
        self.begin_block()

    def begin_block(self) -> None:
        self.steps = 0
        self.pending: Reader | None = None

    def done(self, flag: torch.Tensor) -> bool:
        self.steps += 1
        if self.mode == "sync":
            return bool(flag)
        if self.mode == "every_k":
            return self.steps % self.k == 0 and bool(flag)
        previous, self.pending = self.pending, self.copy(flag)
        return previous is not None and previous()
