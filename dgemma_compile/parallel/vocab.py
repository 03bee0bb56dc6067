"""The vocabulary split over the ranks: the embedding lookup, the logits and the self-conditioning product.

The vocabulary V is padded to Vp, the next multiple of the rank count N (the demo's 27 -> 28 on 2 ranks; the
released 262144 divides), and rank r holds table rows [r*Vp/N, (r+1)*Vp/N), the padding rows zero. Then:
- lookup (`VocabParallelEmbedding`): each rank embeds the ids inside its range, zeros elsewhere, and an all-reduce
  sums: exactly one rank contributes a row, so the result is bitwise the single-process lookup;
- logits (`VocabParallelHead`): each rank computes its [.., Vp/N] slice, places it in zeros [.., Vp] and an
  all-reduce sums (a gather; see `VocabParallelHead.forward` for why not an all-gather), the padding columns are cut:
  [.., V] on every rank, each logit the same dot product as in one process;
- self-conditioning product (`VocabParallelProduct`): probs [.., V] (zero-padded to Vp) times the rank's rows, summed
  over ranks by an all-reduce: a sum over V in N partial sums (float32 reduction order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from ..kernels.sample.vocab_parallel import VocabShard
from .quantized import is_quantized, narrow_tensor
from .source import ModelWeights


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first id, rows per rank) of rank `rank`: rows per rank = ceil(vocab_size / world_size)."""
    per = -(-vocab_size // world_size)
    return rank * per, per


def local_rows(table: torch.Tensor, rank: int, world_size: int, source=None, name: str = "table",
               dim: int = 0) -> torch.Tensor:
    """Rank `rank`'s vocabulary entries of `table` along `dim` (the rows of a [V, D] table; dim 1: the columns of a
    [D, V] projection), zero-padded to ceil(V / world_size) of them, a fresh tensor; read through `source`
    (`source.ModelWeights` by default; `FileWeights` for a meta table named `name` the loader left unread). A
    quantized (torchao) table is padded part by part (`quantized.narrow_tensor`: zero codes, zero scales)."""
    V = table.shape[dim]
    start, per = vocab_range(V, rank, world_size)
    have = max(0, min(per, V - start))
    part = (source or ModelWeights()).take(name, table, dim, min(start, V), have)
    if have == per:
        return part
    if is_quantized(part):
        return narrow_tensor(part, dim, 0, have, name, padded=per)
    shape = list(part.shape)
    shape[dim] = per - have
    return torch.cat([part, part.new_zeros(shape)], dim=dim)


def held_rows(weight: torch.Tensor, start: torch.Tensor | int, ids: torch.Tensor) -> torch.Tensor:
    """[..., D] in `weight`'s dtype: the table rows of `ids` (int64 [...]) that this rank holds (`weight` [ceil(V/N),
    D] is rows `start` ..), zeros for the others; summed over the ranks, every id's row exactly (one nonzero term)."""
    local = ids - start
    inside = (local >= 0) & (local < weight.shape[0])
    rows = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return torch.where(inside[..., None], rows, torch.zeros_like(rows))


class VocabParallelEmbedding(nn.Module):
    """forward(ids [...] int64 in [0, V)) -> [..., D] in the weight's dtype: the full table's rows, bitwise.
    `weight` [ceil(V/N), D] holds this rank's rows (the model's `dtype` / `device` read it)."""

    def __init__(self, weight: torch.Tensor, start: int, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("start", torch.tensor(start, dtype=torch.long, device=weight.device), persistent=False)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(held_rows(self.weight, self.start, ids), "sum", self.group)


class VocabParallelHead(nn.Module):
    """forward(hidden [..., D]) -> logits [..., V] in the weight's dtype (the model casts and soft-caps them): this
    rank's [..., V/N] slice `hidden @ weight.T`, gathered over the ranks (an all-reduce of the placed slices), the
    padding columns cut. `weight`
    [ceil(V/N), D]: this rank's rows of the tied table (shared with the embedding) or of the untied lm_head.
    `shard`: the rank's slice of the vocabulary these rows are (`sampler.VocabShard`: what the step's sampler works
    on), held here, by the product it shards; the model reads it as `DiffusionGemma.vocab_shard`."""

    def __init__(self, weight: nn.Parameter | torch.Tensor, vocab_size: int, group: dist.ProcessGroup,
                 shard: "VocabShard"):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.vocab_size = vocab_size
        self.group = group
        self.shard = shard
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., ceil(V/N)]: this rank's slice of the logits, padding ids included (what the step's sampler reads:
        `sampler.VocabShard`; no collective)."""
        return F.linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.local_logits(hidden)  # [..., V/N]
        per = local.shape[-1]
        # The gather as an all-reduce of the slice placed in zeros (exact: one nonzero term per logit). An all-gather
        # would move half the bytes, but Inductor's C++ wrapper (CompileOptions.cpp_wrapper, on for CPU) cannot call
        # all_gather_into_tensor in torch 2.13 ("arg type Any is not yet supported by custom_op_wrapper"). The step
        # never gathers: its sampler works on `local_logits` (`sampler.VocabShard`).
        placed = F.pad(local, (self.rank * per, (self.world_size - 1 - self.rank) * per))
        return funcol.all_reduce(placed, "sum", self.group)[..., :self.vocab_size]


class VocabParallelProduct(nn.Module):
    """The self-conditioning product as a [V -> D] projection (the model's `sc_embedding` hook):
    forward(probs [..., V]) -> [..., D] = probs @ table, in probs' dtype, from this rank's rows `weight`
    [ceil(V/N), D] (shared with the embedding) and one all-reduce. `projection`: a quantized model's product
    (`quant.quantize`'s `sc_embedding`, the table as a [V -> D] linear) sliced to this rank's columns [D, ceil(V/N)]
    (a torchao tensor), used in place of `weight` when given."""

    def __init__(self, weight: nn.Parameter, start: int, vocab_size: int, group: dist.ProcessGroup,
                 projection: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.projection = None if projection is None else nn.Parameter(projection, requires_grad=False)
        self.start = start
        self.vocab_size = vocab_size
        self.group = group

    def local(self, probs_local: torch.Tensor, pinned: torch.Tensor | None = None,
              ids: torch.Tensor | None = None) -> torch.Tensor:
        """[..., D]: the product from this rank's slice of the probabilities [..., ceil(V/N)] (padding ids 0), one
        all-reduce (the step's path: `sampler.VocabShard.sample_step` gives the slice). `pinned` (bool [...]) with
        `ids` (int64 [...]): those positions take their token's table row instead (`DiffusionGemma
        .self_conditioning_embedding`), from the rank that holds it and zero on the others, before the all-reduce:
        the row exactly, with no collective added."""
        product = probs_local @ self.weight if self.projection is None else F.linear(probs_local, self.projection)
        if pinned is not None:
            product = torch.where(pinned[..., None], held_rows(self.weight, self.start, ids), product)
        return funcol.all_reduce(product, "sum", self.group)

    def forward(self, probs: torch.Tensor, pinned: torch.Tensor | None = None,
                ids: torch.Tensor | None = None) -> torch.Tensor:
        per = self.weight.shape[0]
        padded = F.pad(probs, (0, self.start + per - min(self.vocab_size, self.start + per)))
        return self.local(padded[..., self.start:self.start + per], pinned, ids)
