"""dgemma_compile: DiffusionGemma block-diffusion generation, eager reference and compiled.

Low-level API: `load(path)` -> model; `model.new_cache(B, S)`; `encode(model, ids, cache)`;
`denoise(model, canvas, cache, self_conditioning_logits)` (the checked uniform passes); `generate(model, prompts, config, seed=...)`;
`build(model)` -> compiled generator with the same `generate`; `Observer` for per-step and per-unit timings;
`quantize(model, scheme)` -> `QuantReport` (torchao, the optional `[quant]` extra).

Imports cost only what is used: each public name is imported from its submodule on first use (PEP 562), so
`import dgemma_compile` and `dgemma --help` import no torch, and `load` / `build` import no Dynamo or Inductor until
something compiles (`tests/test_imports.py`).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .canvas import Canvas
    from .compile import CompiledGenerator, CompileOptions, build
    from .config import ConfigError, GenerationConfig, ModelConfig
    from .generate import GenerationOutput, RequestStats, generate
    from .kv_cache import CacheFullError, KVCache
    from .loader import CheckpointError, load, load_tokenizer
    from .model import DiffusionGemma
    from .observe import Observer
    from .quant import QuantReport, quantize
    from .uniform import denoise, encode

_SOURCES = {
    "canvas": ("Canvas",),
    "compile": ("CompiledGenerator", "CompileOptions", "build"),
    "config": ("ConfigError", "GenerationConfig", "ModelConfig"),
    "generate": ("GenerationOutput", "RequestStats", "generate"),
    "kv_cache": ("CacheFullError", "KVCache"),
    "loader": ("CheckpointError", "load", "load_tokenizer"),
    "model": ("DiffusionGemma",),
    "observe": ("Observer",),
    "quant": ("QuantReport", "quantize"),
    "uniform": ("denoise", "encode"),
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


class _Package(types.ModuleType):
    """This package's module type. The import system binds each submodule it imports on its package
    (`dgemma_compile.generate = <module dgemma_compile.generate>`); where a public name is also a submodule's name
    (`generate`), the name keeps the submodule's object of that name, as the eager `from .generate import generate`
    did: `dgemma_compile.generate` is the function whatever was imported first."""

    def __setattr__(self, name: str, value) -> None:
        if (_SUBMODULE.get(name) == name and isinstance(value, types.ModuleType)
                and value.__name__ == f"{__name__}.{name}"):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
