"""Custom ops (`torch.ops.dgemma.*`): each a `torch.library.custom_op` with a schema, a fake (meta) implementation
and a CPU implementation in plain torch (the oracle), so every compiled graph still compiles without a GPU.

- `moe.py`: `dgemma::moe_experts`, the routed experts of one MoE layer.

Importing this package registers the ops.
"""

from . import moe  # noqa: F401  (registers torch.ops.dgemma.moe_experts)
from .moe import moe_experts, moe_experts_dense, moe_experts_grouped

__all__ = ["moe_experts", "moe_experts_dense", "moe_experts_grouped"]
