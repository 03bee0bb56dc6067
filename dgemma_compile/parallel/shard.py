"""Tensor-parallel sharding of a loaded `DiffusionGemma`, applied from outside the model: `shard(model, group)`.

What each rank keeps (Megatron's split, transformers' `base_model_tp_plan`: q/k/v colwise, o rowwise):
- attention: its H/N query heads (q_proj output rows), the KV heads those query heads read (k_proj / v_proj output
  rows): Hkv/N of them when Hkv >= N, else the one KV head its query heads share, replicated on N/Hkv ranks (the
  released full layers have 2 KV heads); o_proj is row parallel over the same heads (`RowParallelLinear`, one
  all-reduce per layer). q_norm / k_norm / v_norm act per head and stay whole.
- dense MLP: gate_proj / up_proj output rows I/N (column parallel), down_proj row parallel (one all-reduce).
- routed experts: every expert's intermediate slice I/N (`experts.py`, experts="tensor", the default) or E/N whole
  experts (`expert_parallel.py`, experts="expert"); one all-reduce per layer either way.
- vocabulary: table rows Vp/N of the padded vocabulary for the lookup, the logits and the self-conditioning product
  (`vocab.py`); the step's sampler works on the rank's slice of the logits (`sampler.VocabShard`, held by the
  sharded lm_head, `VocabParallelHead.shard`; the model reads it as `model.vocab_shard`): the logits are never gathered in a step (`model.logits(hidden)` without `local` still
  gathers, for tests and callers that want [.., V]).
- replicated, unchanged: norms, router, self-conditioning MLP, vision tower.
So every rank's residual stream is the full [B, T, D] and bitwise the same on every rank.

`model.config` becomes the rank's local attention shape (num_attention_heads = H/N, num_kv_heads per layer the
local count), so every cache the model makes (`new_cache`, paged caches) holds only this rank's KV heads; the
checkpoint's config is `model.tensor_parallel.config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..kernels.sample.vocab_parallel import VocabShard
from ..model.config import ModelConfig
from .errors import ParallelError
from .expert_parallel import ExpertParallelExperts, check_expert_parallel, check_expert_split
from .experts import TensorParallelExperts, check_experts
from .linear import RowParallelLinear, column_parallel, split
from .vocab import VocabParallelEmbedding, VocabParallelHead, VocabParallelProduct, local_rows, vocab_range

if TYPE_CHECKING:
    from ..model.backbone import DiffusionGemma
    from .load import LoadReport


@dataclass(frozen=True)
class TensorParallel:
    """How a model was sharded: `group` (the process group), this process's `rank` of `world_size`, the checkpoint's
    `config` (before sharding), per layer the (query heads, KV heads) this rank holds (global head ids), and how
    the routed experts were split (`experts`: "tensor" or "expert", `expert_parallel.EXPERT_SPLITS`); `load_report`:
    what `load.load_sharded` read from the files (a `load.LoadReport`; None when the model was sharded in memory)."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    config: ModelConfig
    heads: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    experts: str = "tensor"
    load_report: "LoadReport | None" = None


