"""The ranks of a `dgemma generate|serve --tensor-parallel-size N` command: started here, or joined under torchrun.

`world_size_for(flag)` decides whether a command runs tensor parallel: the flag's N, or torchrun's WORLD_SIZE when
its variables are set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: then this process is one rank and joins; a flag
that disagrees is refused). `run(command, argv, world, timeout_s)` then either

- joins (torchrun, or a rank this module started): `group.init` on the rank's device (CUDA: cuda:LOCAL_RANK with
  nccl when CUDA is available, else the CPU with gloo), the host channel (`channel.HostChannel`), the command, and
  leaves the group; ranks other than 0 write nothing to stdout and only their own fatal error to stderr, so the
  output is rank 0's alone; or
- starts the ranks on this machine: this process becomes rank 0 (it keeps stdin, the terminal and the exit status)
  and starts ranks 1..N-1 as fresh processes (`parallel.launch.start`, the one launcher) running the same command
  line, all on a free local port; when rank 0's command ends it waits for them (at most the group timeout) and fails when one failed.

Each rank runs the command's whole body on the same inputs (the CLI shares rank 0's stdin and image files through
the channel: `share`), so every host decision it makes is the same (docs/parallel.md, "Serving").
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch

from ..parallel import group
from ..parallel.channel import HostChannel
from ..parallel.errors import ParallelError
from ..parallel import launch
from ..parallel.group import DEFAULT_TIMEOUT_S as DEFAULT_GROUP_TIMEOUT_S


def torchrun_env() -> bool:
    """Whether torchrun's variables describe a rank (RANK and WORLD_SIZE set)."""
    return all(os.environ.get(v) for v in ("RANK", "WORLD_SIZE"))


def world_size_for(flag: int | None) -> int:
    """The command's world size: `flag` (--tensor-parallel-size), else torchrun's WORLD_SIZE, else 1.

    Raises:
        ParallelError: the flag is < 1, or disagrees with a WORLD_SIZE set by torchrun.
    """
    if flag is not None and flag < 1:
        raise ParallelError(f"tensor_parallel_size: must be a positive integer, got {flag}")
    if torchrun_env():
        rank, world = group.env_rank()
        if flag is not None and flag != world:
            raise ParallelError(f"tensor_parallel_size: {flag}, but torchrun started WORLD_SIZE={world} ranks")
        return world
    return 1 if flag is None else flag


def device() -> torch.device:
    """The rank's device: cuda:LOCAL_RANK when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
    return torch.device("cpu")


class Ranks:
    """This process's place in the run: `rank`, `world_size`, `channel` (the host channel), `device`."""

    def __init__(self, channel: HostChannel, dev: torch.device):
        self.channel, self.device = channel, dev
        self.rank, self.world_size = channel.rank, channel.world_size

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, make: Callable[[], object]) -> object:
        """Rank 0's `make()` on every rank (`HostChannel.share`)."""
        return self.channel.share(make)


def run(command: Callable[[Ranks], int], argv: list[str], world: int, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S
        ) -> int:
    """Run `command(ranks)` as one rank of `world` (module docstring); returns the exit status.

    Args:
        command: the CLI command's body; returns its exit status.
        argv: the command line (without the program name): what the started ranks run.
    Raises:
        ParallelError: a started rank failed (its exit code named) or the group could not form.
    """
    if torchrun_env():
        return _join(command, timeout_s)
    port = launch.free_port()
    followers = launch.start(_follower, range(1, world), world, port, (argv,), threads=None)  # they set their own
    os.environ.update(launch.rank_env(0, world, port))
    try:
        code = _join(command, timeout_s)
    finally:
        deadline = time.monotonic() + timeout_s
        for p in followers:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in followers:
            if p.exitcode is None:
                p.terminate()
                p.join(5.0)
    failed = [(r, p.exitcode) for r, p in enumerate(followers, 1) if p.exitcode != 0]
    if failed and code == 0:
        raise ParallelError("tensor parallel: " + ", ".join(
            f"rank {r} " + ("was still running after rank 0 ended, terminated" if c is None else f"exited with {c}")
            for r, c in failed))
    return code


def _join(command: Callable[[Ranks], int], timeout_s: float) -> int:
    dev = device()
    try:
        group.init(dev, timeout_s=timeout_s)
    except (RuntimeError, ValueError) as e:
        raise ParallelError(f"tensor parallel: rank {os.environ.get('RANK')} could not join the group at "
                            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}: {e}") from None
    try:
        ranks = Ranks(HostChannel(timeout_s), dev)
        return command(ranks)
    finally:
        group.destroy()


def _follower(rank: int, world: int, argv: list[str]) -> None:
    """A started rank (`launch.start` set torchrun's variables): the CLI's own main on the same command line."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, whose stop (or exit) ends this rank
    from . import main

    code = main(argv, owns_process=True)  # a rank is a process of its own
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def quiet(rank: int) -> None:
    """A rank other than 0 writes nothing to stdout; its stderr keeps only lines that start with `dgemma: rank`
    (its own fatal error, `error_line`) -- the output is rank 0's."""
    if rank == 0:
        return
    import logging

    sys.stdout = open(os.devnull, "w")
    sys.stderr = _RankErrors(sys.stderr)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)


def error_line(rank: int, message: str) -> str:
    return f"dgemma: rank {rank}: error: {message}"


class _RankErrors:
    """stderr of a rank other than 0: drops everything but `error_line`s (module docstring of `quiet`)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        if text.startswith("dgemma: rank"):
            self.stream.write(text)
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False
