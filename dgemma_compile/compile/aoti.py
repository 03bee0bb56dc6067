"""A compile unit's graph as an AOTInductor package: what the compile cache stores, and how a later process runs it
without importing Dynamo or Inductor.

Why AOTInductor: a step saved as Inductor's own artifact (`standalone_compile(..., aot=True)`, loaded with
`CompiledArtifact.load`) unpickles AOTAutograd's wrappers and Inductor's output code, and that imports
`torch._inductor.compile_fx` and what it imports (select_algorithm, lowering, Dynamo): 0.8-2.4 s of a warm load on
a 2-core CPU, against ~0.02 s for the step itself (bench/results/startup_cpu_*.md). An AOTInductor package is a
shared library with a C++ wrapper (`torch._C._aoti`, part of libtorch), so loading it is an unzip and a `dlopen`: no Python
compiler module runs. Its kernels are Inductor's, generated from the same graph under the same config and
decompositions; on the demo's step they give the same bits as the in-process compile (tests/compile/test_aoti.py),
and its C++ wrapper calls them with less per-call overhead than AOTAutograd's Python wrapper (1.20 against 1.41 ms
a demo B1 step on 2 cores).

How a unit's graph becomes one (`compile_package`): Dynamo's graph of a step takes every tensor it reads as an
input (the model's parameters and buffers, the bucket's buffers) and returns nothing: its effects are in-place
writes to those inputs. `torch.export` (non-strict: the graph is already traced) turns it into an ExportedProgram
whose graph keeps the writes; `run_decompositions` with the unit's decomposition table (Inductor's default and, when
the MoE op is traced, `dgemma::moe_experts`'s) functionalizes it (each write becomes a user-input mutation);
`torch._inductor.aot_compile` compiles that, writing the mutations back in place, and `package_aoti` zips the
library. `aoti_compile_and_package` is not used: it also serializes the ExportedProgram into the package, and
torch 2.13's serializer refuses FlexAttention's block-mask arguments; the library alone is what runs.

Loading (`load`) uses `torch._C._aoti.AOTIModelPackageLoader` directly, as `torch._inductor.package.load_package`
does, because importing `torch._inductor.package` imports Inductor (1.2 s), which is what this module avoids.

A cost: torch's binding of the runner's `run` (2.11-2.13) holds the GIL while the step runs, where the in-process
compile's C++ wrapper released it. A thread beside the step (the server's HTTP loop beside its engine) waits for it:
one step at most (the demo's: ~1-2 ms; the scaled model's: ~0.2 s on 2 cores). On CUDA the step is a CUDA graph
replay. `CompileOptions(artifact_cache=False)` compiles in process instead.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger("dgemma_compile")

MODEL_NAME = "model"
"""The model's name inside a package (`package_aoti`'s default, which `load_package` reads)."""


class _Effects(torch.nn.Module):
    """Dynamo's graph as a module for `torch.export`: calls it on the flat inputs and returns nothing (the graph's
    effects are its in-place writes)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, *inputs):
        self.gm(*inputs)
        return ()


def compile_package(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], decompositions: dict,
                    path: str | Path) -> tuple[dict[str, float], set[int]]:
    """Compile Dynamo's graph `gm` of a unit (no outputs; effects by in-place writes to its inputs) into an
    AOTInductor package at `path`, under the Inductor config in effect (the caller patches it) and `decompositions`
    (a table as `compile_fx(..., decompositions=)` takes). The example inputs are not written: on CPU only their
    metadata is read; on CUDA, Inductor's AOT compile runs the graph once for its kernels' tuning, on copies of the
    inputs it mutates (extra device memory for those, e.g. the KV cache, while compiling).

    Returns: the seconds spent per stage ({"export", "decompose", "compile"}) and the positions of the inputs the
    graph writes (a set).
    Raises: whatever torch.export or Inductor raise for a graph they cannot take (the caller, `UnitFactory._package`,
    logs it and saves Inductor's own artifact instead).
    """
    import torch._dynamo.config
    from torch._inductor import aot_compile
    from torch.export.graph_signature import InputKind
    from torch._inductor.package import package_aoti

    seconds = {}
    start = time.perf_counter()
    # - outside Dynamo's tracing context (a backend runs inside it): export makes its own fake tensors, and would
    #   otherwise find Dynamo's fake mode and refuse the graph's real constants;
    # - fake_tensor_cache_enabled off: with it, torch 2.13's non-strict export of FlexAttention's mask_mod (a
    #   captured tensor indexed by the symbolic block indices) fails on a cached SymInt "not tracked with proxy"
    #   (the demo's step at the default max_seq_len); without it, the same graph exports
    with torch._guards.tracing(None), torch.no_grad(), torch._dynamo.config.patch(fake_tensor_cache_enabled=False), \
            warnings.catch_warnings():
        # torch 2.13's own pytree code warns about its own deprecated LeafSpec check while exporting: not ours to fix
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        exported = torch.export.export(_Effects(gm), tuple(example_inputs), strict=False)
        seconds["export"] = time.perf_counter() - start
        start = time.perf_counter()
        exported = exported.run_decompositions(dict(decompositions))
        seconds["decompose"] = time.perf_counter() - start
        signature = exported.graph_signature
        users = [spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT]
        written = set(signature.user_inputs_to_mutate.values())
        mutated = {i for i, name in enumerate(users) if name in written}
        start = time.perf_counter()
        # a metadata dict of its own: AOTInductor writes the device and ISA into the one in effect, which would
        # otherwise leave Inductor's default changed for the rest of the process (and in `artifacts.ambient_config`)
        files = aot_compile(exported.module(), tuple(example_inputs),
                            options={"aot_inductor.package": True, "aot_inductor.metadata": {}})
        package_aoti(str(path), files)
    seconds["compile"] = time.perf_counter() - start
    return seconds, mutated


class StepPackage:
    """A loaded package: `step(*inputs)` runs the unit's graph on the flat inputs, in place, and returns `()` (what
    Dynamo's graph of the unit returns). `inputs` are the tensors of the compile, in order (the same dtypes, shapes,
    strides and devices: `artifacts.resolve_inputs` checks a loaded entry's before it is called)."""

    def __init__(self, path: str | Path, device: torch.device):
        # one runner; run_single_threaded on CUDA, where the step is captured and replayed as a CUDA graph (the
        # runner's own stream synchronization would break the capture); a step is only ever called from one thread
        device = torch.device(device)
        index = device.index if device.index is not None else -1
        # on CUDA under the device's own context: the runner's constructor selects its device and does not restore
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            self.runner = torch._C._aoti.AOTIModelPackageLoader(str(path), MODEL_NAME, device.type == "cuda", 1,
                                                                index)
        self.path = str(path)
        """The file loaded (the runner extracted it: the file may be removed, as `UnitFactory._save` does)."""

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        self.runner.run(list(inputs))
        return ()


def load(path: str | Path, device: torch.device) -> StepPackage:
    """The package at `path`, loaded for `device` (its library extracted and `dlopen`ed; no compiler module
    imported).
    Raises: RuntimeError from torch for a file that is not a package of this torch's format."""
    return StepPackage(path, device)
