"""`dgemma::moe_experts`: the routed experts of one MoE layer, one op with a selectable implementation.

Legend: N tokens, D hidden, E experts, K experts per token, I expert intermediate size, M = N*K assignments.

The op is the one MoE call in every captured graph (the model calls it in eager and compiled runs alike); its
`impl` argument names the implementation, each a plain torch function of (x, w, idx, gate_up, down):
- "loop" (`moe_experts_loop`): transformers' reference loop over the experts that received tokens, accumulated in
  expert order. Data-dependent shapes and host syncs; the parity oracle.
- "grouped" (`moe_experts_grouped`): assignments sorted by expert, one `torch._grouped_mm` per projection; static
  shapes, no sync, the loop's per-token accumulation order. Under torch.compile `_grouped_mm` traces only in
  bfloat16 (its meta check), with D and I multiples of 8 (16-byte strides); eagerly float32 works on CPU.
- "dense" (`moe_experts_dense`): every expert on every token, combined by a dense [N, E] matrix of routing weights
  (zero where unrouted): E/K times the FLOPs, static shapes, any dtype.
- "gathered" (`moe_experts_gathered`): per assignment, its expert's rows gathered and multiplied with the token
  (a matrix-vector product written as multiply + sum): the routed FLOPs, static shapes, any dtype, no sort. Compiled,
  Inductor fuses gather, both projections, GELU and the combine into one C++ loop nest that never materialises the
  gathered [M, 2I, D] weights (eagerly it does: tests and explicit choices only).

Eagerly (CPU and CUDA) the op runs the named implementation, except "gathered" on CPU with unquantized float32 or
bfloat16 experts, which runs "grouped" (`eager_impl`): eagerly, gathering each assignment's expert rows materialises
[M, 2I, D] weights (~2 ms a call at the demo's 16 tokens on this CPU, ~40 ms at 128), where one grouped GEMM per
projection reads each expert once (~0.3 ms, ~0.7 ms). The sum is the same, over the same assignments; only the
rounding of a float32 sum differs (it already differs between eager and compiled "gathered"), and "grouped" is
batch-invariant on CPU as "gathered" is (`compile.options.BATCH_INVARIANT_MOE`): the eager step that answers while
the compiled one compiles gave the compiled step's tokens on all 500 demo test prompts
(bench/results/eager_step_cpu_2026-12-03.md). Compiled through `moe_decompositions(gm)` (the
table the compile backend passes to Inductor), "grouped", "dense" and "gathered" are traced into the graph in place of the op,
so Inductor sees plain aten ops; "loop" stays an opaque call (it cannot be traced), and so does "grouped" outside
bfloat16 (`stays_opaque`: `torch._grouped_mm` traces only in bfloat16, and eagerly on CPU it runs in float32 too), which
`resolve_moe_impl` picks on CPU for float32 models whose canvas is at least `GROUPED_MIN_CANVAS` tokens.
`resolve_moe_impl` is the rule that picks one.

Weights come as (weight, scales) per projection, plain tensors in the format the `quant` argument names
(`EXPERT_QUANTS`; the format objects and their layouts: `formats.py`), so that quantized experts reach the op
without tensor-subclass dispatch. Each implementation states the formats it takes (`IMPL_QUANTS`): "loop", "dense" and "gathered" read the
stored bytes and dequantize the rows they multiply (for "gathered", Inductor fuses the unpacking into the weight loop;
the weights are never stored dequantized); "grouped" takes unquantized weights only. An unsupported pair is a
ValueError naming moe_impl and the format, never a silent dequantize to another path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .formats import EXPERT_FORMATS, NONE, ExpertFormat, expert_format

MOE_IMPLS = ("loop", "grouped", "dense", "gathered")
EXPERT_QUANTS = tuple(EXPERT_FORMATS)
"""Names of the expert weights' formats (the `quant` argument; the objects: `formats.EXPERT_FORMATS`): the
model dtype; float8_e4m3fn with per-row scales, with ("fp8") or without ("fp8-weight-only") dynamic per-row fp8
activations; NVFP4 weights with 16-bit activations."""
IMPL_QUANTS = {"loop": EXPERT_QUANTS, "dense": EXPERT_QUANTS, "gathered": EXPERT_QUANTS,
               "grouped": tuple(name for name, f in EXPERT_FORMATS.items() if not f.quantized)}
"""The formats each implementation takes. `torch._grouped_mm` multiplies 16-bit operands only (its fp8 sibling,
`torch._scaled_grouped_mm`, needs sm90 and per-row scales of both operands; not wired yet)."""


class ExpertWeight(NamedTuple):
    """One projection of every expert as the op receives it: stored `weight`, its `scales`, its `format`
    (`formats.ExpertFormat`) and the `dtype` its products run in (`ExpertFormat.compute_dtype`; the
    implementations round each projection's output to the activations' dtype, as torchao's linears return it)."""

    weight: torch.Tensor
    scales: list[torch.Tensor]
    format: ExpertFormat
    dtype: torch.dtype

    def rows(self, index: torch.Tensor | int | slice) -> torch.Tensor:
        """Dequantized weights of the experts (or, with a tuple-free slice, rows) `index` selects."""
        return self.format.dequantize(self.weight[index], [s[index] for s in self.scales], self.dtype)

    def part(self, rows: slice) -> "ExpertWeight":
        """The output rows `rows` of every expert (gate or up half of gate_up), still in the stored format."""
        return self._replace(weight=self.weight[:, rows], scales=[s[:, rows] for s in self.scales])

    def all(self) -> torch.Tensor:
        return self.format.dequantize(self.weight, self.scales, self.dtype)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """The input as this format's GEMM multiplies it, in `dtype` (`ExpertFormat.activation`)."""
        return self.format.activation(x, self.dtype)


def _as_weight(weight: "torch.Tensor | ExpertWeight", x: torch.Tensor) -> ExpertWeight:
    """The implementations take an `ExpertWeight` or, unquantized, the plain [E, N, K] tensor."""
    return weight if isinstance(weight, ExpertWeight) else ExpertWeight(weight, [], NONE, x.dtype)


def moe_experts_loop(x_ND, w_NK, idx_NK, gate_up: ExpertWeight, down: ExpertWeight):
    """transformers' loop: the experts that received tokens in increasing id order, each token's contributions
    accumulated into zeros in that order (bit-identical to transformers' eager MoE). Ids >= E are skipped: an
    assignment another rank computes (expert parallel, `parallel.expert_parallel.local_routing`)."""
    gate_up, down = _as_weight(gate_up, x_ND), _as_weight(down, x_ND)
    out = torch.zeros_like(x_ND)
    x_in = gate_up.activation(x_ND)
    for e in torch.unique(idx_NK).tolist():
        if e >= gate_up.weight.shape[0]:
            continue
        token, slot = torch.where(idx_NK == e)
        gate, up = F.linear(x_in[token], gate_up.rows(e)).to(x_ND.dtype).chunk(2, dim=-1)
        h = F.gelu(gate, approximate="tanh") * up
        y = F.linear(down.activation(h), down.rows(e)).to(x_ND.dtype) * w_NK[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def moe_experts_grouped(x_ND, w_NK, idx_NK, gate_up: ExpertWeight, down: ExpertWeight):
    """Sync-free experts: assignments sorted by expert (stable, so each token's contributions are accumulated in
    increasing expert id, as in the loop), one grouped GEMM per projection, static shapes. Functional ops only (it
    is also traced as a decomposition, below functionalization). Unquantized weights only (`IMPL_QUANTS`)."""
    gate_up, down = _as_weight(gate_up, x_ND), _as_weight(down, x_ND)
    gate_up_EID, down_EDI = gate_up.weight, down.weight
    K = idx_NK.shape[1]
    E = gate_up_EID.shape[0]
    flat_M = idx_NK.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)
    token_M = order_M // K
    counts_E = torch.zeros(E, dtype=torch.int32, device=x_ND.device).scatter_add(
        0, flat_M, torch.ones_like(flat_M, dtype=torch.int32))
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x_ND[token_M], gate_up_EID.transpose(1, 2), offs=offs_E).chunk(2, dim=-1)
    y_MD = torch._grouped_mm(F.gelu(gate, approximate="tanh") * up, down_EDI.transpose(1, 2), offs=offs_E)
    y_MD = y_MD * w_NK.reshape(-1)[order_M, None]
    return torch.zeros_like(x_ND).index_add(0, token_M, y_MD.to(x_ND.dtype))