def attention_heads(num_heads: int, num_kv_heads: int, rank: int, world_size: int,
                    layer: int) -> tuple[list[int], list[int]]:
    """(query heads, KV heads) rank `rank` of `world_size` holds in an attention layer, as global head ids.

    Query heads are split evenly and contiguously. KV heads: split the same way when num_kv_heads >= world_size;
    otherwise each rank keeps the one KV head its query heads read (GQA: query head h reads KV head
    h // (num_heads / num_kv_heads)), replicated on world_size / num_kv_heads ranks.
    Raises:
        ValueError: num_heads is not a multiple of world_size, or num_kv_heads neither a multiple nor a divisor of
            it (the message names the layer's q_proj / k_proj weight).
    """
    if num_heads % world_size:
        raise ValueError(f"tensor parallel: layers.{layer}.self_attn.q_proj.weight has {num_heads} query heads, "
                         f"which cannot be split over {world_size} ranks")
    per = num_heads // world_size
    q = list(range(rank * per, (rank + 1) * per))
    if num_kv_heads >= world_size:
        if num_kv_heads % world_size:
            raise ValueError(f"tensor parallel: layers.{layer}.self_attn.k_proj.weight has {num_kv_heads} KV heads, "
                             f"which cannot be split over {world_size} ranks")
        kv_per = num_kv_heads // world_size
        return q, list(range(rank * kv_per, (rank + 1) * kv_per))
    if world_size % num_kv_heads:
        raise ValueError(f"tensor parallel: layers.{layer}.self_attn.k_proj.weight has {num_kv_heads} KV heads, "
                         f"which can be neither split nor replicated over {world_size} ranks (the rank count must "
                         f"be a multiple of it)")
    group = num_heads // num_kv_heads
    return q, [q[0] // group]


def _check_quantized(model: nn.Module) -> None:
    """A quantized model shards when its quantized weights are the layouts `quantized.py` slices (per-row
    `Float8Tensor`, per-tensor-scaled `NVFP4Tensor`, `ExpertProjection`); ValueError naming another."""
    from .quantized import check_sliceable, is_quantized

    for name, p in model.named_parameters():
        if is_quantized(p.data):
            check_sliceable(p.data, name)


def shard(model: "DiffusionGemma", group: dist.ProcessGroup | None = None, *, source=None,
          experts: str = "tensor") -> "DiffusionGemma":
    """Shard `model` in place over `group` (default: the default group) for this process's rank, and return it.

    Args:
        model: a loaded `DiffusionGemma` holding the full checkpoint (every rank loads the same one), float or
            quantized (`dg.quantize`, or a compressed-tensors checkpoint): a quantized weight's slice keeps its own
            codes and scales (`quantized.py`), so it dequantizes to exactly the slice of the one-process weight.
        group: an initialised process group (`parallel.init`); every rank of it must call `shard` and then run the
            same forwards (each row-parallel projection is one all-reduce).
        source: where the rank's slices are read (`source.py`): None, the model's own full tensors; a `FileWeights`
            for a model the loader left the sharded tensors of unread (`parallel.load_sharded`).
        experts: "tensor" (every expert's I/N intermediate slice on every rank, the default) or "expert" (E/N whole
            experts a rank); docs/parallel.md, "Experts: which split".
    Returns:
        `model`, with `model.tensor_parallel` (a `TensorParallel`) set and `model.config` the local attention shape
        (module docstring). Its forwards return what the unsharded model's do (float32 logits [B, T, V], the full
        vocabulary), within float32 reduction-order error, bitwise identical on every rank.
    Raises:
        ValueError: the model is already sharded, or a tensor cannot be split (the message names it: query heads,
            KV heads, or the dense MLP's or the experts' intermediate size not divisible by the rank count, with
            experts="expert" the expert count, or a quantized weight's slice that would cut a scale group: an NVFP4
            input slice that is not a multiple of 16, a quantized self-conditioning product's ceil(V / N) columns
            included; the vocabulary itself is padded, never refused); an unknown `experts`. Nothing is changed
            when it raises.
        RuntimeError: no process group is initialised.
    """
    if model.tensor_parallel is not None:
        raise ValueError("tensor parallel: the model is already sharded")
    if not dist.is_initialized():
        raise ParallelError("tensor parallel: no process group; call dgemma_compile.parallel.init() first")
    group = dist.group.WORLD if group is None else group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cfg = model.config
    check_expert_split(experts)
    _check_quantized(model)
    # Plan the split first, then read every slice into new modules, then swap them in: a shape that cannot be split
    # (or a slice that would cut a quantized weight's scale group) changes nothing.
    heads = [attention_heads(cfg.num_attention_heads, cfg.num_kv_heads[i], rank, world, i)
             for i in range(cfg.num_layers)]
    for i, layer in enumerate(model.layers):
        split(torch.empty(layer.mlp.gate_proj.weight.shape, device="meta"), 0, rank, world,
              f"layers.{i}.mlp.gate_proj.weight")
        (check_experts if experts == "tensor" else check_expert_parallel)(layer.experts, world, f"layers.{i}.experts")
    changes: list[tuple[object, str, object]] = []  # (owner, attribute, new value)
    for i, (layer, (q, kv)) in enumerate(zip(model.layers, heads)):
        attn, dh = layer.self_attn, layer.self_attn.head_dim
        pre = f"layers.{i}.self_attn"
        q_rows, kv_rows = (q[0] * dh, len(q) * dh), (kv[0] * dh, len(kv) * dh)  # contiguous heads
        changes += [(attn, "q_proj", column_parallel(attn.q_proj, *q_rows, f"{pre}.q_proj", source)),
                    (attn, "k_proj", column_parallel(attn.k_proj, *kv_rows, f"{pre}.k_proj", source))]
        if attn.v_proj is not None:
            changes.append((attn, "v_proj", column_parallel(attn.v_proj, *kv_rows, f"{pre}.v_proj", source)))
        changes += [(attn, "o_proj", RowParallelLinear.from_linear(attn.o_proj, rank, world, group, f"{pre}.o_proj",
                                                                   columns=q_rows, source=source)),
                    (attn, "num_heads", len(q)), (attn, "num_kv_heads", len(kv))]
        mlp, pre = layer.mlp, f"layers.{i}.mlp"
        per = mlp.gate_proj.weight.shape[0] // world
        changes += [(mlp, "gate_proj", column_parallel(mlp.gate_proj, rank * per, per, f"{pre}.gate_proj", source)),
                    (mlp, "up_proj", column_parallel(mlp.up_proj, rank * per, per, f"{pre}.up_proj", source)),
                    (mlp, "down_proj", RowParallelLinear.from_linear(mlp.down_proj, rank, world, group,
                                                                     f"{pre}.down_proj", source=source))]
        split_experts = TensorParallelExperts if experts == "tensor" else ExpertParallelExperts
        changes.append((layer, "experts", split_experts(layer.experts, rank, world, group, f"layers.{i}.experts",
                                                        source)))
    changes += _shard_vocabulary(model, rank, world, group, source)
    for owner, attr, value in changes:
        setattr(owner, attr, value)
    model.tensor_parallel = TensorParallel(group=group, rank=rank, world_size=world, config=cfg,
                                           heads=tuple((tuple(q), tuple(kv)) for q, kv in heads), experts=experts)
    model.config = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // world,
                                       num_kv_heads=tuple(len(kv) for _, kv in heads))
    return model


