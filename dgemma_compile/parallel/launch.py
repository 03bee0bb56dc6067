"""Start N ranks of one function on this machine (what torchrun does, for tests and single-machine runs).

`spawn(fn, world_size, args)` starts `world_size` processes (multiprocessing's "spawn" start method: nothing of the
parent's state is forked), each with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set for a free local port, and
calls `fn(rank, world_size, *args)` in each. It waits at most `timeout_s` for all of them; a rank that raises, exits
non-zero or outlives the deadline makes `spawn` stop the rest and raise `RankFailed` naming each rank's fate.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, Callable

from .group import DEFAULT_TIMEOUT_S


class RankFailed(RuntimeError):
    """At least one rank raised, exited non-zero or ran past the deadline. `exit_codes[r]` is rank r's exit code
    (None: still running at the deadline, then terminated)."""

    def __init__(self, message: str, exit_codes: list[int | None]):
        super().__init__(message)
        self.exit_codes = exit_codes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's variables for rank `rank` of `world` on this machine, meeting at 127.0.0.1:`port`."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, threads: int | None, args: tuple) -> None:
    os.environ.update(rank_env(rank, world, port))
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    try:
        fn(rank, world, *args)
    except BaseException:
        sys.stderr.write(f"[rank {rank}] " + traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)


def start(fn: Callable[..., Any], ranks: Sequence[int], world: int, port: int, args: tuple = (), *,
          threads: int | None = 1) -> list[mp.process.BaseProcess]:
    """Start `fn(rank, world, *args)` for each rank of `ranks` in a fresh process (multiprocessing's "spawn" start
    method, daemonic), with torchrun's variables (`rank_env`) for `port`; a rank that raises prints its traceback on
    stderr and exits 1. `threads`: intra-op threads per rank (None: the rank sets its own). Returns the processes,
    started; the caller waits for them."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, threads, args), daemon=True) for r in ranks]
    for p in procs:
        p.start()
    return procs


def spawn(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = DEFAULT_TIMEOUT_S,
          threads: int = 1) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes and wait for all of them.

    Args:
        fn: a module-level function (it is pickled by reference); it returns nothing: a rank reports through files
            or its exit code.
        threads: intra-op threads per rank (`torch.set_num_threads`; ranks share the machine's cores).
        timeout_s: seconds to wait for every rank; then the survivors are terminated.
    Raises:
        ValueError: world_size < 1.
        RankFailed: a rank exited non-zero (its traceback is on stderr) or was still running at the deadline.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    procs = start(fn, range(world_size), world_size, free_port(), args, threads=threads)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    if any(p.exitcode not in (None, 0) for p in procs):  # let the peers of a failed rank fail on their own
        grace = min(deadline, time.monotonic() + 5.0)
        while time.monotonic() < grace and any(p.exitcode is None for p in procs):
            time.sleep(0.05)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.terminate()
            p.join(5.0)
    if any(c != 0 for c in codes):
        fates = ", ".join(f"rank {r}: " + ("still running at the deadline, terminated" if c is None
                                           else f"exit code {c}") for r, c in enumerate(codes))
        raise RankFailed(f"{world_size} ranks of {getattr(fn, '__name__', fn)} failed within {timeout_s:.0f} s: "
                         f"{fates}", codes)
