"""Compiled units: a zero-argument step over static buffers, `torch.compile`d under `CompileOptions`, optionally
replayed as a CUDA graph; and `UnitFactory`, which makes them and counts their Inductor compiles.

A unit is the unit of compilation (STYLE.md principle 3): `denoise_step` and `encoder_chunk` per batch bucket in the
generator, the prefill chunk and one-token step in the AR baseline. Its function reads and writes only static
buffers captured by the closure, so every call runs the same graph and a CUDA graph can replay it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import torch

from .options import CompileOptions, applied

log = logging.getLogger("dgemma_compile")


class CudaGraphs:
    """The CUDA-graph calls a `CompiledUnit` makes, behind one seam (tests substitute a fake on CPU)."""

    def pool(self):
        """A memory pool shared by the graphs of one factory."""
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], None], pool):
        """Record `fn`'s kernels into a graph (capture does not execute them); returns an object with `replay()`."""
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph


class CompiledUnit:
    """A zero-argument step over static buffers, `torch.compile`d under `options`. With `graphs`, the third call
    onwards replays a CUDA graph captured after the second (warm) call; a failed capture is logged and the unit
    keeps running compiled without a graph (`graph_error` says why). Never a silent fallback."""

    def __init__(self, name: str, fn: Callable[[], None], options: CompileOptions, *, backend="inductor",
                 graphs: CudaGraphs | None = None, graph_pool=None):
        self.name, self.fn, self.options = name, fn, options
        self.compiled = torch.compile(fn, fullgraph=options.fullgraph, dynamic=options.dynamic, backend=backend)
        self.graphs, self.graph_pool = graphs, graph_pool
        self.calls = 0
        self.graph = None
        self.graph_error: str | None = None

    def __call__(self) -> None:
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return
        with applied(self.options):
            self.compiled()
        if self.graphs is not None and self.graph_error is None and self.calls == 2:
            self._capture()

    def _capture(self) -> None:
        """Capture after the second warm call. Capture records the kernels without running them, so the step that
        just ran compiled is not applied twice; later calls replay the graph over the same static buffers."""

        def run() -> None:
            with applied(self.options):
                self.compiled()

        try:
            self.graph = self.graphs.capture(run, self.graph_pool)
            log.info("captured CUDA graph for %s", self.name)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back, loudly
            self.graph_error = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph capture failed for %s (%s); running it compiled without a graph",
                        self.name, self.graph_error)


class UnitFactory:
    """Makes `CompiledUnit`s for one device under one `CompileOptions`, counting each unit's Inductor compiles
    (`compiles[name]`; above one means a recompile) and their seconds (`compile_seconds`, Dynamo tracing excluded).

    CUDA graphs are used when `options.cuda_graphs` and the device is CUDA, or when `graphs` is given (a fake for
    tests).
    """

    def __init__(self, options: CompileOptions, device: torch.device | str, graphs: CudaGraphs | None = None):
        self.options = options
        use = graphs is not None or (options.cuda_graphs and torch.device(device).type == "cuda")
        self.graphs = (graphs or CudaGraphs()) if use else None
        self.graph_pool = self.graphs.pool() if self.graphs is not None else None
        self.compiles: Counter = Counter()
        self.compile_seconds = 0.0

    def backend(self, name: str):
        """Inductor with our decompositions (`ops.moe.moe_decompositions`: a "grouped" or "dense"
        `dgemma::moe_experts` is traced into the graph), counting compiles of unit `name` and their seconds."""
        from torch._inductor.compile_fx import compile_fx

        from ..ops.moe import moe_cache_key, moe_decompositions

        def backend(gm: torch.fx.GraphModule, example_inputs):
            start = time.perf_counter()
            self.compiles[name] += 1
            with moe_cache_key():
                out = compile_fx(gm, example_inputs, decompositions=moe_decompositions(gm))
            self.compile_seconds += time.perf_counter() - start
            return out

        return backend

    def unit(self, name: str, fn: Callable[[], None]) -> CompiledUnit:
        """A compiled unit named `name` running `fn` (zero arguments, over static buffers)."""
        return CompiledUnit(name, fn, self.options, backend=self.backend(name), graphs=self.graphs,
                            graph_pool=self.graph_pool)
