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

from ..model import ExpertProjection, Experts
from .linear import split


def _projection(weight: torch.Tensor) -> ExpertProjection:
    E, N, K = weight.shape
    p = ExpertProjection(0, N, K)  # no [E, N, K] allocation: the weight is replaced at once
    p.weight = nn.Parameter(weight, requires_grad=False)
    return p


class TensorParallelExperts(Experts):
    """One rank's share of a layer's `Experts` (module docstring). forward(x [N, D], w [N, K], idx [N, K], impl)
    -> [N, D], the sum over ranks of the local experts' output: the single-process value within float32
    reduction-order error, bitwise the same on every rank.

    Raises (construction): ValueError naming the tensor for quantized experts (shard before quantizing) or an
    intermediate size I that is not a multiple of the rank count.
    """

    def __init__(self, experts: Experts, rank: int, world_size: int, group: dist.ProcessGroup, name: str):
        nn.Module.__init__(self)
        if experts.quant != "none":
            raise ValueError(f"tensor parallel: {name}.gate_up_proj.weight is quantized ({experts.quant!r}); shard "
                             f"the model before quantizing it")
        E, I2, D = experts.gate_up_proj.shape
        I = I2 // 2
        gu = experts.gate_up_proj.weight.detach()
        gate = split(gu[:, :I], 1, rank, world_size, f"{name}.gate_up_proj.weight (gate rows)")
        up = split(gu[:, I:], 1, rank, world_size, f"{name}.gate_up_proj.weight (up rows)")
        down = split(experts.down_proj.weight.detach(), 2, rank, world_size, f"{name}.down_proj.weight")
        self.gate_up_proj = _projection(torch.cat([gate, up], dim=1))
        self.down_proj = _projection(down)
        self.group = group

    def forward(self, x_ND, w_NK, idx_NK, impl: str):
        return funcol.all_reduce(super().forward(x_ND, w_NK, idx_NK, impl), "sum", self.group)


def check_experts(experts: Experts, world_size: int, name: str) -> None:
    """The checks `TensorParallelExperts` makes, without building it (ValueError as there)."""
    if experts.quant != "none":
        raise ValueError(f"tensor parallel: {name}.gate_up_proj.weight is quantized ({experts.quant!r}); shard "
                         f"the model before quantizing it")
    split(experts.down_proj.weight[:1, :1], 2, 0, world_size, f"{name}.down_proj.weight")
