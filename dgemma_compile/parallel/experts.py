"""The routed experts sharded over their intermediate dimension: every rank holds every expert's I/N slice.

Each rank keeps, for every expert e, gate rows and up rows [r*I/N, (r+1)*I/N) of gate_up_proj [E, 2I, D] (packed
again as [E, 2I/N, D], gate rows first, the layout `dgemma::moe_experts` reads) and the matching input columns of
down_proj [E, D, I]. The op then computes each token's partial sum over the slice of the intermediate features
(the routing weights multiply linearly), and one all-reduce per layer adds the ranks' parts. Routing stays
replicated (the router runs on every rank on the same residual, so every rank routes every token identically).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from ..model.backbone import Experts
from .linear import split
from .quantized import cat_projections
from .source import ModelWeights


class TensorParallelExperts(Experts):
    """One rank's share of a layer's `Experts` (module docstring). forward(x [N, D], w [N, K], idx [N, K], impl)
    -> [N, D], the sum over ranks of the local experts' output: the single-process value within float32
    reduction-order error, bitwise the same on every rank.

    Quantized experts keep their format: each part of the layout sliced with the rows or columns it scales
    (`quantized.py`).

    Raises (construction): ValueError naming the tensor for an intermediate size I that is not a multiple of the rank
    count, or a slice that cuts an NVFP4 block of 16 inputs (down_proj's columns).
    """

    def __init__(self, experts: Experts, rank: int, world_size: int, group: dist.ProcessGroup, name: str,
                 source=None):
        nn.Module.__init__(self)
        check_experts(experts, world_size, name)
        source = source or ModelWeights()
        gu, gu_name = experts.gate_up_proj, f"{name}.gate_up_proj.weight"
        I = gu.shape[1] // 2
        per = I // world_size
        gate = source.take_projection(gu_name, gu, 1, rank * per, per)  # gate rows first
        up = source.take_projection(gu_name, gu, 1, I + rank * per, per)
        self.gate_up_proj = cat_projections([gate, up], 1)
        self.down_proj = source.take_projection(f"{name}.down_proj.weight", experts.down_proj, 2, rank * per, per)
        self.group = group

    def forward(self, x_ND, w_NK, idx_NK, impl: str):
        return funcol.all_reduce(super().forward(x_ND, w_NK, idx_NK, impl), "sum", self.group)


def check_experts(experts: Experts, world_size: int, name: str) -> None:
    """The checks `TensorParallelExperts` makes before reading anything. Raises ValueError naming the tensor: an
    intermediate size (gate and up halves of gate_up_proj, down_proj's columns) that cannot be split."""
    N = experts.gate_up_proj.shape[1]
    split(torch.empty(1, N // 2, 1, device="meta"), 1, 0, world_size, f"{name}.gate_up_proj.weight (gate rows)")
    split(torch.empty(1, 1, experts.down_proj.shape[2], device="meta"), 2, 0, world_size, f"{name}.down_proj.weight")