def moe_experts_dense(x_ND, w_NK, idx_NK, gate_up: ExpertWeight, down: ExpertWeight):
    """Sync-free experts: every expert on every token, combined with the routing weights (zero where unrouted).
    The combine matrix adds the weights of repeated ids (an expert-parallel rank's masked slots: weight 0; with
    distinct ids, as routing gives, the same values as a plain scatter)."""
    gate_up, down = _as_weight(gate_up, x_ND), _as_weight(down, x_ND)
    N, E = x_ND.shape[0], gate_up.weight.shape[0]
    combine_EN = torch.zeros(N, E, dtype=w_NK.dtype, device=x_ND.device).scatter_add(1, idx_NK, w_NK).T
    gate, up = torch.einsum("nd,eid->eni", gate_up.activation(x_ND), gate_up.all()).to(x_ND.dtype).chunk(2, dim=-1)
    h = F.gelu(gate, approximate="tanh") * up
    y_END = torch.einsum("eni,edi->end", down.activation(h), down.all()).to(x_ND.dtype)
    return (y_END * combine_EN[..., None]).sum(0).to(x_ND.dtype)


# Defined with the low-level `torch.library.Library` API rather than `custom_op`: this op runs four times in every
# compiled step, and `custom_op`'s Python autograd wrapper costs ~40 us a call on CPU against ~15 us for a plain
# dispatcher kernel (measured 2026-12-01, 2000 calls of a [128, 64] copy). Inference only: no autograd formula.
_LIB = torch.library.Library("dgemma", "FRAGMENT")
_LIB.define("materialize(Tensor x) -> Tensor")


