"""`CompileOptions`: every Dynamo/Inductor knob dgemma_compile uses, each with its reason, and `applied()`, the one
function that applies them (only around our own compiled calls; nothing is set at import time)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from ..kernels.moe.op import MOE_IMPLS
from ..model.config import DEFAULT_MAX_SEQ_LEN, FULL, SLIDING, ConfigError
from ..model.plan import QUERY_KINDS
from .passes import check_names


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
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    # Static width of the per-row temperature table (its shape is part of the graph): the most denoise steps per
    # block a request may ask for. The reference default is 48; vLLM-style fixed runs use 16.
    max_denoising_steps: int = 256
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
    # The MoE experts' implementation in compiled units. "auto" = kernels.moe.op.resolve_moe_impl's rule ("grouped" for
    # bfloat16 with E/K > 4, else "gathered"): traceable, so no opaque, host-syncing expert loop runs inside a step.
    moe_impl: str = "auto"
    # Inductor's wrapper code (buffer allocation and the kernel calls of one compiled graph) in C++ instead of Python.
    # On CPU the Python wrapper is a sizeable share of a small model's step: the demo's denoise step at B=1 went from
    # 1.64 to 1.42 ms (bench/results/demo_cpu_*.md). None = on for CPU graphs, off for CUDA graphs, whose kernels
    # replay from a CUDA graph without running the wrapper.
    cpp_wrapper: bool | None = None
    # After a unit's first call, call its compiled graph directly over the tensors it was compiled with, without
    # Dynamo (no frame evaluation, guard check or input gathering): CPU's counterpart of a CUDA-graph replay. Sound
    # because a unit reads only the model and its bucket's buffers, updated in place: `units.CompiledUnit._go_direct`
    # checks that the graph's inputs are exactly those tensors, the generator checks the model's fingerprint and the
    # owners' tensors once per generate call. The demo's denoise step at B=1: 1.44 -> 1.33 ms (bench.overhead).
    direct_calls: bool = True
    # Skip Dynamo's guard evaluation (all but the static buffers' tensor guards) inside our units' calls once each
    # unit has compiled: at bucket B=1 the guards cost a sizeable share of a demo denoise step
    # (bench/results/overhead_cpu_*.md). Sound because a unit reads only its static buffers and the model, whose
    # fingerprint the generator checks once per generate call (`units.ModelFingerprint`). Off: Dynamo sees, and
    # `fail_on_recompile` catches, every would-be recompile.
    skip_guards: bool = True
    # Commit fusion: run each block's commit inside the next block's first denoise step, one forward of 2C tokens
    # (`mixed_step.denoise_step(commit=True)`, a third compile unit per bucket; the cache gets 2C block slots): one
    # forward and one unit call fewer per block. Tokens equal the unfused run's up to float reduction order. None =
    # on for CUDA, off for CPU: at batch 1 a GPU forward is bound by reading the weights, so a 2C-token forward
    # costs about one C-token forward (not yet measured: no GPU run); on CPU the demo gained no wall time per canvas
    # (0.96-0.99x, bench/results/commit_fusion_cpu_2026-11-30.md) and the extra unit doubled the compile time.
    fuse_commit: bool | None = None
    # Our graph passes (`compile.passes.PASS_NAMES`, run inside each unit's Inductor compile) to leave out, by name. All run by
    # default: each rewrite is value-preserving up to float reduction order and checked token-equal with it off
    # (tests/compile/test_passes.py). `sample_step_fusion` replaces the vocabulary-wide region of the denoise step with
    # `dgemma::sample_step`, whose CPU implementation works in slices of positions (bounded transient memory).
    disabled_passes: tuple[str, ...] = ()
    # A forward in which no row samples (prefill chunks and unfused commits only: on CPU every block of a lone request
    # after the first begins with a commit-only forward) skips the vocabulary region (the lm_head, the sampler, the
    # self-conditioning product, logprobs): `torch.cond` on "some row steps" inside the one step (`mixed_step.mixed_step`);
    # tokens unchanged (that region's outputs are read only for rows that stepped; bench/results/idle_vocabulary_*).
    # None = on for CPU, off for CUDA: Inductor lowers `torch.cond` to a host read of the predicate
    # (`codegen_conditional`, torch 2.11-2.13), which a CUDA graph cannot capture; and off for a model with
    # tensor-subclass weights (torchao's quantized ones), for which torch 2.13's `torch.cond` has no rule.
    skip_idle_vocabulary: bool | None = None
    # `sample_step_fusion` rewrites a region only when its logits, counted as float32, span at least this many bytes
    # (B x C x V x 4). The op exists to bound the region's memory at the released vocabulary; its CPU implementation
    # is eager torch over slices, which at the demo's size costs more than Inductor's fused loops (forced on, the
    # demo step went 1.27 -> 1.70 ms; bench/results/passes_cpu_*.md). 256 MiB = the released vocabulary (256 x
    # 262,144) at every batch size; the demo and the scaled bench model stay with Inductor's loops. 0: always.
    sample_step_fusion_min_bytes: int = 256 * 2**20
    # Batch-invariant rows: each row's logits bitwise equal to its solo run's whatever the bucket and its batch mates
    # (tests/step/test_batch_invariance.py; issue 15). What it takes: fixed shapes (every bucket's cache holds
    # `max_seq_len` slots; prefill runs in fixed chunks), an experts implementation whose per-token result does not
    # depend on how many tokens an expert receives ("gathered", "dense", "grouped"; never "loop", one GEMM per expert
    # over its tokens), and GEMMs whose row count M stays where the CPU kernels give each row the same result. Measured
    # here (bench/results/batch_invariance_cpu_*.md): float32 rows change below M = 4, bfloat16 rows only at M = 1;
    # every GEMM of the units has M = B x T with T = the canvas (16 demo, 256 released), so no shape needs a fixed-M
    # call: the mode checks the rule (`check_batch_invariant`) and costs nothing (on and off compile the same graphs).
    # None = on for CPU; on CUDA unmeasured (cuBLAS picks kernels, split-K included, by M), so off, and True refused.
    batch_invariant: bool | None = None
    # Log-probabilities each step keeps per canvas position (`mixed_step.logprobs`, temperature 1): None = none computed
    # (`generate` returns none); 0 = the committed tokens' own; K = also the K most likely alternatives (the
    # server's `top_logprobs` limit; `dgemma serve` uses 20, vLLM's default). Part of the step's shapes; K > 0 adds a
    # top-K over the vocabulary to every step.
    max_logprobs: int | None = None
    # FlexAttention kernel options per query kind ("encoder": prefill chunks and unfused commits; "canvas": denoise
    # steps and commit + denoise) and layer type ("sliding_attention", "full_attention"), passed to `flex_attention`
    # as they are. Canvas queries are pinned to the main FlexAttention template (FORCE_USE_FLEX_ATTENTION): with
    # fewer than 128 queries (small canvases, e.g. the demo's 16) Inductor would pick its flex-decoding kernel, which
    # is built for one to a few query tokens per row, not a bidirectional canvas. Encoder rows keep the kernels'
    # defaults. On CPU Inductor's flex template accepts the options and ignores them. Entries given here are merged
    # over these defaults ({query kind: {layer type: {option: value}}}, option names as `FlexKernelOptions`'s); a canvas
    # entry may not unpin (FORCE_USE_FLEX_ATTENTION=False). None = the defaults.
    attention_kernel_options: dict | None = None
    # Keep each compiled step in the user-level compile cache (`artifacts.ArtifactStore`: `$DGEMMA_CACHE_DIR`, else
    # `$XDG_CACHE_HOME/dgemma_compile`) and load it there in later processes: no Dynamo trace, no Inductor compile,
    # no g++ (its C++ builds are kept too, keyed without the venv's paths). The demo's step: 108 s cold, 11 s warm in
    # Inductor's own caches, ~2 s loaded (bench/results/startup_cpu_*.md). Needs `direct_calls` (a loaded step is
    # called directly). Off, or `DGEMMA_CACHE=off`: every process compiles. Not part of the artifact's key.
    artifact_cache: bool = True

    def __post_init__(self) -> None:
        b = self.batch_buckets
        if not b or any(not isinstance(x, int) or x <= 0 for x in b) or list(b) != sorted(set(b)):
            raise ConfigError("batch_buckets", f"must be increasing positive integers, got {b!r}")
        for name in ("max_seq_len", "max_denoising_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(name, f"must be a positive integer, got {v!r}")
        if self.moe_impl not in ("auto", *MOE_IMPLS):
            raise ConfigError("moe_impl", f"must be one of {('auto', *MOE_IMPLS)}, got {self.moe_impl!r}")
        if not isinstance(self.skip_guards, bool):
            raise ConfigError("skip_guards", f"must be a bool, got {self.skip_guards!r}")
        if not (self.fuse_commit is None or isinstance(self.fuse_commit, bool)):
            raise ConfigError("fuse_commit", f"must be None, True or False, got {self.fuse_commit!r}")
        if not (self.skip_idle_vocabulary is None or isinstance(self.skip_idle_vocabulary, bool)):
            raise ConfigError("skip_idle_vocabulary", f"must be None, True or False, got {self.skip_idle_vocabulary!r}")
        if not (self.batch_invariant is None or isinstance(self.batch_invariant, bool)):
            raise ConfigError("batch_invariant", f"must be None, True or False, got {self.batch_invariant!r}")
        if not isinstance(self.artifact_cache, bool):
            raise ConfigError("artifact_cache", f"must be a bool, got {self.artifact_cache!r}")
        if not isinstance(self.direct_calls, bool):
            raise ConfigError("direct_calls", f"must be a bool, got {self.direct_calls!r}")
        if not (self.cpp_wrapper is None or isinstance(self.cpp_wrapper, bool)):
            raise ConfigError("cpp_wrapper", f"must be None, True or False, got {self.cpp_wrapper!r}")
        v = self.sample_step_fusion_min_bytes
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError("sample_step_fusion_min_bytes", f"must be an int >= 0, got {v!r}")
        if not isinstance(self.disabled_passes, tuple):
            raise ConfigError("disabled_passes", f"must be a tuple of pass names, got {self.disabled_passes!r}")
        check_names(self.disabled_passes)  # ConfigError naming disabled_passes
        _check_attention_kernel_options(self.attention_kernel_options)
        k = self.max_logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 64):
            raise ConfigError("max_logprobs", f"must be None or an integer in [0, 64], got {self.max_logprobs!r}")
        if self.attention_kernel_options is not None:  # a private copy: the caller's dicts may change later
            object.__setattr__(self, "attention_kernel_options", copy.deepcopy(self.attention_kernel_options))
        if self.recompile_limit < 2 * len(b):
            raise ConfigError("recompile_limit", f"must be >= 2 * len(batch_buckets) = {2 * len(b)}")


    def attention_kernels(self) -> dict:
        """{query kind: {layer type: FlexAttention kernel options}}: the defaults with `attention_kernel_options`
        merged over them (a fresh copy per call)."""
        pinned = {"FORCE_USE_FLEX_ATTENTION": True}
        out = {"encoder": {SLIDING: {}, FULL: {}}, "canvas": {SLIDING: dict(pinned), FULL: dict(pinned)}}
        for kind, per_type in (self.attention_kernel_options or {}).items():
            for layer_type, options in per_type.items():
                out[kind][layer_type].update(options)
        return out

    def pass_settings(self) -> dict:
        """{pass name: keyword arguments of its `apply`} (`compile.passes`)."""
        return {"sample_step_fusion": {"min_logits_bytes": self.sample_step_fusion_min_bytes}}

    def commit_fusion(self, device_type: str) -> bool:
        """Whether generators on `device_type` ("cpu", "cuda", ...) fuse commits (`fuse_commit`, None resolved)."""
        return device_type == "cuda" if self.fuse_commit is None else self.fuse_commit

    def idle_vocabulary_skip(self, device_type: str, subclass_weights: bool = False) -> bool:
        """Whether generators on `device_type` skip the vocabulary region where no row samples
        (`skip_idle_vocabulary`, None resolved); `subclass_weights`: the model has tensor-subclass weights
        (torchao's quantized ones), for which torch 2.13's `torch.cond` has no rule ("no rule registered for HOP
        cond and subclass Float8Tensor"), so None resolves to off. Raises ConfigError for True with CUDA graphs on
        CUDA, or with tensor-subclass weights."""
        if self.skip_idle_vocabulary and device_type == "cuda" and self.cuda_graphs:
            raise ConfigError("skip_idle_vocabulary", "its torch.cond reads the predicate on the host, which a CUDA "
                              "graph cannot capture: turn cuda_graphs off to use it on CUDA")
        if self.skip_idle_vocabulary and subclass_weights:
            raise ConfigError("skip_idle_vocabulary", "torch.cond has no rule for tensor-subclass weights (torchao's "
                              "quantized ones) in this torch: leave it None or False for a quantized model")
        if self.skip_idle_vocabulary is None:
            return device_type != "cuda" and not subclass_weights
        return self.skip_idle_vocabulary

    def batch_invariance(self, device_type: str) -> bool:
        """Whether generators on `device_type` promise batch-invariant rows (`batch_invariant`, None resolved).
        Raises ConfigError for True off the CPU (not measured there)."""
        if self.batch_invariant and device_type != "cpu":
            raise ConfigError("batch_invariant", f"measured on CPU only; on {device_type} GEMM kernels change with the "
                              "row count: use batch_invariant=False or None")
        return device_type == "cpu" if self.batch_invariant is None else self.batch_invariant

    def inductor_config(self, device_type: str) -> dict:
        """The Inductor settings that depend on the device a graph runs on (`device_type` "cpu", "cuda", ...), patched
        by the units' compile backend around each Inductor compile."""
        cpp_wrapper = device_type == "cpu" if self.cpp_wrapper is None else self.cpp_wrapper
        out: dict = {"cpp_wrapper": cpp_wrapper}
        if self.idle_vocabulary_skip(device_type):
            # `torch.cond` (`skip_idle_vocabulary`) is not marked cacheable in torch 2.11-2.13, so Inductor's graph
            # cache and AOTAutograd's would bypass the step (an in-process compile would redo its codegen in every
            # process). Sound here: the branches are submodules of the step's graph,
            # and our cache's key hashes the sources that define them (`artifacts.step_key`: a changed branch is a
            # miss, tests/compile/test_artifacts.py).
            out["unsafe_marked_cacheable_functions"] = [COND]
        return out


COND = "torch.ops.higher_order.cond"
"""`torch.cond`'s operator as `HigherOrderOperator.cacheable` names it."""


def _check_attention_kernel_options(k) -> None:
    """Raises ConfigError naming `attention_kernel_options` for a malformed value (see the field's comment)."""
    if k is None:
        return
    shape = (f"{{query kind in {QUERY_KINDS}: {{layer type in {(SLIDING, FULL)}: {{FlexKernelOptions name: "
             f"value}}}}}}")
    if (not isinstance(k, dict) or not set(k) <= set(QUERY_KINDS)
            or any(not isinstance(v, dict) or not set(v) <= {SLIDING, FULL}
                   or any(not isinstance(o, dict) for o in v.values()) for v in k.values())):
        raise ConfigError("attention_kernel_options", f"must be {shape}, got {k!r}")
    from torch.nn.attention import flex_attention

    known = getattr(flex_attention, "FlexKernelOptions", None)
    names = set(known.__annotations__) if known is not None else None
    for kind, per_type in k.items():
        for layer_type, options in per_type.items():
            bad = [n for n in options if not isinstance(n, str) or (names is not None and n not in names)]
            if bad:
                raise ConfigError(f"attention_kernel_options[{kind!r}][{layer_type!r}]", f"unknown option(s) {bad}; "
                                  f"FlexAttention's kernel options are {sorted(names or ())}")
            if kind == "canvas" and (options.get("FORCE_USE_FLEX_ATTENTION", True) is not True
                                     or "DECODE" in str(options.get("BACKEND", "")).upper()):
                raise ConfigError(f"attention_kernel_options['canvas'][{layer_type!r}]", "canvas queries stay pinned to "
                                  "the main FlexAttention template (FORCE_USE_FLEX_ATTENTION=True), never flex-decoding")


GEMM_ROW_SWITCH = {torch.float32: 4, torch.bfloat16: 2}
"""Per dtype, the fewest GEMM rows (M) from which a CPU GEMM gives each row the same bits whatever M: measured on this
2-core AVX512 CPU, torch 2.13 (MKL float32, oneDNN bfloat16), 1 and 2 threads, every projection shape of the demo and
of the released width (bench/batch_invariance.py): float32 rows differ at M <= 3, bfloat16 rows at M = 1 only."""
BATCH_INVARIANT_MOE = ("gathered", "dense", "grouped")
"""Experts implementations whose per-token result does not depend on the other tokens: per-assignment products
("gathered"), every expert on every token ("dense"), or `torch._grouped_mm`, whose CPU groups give a token the same bits
whatever the group's size (measured, eager and compiled). "loop" runs one `F.linear` per expert over its routed tokens:
M = 1..3 rows change bits."""


def check_batch_invariant(canvas_length: int, dtype: torch.dtype, moe_impl: str) -> None:
    """What batch-invariant rows need of a compiled generator (`CompileOptions.batch_invariant`): every GEMM of the units
    has M = B x T rows with T >= canvas_length, so T must reach `GEMM_ROW_SWITCH[dtype]`; and an M-invariant experts
    implementation (`BATCH_INVARIANT_MOE`).

    Raises:
        ConfigError: naming batch_invariant, for a canvas below the switch, an unmeasured dtype or a "loop" MoE."""
    switch = GEMM_ROW_SWITCH.get(dtype)
    if switch is None:
        raise ConfigError("batch_invariant", f"not measured for {dtype} (only {sorted(map(str, GEMM_ROW_SWITCH))}); "
                          "use batch_invariant=False")
    if canvas_length < switch:
        raise ConfigError("batch_invariant", f"a canvas of {canvas_length} tokens gives GEMMs of fewer rows than the "
                          f"{switch} from which {dtype} rows keep their bits; use batch_invariant=False")
    if moe_impl not in BATCH_INVARIANT_MOE:
        raise ConfigError("batch_invariant", f"moe_impl {moe_impl!r} is not batch-invariant (one GEMM per expert over "
                          f"its routed tokens); use one of {BATCH_INVARIANT_MOE} or batch_invariant=False")


@contextlib.contextmanager
def applied(options: CompileOptions):
    """Apply `options` to Dynamo and Inductor for the duration of the block (compilation happens at first call)."""
    import torch._dynamo.config  # here, not at module level: `build` imports neither until something compiles
    import torch._inductor.config

    with torch._dynamo.config.patch(recompile_limit=options.recompile_limit, cache_size_limit=options.recompile_limit,
                                    fail_on_recompile_limit_hit=True, automatic_dynamic_shapes=options.dynamic), \
            torch._inductor.config.patch({"max_autotune": options.max_autotune,
                                          "triton.cudagraphs": options.inductor_cudagraphs}):
        yield
