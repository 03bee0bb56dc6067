"""Compiled units: a zero-argument step over static buffers, `torch.compile`d under `CompileOptions`, optionally
replayed as a CUDA graph; and `UnitFactory`, which makes them and counts their Inductor compiles.

A unit is the unit of compilation: the step (`mixed_step.mixed_step`) of one batch size of a bucket in the generator
(`step[B{b}_{tag}]`), the prefill chunk and one-token step in the AR baseline (bench/ar.py). Its function reads and
writes only static buffers captured by the closure, so every call runs the same graph and a CUDA graph can replay it.

Guards: each unit has its own Dynamo cache (`isolate_recompiles`), holding one entry. With
`CompileOptions.skip_guards`, calls after the first run under Dynamo's `skip_guard_eval_unsafe` (`guards_skipped`, only
inside the unit's call). In torch 2.13 that keeps only the tensor guards (dtype, device, shape, stride) of inputs that
are not `nn.Parameter`s -- the static buffers -- and drops the rest: the parameters' tensor guards and every guard on
Python values (the model's attributes, closure constants, global state such as grad mode). What could change under a
unit is the model (the buffers are updated in place and stay guarded): `ModelFingerprint` records it at build time and
the generator checks it once per `generate`/`warmup` call. bench/overhead.py measures what the guards cost.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .options import CompileOptions, applied

if TYPE_CHECKING:
    from .artifacts import ArtifactStore

log = logging.getLogger("dgemma_compile")


_SKIPPED_GUARDS_RECOMPILE = "Recompilation triggered with skip_guard_eval_unsafe"
"""How torch 2.13 refuses to compile under `skip_guard_eval_unsafe` (no entry passed the guards it keeps)."""


@contextlib.contextmanager
def guards_skipped():
    """Dynamo's `skip_guard_eval_unsafe` for the duration of the block, keeping the current stance (e.g. a caller's
    "fail_on_recompile") and restoring it on exit. The stance is process-global and torch 2.13 has no public getter,
    so the current one is read from the private `torch._dynamo.eval_frame._stance` (a `DynamoStance`)."""
    import torch._dynamo.eval_frame  # here, not at module level: `build` imports no Dynamo until something compiles

    prior = torch._dynamo.eval_frame._stance
    with torch.compiler.set_stance(prior.stance, skip_guard_eval_unsafe=True, force_backend=prior.backend):
        yield


class ModelChangedError(RuntimeError):
    """The model changed after `build()`: the compiled units (and CUDA graphs) were made for the old one."""


_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _constant_types() -> tuple[type, ...]:
    """The types of a value Dynamo may specialise on and `ModelFingerprint` records: a plain constant
    (`_CONSTANTS`) or an expert projection's `ExpertFormat` (a frozen value object: compared, and keyed by its repr,
    by value). Not every frozen dataclass: some hold a process group (`parallel.TensorParallel`, `VocabShard`), whose
    repr is an address."""
    from ..kernels.moe.formats import ExpertFormat

    return (*_CONSTANTS, ExpertFormat)


@dataclass(frozen=True)
class ModelFingerprint:
    """What compiled units assume of the model they read: per parameter and buffer (by name) its dtype, device, shape,
    stride and data pointer, and the plain constant attributes (head counts, eps, `attention`, ...) of the model's own
    modules, which Dynamo specialises on (torch.nn's modules are left out: their attributes follow from their
    weights' shapes; so is `training`: the model never reads it).

    A data pointer matters to CUDA graphs (they replay fixed addresses) and shows a replaced tensor; dtype, device and
    shape matter to every compiled graph, and a skipping call checks none of them for parameters. `entries` holds one
    tuple per tensor (kind, name, dtype, device, shape, stride, data_ptr) or attribute ("attribute", name, value); one
    pass over the modules, ~0.25 ms for the demo model on a 2-core CPU, once per generate call."""

    entries: tuple

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelFingerprint":
        constant = _constant_types()
        out = []
        for prefix, mod in model.named_modules():
            dot = prefix + "." if prefix else ""
            for kind, tensors in (("parameter", mod._parameters), ("buffer", mod._buffers)):
                for k, t in tensors.items():
                    if t is not None:
                        out.append((kind, dot + k, t.dtype, t.device, tuple(t.shape), t.stride(), t.data_ptr()))
            if not type(mod).__module__.startswith("torch."):
                out += [("attribute", dot + k, v) for k, v in vars(mod).items()
                        if k[0] != "_" and k != "training" and isinstance(v, constant)]
        return cls(entries=tuple(out))

    def changes(self, model: torch.nn.Module) -> list[str]:
        """What differs in `model` now, one line per tensor or attribute (empty: unchanged)."""
        now = ModelFingerprint.of(model)
        if now.entries == self.entries:
            return []
        old, new = ({e[:2]: e[2:] for e in f.entries} for f in (self, now))
        fields = ("dtype", "device", "shape", "stride", "data_ptr")
        out = []
        rank = {"parameter": 0, "buffer": 1, "attribute": 2}
        for key in sorted(old.keys() | new.keys(), key=lambda k: (rank[k[0]], k[1])):
            label = " ".join(key)
            a, b = old.get(key), new.get(key)
            if a is None or b is None:
                out.append(f"{label} {'added' if a is None else 'removed'}")
            elif key[0] == "attribute" and (type(a[0]) is not type(b[0]) or a != b):
                out.append(f"{label}: {a[0]!r} -> {b[0]!r}")
            elif a != b:
                out.append(f"{label}: " + ", ".join(f"{f} {hex(x) if f == 'data_ptr' else x} -> "
                                                     f"{hex(y) if f == 'data_ptr' else y}"
                                                     for f, x, y in zip(fields, a, b) if x != y))
        return out

    def check(self, model: torch.nn.Module) -> None:
        """Raises:
            ModelChangedError: `model` differs from this fingerprint, naming the first changes."""
        changes = self.changes(model)
        if changes:
            more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
            raise ModelChangedError("model changed since build(): " + "; ".join(changes[:3]) + more +
                                    "; the compiled units were made for the old model: build a new generator")


def static_tensors(*owners) -> list[torch.Tensor]:
    """Every tensor `owners` hold: a tensor itself (the generator's units list their buffers explicitly,
    `row_table.Bucket.tensors`); an `nn.Module`'s parameters and buffers; for any other object, its tensor
    attributes and the tensors in its list/tuple attributes."""
    out: list[torch.Tensor] = []
    for owner in owners:
        if isinstance(owner, torch.Tensor):
            out.append(owner)
            continue
        if isinstance(owner, torch.nn.Module):
            out += list(owner.parameters()) + list(owner.buffers())
            continue
        for value in vars(owner).values():
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, (list, tuple)):
                out += [v for v in value if isinstance(v, torch.Tensor)]
    return out


@dataclass
class CompiledGraph:
    """One graph a unit's backend compiled: Inductor's callable (AOTAutograd's forward, positional tensors in the
    Dynamo graph's input order, input mutations applied by its runtime wrapper), the real tensors Dynamo gathered as
    that graph's inputs on the call that compiled it, and how many outputs the graph returns."""

    fn: Callable
    inputs: list
    num_outputs: int


@dataclass
class DirectCall:
    """A unit's steady-state call without Dynamo: the one compiled graph applied to the tensors it was compiled with
    (CPU's counterpart of a CUDA-graph replay). `buffer_ids`: the identities of the tensors the unit's non-module
    owners (the bucket's buffers) held when it was set up; modules are covered by the generator's `ModelFingerprint`
    (a replaced parameter changes its data pointer, shape or dtype, which the fingerprint check refuses)."""

    call: Callable[[], object]
    buffer_ids: tuple = field(repr=False)


class CudaGraphs:
    """The CUDA-graph calls a `CompiledUnit` makes, behind one seam (tests substitute a fake on CPU)."""

    def pool(self):
        """A memory pool shared by the graphs of one factory."""
        return torch.cuda.graph_pool_handle()

    def warm_up(self, fn: Callable[[], None]) -> None:
        """Run `fn` once on a side stream (lazy library initialisation, autotuning; what CUDA-graph capture needs
        done before it), then join the current stream."""
        side, current = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
        current.wait_stream(side)

    def capture(self, fn: Callable[[], None], pool):
        """Record `fn`'s kernels into a graph (capture does not execute them); returns an object with `replay()`.
        `capture_error_mode="thread_local"`: only this thread's CUDA calls are checked while capturing (another
        thread -- the server's -- may call CUDA meanwhile)."""
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            fn()
        return graph


def compile_isolated(fn: Callable, **kwargs) -> Callable:
    """`torch.compile(fn, isolate_recompiles=True, **kwargs)`: `fn` gets its own Dynamo cache. torch 2.11 (the GPU
    machine's) has no `isolate_recompiles`: there Dynamo, which keeps its cache on the code object, compiles a copy of
    `fn` with its own copy of the code object, which isolates it the same way (a function or a bound method; anything
    else is compiled as it is, sharing its code object's cache)."""
    if "isolate_recompiles" in _compile_parameters():
        return torch.compile(fn, isolate_recompiles=True, **kwargs)
    return torch.compile(_own_code(fn), **kwargs)


@functools.cache
def _compile_parameters() -> frozenset[str]:
    import inspect

    return frozenset(inspect.signature(torch.compile).parameters)


def _own_code(fn: Callable) -> Callable:
    """A copy of `fn` whose code object is its own (`code.replace()` makes a new one), same globals, closure,
    defaults and attributes."""
    import types

    if isinstance(fn, types.MethodType):
        return types.MethodType(_own_code(fn.__func__), fn.__self__)
    if not isinstance(fn, types.FunctionType):
        return fn
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    return copy


class CompiledUnit:
    """A zero-argument step over static buffers, `torch.compile`d under `options`, that decides once how it is
    called (`strategy`): after its first call -- `prepare()` at warm-up, or the first real call -- it replays a CUDA
    graph ("cuda graph", with `graphs`: captured right then), calls its compiled graph directly ("direct", CPU's
    counterpart; `_go_direct`), or goes through Dynamo ("dynamo", guards skipped per `options.skip_guards`). A failed
    capture or a refused direct call is logged with its reason (`graph_error`, `direct_refused`) and the next
    strategy taken; never a silent fallback. `check_owners` may send a direct unit back through Dynamo.

    The unit has its own Dynamo cache (`isolate_recompiles`: the step functions of all buckets share one code object,
    so without it every bucket's entry would be searched on every call). With `options.skip_guards`, every call after
    the first successful one skips guard evaluation (all but the buffers' tensor guards), inside this call only
    (`guards_skipped`); a call whose kept guards fail, or whose entry is gone (`torch._dynamo.reset()`), is refused by
    torch before anything runs, then logged and rerun with every guard, which recompiles."""

    def __init__(self, name: str, fn: Callable[[], None], options: CompileOptions, *, backend="inductor",
                 graphs: CudaGraphs | None = None, graph_pool=None, compiled_graphs: list[CompiledGraph] | None = None,
                 owners: tuple = (), artifact: "ArtifactSlot | None" = None):
        self.name, self.fn, self.options = name, fn, options
        self._backend = backend
        self._compiled = None  # `compiled`, made on first use: a loaded or held unit never imports Dynamo
        self.graphs, self.graph_pool = graphs, graph_pool
        self.calls = 0
        self.warm = False  # a call completed: the unit's cache entry exists, so guards may be skipped
        self.graph = None
        self.graph_error: str | None = None
        # direct calls (`options.direct_calls`): what the backend compiled, and the objects holding every tensor the
        # unit may read (the model, the bucket's buffers)
        self.compiled_graphs = compiled_graphs
        self.owners = owners
        self.direct: DirectCall | None = None
        self.direct_refused: str | None = None  # why the unit's calls go through Dynamo (None: direct, or not tried)
        self.strategy: str | None = None
        """How calls run, decided once after the first call: "cuda graph", "direct" or "dynamo"."""
        self.artifact = artifact
        self.cacheable = artifact is not None  # the compile cache can hold this unit's step
        self.key = artifact.key if artifact is not None else None  # its compile-cache key
        self.held = False
        self._preloaded = False  # `preload` made the direct call; the first call captures it (CUDA graphs)
        """Run `fn` eagerly, neither compiling nor loading, until released (`CompiledGenerator.defer`: the eager step
        answers while a background process compiles); not counted in `calls`."""
        self.source: str | None = None
        """Where the step came from, decided with `strategy`: "loaded" (an artifact of the compile cache: no trace,
        no compile) or "compiled" (Dynamo and Inductor ran, or Inductor's own caches served them)."""

    @property
    def ready(self) -> bool:
        """Whether the step has compiled or loaded and decided how it is called (`strategy`): a driver picks a
        ready batch size over one that would compile now (`row_table.RowTable.warm`)."""
        return self.strategy is not None

    @property
    def compiled(self) -> Callable[[], None]:
        """`torch.compile(fn, ...)` under the unit's options and backend, made on first use."""
        if self._compiled is None:
            o = self.options
            self._compiled = compile_isolated(self.fn, fullgraph=o.fullgraph, dynamic=o.dynamic,
                                              backend=self._backend)
        return self._compiled

    def __call__(self) -> None:
        if self.held:
            with torch.no_grad():
                self.fn()
            return
        self.calls += 1
        if self.strategy is None:
            self._first_call()
            return
        if self.graph is not None:
            self.graph.replay()
        elif self.direct is not None:
            with torch.no_grad():
                self.direct.call()
        elif self.options.skip_guards:
            self._call_skipping_guards()
        else:
            with applied(self.options):
                self.compiled()

    def prepare(self) -> None:
        """Compile and decide the strategy at warm-up, with a call whose effect does not matter (the caller's buffers
        hold no live work, e.g. every row of a bucket idle): on CUDA that call runs on a side stream and the graph is
        captured here, never inside a real request. No-op once decided. Counts as a call."""
        if self.strategy is not None or self.held:
            return
        self.calls += 1
        if self._preloaded or self._load():
            if self.graphs is not None:
                self.graphs.warm_up(self.direct.call)
            self._decide_loaded()
            return
        if self.graphs is not None:
            def run() -> None:
                with applied(self.options):
                    self.compiled()
            self.graphs.warm_up(run)
            self._decide()
        else:
            self._first_call()

    def _first_call(self) -> None:
        """The first call (compiles, and takes effect), then the strategy decision. A capture after it records the
        kernels without running them, so the step is not applied twice. With a compile-cache artifact for the
        unit, that is loaded and called instead (no Dynamo, no compile)."""
        if self._preloaded or self._load():
            with torch.no_grad():
                self.direct.call()
            self._decide_loaded()
            return
        with applied(self.options):
            self.compiled()
        self._decide()

    def preload(self) -> bool:
        """Load the unit's compile-cache artifact now, without calling it (rows may be busy: an engine between
        iterations). Without CUDA graphs the unit is then ready ("direct"); with them, its first call captures. False:
        no artifact (nothing changes, a first call compiles)."""
        if self.strategy is not None or self.held or not self._load():
            return self.source == "loaded"
        if self.graphs is None:
            self.warm, self.strategy = True, "direct"
        else:  # the first call runs it and captures (`_first_call` finds the direct call made)
            self._preloaded = True
        return True

    def _load(self) -> bool:
        """Load the unit's compile-cache artifact (`artifacts.ArtifactStore`) and make its direct call over the
        owners' tensors now; False when there is none (a miss, logged by the store) or the unit has no slot."""
        slot, self.artifact = self.artifact, None  # tried once: a miss compiles, and the compile saves
        if slot is None:
            return False
        loaded = slot.store.load(slot.key, slot.parts, slot.model, slot.tensors)
        if loaded is None:
            return False
        self.direct = DirectCall(call=functools.partial(loaded.fn, *loaded.inputs), buffer_ids=self._buffer_ids())
        self.source = "loaded"
        slot.loads[self.name] += 1
        counts = loaded.meta.get("pass_matches")
        slot.matches[self.name] = PassMatches(counts, "compile cache") if counts is not None else \
            PassMatches(None, "unknown")
        log.info("%s: loaded from the compile cache (%s)", self.name, slot.store.root)
        return True

    def _decide_loaded(self) -> None:
        """After a loaded artifact's first call: capture it as a CUDA graph where graphs are used, else call it
        directly."""
        self.warm = True
        if self.graphs is not None:
            try:
                self.graph = self.graphs.capture(self.direct.call, self.graph_pool)
                self.strategy = "cuda graph"
                return
            except Exception as e:  # noqa: BLE001 - any capture failure falls back, loudly
                self.graph_error = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed for %s (%s); calling it directly", self.name, self.graph_error)
        self.strategy = "direct"

    def _decide(self) -> None:
        self.warm = True
        self.source = "compiled"
        if self.graphs is not None:
            self._capture()
            if self.graph is not None:
                self.strategy = "cuda graph"
                return
        if self.options.direct_calls and self.compiled_graphs is not None:
            self._go_direct()
        self.strategy = "direct" if self.direct is not None else "dynamo"

    def _go_direct(self) -> None:
        """After the first compiled call: from now on call the compiled graph directly, if that is exactly what Dynamo
        would run -- one graph under fullgraph=True (no graph break left Python to run around it), no outputs (the
        step's effects are its in-place writes, which AOTAutograd's wrapper applies), and inputs that are all tensors
        held by the unit's owners (so every later call reads the same tensors; `check_owners` re-checks that once per
        generate call). Otherwise the reason is logged and kept in `direct_refused`, and calls keep going through
        Dynamo. A unit function must have no effect but its tensor writes: a Python side effect (an attribute store of
        a non-tensor, a list append) would run under Dynamo and be skipped by direct calls; the units' step functions
        (`mixed_step.denoise_step`, `mixed_step.encode_chunk`) have none."""
        graphs = self.compiled_graphs
        static = static_tensors(*self.owners)
        ids = {id(t) for t in static}
        if not self.options.fullgraph:
            reason = "fullgraph=False (a graph break would leave code outside the graph)"
        elif len(graphs) != 1:
            reason = f"{len(graphs)} graphs compiled"
        elif graphs[0].num_outputs:
            reason = f"the graph returns {graphs[0].num_outputs} output(s)"
        elif not all(isinstance(t, torch.Tensor) and id(t) in ids for t in graphs[0].inputs):
            reason = "an input is not a tensor of the unit's owners (model, buffers)"
        else:
            g = graphs[0]
            self.direct = DirectCall(call=functools.partial(g.fn, *g.inputs), buffer_ids=self._buffer_ids())
            log.debug("%s: direct calls of its compiled graph (%d inputs)", self.name, len(g.inputs))
            graphs.clear()  # the direct call holds what it needs; later compiles (after a fallback) are not kept
            return
        graphs.clear()
        self.direct_refused = reason
        log.warning("%s: calls go through Dynamo (%s)", self.name, reason)

    def _buffer_ids(self) -> tuple:
        """Per tensor of the non-module owners: identity, storage address, dtype, shape and stride (an in-place
        `set_` or `resize_` keeps the identity but not what the compiled kernels were built for)."""
        return tuple((id(t), t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                     for t in static_tensors(*(o for o in self.owners if not isinstance(o, torch.nn.Module))))

    def check_owners(self) -> None:
        """Once per generate call: if a tensor of the unit's non-module owners was replaced or re-laid-out since direct
        calls began (a bucket buffer rebound, `set_`, `resize_`), go back to calling through Dynamo, which reads the owners afresh. A changed model
        is the generator's `ModelFingerprint` check's to refuse (before this)."""
        if self.direct is not None and self._buffer_ids() != self.direct.buffer_ids:
            self.direct = None
            self.strategy = "dynamo"
            self.direct_refused = "a tensor of the unit's owners was replaced"
            log.warning("%s: a tensor of the unit's owners was replaced; calls go through Dynamo again", self.name)

    def _call_skipping_guards(self) -> None:
        """A warm call with guards skipped, which cannot compile: `applied()`, whose config patches (~0.05 ms) only
        matter when compiling, is left out. A call torch refuses (a kept tensor guard failed, or the entry is gone) is
        logged and rerun with every guard under `applied()` (which compiles)."""
        try:
            with guards_skipped():
                self.compiled()
        except RuntimeError as e:
            if _SKIPPED_GUARDS_RECOMPILE not in str(e):
                raise
            log.warning("%s: no cache entry passed the guards kept when skipping (a buffer changed, or Dynamo's cache "
                        "was reset); rerunning with every guard", self.name)
            with applied(self.options):
                self.compiled()

    def _capture(self) -> None:
        """Capture after the first (warm) call; later calls replay the graph over the same static buffers."""

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


@dataclass
class ArtifactSlot:
    """A unit's place in the compile cache: the store, the key and its readable parts (`artifacts.step_key_parts`),
    the model and the bucket's tensors its graph inputs are named by; `matches`: where a loaded unit reports the pass
    matches recorded with its entry."""

    store: "ArtifactStore"
    key: str
    parts: dict
    model: torch.nn.Module
    tensors: list
    matches: dict = field(default_factory=dict)  # the factory's `pass_matches`, filled for a loaded unit
    loads: Counter = field(default_factory=Counter)  # the factory's `loads`, counted for a loaded unit


@dataclass(frozen=True)
class PassMatches:
    """The graph passes' matches in one unit's latest compile: `counts` {pass name: matches} (None: unknown), and
    where they come from: "compiled" (the passes ran), "cache record" (the compile caches served the compile; the
    counts recorded when its entry was made, `compile.pass_records`) or "unknown" (served with no record)."""

    counts: dict[str, int] | None
    source: str

    def text(self) -> str:
        if self.counts is None:
            return "passes=unknown (served from the compile caches with no record)"
        return "passes=" + (",".join(f"{k}:{v}" for k, v in sorted(self.counts.items())) or "none") + \
            f" ({self.source})"


class UnitFactory:
    """Makes `CompiledUnit`s for one device under one `CompileOptions`, counting each unit's Inductor compiles
    (`compiles[name]`; above one means a recompile) and their seconds (`compile_seconds`, Dynamo tracing excluded).

    CUDA graphs are used when `options.cuda_graphs` and the device is CUDA, or when `graphs` is given (a fake for
    tests).
    """

    def __init__(self, options: CompileOptions, device: torch.device | str, graphs: CudaGraphs | None = None,
                 store: "ArtifactStore | None" = None):
        self.options = options
        self.store = store
        """The compile cache (`artifacts.ArtifactStore`) units with a structure load from and save to; None: off."""
        self.device = torch.device(device)
        use = graphs is not None or (options.cuda_graphs and torch.device(device).type == "cuda")
        self.graphs = (graphs or CudaGraphs()) if use else None
        self.graph_pool = self.graphs.pool() if self.graphs is not None else None
        self.compiles: Counter = Counter()
        self.loads: Counter = Counter()  # per unit name, steps loaded from the compile cache (no compile)
        self.compile_seconds = 0.0
        self.pass_matches: dict[str, PassMatches] = {}  # per unit name, its latest compile

    def backend(self, name: str, sink: list[CompiledGraph] | None = None, slot: ArtifactSlot | None = None):
        """Inductor with our decompositions (`kernels.moe.op.moe_decompositions`: a "grouped", "dense" or "gathered"
        `dgemma::moe_experts` is traced into the graph), our graph passes (`passes`, minus
        `CompileOptions.disabled_passes`) and `CompileOptions.inductor_config` for the factory's device, counting
        compiles of unit `name` and their seconds and the passes' matches (`pass_matches`); each compiled graph is
        appended to `sink` if given. With a compile-cache `slot`, the graph is compiled by AOTInductor (`_package`: the
        same kernels, as a package that loads without the compiler), or where it cannot be by `standalone_compile(...,
        aot=True)` (Inductor's own saveable compile), and saved as the unit's artifact. With a cache (`store`),
        every graph's C++ is built through its C++ store (`cpp_store`), slot or not, so that a new venv rebuilds
        none. Inductor and the passes are imported when a graph compiles (an eager or loaded step
        never imports them)."""

        def backend(gm: torch.fx.GraphModule, example_inputs):
            from torch._inductor.compile_fx import compile_fx

            from . import lowerings, passes
            from ..kernels.moe.op import graph_moe_calls, moe_cache_key, moe_decompositions
            from . import pass_records as records

            lowerings.register()
            start = time.perf_counter()
            self.compiles[name] += 1
            pass_config = passes.inductor_config(self.options.disabled_passes, self.options.pass_settings())
            config = {**self.options.inductor_config(self.device.type), **pass_config}
            # every compile's C++ through the cache's C++ store, also the steps the cache cannot hold (quantized
            # weights, `artifact_cache=False`): their Inductor graph cache hits in a new venv, and then its g++ builds
            store = self.store.cpp_builds(self.device) if self.store is not None else contextlib.nullcontext()
            decompositions = moe_decompositions(gm)
            traced_moe = decompositions.decompose_moe and bool(graph_moe_calls(gm))  # the op traced into gm
            with moe_cache_key(traced_moe), passes.cache_key(pass_config), \
                    torch._inductor.config.patch(config), passes.recording() as counts, store:
                key = records.record_key(gm, example_inputs, pass_config)  # before compile_fx changes gm
                saveable = slot is not None and self._saveable(slot, gm, example_inputs)
                out = self._package(slot, gm, example_inputs, decompositions) if saveable else None
                if out is None:
                    counts.clear()  # a package tried and refused: its passes' matches are not this compile's
                    if saveable:  # Inductor's own saveable compile: its load imports the compiler (~1-2 s)
                        out = torch._inductor.standalone_compile(
                            gm, example_inputs, dynamic_shapes="from_example_inputs", aot=True,
                            options={"decompositions": decompositions})
                    else:
                        out = compile_fx(gm, example_inputs, decompositions=decompositions)
            if not pass_config:
                self.pass_matches[name] = PassMatches({}, "no pass enabled")
            elif counts:  # the passes ran: Inductor compiled this graph
                records.save(key, counts)
                self.pass_matches[name] = PassMatches(dict(counts), "compiled")
            else:  # served by the compile caches: the counts recorded when the entry was made, if any
                saved = records.load(key)
                self.pass_matches[name] = PassMatches(saved, "cache record" if saved is not None else "unknown")
            self.compile_seconds += time.perf_counter() - start
            if saveable:
                self._save(slot, out, example_inputs)
            if sink is not None:
                (output,) = gm.graph.find_nodes(op="output")
                result = output.args[0]
                sink.append(CompiledGraph(fn=out, inputs=list(example_inputs),
                                          num_outputs=len(result) if isinstance(result, (tuple, list)) else 1))
            return out

        return backend

    def _saveable(self, slot: ArtifactSlot, gm: torch.fx.GraphModule, example_inputs) -> bool:
        """Whether `gm` is what a direct call of the unit runs, so that the cache can hold it: the unit's first
        compile, no outputs, every input a tensor of the model or the bucket (`artifacts.input_names`); else logged."""
        from .artifacts import input_names

        (output,) = gm.graph.find_nodes(op="output")
        result = output.args[0]
        if self.compiles[slot.parts["unit"]] > 1 or (isinstance(result, (tuple, list)) and len(result)) or \
                input_names(list(example_inputs), slot.model, slot.tensors) is None:
            log.info("%s: not saved to the compile cache (a recompile, an output, or an input outside the model and "
                     "bucket)", slot.parts["unit"])
            return False
        return True

    def _package(self, slot: ArtifactSlot, gm: torch.fx.GraphModule, example_inputs, decompositions):
        """Compile `gm` into an AOTInductor package (`aoti.compile_package`), load it and run it once on copies of
        the inputs it writes. None when torch cannot export, package, load or run it (logged with the reason: e.g.
        torch 2.13's AOTInductor cannot call an `aten::index_add` fallback, which a bfloat16 MoE step on CPU has);
        the caller then compiles it with Inductor's own saveable artifact instead."""
        from . import aoti

        unit = slot.parts["unit"]
        path = slot.store.scratch(".pt2")
        try:
            seconds, mutated = aoti.compile_package(gm, example_inputs, decompositions, path)
            package = aoti.load(path, self.device)
            # one trial run on copies of the inputs it writes (the step's state is left as it is): a package that
            # loads but cannot run (an opaque op its C++ wrapper cannot call) is refused here, never saved
            package(*(x.clone() if i in mutated else x for i, x in enumerate(example_inputs)))
        except Exception as e:  # noqa: BLE001 - a graph torch cannot export, package or run gets Inductor's artifact
            path.unlink(missing_ok=True)
            log.warning("%s: AOTInductor could not package its graph (%s: %s); saved as Inductor's own artifact "
                        "instead (its load imports the compiler: ~1-2 s)", unit, type(e).__name__,
                        (str(e).splitlines() or [""])[0][:300])
            return None
        log.debug("%s: packaged (%s)", unit, ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
        return package

    def _save(self, slot: ArtifactSlot, out, example_inputs) -> None:
        """Save `out` as `slot`'s artifact: a package (`aoti.StepPackage`, from `_package`: its file, removed once
        copied) or Inductor's `CompiledArtifact`."""
        from . import aoti
        from .artifacts import input_names

        counts = self.pass_matches.get(slot.parts["unit"])
        package = isinstance(out, aoti.StepPackage)
        try:
            slot.store.save(slot.key, slot.parts, Path(out.path) if package else out,
                            input_names(list(example_inputs), slot.model, slot.tensors), list(example_inputs),
                            extra={"pass_matches": counts.counts if counts is not None else None})
        finally:
            if package:
                Path(out.path).unlink(missing_ok=True)

    def slot(self, name: str, owners: tuple, structure: dict | None) -> ArtifactSlot | None:
        """The compile-cache slot of a unit whose owners are (model, *bucket tensors), or None: no store, no
        `structure`, `options.artifact_cache` or `options.direct_calls` off (a loaded step is only ever called
        directly)."""
        if self.store is None or structure is None or not self.options.artifact_cache or \
                not self.options.direct_calls or not owners or not isinstance(owners[0], torch.nn.Module):
            return None
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if any(is_traceable_wrapper_subclass(p) for p in owners[0].parameters()):
            log.info("%s: not in the compile cache (tensor-subclass weights, e.g. torchao's quantized ones: the cache "
                     "holds plain-tensor steps only); compiled in this process", name)
            return None
        from .artifacts import step_key, step_key_parts

        model, tensors = owners[0], list(owners[1:])
        parts = step_key_parts(options=self.options, model=model, unit=name, structure=structure, tensors=tensors)
        return ArtifactSlot(store=self.store, key=step_key(parts), parts=parts, model=model, tensors=tensors,
                            matches=self.pass_matches, loads=self.loads)

    def unit(self, name: str, fn: Callable[[], None], owners: Iterable = (), structure: dict | None = None
             ) -> CompiledUnit:
        """A compiled unit named `name` running `fn` (zero arguments, over static buffers). `owners`: the objects
        holding every tensor `fn` reads (the model, the bucket's buffers); with them, and `options.direct_calls`, the
        unit calls its compiled graph directly after the first call (`CompiledUnit._go_direct`). `structure`: what
        else decides the unit's graph (its bucket's structural config); with it, and a `store`, the unit loads its
        step from the compile cache or saves it there (owners = (model, *bucket tensors))."""
        sink: list[CompiledGraph] = []
        owners = tuple(owners)
        slot = self.slot(name, owners, structure)
        return CompiledUnit(name, fn, self.options, backend=self.backend(name, sink, slot), graphs=self.graphs,
                            graph_pool=self.graph_pool, compiled_graphs=sink if owners else None, owners=owners,
                            artifact=slot)
