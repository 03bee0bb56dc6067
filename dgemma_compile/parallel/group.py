"""The process group of a tensor-parallel run: one `init` from torchrun's environment variables.

Every rank runs the same program; `init` joins it to the others through the rendezvous the environment names
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: what torchrun and `parallel.launch.spawn` set) and returns the default
process group: gloo for CPU tensors, nccl for CUDA ones. The group carries a timeout, so a rank whose peer died or
stopped participating raises instead of waiting forever (gloo: the collective fails after at most `timeout_s`, or at
once when the peer's connection closes).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from .errors import ParallelError

ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 300.0
"""Seconds a rank waits in a collective for its peers, and a launcher for its ranks, unless told otherwise (the CLI's
--group-timeout default too): long enough for the ranks' compiles of a new batch size to drift apart on a shared CPU,
short enough that a stalled rank ends the run (a crashed one ends it at once)."""


class RendezvousError(ParallelError):
    """The environment does not describe a rank of a process group (a variable missing or malformed)."""


def backend_for(device: torch.device | str) -> str:
    """The collective backend for tensors on `device`: "nccl" for CUDA, "gloo" for CPU. ValueError for others."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "nccl"
    if kind == "cpu":
        return "gloo"
    raise ValueError(f"tensor parallel: no collective backend for device {kind!r} (cpu: gloo, cuda: nccl)")


def env_rank() -> tuple[int, int]:
    """(rank, world_size) from the environment. Raises RendezvousError naming a missing or malformed variable."""
    missing = [v for v in ENV_VARS if v not in os.environ]
    if missing:
        raise RendezvousError(f"tensor parallel: environment variables {missing} are not set (start the ranks with "
                              f"torchrun or dgemma_compile.parallel.launch.spawn)")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        int(os.environ["MASTER_PORT"])
    except ValueError as e:
        raise RendezvousError(f"tensor parallel: RANK, WORLD_SIZE and MASTER_PORT must be integers: {e}") from None
    if not 0 <= rank < world:
        raise RendezvousError(f"tensor parallel: RANK={rank} is outside [0, WORLD_SIZE={world})")
    return rank, world


def init(device: torch.device | str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.ProcessGroup:
    """Join this process to the process group the environment describes and return it (the default group).

    Args:
        device: where the model's tensors live; picks the backend (`backend_for`). On CUDA the rank's device is
            cuda:LOCAL_RANK (default RANK) and is made current.
        timeout_s: seconds a rendezvous or a collective may wait for a peer before raising (RuntimeError from the
            backend). Also bounds how long a dead rank keeps the others waiting.
    Raises:
        RendezvousError: the environment variables are missing or malformed.
        RuntimeError: a group is already initialised in this process, or the rendezvous timed out.
    """
    rank, world = env_rank()
    if dist.is_initialized():
        raise ParallelError("tensor parallel: a process group is already initialised in this process")
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend=backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.group.WORLD


def destroy() -> None:
    """Leave the process group (a no-op when none is initialised)."""
    if dist.is_initialized():
        dist.destroy_process_group()
