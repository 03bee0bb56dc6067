"""What the collectives of a tensor-parallel step move: measured by a dispatch mode, and the analytic count beside it.

`CollectiveCounter` (a `TorchFunctionMode`) records every collective a rank issues while it is active: the
functional collectives (`_c10d_functional.*`, what our modules call: `funcol.all_reduce`) and the in-place c10d ops
(`c10d.*`), with the tensor's shape and dtype. `measure_steps` runs the eager reference's own step functions
(`oracle.EagerSteps`: `mixed_step.encode_chunk` for a prefill chunk and a commit, `mixed_step.denoise_step` for a denoise
step, sampler included) over a sharded model under the counter, so whatever collectives the step holds (since
2026-12-02 the vocabulary-parallel sampler's reductions, no logits gather) are what it reports.

Bytes, per rank and step (docs/parallel.md, "Bytes per step"):
- payload: the bytes of the collective's result on a rank (all_reduce / broadcast: the tensor; all_gather: N
  inputs; reduce_scatter: 1/N of the input);
- wire: what a rank sends with a ring algorithm (NCCL's and gloo's default for large tensors): all_reduce
  2(N-1)/N x payload (reduce-scatter + all-gather), all_gather (N-1)/N x payload, reduce_scatter (N-1)/N x input,
  all_to_all (N-1)/N x input, broadcast the payload (its root).

`analytic_bytes` is the count from the sharding's design (shard.py, vocab.py, the two experts splits), per forward
kind; `tests/parallel/test_parallel_traffic.py` checks that it equals the measured count.

Legend: B rows, T tokens per row of the forward, C canvas, D hidden, Vp padded vocabulary, L layers, N ranks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from ..model.config import ModelConfig
from ..step.sampler import SAMPLE_CHUNK

FUNCTIONAL = "_c10d_functional"
INPLACE = "c10d"


@dataclass(frozen=True)
class Collective:
    """One collective a rank issued: `op` (e.g. "all_reduce"), the input `shape` and `dtype`, the group's
    `world_size`."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    world_size: int

    @property
    def input_bytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @property
    def payload_bytes(self) -> int:
        """Bytes of the result on a rank (module docstring)."""
        op, b, n = self.op, self.input_bytes, self.world_size
        if op.startswith("all_gather"):
            return b * n
        if op.startswith("reduce_scatter"):
            return b // n
        return b

    @property
    def wire_bytes(self) -> float:
        """Bytes a rank sends with a ring algorithm (module docstring)."""
        op, n = self.op, self.world_size
        if n == 1:
            return 0.0
        if op.startswith(("all_reduce", "allreduce")):
            return 2 * (n - 1) / n * self.payload_bytes
        if op.startswith(("all_gather", "allgather")):
            return (n - 1) / n * self.payload_bytes
        if op.startswith(("reduce_scatter", "all_to_all", "alltoall")):
            return (n - 1) / n * self.input_bytes
        return float(self.payload_bytes)


class CollectiveCounter(TorchFunctionMode):
    """`with CollectiveCounter(world_size) as c: ...` records every collective issued inside (`c.records`, in
    order); `c.total()` sums them. Collectives are recognised by their op namespace (`_c10d_functional`, `c10d`); the
    counter never changes what runs. `world_size`: the group's size (the wire bytes depend on it).

    A torch-function mode, not a dispatch mode: eager FlexAttention compiles its kernel with Dynamo, which refuses a
    user dispatch mode on the stack but traces through a function mode (the ops it sees there are not collectives)."""

    def __init__(self, world_size: int):
        super().__init__()
        self.world_size = world_size
        self.records: list[Collective] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        qualified = _op_name(func)
        if qualified is not None:
            ns, name = qualified.split("::", 1)
            if ns == FUNCTIONAL and name not in ("wait_tensor", "_wrap_tensor_autograd"):
                for t in _tensors(args[0]):
                    self.records.append(Collective(name, tuple(t.shape), t.dtype, self.world_size))
            elif ns == INPLACE and not name.startswith(("barrier", "monitored_barrier")):
                for t in _tensors(args[0]):
                    self.records.append(Collective(name.rstrip("_"), tuple(t.shape), t.dtype, self.world_size))
        return func(*args, **(kwargs or {}))

    def total(self) -> "Traffic":
        return Traffic.of(self.records)


def _op_name(func) -> str | None:
    """"namespace::name" of an operator (overload or packet), None for anything else (a Python function)."""
    if isinstance(func, torch._ops.OpOverload):
        return func._schema.name
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name
    return None


