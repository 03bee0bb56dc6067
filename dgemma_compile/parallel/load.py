"""Loading a rank's shards only: `load_sharded(path, group)` reads from the safetensors files just the slices
`shard` keeps on this rank.

The loader checks every tensor of the checkpoint as usual (names, shapes, dtypes) but leaves the ones `shard` splits
unread (`loader.load(lazy=is_sharded)`: meta tensors of the checkpoint's shape); `shard` then plans the split on those
shapes (a shape that can be neither split, padded nor replicated is refused naming the tensor, before any byte of it
is read) and reads each slice with safetensors' `get_slice` (`source.FileWeights`). So a rank holds its q/k/v/o
heads, its 1/N of the dense MLP's and every expert's intermediate features and its 1/N of the vocabulary's rows, and
never a full copy of them; the replicated tensors (norms, router, self-conditioning MLP, vision tower) are read whole.

What reaches memory is the slice; what the OS pages in from the file is the slice's pages for row slices (q/k/v,
gate/up, the vocabulary: whole rows of a row-major tensor), but may be most of the tensor's pages for column slices
(o_proj, down_proj, the experts' down_proj: each row contributes a short run), a page cache cost, not a copy.
A compressed-tensors checkpoint (FP8, NVFP4) is read the same way, each stored part of a quantized weight (codes,
per-row, per-block and per-tensor scales) sliced with the rows or columns it covers (`quantized.py`), and built into
the torchao tensors (or the experts' plain layout) the loader builds for the whole checkpoint: the rank's weights
are exactly the slices of the one-process model's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..model.loader import CheckpointError, load
from .errors import ParallelError
from .shard import shard
from .source import FileWeights

if TYPE_CHECKING:
    from ..model.backbone import DiffusionGemma

SHARDED = re.compile(r"(embed_tokens|lm_head)\.weight|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                     r"|experts\.(gate_up|down)_proj)\.weight")
"""State-dict names `shard` splits, float or stored quantized (every other tensor is replicated)."""


def is_sharded(name: str) -> bool:
    return SHARDED.fullmatch(name) is not None


@dataclass(frozen=True)
class LoadReport:
    """What a rank read of the sharded tensors: `bytes_read` (stored dtype), `full_bytes` (the same tensors whole) and
    per tensor the elements of its largest slice (`largest`) beside its full size (`full`)."""

    bytes_read: int
    full_bytes: int
    largest: dict[str, int]
    full: dict[str, int]


def load_sharded(path: str | Path, group: dist.ProcessGroup | None = None, *, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", experts: str = "tensor",
                 quant: str | None = None) -> "DiffusionGemma":
    """Load this rank's shard of a checkpoint, float or compressed-tensors (module docstring): the model
    `shard(load(path))` gives, without reading the full sharded tensors. `model.tensor_parallel.load_report` is a
    `LoadReport` (a quantized weight's parts counted under their checkpoint keys); a quantized checkpoint's
    `model.checkpoint.quant_report` counts the rank's bytes. `experts`: as `shard`'s
    ("tensor" or "expert": with "expert" a rank reads its E/N whole experts, contiguous rows of the files).
    `quant`: a `quant.SCHEMES` name: the float checkpoint is loaded whole instead, quantized as one process would
    (`quant.quantize`) and then sharded, so that the rank holds the one-process quantized weights' slices, at the
    cost of a full float copy while loading; `model.checkpoint.quant_report` is then the whole model's report.

    Raises:
        CheckpointError: as `loader.load`.
        ConfigError: as `quant.quantize` (a scheme it refuses, a checkpoint already quantized).
        ValueError: a tensor that cannot be split (as `shard`, naming it); the half-built model is then unusable.
        RuntimeError: no process group is initialised.
    """
    if not dist.is_initialized():
        raise ParallelError("tensor parallel: no process group; call dgemma_compile.parallel.init() first")
    if quant is not None:
        from ..quant import quantize

        model = load(path, dtype=dtype, device=device)
        report = quantize(model, quant)
        shard(model, group, experts=experts)
        model.checkpoint.quant_report = report
        return model
    model = load(path, dtype=dtype, device=device, lazy=is_sharded)
    lazy_weights = model.checkpoint.lazy
    source = FileWeights(lazy_weights.float_sources, lazy_weights.dtype, torch.device(device),
                         quantized=lazy_weights.quantized, files=lazy_weights.files,
                         scheme=model.checkpoint.scheme)
    stored = dict(lazy_weights.float_sources)  # float: counted by our name
    stored.update((k, (p, k)) for k, p in lazy_weights.files.items())  # quantized: by each stored part's key
    full, nbytes = {}, 0
    sizes = _stored_sizes({p for p, _ in stored.values()})
    for name, (p, k) in stored.items():
        numel, itemsize = sizes[p, k]
        full[name], nbytes = numel, nbytes + numel * itemsize
    try:
        shard(model, group, source=source, experts=experts)
    finally:
        source.close()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointError(f"{path}: tensor parallel left tensors unread: {left}")
    model.tensor_parallel = dataclasses.replace(model.tensor_parallel, load_report=LoadReport(
        source.bytes_read, nbytes, dict(source.largest), full))
    if model.checkpoint.quant_report is not None:  # the rank's bytes, not the meta model's
        from ..quant.checkpoint import count_bytes

        count_bytes(model.checkpoint.quant_report, model, lazy_weights.dtype)
    return model


def _stored_sizes(paths: set[Path]) -> dict[tuple[Path, str], tuple[int, int]]:
    """(file, key) -> (elements, bytes per element) of every tensor stored in `paths` (each header read once)."""
    from safetensors import safe_open

    sizes = {}
    for path in paths:
        with safe_open(path, framework="pt", device="cpu") as fh:
            for key in fh.keys():
                sl = fh.get_slice(key)
                sizes[path, key] = math.prod(sl.get_shape()), ITEMSIZE.get(sl.get_dtype(), 0)  # 0: never sharded
    return sizes


ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "F8_E4M3": 1, "U8": 1}
