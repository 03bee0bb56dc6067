"""Rank 0's host decisions to every rank: one broadcast of a pickled message per step.

In a tensor-parallel run every rank runs the same step over the same bucket; only the host decisions that feed it --
which requests arrive and are cancelled, a CLI's inputs -- start on rank 0 (the HTTP front end, stdin). `HostChannel`
carries them: `send(message)` on rank 0 and `receive()` on the others return the same object. A message travels as
a header (int64 [1]: its pickled length, 0 for "nothing new") and, when non-empty, the pickled bytes (uint8 [n]),
over a gloo group of its own (CPU tensors whatever the model's device, so a CUDA run's nccl group is never used for
host bytes). The group's timeout bounds every wait: a rank whose rank 0 died or stalled raises instead of hanging.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

from .errors import ParallelError


class HostChannel:
    """A broadcast from rank `src` (0) over a gloo group of every rank (module docstring).

    Args:
        timeout_s: seconds a rank waits in a broadcast before raising (RuntimeError from gloo).
    Every rank must construct it at the same point (it creates a process group collectively).
    Raises:
        RuntimeError: no process group is initialised.
    """

    def __init__(self, timeout_s: float, src: int = 0):
        if not dist.is_initialized():
            raise ParallelError("tensor parallel: no process group; call dgemma_compile.parallel.init() first")
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.src = src
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s

    @property
    def leader(self) -> bool:
        """Whether this rank decides (rank 0)."""
        return self.rank == self.src

    def send(self, message: Any = None) -> Any:
        """Rank 0: broadcast `message` (any picklable object; None: nothing new) and return it."""
        if not self.leader:
            raise ParallelError(f"tensor parallel: rank {self.rank} cannot send on the host channel (rank {self.src} "
                               f"decides)")
        data = b"" if message is None else pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.long), self.src, group=self.group)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), self.src, group=self.group)
        return message

    def receive(self) -> Any:
        """Any other rank: the message rank 0 sends next (None: nothing new). Raises RuntimeError (gloo) when rank 0
        died or sent nothing within the timeout."""
        if self.leader:
            raise ParallelError(f"tensor parallel: rank {self.src} sends on the host channel, it does not receive")
        header = torch.zeros(1, dtype=torch.long)
        dist.broadcast(header, self.src, group=self.group)
        n = int(header[0])
        if not n:
            return None
        buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, self.src, group=self.group)
        return pickle.loads(buf.numpy().tobytes())

    def share(self, make) -> Any:
        """Every rank gets rank 0's `make()` (called on rank 0 only): a CLI's inputs read once (stdin, files).
        An exception `make` raises on rank 0 is raised on every rank."""
        if self.leader:
            try:
                value = make()
            except Exception as e:  # noqa: BLE001 - every rank must learn of it, then it is re-raised here
                self.send(("error", e))
                raise
            self.send(("ok", value))
            return value
        kind, value = self.receive()
        if kind == "error":
            raise value
        return value