def _tensors(arg) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


@dataclass(frozen=True)
class Traffic:
    """Collectives of one forward or step: `calls`, `payload_bytes`, `wire_bytes` (per rank) and `by_shape`
    ((op, shape, dtype name) -> calls)."""

    calls: int
    payload_bytes: int
    wire_bytes: float
    by_shape: dict[tuple[str, tuple[int, ...], str], int]

    @classmethod
    def of(cls, records: list[Collective]) -> "Traffic":
        return cls(calls=len(records), payload_bytes=sum(r.payload_bytes for r in records),
                   wire_bytes=sum(r.wire_bytes for r in records),
                   by_shape=dict(Counter((r.op, r.shape, str(r.dtype).removeprefix("torch.")) for r in records)))


def analytic_bytes(cfg: ModelConfig, world_size: int, *, kind: str, batch: int, tokens: int, dtype_bytes: int,
                   experts: str = "tensor") -> dict[str, int]:
    """The all-reduce payload bytes per rank of one forward (or step) of `kind`, by source, from the sharding's
    design: "embedding" (the vocabulary-parallel lookup, [B, T, D]); per layer "o_proj", "down_proj" and "experts"
    ([B*T, D] each, whichever the experts split: both end in one all-reduce of the layer's [N, D] MoE output);
    for "denoise" also "sampler" (`sampler.VocabShard.sample_step`'s reductions, float32 and int64 whatever the
    model dtype: per position the max 4, the argmax 8, the chunk masses 4 N K, the token 8 and the entropy 4 bytes,
    K = the rank's inverse-CDF chunks) and "self-conditioning" (the product probs @ table, [B, C, D]). "prefill" and
    "commit": encoder passes, no logits. The rest in the model dtype (`dtype_bytes`). `cfg`: the checkpoint's config
    (not a rank's local one).

    Raises ValueError for an unknown kind or experts split."""
    if kind not in ("prefill", "denoise", "commit"):
        raise ValueError(f"kind must be prefill, denoise or commit, got {kind!r}")
    if experts not in ("tensor", "expert"):
        raise ValueError(f"experts must be tensor or expert, got {experts!r}")
    if world_size == 1:
        return {}
    D, L, b = cfg.hidden_size, cfg.num_layers, dtype_bytes
    row = batch * tokens * D * b
    out = {"embedding": row, "o_proj": L * row, "down_proj": L * row, "experts": L * row}
    if kind == "denoise":
        per = -(-cfg.vocab_size // world_size)
        chunks = -(-per // min(SAMPLE_CHUNK, per))
        out["sampler"] = batch * tokens * (4 + 8 + 4 * world_size * chunks + 8 + 4)
        out["self-conditioning"] = row
    return out


def measure_steps(model, *, batch: int, prompt_len: int, world_size: int, moe_impl: str = "loop"
                  ) -> dict[str, Traffic]:
    """The collectives of one prefill chunk, one denoise step (the second of the block: self-conditioning on) and
    one commit of `model` (sharded, or not: then nothing is counted), run eagerly through the reference's own steps
    (`oracle.EagerSteps`), each under a `CollectiveCounter`. `batch` rows of `prompt_len` <= C prompt tokens
    each. Returns {"prefill": .., "denoise": .., "commit": ..}. Every rank of the group must call it alike."""
    from ..oracle import EagerSteps, prefill

    C, V = model.config.canvas_length, model.config.vocab_size
    if not 1 <= prompt_len <= C:
        raise ValueError(f"prompt_len must be in [1, {C}] (one prefill chunk), got {prompt_len}")
    cfg = model.generation_config.resolved(model.config)
    runner = EagerSteps(model, [cfg] * batch, list(range(batch)), max_seq_len=prompt_len + 2 * C, moe_impl=moe_impl)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (batch, prompt_len), generator=g).to(model.device)
    out = {}
    with torch.no_grad():
        with CollectiveCounter(world_size) as c:
            prefill(runner, ids, torch.full((batch,), prompt_len, device=model.device))
        out["prefill"] = c.total()
        runner.begin_block(0, torch.zeros(batch, dtype=torch.bool, device=model.device))
        runner.step()
        with CollectiveCounter(world_size) as c:
            runner.step()
        out["denoise"] = c.total()
        argmax, _ = runner.result()
        with CollectiveCounter(world_size) as c:
            runner.commit(argmax.clone(), torch.full((batch,), C, device=model.device))
        out["commit"] = c.total()
    return out