def _materialize(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


_LIB.impl("materialize", _materialize, "CompositeExplicitAutograd")
_LIB.define("materialize_many(Tensor[] xs) -> Tensor[]")


def _materialize_many(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone(memory_format=torch.contiguous_format) for x in xs]


_LIB.impl("materialize_many", _materialize_many, "CompositeExplicitAutograd")


@torch.library.register_fake("dgemma::materialize")
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("dgemma::materialize_many")
def _(xs):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]


def materialize(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` (same shape, dtype and values, contiguous) that a compiled graph stores in a buffer of its own:
    `torch.ops.dgemma.materialize`, an opaque op, so Inductor cannot inline x's producer into the consumers (it
    realizes an op's inputs and output). For an input that a loop nest would otherwise recompute per element of an
    outer dimension (`moe_experts_gathered`); eagerly a plain `clone`."""
    return torch.ops.dgemma.materialize(x)


def materialize_many(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """`materialize` of several tensors in one opaque call (`torch.ops.dgemma.materialize_many`)."""
    return torch.ops.dgemma.materialize_many(xs)


def moe_experts_gathered(x_ND, w_NK, idx_NK, gate_up: ExpertWeight, down: ExpertWeight):
    """Sync-free experts, routed FLOPs only: for each of the M = N*K assignments (token n, slot k), its expert's
    weights gathered by index (and dequantized as they are read) and applied as a matrix-vector product (multiply +
    sum over the input dim, which Inductor fuses with the gather into one loop nest); each token's K terms summed in
    slot order.

    `x` goes through `materialize` first: compiled, Inductor would otherwise inline x's producer (the pre-MoE
    RMSNorm, a scalar pow per element) into the weight loop and recompute it for every one of the 2I output rows
    whenever its reuse heuristic (more than `realize_reads_threshold` reads) does not fire -- measured on the demo's
    mixed step at B=8: the first layer's experts 3.2 ms instead of 1.1 ms, a sixth of the whole step."""
    gate_up, down = _as_weight(gate_up, x_ND), _as_weight(down, x_ND)
    N, K = idx_NK.shape
    D = x_ND.shape[1]
    I = gate_up.weight.shape[1] // 2
    idx_M = idx_NK.reshape(-1)
    x_M1D = materialize(gate_up.activation(x_ND))[:, None, :].expand(N, K, D).reshape(N * K, 1, D)
    gate = (gate_up.part(slice(None, I)).rows(idx_M) * x_M1D).sum(-1).to(x_ND.dtype)
    up = (gate_up.part(slice(I, None)).rows(idx_M) * x_M1D).sum(-1).to(x_ND.dtype)
    h_M1I = down.activation(F.gelu(gate, approximate="tanh") * up)[:, None, :]
    y_MD = (down.rows(idx_M) * h_M1I).sum(-1).to(x_ND.dtype)
    return (y_MD.view(N, K, D) * w_NK[..., None]).sum(1).to(x_ND.dtype)


_IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "loop": moe_experts_loop, "grouped": moe_experts_grouped, "dense": moe_experts_dense,
    "gathered": moe_experts_gathered}


def _check(impl: str, quant: str) -> None:
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {impl!r}")
    if quant not in IMPL_QUANTS[impl]:
        raise ValueError(f"moe_impl={impl!r} does not take {quant!r} expert weights (it takes {IMPL_QUANTS[impl]}); "
                         f"use one of {[i for i in MOE_IMPLS if quant in IMPL_QUANTS[i]]}")


def _run(x_ND, w_NK, idx_NK, gate_up_EID, gate_up_scales, down_EDI, down_scales, impl, quant) -> torch.Tensor:
    fmt = expert_format(quant)
    compute = fmt.compute_dtype(x_ND.dtype)
    gate_up = ExpertWeight(gate_up_EID, list(gate_up_scales), fmt, compute)
    down = ExpertWeight(down_EDI, list(down_scales), fmt, compute)
    return _IMPLEMENTATIONS[impl](x_ND, w_NK, idx_NK, gate_up, down)


@torch.library.custom_op("dgemma::moe_experts", mutates_args=())
def moe_experts(x_ND: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor, gate_up_EID: torch.Tensor,
                gate_up_scales: list[torch.Tensor], down_EDI: torch.Tensor, down_scales: list[torch.Tensor],
                impl: str, quant: str) -> torch.Tensor:
    """sum_k w[n, k] * down[e] @ (gelu_tanh(gate[e] @ x[n]) * (up[e] @ x[n])), e = idx[n, k].

    Args: x [N, D] (model dtype), w [N, K] float32 routing weights, idx [N, K] int64 expert ids (distinct per row),
    gate_up [E, 2I, D] (gate rows first) and down [E, D, I] as stored in the format `quant` (`EXPERT_QUANTS`,
    layouts in `model.ExpertProjection`; packed NVFP4 halves the last dim), each with its list of scale tensors
    ([] unquantized), impl one of `MOE_IMPLS`. Returns [N, D] in x's dtype. Expert parallel
    (`parallel.expert_parallel.local_routing`) also passes repeated ids of weight 0 and, to "loop", ids >= E (skipped).

    Raises: ValueError for an unknown impl (naming moe_impl) or a format the implementation does not take.
    """
    return run_eager(x_ND, w_NK, idx_NK, gate_up_EID, gate_up_scales, down_EDI, down_scales, impl, quant)


def run_eager(x_ND, w_NK, idx_NK, gate_up_EID, gate_up_scales, down_EDI, down_scales, impl: str, quant: str
              ) -> torch.Tensor:
    """What the op computes eagerly (`eager_impl(impl, ...)`), called as a plain function: the model's experts call
    it directly when they run uncompiled on CPU (`model.Experts`), skipping the custom op's Python dispatch (about a
    tenth of the demo's eager MoE call). Same arguments and errors as the op."""
    _check(impl, quant)
    return _run(x_ND, w_NK, idx_NK, gate_up_EID, gate_up_scales, down_EDI, down_scales, eager_impl(impl, quant, x_ND),
                quant)


def eager_impl(impl: str, quant: str, x_ND: torch.Tensor) -> str:
    """The implementation the op runs eagerly for `impl` (see the module docstring): `impl` itself, or "grouped" for
    "gathered" on CPU with unquantized float32 / bfloat16 experts (where `torch._grouped_mm` runs eagerly). Traced
    (`moe_decompositions`), `impl` itself always."""
    if (impl == "gathered" and not expert_format(quant).quantized and x_ND.device.type == "cpu"
            and x_ND.dtype in (torch.float32, torch.bfloat16)):
        return "grouped"
    return impl


GROUPED_MIN_CANVAS = 256
"""`resolve_moe_impl` picks "grouped" for a compiled float32 model on CPU whose canvas is at least this many tokens (so
every forward, at every batch size, has at least that many: one rule per generator, so a row's bits never depend on
its bucket). There "grouped" stays an opaque call of the op in the compiled step (`stays_opaque`) and runs
`torch._grouped_mm` eagerly, each expert's weights read once, instead of Inductor's "gathered" loop nest (each
assignment's rows read). Measured per call, compiled, one thread (`python -m bench.moe`): at the scaled model's
256-token canvas "grouped" 14.6 ms against "gathered" 29.5 ms on an AVX2 host (bench/results/moe_cpu_2026-12-07.md)
and 13.2 against 16.8 ms on an AVX-512 host (moe_cpu_2026-11-30.md); at 128 tokens 1.42 against 1.67 ms (AVX2) and
0.71 against 0.69 ms (AVX-512); at 16 tokens "gathered" is 1.9-2.3x faster. The released model's canvas is 256."""


def stays_opaque(impl: str, quant: str, x_ND: torch.Tensor | None) -> bool:
    """Whether a compiled call of the op stays an opaque call that runs `run_eager` (rather than being traced into
    Inductor's graph): "loop" always (data-dependent shapes), "grouped" when its input `x_ND` is not bfloat16
    (`torch._grouped_mm`'s meta check traces bfloat16 only). `x_ND` may be a fake tensor, or None when unknown (a
    symbolically traced graph): then only "loop"."""
    return impl == "loop" or (impl == "grouped" and x_ND is not None and x_ND.dtype != torch.bfloat16)


@moe_experts.register_fake
def _(x_ND, w_NK, idx_NK, gate_up_EID, gate_up_scales, down_EDI, down_scales, impl, quant):
    _check(impl, quant)
    return torch.empty_like(x_ND)


def _decompose_moe_experts(x_ND, w_NK, idx_NK, gate_up_EID, gate_up_scales, down_EDI, down_scales, impl, quant):
    """Inductor decomposition of the op: the traced implementation for "grouped", "dense" and "gathered". "loop" returns
    NotImplemented (proxy_tensor.maybe_handle_decomp then keeps the op); `moe_decompositions` never adds this entry
    for a graph that calls "loop", so this is a guard, not a path."""
    _check(impl, quant)
    if impl == "loop":
        return NotImplemented
    return _run(x_ND, w_NK, idx_NK, gate_up_EID, gate_up_scales, down_EDI, down_scales, impl, quant)


def graph_moe_calls(gm: torch.fx.GraphModule) -> list[tuple[str, str, torch.Tensor | None]]:
    """(impl, quant, x) of each `dgemma::moe_experts` call in `gm` and its subgraphs (a Dynamo graph: x is the
    input's example value, a fake tensor; None where the node carries none, as in a symbolically traced graph)."""
    op = torch.ops.dgemma.moe_experts
    names = ("x_ND", "w_NK", "idx_NK", "gate_up_EID", "gate_up_scales", "down_EDI", "down_scales", "impl", "quant")
    calls = []
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for target in (op, op.default):
                for node in module.graph.find_nodes(op="call_function", target=target):
                    args = dict(zip(names, node.args)) | dict(node.kwargs)
                    x = args["x_ND"]
                    meta = x.meta.get("example_value", x.meta.get("val")) if isinstance(x, torch.fx.Node) else None
                    calls.append((args["impl"], args["quant"], meta if isinstance(meta, torch.Tensor) else None))
    return calls


def moe_decompositions(gm: torch.fx.GraphModule) -> dict:
    """The decomposition table for compiling `gm` (`compile_fx(gm, ..., decompositions=...)`): Inductor's default
    table (`select_decomp_table()`, read now: it depends on Inductor's config) plus the decomposition of
    `dgemma::moe_experts` into its traceable implementation, unless the calls in `gm` stay opaque (`stays_opaque`:
    "loop", or "grouped" outside bfloat16, which then runs eagerly inside the compiled code).

    The choice is per graph: Inductor refuses an op that has a decomposition entry but must fall back to its eager
    kernel (torch/_inductor/lowering.py `make_fallback`: "both a fallback and a decomp for same op"), whatever the
    entry returns. A new dict: nothing is registered globally.

    Raises: ValueError (naming moe_impl) when one graph mixes calls that stay opaque with calls that are traced
    (one unit, one implementation: the traced ones would silently stay opaque).
    """
    calls = graph_moe_calls(gm)
    opaque = {(impl, stays_opaque(impl, quant, x)) for impl, quant, x in calls}
    if len({o for _, o in opaque}) > 1:
        raise ValueError(f"moe_impl: one compiled graph calls dgemma::moe_experts with {sorted(i for i, _ in opaque)}, "
                         "some of which stay opaque calls and some are traced; one graph takes one kind")
    return DecompositionTable(decompose_moe=not any(o for _, o in opaque))


class DecompositionTable(dict):
    """Inductor's default decomposition table (`select_decomp_table()`, read at construction: it depends on
    Inductor's config), plus, with `decompose_moe`, `dgemma::moe_experts` -> its traceable implementation.

    Pickles as its recipe, `DecompositionTable(decompose_moe)`: Inductor's FX graph cache keys a compile on the
    pickled `decompositions` it was given, and the default table holds a pybind11 function that does not pickle, so
    a plain dict made every compile bypass the on-disk cache ("Cannot produce stable cache key", measured: each
    process recompiled every unit). The recipe's code is covered by `moe_cache_key` (a hash of this file), the
    default table's by the cache key's Inductor config and torch version.
    """

    def __init__(self, decompose_moe: bool):
        from torch._inductor.decomposition import select_decomp_table

        super().__init__(select_decomp_table())
        self.decompose_moe = decompose_moe
        if decompose_moe:
            self[torch.ops.dgemma.moe_experts.default] = _decompose_moe_experts

    def __reduce__(self):
        return (DecompositionTable, (self.decompose_moe,))


@contextlib.contextmanager
def moe_cache_key(decomposed: bool = True):
    """Around a compile with `moe_decompositions`: where the graph's `dgemma::moe_experts` is `decomposed` (traced
    into it), appends a hash of this folder's op and formats (`op.py`, `formats.py`, whose dequantization the
    decompositions trace) to `torch.compiler.config.cache_key_tag`. AOTAutograd's cache key covers the Dynamo graph
    (where the op still stands) but not the decomposition table, so without the tag a graph compiled without our
    decompositions, or with an older version of them, is served from the on-disk cache (observed: a plain Inductor
    compile of a "dense" graph, then ours, ran the opaque op). A graph without a decomposed op (none, or one that
    stays an opaque call, which runs this file's code at call time) gets no tag: an edit here leaves its cache
    entries warm (issue 41: a kernel folder keys only the compiles that trace it)."""
    if not decomposed:
        yield
        return
    from torch._inductor.custom_graph_pass import get_hash_for_files

    tag = torch.compiler.config.cache_key_tag
    from . import formats as expert_formats

    ours = "dgemma-moe-" + get_hash_for_files((__file__, expert_formats.__file__)).hex()[:16]
    with torch.compiler.config.patch(cache_key_tag=f"{tag}|{ours}" if tag else ours):
        yield


def resolve_moe_impl(requested: str, *, dtype: torch.dtype, num_experts: int, top_k: int, compiled: bool,
                     quant: str = "none", device_type: str | None = None, canvas_length: int | None = None) -> str:
    """The MoE implementation to run: `requested` if explicit, else (for "auto") the rule below.

    - eager: "loop", transformers' summation order, so eager runs follow transformers (what the parity tests
      check) and the eager generator stays the oracle.
    - compiled, bfloat16 with E/K > 4: "grouped" (routed FLOPs, each expert's weights read once per forward).
    - compiled on CPU (`device_type` "cpu"), float32, unquantized, a canvas of at least `GROUPED_MIN_CANVAS` tokens:
      "grouped" as an opaque call that runs `torch._grouped_mm` eagerly inside the compiled step (`stays_opaque`;
      numerics `cpu-experts/v2`, docs/numerics.md).
    - compiled, anything else: "gathered" (routed FLOPs, one fused loop nest, no sort). `torch._grouped_mm`'s meta
      check accepts only bfloat16, so a grouped graph in float32 or float16 cannot be traced. Measured against
      "dense" on this 2-core CPU, one thread, compiled (bench/results/moe_cpu_*.md): float32 2.2x faster at the
      demo's shapes (16 and 128 tokens, E=8, K=2) and 6.1x at the scaled model's (256 tokens, E=64, K=4).
    - quantized experts (`ExpertFormat.quantized`): never "grouped" (`IMPL_QUANTS`), so "gathered" when compiled.

    Raises: ValueError (naming moe_impl) for an unknown name, for "grouped" compiled in a dtype other than bfloat16
    (except float32 on CPU, where it stays an opaque eager call), or for an implementation that does not take the
    experts' format `quant` (an explicit choice that cannot run is refused, never replaced).
    """
    if requested != "auto" and requested not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be 'auto' or one of {MOE_IMPLS}, got {requested!r}")
    cpu_float32 = device_type == "cpu" and dtype == torch.float32
    if requested == "grouped" and compiled and dtype != torch.bfloat16 and not cpu_float32:
        raise ValueError(f"moe_impl='grouped' cannot be compiled in {dtype} on {device_type or 'this device'}: "
                         "torch._grouped_mm traces only in bfloat16 (and runs eagerly in float32 on CPU only); use "
                         "'gathered', 'dense' or 'auto'")
    if requested != "auto":
        _check(requested, quant)
        return requested
    if not compiled:
        return "loop"
    if not expert_format(quant).quantized and ((dtype == torch.bfloat16 and num_experts > 4 * top_k) or
                            (cpu_float32 and canvas_length is not None and canvas_length >= GROUPED_MIN_CANVAS)):
        return "grouped"
    return "gathered"
