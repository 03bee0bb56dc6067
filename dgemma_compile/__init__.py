"""dgemma_compile: DiffusionGemma block-diffusion generation, eager reference and compiled.

Low-level API: `load(path)` -> model; `model.new_cache(B, S)`; `model.encode(ids, cache)`;
`model.denoise(canvas, cache, self_conditioning_logits)`; `generate(model, prompts, config, seed=...)`;
`build(model)` -> compiled generator with the same `generate`; `Observer` for per-step and per-unit timings;
`quantize(model, scheme)` -> `QuantReport` (torchao, the optional `[quant]` extra).
"""

from .compile import CompiledGenerator, CompileOptions, build
from .config import ConfigError, GenerationConfig, ModelConfig
from .generate import GenerationOutput, RequestStats, generate
from .kv_cache import CacheFullError, KVCache
from .loader import CheckpointError, load, load_tokenizer
from .model import DiffusionGemma
from .observe import Observer
from .quant import QuantReport, quantize

__all__ = [
    "CacheFullError", "CheckpointError", "CompileOptions", "CompiledGenerator", "ConfigError", "DiffusionGemma",
    "GenerationConfig", "GenerationOutput", "KVCache", "ModelConfig", "Observer", "QuantReport", "RequestStats", "build",
    "generate", "load", "load_tokenizer", "quantize",
]
