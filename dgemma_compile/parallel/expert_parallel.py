"""The routed experts split by expert (expert parallel): every rank holds E/N whole experts.

Rank r keeps experts [r*E/N, (r+1)*E/N) of gate_up_proj [E, 2I, D] and down_proj [E, D, I], whole (rows 0..E/N-1 of
its local [E/N, 2I, D] and [E/N, D, I], the layout `dgemma::moe_experts` reads). The router stays replicated: the
residual stream is the same on every rank, so every rank routes every token identically. Each rank computes, for
every token, the contribution of the assignments (token, slot) whose expert it holds, and one all-reduce per layer
sums the ranks' parts -- the same collective, of the same [N, D] tensor, as the tensor split (`experts.py`): with
replicated activations the two splits move the same bytes per step (docs/parallel.md, "Experts: which split").

The other ranks' assignments (`local_routing`): for impl "loop" they get the id E/N, one past the local experts,
which the loop skips (its work is the rank's routed assignments only); for "grouped", "dense" and "gathered" (static
shapes: every assignment is computed) they point at local expert 0 with routing weight 0, so they add exactly 0.

Legend: N tokens, D hidden, K experts per token, E experts, El = E / world experts on this rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from ..model.backbone import Experts
from .source import ModelWeights

EXPERT_SPLITS = ("tensor", "expert")
"""How `shard` splits the routed experts: "tensor" (every expert's intermediate slice I/N on every rank,
`experts.TensorParallelExperts`; the default) or "expert" (E/N whole experts a rank, `ExpertParallelExperts`)."""
DEFAULT_EXPERT_SPLIT = "tensor"
"""Both move the same bytes per step here; "tensor" balances the work exactly whatever the routing, "expert" puts
each rank's share at the mercy of how many assignments its experts receive (docs/parallel.md)."""


def check_expert_split(split: str) -> str:
    """`split` if it is one of `EXPERT_SPLITS`; ValueError naming `experts` otherwise."""
    if split not in EXPERT_SPLITS:
        raise ValueError(f"tensor parallel: experts must be one of {EXPERT_SPLITS}, got {split!r}")
    return split


def expert_range(num_experts: int, rank: int, world_size: int, name: str) -> tuple[int, int]:
    """(first expert, experts per rank) of rank `rank`.

    Raises:
        ValueError: `num_experts` is not a multiple of `world_size` (the message names `name`, the layer's
            gate_up_proj weight, and its shape's expert count).
    """
    if num_experts % world_size:
        raise ValueError(f"tensor parallel: {name} holds {num_experts} experts, which cannot be split over "
                         f"{world_size} ranks by expert (experts='expert' needs a multiple of the rank count; "
                         f"experts='tensor' splits each expert instead)")
    per = num_experts // world_size
    return rank * per, per


def local_routing(w_NK: torch.Tensor, idx_NK: torch.Tensor, start: int, count: int, impl: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of the experts [start, start + count) only: (weights float32 [N, K], local ids int64 [N, K]).
    Assignments to those experts keep their weight and get id - start; the others get weight 0 and id `count`
    (impl "loop", which skips ids >= its expert count) or 0 (the static-shape impls, which compute them: 0 * y)."""
    local = idx_NK - start
    mine = (local >= 0) & (local < count)
    other = count if impl == "loop" else 0
    return torch.where(mine, w_NK, torch.zeros_like(w_NK)), torch.where(mine, local, torch.full_like(local, other))


class ExpertParallelExperts(Experts):
    """One rank's experts of a layer's `Experts` (module docstring). forward(x [N, D], w [N, K], idx [N, K] global
    expert ids, impl) -> [N, D]: the sum over ranks of `partial`, the single-process value within float32
    reduction-order error (each token's K terms are summed per rank, then across ranks), bitwise the same on every
    rank.

    Quantized experts keep their format (whole experts: every part of the layout sliced by expert).

    Raises (construction): ValueError naming the tensor for an expert count that is not a multiple of the rank count
    (`expert_range`).
    """

    def __init__(self, experts: Experts, rank: int, world_size: int, group: dist.ProcessGroup | None, name: str,
                 source=None):
        nn.Module.__init__(self)
        check_expert_parallel(experts, world_size, name)
        source = source or ModelWeights()
        gu, down = experts.gate_up_proj, experts.down_proj
        self.start, self.count = expert_range(gu.shape[0], rank, world_size, f"{name}.gate_up_proj.weight")
        self.gate_up_proj = source.take_projection(f"{name}.gate_up_proj.weight", gu, 0, self.start, self.count)
        self.down_proj = source.take_projection(f"{name}.down_proj.weight", down, 0, self.start, self.count)
        self.group = group

    def partial(self, x_ND, w_NK, idx_NK, impl: str):
        """This rank's part: the assignments routed to its experts, [N, D] in x's dtype (no collective)."""
        w_local, idx_local = local_routing(w_NK, idx_NK, self.start, self.count, impl)
        return super().forward(x_ND, w_local, idx_local, impl)

    def forward(self, x_ND, w_NK, idx_NK, impl: str):
        return funcol.all_reduce(self.partial(x_ND, w_NK, idx_NK, impl), "sum", self.group)

    def extra_repr(self) -> str:
        return f"experts=[{self.start}, {self.start + self.count})"


def check_expert_parallel(experts: Experts, world_size: int, name: str) -> None:
    """The checks `ExpertParallelExperts` makes before reading anything: ValueError naming the tensor for an expert
    count that cannot be split."""
    expert_range(experts.gate_up_proj.shape[0], 0, world_size, f"{name}.gate_up_proj.weight")
    if experts.down_proj.shape[0] != experts.gate_up_proj.shape[0]:
        raise ValueError(f"tensor parallel: {name}.down_proj.weight holds {experts.down_proj.shape[0]} experts "
                         f"but gate_up_proj {experts.gate_up_proj.shape[0]}")
