"""Tensor parallelism over torch.distributed (docs/parallel.md): the process group (`group.py`), a local launcher
(`launch.py`), a weight's per-rank slice and the row-parallel linear (`linear.py`), the sharding of a loaded model
(`shard.py`: attention heads and the dense MLP)."""

from .group import RendezvousError, backend_for, destroy, init
from .launch import RankFailed, spawn
from .linear import RowParallelLinear, split
from .shard import TensorParallel, attention_heads, shard

__all__ = ["RankFailed", "RendezvousError", "RowParallelLinear", "TensorParallel", "attention_heads", "backend_for",
           "destroy", "init", "shard", "spawn", "split"]
