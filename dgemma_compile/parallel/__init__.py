"""Tensor parallelism over torch.distributed (docs/parallel.md): the process group (`group.py`), a local launcher
(`launch.py`)."""

from .group import RendezvousError, backend_for, destroy, init
from .launch import RankFailed, spawn

__all__ = ["RankFailed", "RendezvousError", "backend_for", "destroy", "init", "spawn"]
