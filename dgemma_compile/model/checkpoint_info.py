"""What a model remembers about where its weights came from and how they are held: one typed record per model.

`DiffusionGemma.checkpoint` is a `CheckpointInfo` (empty for a model built in memory). Its writers:
- `loader.load`: `directory`; for a quantized checkpoint `quant_scheme` and `quant_report`; with `lazy=...` the
  weights it checked but left on disk (`lazy`, a `LazyWeights`);
- `quant.quantize`: `quant_scheme` (its report is returned to the caller);
- `parallel.load_sharded`: `quant_report`, counted over the rank's own bytes.
Its readers: `preprocess.image_processor` (the directory's processor settings), the CLI (the report, the scheme the
background compile repeats), `parallel.load_sharded` (the lazy sources), `quant.quantize` (refuses a second
quantization). Nothing else about the checkpoint is stored on the model: the generation config stays the model's
`generation_config`, the attribute transformers' users read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..quant.checkpoint import StoredWeight
    from ..quant.quantize import QuantReport


@dataclass
class LazyWeights:
    """Weights `loader.load(..., lazy=...)` checked (name, shape, dtype) but did not read; they stay meta tensors until
    `parallel.load_sharded` reads each rank's slices.

    float_sources: state-dict name -> (safetensors file, tensor key) of every float tensor left unread.
    dtype: the dtype those float tensors load as.
    quantized: state-dict name -> the stored family of a quantized weight left unread (`quant.checkpoint`).
    files: checkpoint tensor key -> file, for every key of `quantized`'s families.
    """

    float_sources: dict[str, tuple[Path, str]]
    dtype: torch.dtype
    quantized: dict[str, "StoredWeight"] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)


@dataclass
class CheckpointInfo:
    """directory: the checkpoint directory the model was loaded from (None: built in memory).
    quant_scheme: the `quant.SCHEMES` name the model's weights run as (None: not quantized).
    quant_report: what a quantized checkpoint stored quantized and what it left in float (`quant.QuantReport`), or
        None (a float checkpoint, or a model quantized in this process: `quantize` returns its report).
    lazy: the weights left on disk by a lazy load (`LazyWeights`), or None.
    """

    directory: Path | None = None
    quant_scheme: str | None = None
    quant_report: "QuantReport | None" = None
    lazy: LazyWeights | None = None

    @property
    def scheme(self):
        """The `quant.schemes.Scheme` named by `quant_scheme` (None: not quantized): the one place the model's scheme
        is looked up from its name."""
        if self.quant_scheme is None:
            return None
        from ..quant.schemes import scheme

        return scheme(self.quant_scheme)
