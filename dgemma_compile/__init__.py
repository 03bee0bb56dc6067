"""dgemma_compile: DiffusionGemma block-diffusion generation, eager reference and compiled.

Low-level API: `load(path)` -> model; `model.new_cache(B, S)`; `encode(model, ids, cache)`;
`denoise(model, canvas, cache, self_conditioning_logits)` (the checked uniform passes); `generate(model, prompts, config, seed=...)`;
`build(model)` -> compiled generator with the same `generate`; `Observer` for per-step and per-unit timings;
`quantize(model, scheme)` -> `QuantReport` (torchao, the optional `[quant]` extra).

Imports cost only what is used: each public name is imported from its submodule on first use (PEP 562), so
`import dgemma_compile` and `dgemma --help` import no torch, and `load` / `build` import no Dynamo or Inductor until
something compiles (`tests/cli/test_imports.py`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .compile import CompiledGenerator, CompileOptions, build
    from .model.backbone import DiffusionGemma
    from .model.config import ConfigError, GenerationConfig, ModelConfig
    from .model.forwards import denoise, encode
    from .model.kv_cache import CacheFullError, KVCache
    from .model.loader import CheckpointError, load, load_tokenizer
    from .oracle import generate
    from .quant import QuantReport, quantize
    from .step.canvas import Canvas
    from .step.observe import Observer
    from .step.requests import GenerationOutput, RequestStats

_SOURCES = {
    "compile": ("CompiledGenerator", "CompileOptions", "build"),
    "model.backbone": ("DiffusionGemma",),
    "model.config": ("ConfigError", "GenerationConfig", "ModelConfig"),
    "model.forwards": ("denoise", "encode"),
    "model.kv_cache": ("CacheFullError", "KVCache"),
    "model.loader": ("CheckpointError", "load", "load_tokenizer"),
    "oracle": ("generate",),
    "quant": ("QuantReport", "quantize"),
    "step.canvas": ("Canvas",),
    "step.observe": ("Observer",),
    "step.requests": ("GenerationOutput", "RequestStats"),
}
_SUBMODULE = {name: sub for sub, names in _SOURCES.items() for name in names}
"""Public name -> the submodule (of this package) it is imported from on first use."""

__all__ = [
    "CacheFullError", "Canvas", "CheckpointError", "CompileOptions", "CompiledGenerator", "ConfigError",
    "DiffusionGemma", "GenerationConfig", "GenerationOutput", "KVCache", "ModelConfig", "Observer", "QuantReport",
    "RequestStats", "build", "denoise", "encode", "generate", "load", "load_tokenizer", "quantize",
]


def __getattr__(name: str):
    sub = _SUBMODULE.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{sub}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
