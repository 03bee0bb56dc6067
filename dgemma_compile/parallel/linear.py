"""The pieces of a tensor-parallel projection: a weight's slice for one rank, and the row-parallel linear.

Column parallel (q/k/v, gate/up) needs no module of its own: the rank keeps an `nn.Linear` holding its slice of the
output rows (`split`), and its outputs are the matching slice of the full projection's, bitwise (each output is the
same dot product). Row parallel (o_proj, down_proj) is `RowParallelLinear`: the rank holds the matching slice of the
input columns, computes a partial product and all-reduces it (a functional collective, so the same code traces
under torch.compile with 0 graph breaks: docs/parallel.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from .source import ModelWeights


def split(tensor: torch.Tensor, dim: int, rank: int, world_size: int, name: str) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/world_size slice of `tensor` along `dim`, as a fresh contiguous tensor (so the
    full weight can be freed).

    Raises:
        ValueError: `tensor.shape[dim]` is not a multiple of `world_size` (the message names `name` and the shape).
    """
    size = tensor.shape[dim]
    if size % world_size:
        raise ValueError(f"tensor parallel: {name} {list(tensor.shape)} cannot be split over {world_size} ranks: "
                         f"dim {dim} ({size}) is not a multiple of {world_size}")
    part = size // world_size
    return tensor.narrow(dim, rank * part, part).contiguous()


def column_parallel(linear: nn.Linear, start: int, length: int, name: str, source=None) -> nn.Linear:
    """A new `nn.Linear` holding `linear`'s output rows [start, start + length) (weight and bias), read through
    `source` (`source.ModelWeights` by default; `FileWeights` when `linear` is a meta module the loader left unread);
    its output is `linear(x)[..., start:start + length]`, bitwise. `name`: the module's state-dict prefix."""
    source = source or ModelWeights()
    w = source.take(f"{name}.weight", linear.weight, 0, start, length)
    out = nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w, requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(source.take(f"{name}.bias", linear.bias, 0, start, length), requires_grad=False)
    return out


class RowParallelLinear(nn.Module):
    """y = all_reduce_sum(x_local @ weight_local.T) + bias over `group`: one rank's share of a linear whose input
    features are split over the ranks.

    Args:
        weight: [out, in / world] this rank's input columns (the model dtype).
        bias: [out] or None, the full bias, added once after the reduction.
        group: the process group the partial products are summed over.
    forward(x [..., in / world]) -> [..., out], same dtype. The sum's order differs from the unsplit product (each
    rank sums in / world terms, then the ranks' partial sums are added), so values match the single-process linear
    within float32 reduction-order error, and are bitwise identical on every rank (gloo gives each rank the same sum).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, world_size: int, group: dist.ProcessGroup,
                    name: str, columns: tuple[int, int] | None = None, source=None) -> "RowParallelLinear":
        """`linear`'s rank-`rank` share: its input columns `columns` = (start, length), or the rank's contiguous
        1/world_size of them when None, read through `source` (as `column_parallel`). ValueError naming `name`
        when the columns cannot be split."""
        source = source or ModelWeights()
        if columns is None:
            split(torch.empty(linear.weight.shape, device="meta"), 1, rank, world_size, f"{name}.weight")  # a check
            per = linear.weight.shape[1] // world_size
            columns = (rank * per, per)
        local = source.take(f"{name}.weight", linear.weight, 1, *columns)
        bias = None if linear.bias is None else source.take(f"{name}.bias", linear.bias, 0, 0, linear.bias.shape[0])
        return cls(local, bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = funcol.all_reduce(F.linear(x, self.weight), "sum", self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_local={self.weight.shape[1]}, out={self.weight.shape[0]}, bias={self.bias is not None}"
