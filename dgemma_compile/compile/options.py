"""`CompileOptions`: every Dynamo/Inductor knob dgemma_compile uses, each with its reason, and `applied()`, the one
function that applies them (only around our own compiled calls; nothing is set at import time)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..config import ConfigError


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """Every compiler setting of dgemma_compile, each with its reason. Applied only around our own compiled calls by
    `applied()`; nothing is set at import time.

    Raises:
        ConfigError: an invalid value, naming the field.
    """

    # Static batch shapes: a call with B requests runs in the smallest bucket >= B (padded rows are frozen).
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    # Static committed slots per row (prompt + committed blocks); the KV cache is preallocated at this size.
    max_seq_len: int = 1024
    # A graph break must be an error: a split step would run pieces eagerly and sync with the host.
    fullgraph: bool = True
    # Shapes are static per bucket; per-step scalars are tensors, so dynamic shapes would only add guards.
    dynamic: bool = False
    # Capture each bucket's units as CUDA graphs (CUDA only): one launch per step instead of hundreds.
    cuda_graphs: bool = True
    # Each unit compiles once per bucket and per structural config (stop_early, stability depth): the limit must
    # exceed that, and hitting it must fail instead of falling back to eager.
    recompile_limit: int = 32
    # Autotuning multiplies compile time; benchmarks may turn it on explicitly.
    max_autotune: bool = False
    # We capture CUDA graphs ourselves over static buffers; Inductor's cudagraph trees would add a second layer
    # with their own output-lifetime rules.
    inductor_cudagraphs: bool = False

    def __post_init__(self) -> None:
        b = self.batch_buckets
        if not b or any(not isinstance(x, int) or x <= 0 for x in b) or list(b) != sorted(set(b)):
            raise ConfigError(f"batch_buckets: must be increasing positive integers, got {b!r}")
        if not isinstance(self.max_seq_len, int) or self.max_seq_len <= 0:
            raise ConfigError(f"max_seq_len: must be a positive integer, got {self.max_seq_len!r}")
        if self.recompile_limit < 2 * len(b):
            raise ConfigError(f"recompile_limit: must be >= 2 * len(batch_buckets) = {2 * len(b)}")


@contextlib.contextmanager
def applied(options: CompileOptions):
    """Apply `options` to Dynamo and Inductor for the duration of the block (compilation happens at first call)."""
    with torch._dynamo.config.patch(recompile_limit=options.recompile_limit, cache_size_limit=options.recompile_limit,
                                    fail_on_recompile_limit_hit=True, automatic_dynamic_shapes=options.dynamic), \
            torch._inductor.config.patch({"max_autotune": options.max_autotune,
                                          "triton.cudagraphs": options.inductor_cudagraphs}):
        yield