def _shard_vocabulary(model: "DiffusionGemma", rank: int, world: int, group: dist.ProcessGroup,
                      source) -> list[tuple[object, str, object]]:
    """The lookup, the logits and the self-conditioning product over the rank's rows of the padded vocabulary
    (`vocab.py`), as `shard`'s changes: `embed_tokens` becomes a `VocabParallelEmbedding` (its `weight` the local
    rows), `lm_head` a `VocabParallelHead` (over the same rows when tied, over the lm_head's rows otherwise: the
    untied one, or `quant.quantize`'s quantized copy; holding the rank's `VocabShard`) and `sc_embedding` a `VocabParallelProduct` (the input
    embeddings, as transformers' self-conditioning; a quantized model's `sc_embedding` sliced to the rank's
    columns)."""
    V = model.config.vocab_size
    start, per = vocab_range(V, rank, world)
    table = model.embed_tokens.weight.detach()
    embed = VocabParallelEmbedding(local_rows(table, rank, world, source, "embed_tokens.weight"), start, group)
    weight = embed.weight
    head = weight if model.lm_head is None else local_rows(model.lm_head.weight, rank, world, source, "lm_head.weight")
    sc = model.sc_embedding
    product = None if sc is None else local_rows(sc.weight, rank, world, source, "sc_embedding.weight", dim=1)
    scheme = model.checkpoint.scheme
    shard = VocabShard(group=group, rank=rank, world_size=world, start=start, per=per, vocab_size=V,
                       rank_activation_scales=scheme is not None and scheme.dynamic_activations)
    return [(model, "embed_tokens", embed), (model, "lm_head", VocabParallelHead(head, V, group, shard)),
            (model, "sc_embedding", VocabParallelProduct(weight, start, V, group, projection=product))]
